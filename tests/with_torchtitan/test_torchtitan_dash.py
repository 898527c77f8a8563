"""DASH in torchtitan: its Llama debug model, parallelised by torchtitan's own functions on 4 gloo CPU
ranks (FSDP2, and FSDP2 with tensor parallelism), steps through the container exactly as one process
does, resumes on another mesh as if uninterrupted, and refuses a wrong setting when it is built."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers.spawning import spawn
from titan_runs import container, debug_model, one_process, seeded, train
from torchtitan.components.optimizer import ParamGroupConfig

from lightning_dash import DASH
from lightning_dash.torchtitan import DashOptimizersContainer

STEPS = 10
#: float32 arithmetic in a different order (blocks gathered from shards): the bar for "the same steps".
TOLERANCE = {"rtol": 1e-5, "atol": 1e-7}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return one_process(STEPS)


def assert_same(parameters: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert parameters.keys() == reference.keys()
    start = dict(debug_model(1).named_parameters())
    for name, expected in reference.items():
        torch.testing.assert_close(parameters[name], expected, **TOLERANCE, msg=name)
        assert not torch.equal(expected, start[name].detach()), f"{name} did not move"


@pytest.mark.multiprocess
@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["fsdp4", "fsdp2-tp2"])
def test_parallelised_llama_steps_as_one_process(tensor_parallel, reference, tmp_path):
    out = tmp_path / "parameters.pt"
    spawn(lambda rank, world: train(rank, world, tensor_parallel, range(STEPS), out, tmp_path), 4, tmp_path)
    assert_same(torch.load(out), reference)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1)], ids=["fsdp4-to-tp2", "tp2-to-fsdp4"])
def test_checkpoint_resumes_on_another_mesh_as_if_uninterrupted(before, after, reference, tmp_path):
    """Saved by torchtitan's checkpoint manager at step 5 on one mesh, loaded by it on the other."""
    half = STEPS // 2
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    ranks = {run: tmp_path / run for run in ("saving", "resuming")}  # each run's rendezvous file
    for folder in ranks.values():
        folder.mkdir()
    spawn(
        lambda rank, world: train(rank, world, before, range(half), first, tmp_path, save_at=half), 4, ranks["saving"]
    )
    spawn(lambda rank, world: train(rank, world, after, range(half, STEPS), second, tmp_path), 4, ranks["resuming"])
    assert_same(torch.load(second), reference)


def test_adamw_recipe_maps_onto_dash():
    optimizers = container(debug_model(1))
    (dash,) = optimizers.optimizers
    assert isinstance(dash, DASH)
    group = dash.param_groups[0]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.1 and group["grafting_epsilon"] == 1e-8
    assert dash.block_size == 128 and not group["fused"] and group["param_names"][0] == "tok_embeddings.weight"


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [({"block_size": 0}, ValueError, "block_size"), ({"blok_size": 128}, TypeError, "blok_size")],
)
def test_a_wrong_dash_option_fails_when_the_container_is_built(options, error, named):
    with pytest.raises(error, match=named):
        container(debug_model(1), **options)


def test_pipeline_parallel_model_parts_are_refused_by_name():
    config = DashOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="DASH", optimizer_kwargs={"lr": 1e-3})]
    )
    parts = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    with pytest.raises(ValueError, match="pipeline_parallel_degree"):
        config.build(model_parts=parts)


def test_import_lightning_dash_imports_no_torchtitan_module():
    script = "import sys, lightning_dash; print(sorted(m for m in sys.modules if m.startswith('torchtitan')))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_registered_config_runs_dash_with_embeddings_and_output_on_adamw():
    """What torchtitan's launcher loads for ``--module lightning_dash.torchtitan --config
    llama3_debugmodel_dash``: the debug model with DASH, its embedding and output layer on AdamW."""
    from torchtitan.config.manager import ConfigManager

    config = ConfigManager().parse_args(["--module", "lightning_dash.torchtitan", "--config", "llama3_debugmodel_dash"])
    assert isinstance(config.optimizer, DashOptimizersContainer.Config)
    optimizers = config.optimizer.build(model_parts=[debug_model(1)])
    by_kind = {type(optimizer).__name__: optimizer for optimizer in optimizers.optimizers}
    assert sorted(by_kind) == ["AdamW", "DASH"]
    assert by_kind["AdamW"].param_groups[0]["param_names"] == ["tok_embeddings.weight", "lm_head.weight"]
    assert "layers.0.attention.wo.weight" in by_kind["DASH"].param_groups[0]["param_names"]


def test_lr_schedule_reaches_dash_and_its_figures_reach_the_metrics():
    """torchtitan's warm-up drives DASH's groups, and the container reports DASH's monitoring figures."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    model = debug_model(1)
    optimizers = container(model)
    schedulers = LRSchedulersContainer.Config(warmup_steps=4, decay_ratio=None).build(
        optimizers=optimizers, training_steps=STEPS
    )
    (dash,) = optimizers.optimizers
    rates = []
    for number in range(3):
        rates.append(dash.param_groups[0]["lr"])
        for param in model.parameters():
            param.grad = torch.full_like(param, 1e-3 * (number + 1))
        optimizers.step()
        schedulers.step()
    assert rates == pytest.approx([1e-3 * (k + 1) / 4 for k in range(3)])  # linear warm-up: (t + 1) / warmup_steps
    figures = optimizers.metrics()
    assert figures["dash/preconditioned_blocks"] > 0 and figures["dash/nonfinite_grad_skips"] == 0


def test_tied_embedding_and_frozen_layer_as_users_write_them():
    """torchtitan's own weight tying (the output layer is the embedding) and a frozen projection: the
    tied weight sits once in the AdamW group and steps as ``torch.optim.AdamW`` steps it, the frozen
    one stays as it is, and DASH takes every other trainable parameter."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from lightning_dash.torchtitan.config_registry import dash_optimizers

    config = llama3_debugmodel()
    config.model_spec.model.enable_weight_tying = True
    config.model_spec.model.update_from_config(config=config)
    model = config.model_spec.model.build()
    assert model.lm_head.weight is model.tok_embeddings.weight
    frozen = model.get_parameter("layers.0.attention.wo.weight").requires_grad_(False)
    frozen_before = frozen.detach().clone()
    optimizers = dash_optimizers(lr=1e-2, block_size=128).build(model_parts=[model])
    by_kind = {type(optimizer).__name__: optimizer for optimizer in optimizers.optimizers}
    assert by_kind["AdamW"].param_groups[0]["param_names"] == ["tok_embeddings.weight"]
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert set(by_kind["DASH"].param_groups[0]["param_names"]) == trainable - {"tok_embeddings.weight"}

    tied = model.tok_embeddings.weight
    expected = tied.detach().clone().requires_grad_(True)
    adamw = torch.optim.AdamW([expected], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for param in model.parameters():
        if param.requires_grad:
            param.grad = seeded("grad", param.shape, str(param.shape), 1e-3)
    expected.grad = tied.grad.clone()
    optimizers.step()
    adamw.step()
    torch.testing.assert_close(tied.detach(), expected.detach())
    assert torch.equal(frozen.detach(), frozen_before)
