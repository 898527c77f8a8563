"""Parameter routing (``precondition``), expert stacks and fused projections (``split_rows``).

Expectations are independent of the routing code: a 3-D stack of experts must move
exactly as its experts would as separate 2-D parameters, a fused QKV weight split in
three as three separate weights, a convolution's weight as its ``(out, in * k)``
matrix, and a parameter routed to grafting exactly as torch's AdamW moves it.
"""

from __future__ import annotations

import pytest
import torch
from helpers.toy_models import ToyMoE, toy_loss
from torch import nn

from lightning_dash import DASH, DashConfig
from lightning_dash.optim.routing import CONVOLUTION, EMBEDDING, OUTPUT, describe_model
from lightning_dash.optim.stacks.blocks import MatrixView

OPTIONS = dict(lr=0.02, block_size=4, precondition_frequency=1, epsilon=1e-4, weight_decay=0.1)


def train(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()


def random_grads(shape: tuple[int, ...], steps: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(steps)]


# ------------------------------------------------------------------ roles and views
def test_roles_come_from_the_modules():
    model = ToyMoE()
    roles = {name: describe_model(model).roles_of(param) for name, param in model.named_parameters()}
    assert roles["embed.weight"] == {EMBEDDING}
    assert roles["head.weight"] == {OUTPUT}
    assert roles["qkv.weight"] == roles["w_in"] == frozenset()
    tied = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
    tied[1].weight = tied[0].weight
    assert describe_model(tied).roles_of(tied[0].weight) == {EMBEDDING, OUTPUT}
    conv = nn.Sequential(nn.Conv1d(3, 5, 2), nn.Flatten(), nn.Linear(5, 2))
    assert describe_model(conv).roles_of(conv[0].weight) == {CONVOLUTION}


class TablesAsBareParameters(nn.Module):
    """Position tables and tokens as vision and language models hold them (bare parameters, one of them
    3-D), beside a bare matrix that is multiplied into the activations and a real output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.randn(8, 6))
        self.pos_embed = nn.Parameter(torch.randn(1, 9, 6))
        self.cls_token = nn.Parameter(torch.randn(1, 1, 6))
        self.mixing = nn.Parameter(torch.randn(6, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x + self.position[: x.shape[1]]], dim=1)
        return self.head((hidden + self.pos_embed[:, : hidden.shape[1]]) @ self.mixing)


def test_position_tables_and_tokens_held_as_bare_parameters_are_embeddings():
    """Added to the activations, never multiplied into them: the default routing leaves them to the grafting
    optimizer, as Muon's recipe does with embeddings, and still preconditions a bare matrix that multiplies."""
    model = TablesAsBareParameters()
    described = describe_model(model)
    assert {name: described.roles_of(p) for name, p in model.named_parameters() if p.dim() > 1} == {
        "position": {EMBEDDING},
        "pos_embed": {EMBEDDING},
        "cls_token": {EMBEDDING},
        "mixing": frozenset(),
        "head.weight": {OUTPUT},
    }
    views = DASH(model.parameters(), model=model, **OPTIONS).preconditioning()
    assert {name for name, view in views.items() if view is not None} == {"mixing"}
    everything = DASH(model.parameters(), model=model, precondition="all_matrices", **OPTIONS).preconditioning()
    assert everything["position"] == MatrixView(8, 6) and everything["pos_embed"] == MatrixView(9, 6)


def test_all_matrices_preconditions_every_matrix_and_stacks_experts():
    model = ToyMoE()
    views = DASH(model.named_parameters(), **OPTIONS).preconditioning()
    assert views["embed.weight"] == MatrixView(11, 6)
    assert views["head.weight"] == MatrixView(11, 6)
    assert views["w_in"] == MatrixView(10, 6, parts=3)  # one matrix per expert, not (3, 60)
    assert views["w_out"] == MatrixView(6, 10, parts=3)
    assert all(views[name] is None for name, p in model.named_parameters() if p.dim() == 1)


def test_hidden_sends_embeddings_and_the_output_layer_to_grafting():
    model = ToyMoE()
    views = DASH(model.parameters(), precondition="hidden", model=model, **OPTIONS).preconditioning()
    grafted = {name for name, view in views.items() if view is None}
    one_dimensional = {name for name, p in model.named_parameters() if p.dim() == 1}
    assert grafted == {"embed.weight", "head.weight"} | one_dimensional


def test_the_default_routing_is_hidden_where_the_model_is_known_and_all_matrices_elsewhere():
    model = ToyMoE()
    assert DashConfig().precondition == "auto"
    with_model = DASH(model.parameters(), model=model, **OPTIONS).preconditioning()
    assert with_model == DASH(model.parameters(), precondition="hidden", model=model, **OPTIONS).preconditioning()
    alone = DASH(model.named_parameters(), **OPTIONS).preconditioning()
    assert alone == DASH(model.named_parameters(), precondition="all_matrices", **OPTIONS).preconditioning()
    assert with_model["embed.weight"] is None and alone["embed.weight"] == MatrixView(11, 6)


class ByteLSTM(nn.Module):
    def __init__(self, recurrent: type[nn.Module] = nn.LSTM) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 6)
        self.rnn = recurrent(6, 8)
        self.head = nn.Linear(8, 16)


@pytest.mark.parametrize("recurrent", [nn.LSTM, nn.GRU, nn.RNN, nn.GRUCell])
def test_the_default_routing_of_a_recurrent_model_preconditions_every_matrix(recurrent):
    """A recurrent layer's factors starve when its output layer follows Adam, so ``auto`` keeps the
    embedding and the output layer preconditioned in a model with one, wherever it sits."""
    model = nn.Sequential(nn.Linear(3, 6), ByteLSTM(recurrent))
    views = DASH(model.parameters(), model=model, **OPTIONS).preconditioning()
    everything = DASH(model.named_parameters(), precondition="all_matrices", **OPTIONS).preconditioning()
    assert views == everything
    assert views["1.head.weight"] is not None and views["1.embed.weight"] is not None
    hidden = DASH(model.parameters(), precondition="hidden", model=model, **OPTIONS).preconditioning()
    assert hidden["1.head.weight"] is None and hidden["1.embed.weight"] is None


def test_names_and_callables_choose_exactly_the_named_matrices():
    model = ToyMoE()
    chosen = DASH(model.named_parameters(), precondition={"qkv.weight", "w_in"}, **OPTIONS).preconditioning()
    assert {name for name, view in chosen.items() if view is not None} == {"qkv.weight", "w_in"}
    by_rule = DASH(model.named_parameters(), precondition=lambda name, p: name.startswith("w_"), **OPTIONS)
    assert {name for name, view in by_rule.preconditioning().items() if view is not None} == {"w_in", "w_out"}


def test_a_grafted_matrix_moves_exactly_as_adamw_moves_it():
    generator = torch.Generator().manual_seed(3)
    initial = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    grads = [[g] for g in random_grads((7, 5), 4, seed=4)]
    routed, reference = nn.Parameter(initial.clone()), nn.Parameter(initial.clone())
    dash = DASH(
        [("table", routed)], precondition=set(), betas=(0.9, 0.95), grafting_beta2=0.99, nesterov=False, **OPTIONS
    )
    adamw = torch.optim.AdamW([reference], lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    train(dash, [routed], grads)
    train(adamw, [reference], grads)
    torch.testing.assert_close(routed, reference, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ experts, fused projections, convolutions
def test_a_stack_of_experts_moves_as_its_experts_would_alone():
    experts, rows, cols = 3, 10, 6  # block 4: tiles of 4, 4 and 2 rows per expert
    initial = torch.randn(experts, rows, cols, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = random_grads((experts, rows, cols), 5, seed=1)
    stacked = nn.Parameter(initial.clone())
    alone = [nn.Parameter(initial[e].clone()) for e in range(experts)]
    train(DASH([("experts", stacked)], **OPTIONS), [stacked], [[g] for g in grads])
    train(DASH(alone, **OPTIONS), alone, [list(g.unbind(0)) for g in grads])
    for e in range(experts):
        torch.testing.assert_close(stacked[e], alone[e], rtol=1e-10, atol=1e-12)


def test_split_rows_moves_a_fused_qkv_as_three_separate_projections():
    width = 5  # not a multiple of block 4: without the split, tiles would straddle q, k and v
    initial = torch.randn(3 * width, width, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = random_grads((3 * width, width), 5, seed=3)
    fused, unsplit = nn.Parameter(initial.clone()), nn.Parameter(initial.clone())
    parts = [nn.Parameter(part.clone()) for part in initial.chunk(3)]
    train(DASH([("attn.qkv.weight", fused)], split_rows={"qkv": 3}, **OPTIONS), [fused], [[g] for g in grads])
    train(DASH(parts, **OPTIONS), parts, [list(g.chunk(3)) for g in grads])
    train(DASH([unsplit], **OPTIONS), [unsplit], [[g] for g in grads])
    torch.testing.assert_close(fused, torch.cat(parts), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(unsplit, fused)  # the split changed the blocks


def test_split_rows_applies_within_each_expert():
    initial = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = random_grads((2, 8, 3), 4, seed=6)
    gate_up = nn.Parameter(initial.clone())
    halves = [nn.Parameter(half.clone()) for half in initial.reshape(4, 4, 3).unbind(0)]
    dash = DASH([("moe.gate_up", gate_up)], split_rows={"gate_up": 2}, **OPTIONS)
    assert dash.preconditioning()["moe.gate_up"] == MatrixView(4, 3, parts=4)
    train(dash, [gate_up], [[g] for g in grads])
    train(DASH(halves, **OPTIONS), halves, [list(g.reshape(4, 4, 3).unbind(0)) for g in grads])
    torch.testing.assert_close(gate_up.reshape(4, 4, 3), torch.stack(list(halves)), rtol=1e-10, atol=1e-12)


def test_a_convolution_weight_keeps_the_out_by_in_times_kernel_view():
    conv = nn.Conv1d(3, 6, 2).double()
    initial = conv.weight.detach().clone()
    grads = random_grads(tuple(conv.weight.shape), 4, seed=7)
    matrix = nn.Parameter(initial.reshape(6, 6).clone())
    dash = DASH(conv.named_parameters(), model=conv, **OPTIONS)
    assert dash.preconditioning()["weight"] == MatrixView(6, 6)
    conv.bias.requires_grad_(False)
    train(dash, [conv.weight], [[g] for g in grads])
    train(DASH([matrix], **OPTIONS), [matrix], [[g.reshape(6, 6)] for g in grads])
    torch.testing.assert_close(conv.weight.reshape(6, 6), matrix, rtol=1e-10, atol=1e-12)


def test_routed_state_resumes_exactly():
    torch.manual_seed(0)
    model = ToyMoE().double()
    options = dict(OPTIONS, precondition="hidden", split_rows={"qkv": 3})
    dash = DASH(model.named_parameters(), model=model, **options)
    for seed in range(3):
        dash.zero_grad()
        toy_loss(model, seed).backward()
        dash.step()
    saved, weights = dash.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    for seed in range(3, 5):
        dash.zero_grad()
        toy_loss(model, seed).backward()
        dash.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(weights)
    resumed = DASH(model.named_parameters(), model=model, **options)
    resumed.load_state_dict(saved)
    for seed in range(3, 5):
        resumed.zero_grad()
        toy_loss(model, seed).backward()
        resumed.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


def test_a_checkpoint_of_another_split_is_refused():
    fused = nn.Parameter(torch.randn(15, 5, dtype=torch.float64))
    dash = DASH([("qkv", fused)], **OPTIONS)
    fused.grad = torch.randn_like(fused)
    dash.step()
    other = DASH([("qkv", fused)], split_rows={"qkv": 3}, **OPTIONS)
    with pytest.raises(ValueError, match="split_rows"):
        other.load_state_dict(dash.state_dict())


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(precondition="everything"), "precondition must be one of"),
        (dict(precondition=3), "precondition must be one of"),
        (dict(split_rows={"qkv": 0}), "split_rows must map"),
        (dict(split_rows=5), "split_rows must map"),
        (dict(split_rows={"qkv": True}), "split_rows must map"),
    ],
)
def test_bad_routing_options_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        DashConfig(**options)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda m: DASH(m.parameters(), precondition="hidden"), "pass model="),
        (lambda m: DASH(m.parameters(), precondition={"qkv.weight"}), "need parameter names"),
        (lambda m: DASH(m.named_parameters(), precondition={"qkv.wieght"}), r"\['qkv.wieght'\]"),
        (lambda m: DASH(m.named_parameters(), precondition={"qkv.bias"}), "only parameters of two or more"),
        (lambda m: DASH(m.named_parameters(), split_rows={"qkvv": 3}), r"\['qkvv'\]"),
        (lambda m: DASH(m.named_parameters(), split_rows={"qkv": 4}), "does not divide the 18 rows"),
    ],
)
def test_routing_that_does_not_fit_the_model_fails_before_any_change(build, match):
    model = ToyMoE()
    before = [p.detach().clone() for p in model.parameters()]
    dash = build(model)
    toy_loss(model, 0).backward()
    with pytest.raises(ValueError, match=match):
        dash.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_attach_model_enables_hidden_after_construction():
    model = ToyMoE()
    dash = DASH(model.parameters(), precondition="hidden", **OPTIONS)
    dash.attach_model(model)
    assert dash.preconditioning()["embed.weight"] is None
    toy_loss(model, 0).backward()
    dash.step()
    assert dash.owned_blocks > 0


def test_a_converted_optimizer_given_the_model_routes_as_the_strategies_do():
    """``DASH.from_optimizer(adamw, model=model)`` (plain PyTorch) against what the Trainer's
    conversion does (``ConversionOptions.convert(..., model=)``) and against ``DASH(..., model=)``."""
    from lightning_dash.integration.options import ConversionOptions

    model = ToyMoE()
    converted = DASH.from_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model).preconditioning()
    strategy = ConversionOptions.build().convert(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
    assert converted == strategy.preconditioning() == DASH(model.parameters(), model=model).preconditioning()
    assert converted["embed.weight"] is None and converted["qkv.weight"] is not None
    unnamed = DASH.from_optimizer(torch.optim.AdamW(model.named_parameters(), lr=1e-3)).preconditioning()
    assert unnamed["embed.weight"] == MatrixView(11, 6)  # without the model: every matrix
