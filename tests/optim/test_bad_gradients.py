"""Gradients a real run produces after a loss spike or a bad batch, and bad checkpoints.

Each test starts from a reproduction of a way DASH used to break where AdamW does not,
and checks the fixed behaviour against an independent expectation: the float64
reference of the same formula (``reference.ReferenceDash``), AdamW under the same
fault, or an invariant (finite parameters, an unchanged state).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.reference import ReferenceDash
from torch import nn

from lightning_dash import DASH, DashConfig, RootComputationError
from lightning_dash.optim.step.commit import any_nonfinite

SOLVERS = ("eigh", "newton_db", "coupled_newton", "chebyshev")


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def adamw_finite_after(grads: list[torch.Tensor], start: torch.Tensor) -> bool:
    """Whether torch's AdamW keeps a parameter finite under the same gradients."""
    param = nn.Parameter(start.clone())
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return bool(torch.isfinite(param).all())


def run_against_reference(grads: list[torch.Tensor], solver: str, dtype=torch.float32, **options):
    """DASH and the float64 reference from a zero parameter with lr 1 (so the parameter is
    exactly the sum of the updates); returns (dash parameter, reference parameter, optimizer)."""
    shape = grads[0].shape
    param = nn.Parameter(torch.zeros(shape, dtype=dtype))
    settings = dict(lr=1.0, precondition_frequency=1, **options)
    optimizer = DASH([param], inverse_root_method=solver, **settings)
    reference = ReferenceDash(**{k: v for k, v in settings.items() if k in ReferenceDash.__dataclass_fields__})
    expected = [torch.zeros(shape, dtype=torch.float64)]
    for grad in grads:
        param.grad = grad.to(dtype)
        optimizer.step()
        reference.step(expected, [grad.double()])
    return param.detach(), expected[0], optimizer


# ---------------------------------------------------------------- 1. one huge gradient
def test_one_huge_gradient_leaves_the_model_finite_and_matches_the_formula():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(6, 5, generator=generator)
    grads = [1e20 * torch.randn(6, 5, generator=generator), torch.randn(6, 5, generator=generator)]
    param = nn.Parameter(start.clone())
    optimizer = DASH([param])
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    assert torch.isfinite(param).all()
    assert adamw_finite_after(grads, start)  # the bar: AdamW stays finite too
    assert optimizer.root_failure_count == 0 and optimizer.nonfinite_grad_skips == 0
    actual, expected, _ = run_against_reference(grads, "newton_db")
    assert relative_difference(actual, expected) < 1e-3


# ---------------------------------------------------------------- 2, 4. every solver at every scale
# Chebyshev's interpolant is accurate above its floor ((ln 1000 / 2 degree)^2 of the scale):
# it is held to the formula with a degree and an epsilon that keep the spectrum above it.
SOLVER_OPTIONS = {
    "eigh": {},
    "newton_db": {},
    "coupled_newton": {},
    "chebyshev": dict(epsilon=1e-2, chebyshev_degree=60),
}


@pytest.mark.parametrize("scale", [1e-30, 1e-10, 1.0, 1e3, 1e6, 1e10, 1e20])
@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("root_order", [4, 2])
def test_every_solver_matches_the_float64_formula_at_every_gradient_scale(solver, scale, root_order):
    # The (20, 12) block's left factor has rank 12: eight null directions, where p = 2
    # amplifies damping-level components twice as strongly (in the exponent) as p = 4.
    generator = torch.Generator().manual_seed(1)
    grads = [scale * torch.randn(20, 12, generator=generator, dtype=torch.float64) for _ in range(3)]
    options = {**SOLVER_OPTIONS[solver], "root_order": root_order}
    actual, expected, optimizer = run_against_reference(grads, solver, **options)
    assert torch.isfinite(actual).all()
    assert optimizer.root_failure_count == 0
    assert relative_difference(actual, expected) < 1e-3


@pytest.mark.parametrize("solver", SOLVERS)
def test_the_direction_does_not_depend_on_the_loss_scale(solver):
    """An MLP trained on ``1e12 * loss`` follows the same path as on ``loss``: Adam grafting
    and relative damping are scale-invariant (up to the grafting epsilon, negligible here).
    The two runs differ by roundoff, which the iterative solvers amplify at small damping
    (docs/benchmarks/numerics.md, Damping), so they run at the damping recommended for them, 1e-4."""
    options = {**SOLVER_OPTIONS[solver]}
    if solver in ("newton_db", "coupled_newton"):
        options["epsilon"] = 1e-4

    def train(loss_scale: float) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        optimizer = DASH(
            model.parameters(), lr=1e-2, block_size=8, precondition_frequency=2, inverse_root_method=solver, **options
        )
        data = torch.Generator().manual_seed(1)
        for _ in range(6):
            x = torch.randn(32, 8, generator=data)
            optimizer.zero_grad()
            (loss_scale * model(x).pow(2).mean()).backward()
            optimizer.step()
        assert optimizer.root_failure_count == 0 and optimizer.nonfinite_grad_skips == 0
        return [p.detach().clone() for p in model.parameters()]

    for plain, scaled in zip(train(1.0), train(1e12)):
        assert torch.isfinite(scaled).all()
        torch.testing.assert_close(scaled, plain, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- 3. eigh raising, atomic steps
class EighThatRaises:
    """Fault injection: torch.linalg.eigh fails to converge while ``failing`` is set."""

    def __init__(self) -> None:
        self.real = torch.linalg.eigh
        self.failing = False

    def __call__(self, *args, **kwargs):
        if self.failing:
            raise torch.linalg.LinAlgError("linalg.eigh: injected failure to converge")
        return self.real(*args, **kwargs)


def snapshot(optimizer: DASH, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
    state = optimizer.state_dict()["state"]
    return [p.detach().clone() for p in params], {k: {n: v.clone() for n, v in e.items()} for k, e in state.items()}


def test_eigh_failures_keep_the_roots_then_raise_before_anything_changes_and_recover(monkeypatch):
    eigh = EighThatRaises()
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    model = nn.Linear(6, 4)
    params = list(model.parameters())
    optimizer = DASH(
        model.named_parameters(),
        lr=0.01,
        inverse_root_method="eigh",
        precondition_frequency=1,
        max_consecutive_root_failures=2,
    )
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()

    step()  # good roots
    roots = optimizer.state_dict()["state"][0]["left_root_0_0"].clone()
    eigh.failing = True
    before, _ = snapshot(optimizer, params)
    step()  # first failure: counted, previous roots kept, the step is applied whole
    state = optimizer.state_dict()["state"]
    assert optimizer.root_failure_count == 1 and torch.equal(state[0]["left_root_0_0"], roots)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))  # the bias moved as well
    step()  # second failure in a row reaches the limit: applied whole, previous roots kept
    assert optimizer.root_failure_count == 2
    assert torch.equal(optimizer.state_dict()["state"][0]["left_root_0_0"], roots)
    before, saved = snapshot(optimizer, params)
    with pytest.raises(RootComputationError, match="weight"):
        step()  # the host reads the streak back at the next step and raises before it modifies anything
    after, resaved = snapshot(optimizer, params)
    assert all(torch.equal(p, b) for p, b in zip(after, before))
    for key, entry in saved.items():
        for name, value in entry.items():
            assert torch.equal(resaved[key][name], value), (key, name)
    eigh.failing = False
    step()  # usable again: a good step works and resets the streak
    assert all(torch.isfinite(p).all() for p in params)
    assert int(optimizer.state_dict()["state"][0]["root_failures"].max()) == 0


# ---------------------------------------------------------------- 5. residuals that mean something
def test_a_newton_root_that_did_not_converge_counts_as_failed():
    generator = torch.Generator().manual_seed(0)
    param = nn.Parameter(torch.zeros(24, 24))
    # One iteration per pass cannot resolve a damping of 1e-6: the residual stays near 1.
    optimizer = DASH(
        [param],
        lr=0.01,
        epsilon=1e-6,
        inverse_root_method="newton_db",
        root_iterations=1,
        precondition_frequency=1,
        max_consecutive_root_failures=None,
    )
    param.grad = torch.randn(24, 24, generator=generator)
    optimizer.step()
    assert optimizer.root_failure_count == 1
    assert float(optimizer.last_root_residual) > 0.34
    state = optimizer.state_dict()["state"][0]
    assert not state["root_valid"].any()
    # With no previous root the block followed Adam: on step one that is g / (|g| + eps).
    grad = param.grad
    torch.testing.assert_close(param.detach(), -0.01 * grad / (grad.abs() + 1e-8))


def test_converged_newton_roots_are_accepted_with_their_residual():
    generator = torch.Generator().manual_seed(0)
    param = nn.Parameter(torch.zeros(24, 24))
    optimizer = DASH([param], lr=0.01, inverse_root_method="newton_db", precondition_frequency=1)
    for _ in range(3):
        param.grad = torch.randn(24, 24, generator=generator)
        optimizer.step()
    assert optimizer.root_failure_count == 0
    assert float(optimizer.last_root_residual) < 1e-3


# ---------------------------------------------------------------- 6. float64 stays float64
@pytest.mark.parametrize("solver", ["eigh", "newton_db"])
def test_float64_parameters_are_updated_in_float64(solver):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(9, 6, generator=generator, dtype=torch.float64) for _ in range(3)]
    # eigh: exact; newton_db: iterated to float64 roundoff.
    actual, expected, optimizer = run_against_reference(
        grads, solver, dtype=torch.float64, epsilon=1e-3, root_iterations=30 if solver == "newton_db" else None
    )
    assert actual.dtype == torch.float64
    assert relative_difference(actual, expected) < 1e-9
    state = optimizer.state_dict()["state"][0]
    assert state["left_factor_0_0"].dtype == state["momentum"].dtype == torch.float64
    vector = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    vector_optimizer = DASH([vector], lr=1.0)
    reference = ReferenceDash(lr=1.0)
    expected_vector = [torch.zeros(5, dtype=torch.float64)]
    for grad in grads:
        vector.grad = grad[0, :5].clone()
        vector_optimizer.step()
        reference.step(expected_vector, [grad[0, :5]])
    assert relative_difference(vector.detach(), expected_vector[0]) < 1e-12


def test_low_precision_parameters_keep_float32_state():
    param = nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    optimizer = DASH([param], block_size=4)
    param.grad = torch.randn(8, 8, dtype=torch.bfloat16)
    optimizer.step()
    assert param.dtype == torch.bfloat16
    assert optimizer.state_dict()["state"][0]["left_factor_0_0"].dtype == torch.float32


# ---------------------------------------------------------------- 7. zero-element parameters
def test_zero_element_parameters_are_accepted_and_left_alone():
    generator = torch.Generator().manual_seed(0)
    empty_matrix, empty_vector = nn.Parameter(torch.randn(0, 5)), nn.Parameter(torch.randn(0))
    weight = nn.Parameter(torch.randn(4, 5, generator=generator))
    twin = nn.Parameter(weight.detach().clone())
    with_empty = DASH([empty_matrix, weight, empty_vector], lr=0.01)
    alone = DASH([twin], lr=0.01)
    for _ in range(3):
        grad = torch.randn(4, 5, generator=generator)
        weight.grad, twin.grad = grad.clone(), grad.clone()
        empty_matrix.grad, empty_vector.grad = torch.randn(0, 5), torch.randn(0)
        with_empty.step()
        alone.step()
    assert torch.equal(weight, twin)
    assert empty_matrix.shape == (0, 5) and empty_vector.shape == (0,)
    reloaded = DASH([empty_matrix, weight, empty_vector], lr=0.01)
    reloaded.load_state_dict(with_empty.state_dict())


# ---------------------------------------------------------------- 8. foreign or broken checkpoints
def trained(block_size: int = 4, grafting: str = "adam") -> tuple[nn.Parameter, DASH]:
    param = nn.Parameter(torch.randn(8, 8))
    optimizer = DASH([param], block_size=block_size, grafting=grafting)
    param.grad = torch.randn(8, 8)
    optimizer.step()
    return param, optimizer


def test_an_adamw_state_dict_is_rejected_at_load():
    param = nn.Parameter(torch.randn(8, 8))
    adamw = torch.optim.AdamW([param])
    param.grad = torch.randn(8, 8)
    adamw.step()
    with pytest.raises(ValueError, match="not a DASH state dict"):
        DASH([param]).load_state_dict(adamw.state_dict())


def test_a_block_size_mismatch_is_rejected_at_load():
    param, optimizer = trained(block_size=4)
    with pytest.raises(ValueError, match="block_size=8"):
        DASH([param], block_size=8).load_state_dict(optimizer.state_dict())


@pytest.mark.parametrize("item", ["momentum", "left_factor_0_0", "grafting_rms"])
def test_non_finite_saved_state_is_rejected_at_load(item):
    param, optimizer = trained()
    saved = optimizer.state_dict()
    saved["state"][0][item] = saved["state"][0][item].clone()
    saved["state"][0][item].view(-1)[0] = math.nan
    fresh = DASH([param], block_size=4)
    with pytest.raises(ValueError, match=f"{item} of .* non-finite"):
        fresh.load_state_dict(saved)


def test_the_checkpoint_grafting_wins_and_says_so():
    param, optimizer = trained(grafting="sgd")
    fresh = DASH([param], block_size=4, grafting="adam")
    with pytest.warns(UserWarning, match="grafting='sgd' replaces grafting='adam'"):
        fresh.load_state_dict(optimizer.state_dict())
    assert fresh.grafting == "sgd"


# ---------------------------------------------------------------- 9. roundoff is not amplified
@pytest.mark.parametrize("solver", [None, "eigh"])
@pytest.mark.parametrize("frequency", [1, 10])
def test_roundoff_perturbations_stay_roundoff(solver, frequency):
    """``1 + 1e-7 * randn`` on every gradient (the size of a one-rank vs two-rank sum) moves
    the parameters after 10 steps by at most 1e-4 of their movement, with the defaults
    and with eigh, for a rank-deficient factor (a 20 x 12 gradient has a 20 x 20 factor
    of rank 12)."""
    options = {} if solver is None else {"inverse_root_method": solver}
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randn(20, 12, generator=generator)
        grads = [torch.randn(20, 12, generator=generator) for _ in range(10)]
        noise = [torch.randn(20, 12, generator=generator) for _ in range(10)]
        finals = []
        for size in (0.0, 1e-7):
            param = nn.Parameter(start.clone())
            optimizer = DASH([param], lr=1e-2, precondition_frequency=frequency, **options)
            for grad, wiggle in zip(grads, noise):
                param.grad = grad * (1.0 + size * wiggle)
                optimizer.step()
            finals.append(param.detach())
        assert (finals[1] - finals[0]).norm() <= 1e-4 * (finals[0] - start).norm()


def adamw_recipe(net: nn.Module, lr: float, betas: tuple[float, float], kind: str) -> list[torch.optim.Optimizer]:
    """The optimizers a network's AdamW recipe becomes: DASH at its defaults or at
    ``DashConfig.close_to_one_process()`` (converted with the model known, as the strategies convert it),
    or torch's Muon on the 2-D weights (``match_rms_adamw`` at twice AdamW's lr) with AdamW on the rest."""
    if kind == "muon":
        matrices = [p for p in net.parameters() if p.ndim == 2]
        rest = [p for p in net.parameters() if p.ndim != 2]
        muon = torch.optim.Muon(matrices, lr=2 * lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
        return [muon, torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=0.01)]
    options = DashConfig.close_to_one_process().changed() if kind == "close" else {}
    return [DASH.from_optimizer(torch.optim.AdamW(net.parameters(), lr=lr, betas=betas), model=net, **options)]


def perturbed_change(make_net, batches, loss_fn, lr: float, betas: tuple[float, float], kind: str, seed: int) -> float:
    """``||p' - p|| / ||p - p0||`` after the batches, ``p'`` trained on every gradient times ``1 + 1e-7 randn``
    (the size of a one-rank against a two-rank sum); ``seed`` draws the initial weights."""
    finals, start = [], None
    for size in (0.0, 1e-7):
        torch.manual_seed(seed)
        net = make_net()
        start = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
        optimizers = adamw_recipe(net, lr, betas, kind)
        noise = torch.Generator().manual_seed(1)
        for batch in batches:
            net.zero_grad()
            loss_fn(net, batch).backward()
            for p in net.parameters():
                p.grad.mul_(1.0 + size * torch.randn(p.shape, generator=noise))
            for optimizer in optimizers:
                optimizer.step()
        finals.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    return float((finals[1] - finals[0]).norm() / (finals[0] - start).norm())


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 24), nn.Tanh(), nn.Linear(24, 3))


def mlp_loss(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(net(batch[0]), batch[1])


def worst_changes(make_net, data, loss_fn, lr: float, betas: tuple[float, float]) -> dict[str, list[float]]:
    """Each of :data:`KINDS`' changes over :data:`SEEDS` (``data(seed)``: that seed's batches)."""
    return {
        kind: [perturbed_change(make_net, data(seed), loss_fn, lr, betas, kind, seed) for seed in SEEDS]
        for kind in KINDS
    }


#: Initial weights and batches: the peer-relative rule compares each network's largest change over them (a
#: seed on which neither optimizer's training amplifies anything is not the question).
SEEDS = (0, 1, 2, 3)


@pytest.mark.parametrize("steps", [10, 12])
def test_roundoff_on_a_network_converted_from_adamw_stays_below_muons_and_within_1e_4_close_to_one_process(steps):
    """A whole network trained as the strategies train it (AdamW's recipe converted, the model known):
    1 + 1e-7 randn on every gradient moves DASH's defaults, at worst over four seeds, no further than it
    moves torch's Muon, and ``DashConfig.close_to_one_process()`` by at most 1e-4 of the movement on every
    seed."""

    def data(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x = torch.randn(steps, 16, 12, generator=torch.Generator().manual_seed(seed))
        return list(zip(x, torch.sin(2 * x[..., :3])))

    change = worst_changes(mlp, data, mlp_loss, 0.02, (0.9, 0.99))
    assert max(change["close"]) <= 1e-4, change
    assert max(change["defaults"]) <= max(change["muon"]), change


#: DASH's defaults, the preset for runs that must follow each other closely, and torch's Muon.
KINDS = ("defaults", "close", "muon")


class ByteGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.gru, self.head = nn.Embedding(256, 64), nn.GRU(64, 192, batch_first=True), nn.Linear(192, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(tokens))[0])


def next_byte_loss(net: nn.Module, window: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(net(window[:, :-1]).reshape(-1, 256), window[:, 1:].reshape(-1))


def test_roundoff_on_a_recurrent_language_model_stays_below_muons_and_within_1e_4_close_to_one_process():
    """The same where a spiky factor makes it hard: a byte-level GRU language model on English text,
    AdamW's recipe at a high lr. Its output layer turns nearly rank one, its GRU factors get one dominant
    direction and a deep tail, which a small damping whitens (measured: 1.0e-2 defaults, 2.7e-5 close,
    4.0e-2 Muon; with the defaults' eigendecompositions in float32, 1.9e-1)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[name] for name in sorted(topics)).encode("ascii", "replace")
    corpus = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()

    def data(seed: int) -> list[torch.Tensor]:
        starts = torch.randint(0, corpus.numel() - 65, (10, 32), generator=torch.Generator().manual_seed(seed))
        return [torch.stack([corpus[s : s + 65] for s in row.tolist()]) for row in starts]

    change = worst_changes(ByteGRU, data, next_byte_loss, 3e-2, (0.9, 0.999))
    assert max(change["close"]) <= 1e-4, change
    assert max(change["defaults"]) <= max(change["muon"]), change


# ---------------------------------------------------------------- 10. conversions that lose behaviour
class AdamWWithItsOwnStep(torch.optim.AdamW):
    @torch.no_grad()
    def step(self, closure=None):  # a different update rule
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad.sign(), alpha=-group["lr"])


class AdamWWithExtras(torch.optim.AdamW):
    """A subclass that keeps AdamW's step: converting it loses nothing."""


def test_a_subclass_with_its_own_step_is_refused_unless_allowed():
    params = [nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match="AdamWWithItsOwnStep.*allow_custom_step=True"):
        DASH.from_optimizer(AdamWWithItsOwnStep(params, lr=1e-3))
    converted = DASH.from_optimizer(AdamWWithItsOwnStep(params, lr=1e-3), allow_custom_step=True)
    assert converted.grafting == "adam"
    assert isinstance(DASH.from_optimizer(AdamWWithExtras(params, lr=1e-3)), DASH)


# ---------------------------------------------------------------- non-finite gradients vs AdamW
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_costs_one_step_where_adamw_loses_the_model(bad):
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(6, 5, generator=generator)
    grads = [torch.randn(6, 5, generator=generator) for _ in range(4)]
    grads[1] = grads[1].clone()
    grads[1][0, 0] = bad
    param = nn.Parameter(start.clone())
    optimizer = DASH([param], precondition_frequency=1)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    assert torch.isfinite(param).all() and optimizer.nonfinite_grad_skips == 1
    assert not adamw_finite_after(grads, start)  # AdamW: NaN for good
    # The skipped step never happened: the same as training on the other three.
    clean = nn.Parameter(start.clone())
    reference = DASH([clean], precondition_frequency=1)
    for index, grad in enumerate(grads):
        if index != 1:
            clean.grad = grad.clone()
            reference.step()
    assert torch.equal(param, clean)


def test_a_checkpoint_from_before_grafting_rms_resumes_exactly():
    """State dicts written before 0.2 kept Adam's second moment itself and unscaled factors."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = nn.Parameter(torch.randn(6, 5, generator=generator)), nn.Parameter(torch.randn(5))
    optimizer = DASH([weight, bias], block_size=4, precondition_frequency=1)
    for _ in range(2):
        weight.grad, bias.grad = torch.randn(6, 5, generator=generator), torch.randn(5, generator=generator)
        optimizer.step()
    saved = optimizer.state_dict()
    legacy = {**saved, "state": {}}
    for key, entry in saved["state"].items():
        entry = dict(entry)
        entry["grafting_second_moment"] = entry.pop("grafting_rms").square()
        for name in [n for n in entry if n.startswith("factor_scale_")]:
            tile = name.removeprefix("factor_scale_")
            scale = entry.pop(name)
            for side in ("left", "right"):
                entry[f"{side}_factor_{tile}"] = (entry[f"{side}_factor_{tile}"].double() * scale).float()
        legacy["state"][key] = entry
    twins = [nn.Parameter(weight.detach().clone()), nn.Parameter(bias.detach().clone())]
    resumed = DASH(twins, block_size=4, precondition_frequency=1)
    resumed.load_state_dict(legacy)
    grads = [torch.randn(6, 5, generator=generator), torch.randn(5, generator=generator)]
    for params, opt in (([weight, bias], optimizer), (twins, resumed)):
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        opt.step()
    for original, twin in zip((weight, bias), twins):
        torch.testing.assert_close(twin, original, rtol=1e-5, atol=1e-6)


def test_the_finiteness_check_passes_empty_tensors_and_catches_a_bad_entry_beside_them():
    """A rank that owns no block shares empty update tensors; they are finite, not an error."""
    empty, finite = torch.empty(0), torch.ones(3)
    assert float(any_nonfinite([empty], torch.device("cpu"))) == 0.0
    assert float(any_nonfinite([empty, finite], torch.device("cpu"))) == 0.0
    assert float(any_nonfinite([empty, torch.tensor([1.0, math.inf])], torch.device("cpu"))) == 1.0
