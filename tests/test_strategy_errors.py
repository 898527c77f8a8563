"""``strategy="dash"`` where plain Lightning would work: no optimizer, unused parameters; and a clear error for
sharding options, which belong to the FSDP strategy.

Every fit runs a real Lightning Trainer on CPU (two gloo processes where it says so).
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import StrategyRegistry
from test_strategy import DASH_OPTIONS, ParityModule, reference_trajectory, release_process_group, trainer
from torch import nn

from lightning_dash import DASH, DashStrategy


@pytest.fixture(autouse=True)
def clean_process_group():
    yield
    release_process_group()


def parameters(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def unchanged(module: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))


# configure_optimizers returning None


class NoOptimizerModule(BoringModel):
    """Lightning's BoringModel without an optimizer; checks, on every rank, that nothing moved."""

    def __init__(self) -> None:
        super().__init__()
        self.start = parameters(self)

    def configure_optimizers(self):
        return None

    def on_train_end(self):
        assert self.trainer.global_step == 3
        assert unchanged(self, self.start)


def test_no_optimizer_fits_with_lightnings_warning_and_moves_nothing(tmp_path):
    model = NoOptimizerModule()
    run = trainer(1, 3, tmp_path, "dash")
    warning = "`LightningModule.configure_optimizers` returned `None`, this fit will run with no optimizer"
    with pytest.warns(UserWarning, match=re.escape(warning)):
        run.fit(model)
    assert run.global_step == 3
    assert not isinstance(run.optimizers[0], DASH)
    assert unchanged(model, model.start)


def test_no_optimizer_fits_in_two_processes(tmp_path):
    trainer(2, 3, tmp_path, "dash_spawn").fit(NoOptimizerModule())  # the checks run in each rank


# Sharding options


@pytest.mark.parametrize(
    "name,value",
    [
        ("sharding_strategy", "FULL_SHARD"),
        ("auto_wrap_policy", {nn.Linear}),
        ("cpu_offload", True),
        ("mixed_precision", torch.distributed.fsdp.MixedPrecision(param_dtype=torch.bfloat16)),
        ("activation_checkpointing_policy", {nn.Linear}),
        ("state_dict_type", "sharded"),
        ("device_mesh", (1, 2)),
        ("reshard_after_forward", True),
        ("shard_modules", [nn.Linear]),
    ],
)
def test_sharding_option_points_to_the_fsdp_strategy(name, value):
    with pytest.raises(ValueError, match=rf"\['{name}'\].*strategy=\"dash_fsdp\".*DashFSDPStrategy"):
        DashStrategy(**{name: value})


def test_several_sharding_options_are_all_named():
    with pytest.raises(ValueError, match=r"\['auto_wrap_policy', 'sharding_strategy'\]"):
        DashStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={nn.Linear}, block_size=16)


def test_ddp_options_are_still_taken():
    strategy = DashStrategy(find_unused_parameters=True, static_graph=False, gradient_as_bucket_view=True, block_size=8)
    assert strategy.conversion.overrides == {"block_size": 8}


# Parameters without gradients (find_unused_parameters)


@pytest.mark.parametrize("namespace", ["lightning.pytorch"])
def test_every_ddp_registry_name_has_a_dash_twin_with_the_same_settings(namespace):
    strategies = importlib.import_module(f"{namespace}.strategies")
    registry, ddp = strategies.StrategyRegistry, strategies.DDPStrategy
    ddp_names = [name for name, entry in registry.items() if entry["strategy"] is ddp]
    assert "ddp_find_unused_parameters_true" in ddp_names and "ddp_notebook_find_unused_parameters_false" in ddp_names
    for name in ddp_names:
        twin = registry["dash" + name.removeprefix("ddp")]
        assert issubclass(twin["strategy"], ddp) and twin["strategy"].__name__ == "DashStrategy"
        assert twin["init_params"] == registry[name]["init_params"]


class IdleLayerModule(BoringModel):
    """BoringModel with a layer its forward never uses, as a GAN's idle half."""

    def __init__(self) -> None:
        super().__init__()
        self.idle = nn.Linear(32, 2)


def test_idle_layer_fits_with_find_unused_parameters_true(tmp_path):
    model = IdleLayerModule()
    layer, idle = parameters(model.layer), parameters(model.idle)
    run = trainer(1, 3, tmp_path, "dash_find_unused_parameters_true")
    run.fit(model)
    assert isinstance(run.optimizers[0], DASH)
    assert unchanged(model.idle, idle)
    assert not torch.equal(model.layer.weight, layer[0])
    assert all(torch.isfinite(p).all() for p in model.parameters())


class IdleLayerParityModule(ParityModule):
    """ParityModule (checked against single-process DASH after every step) plus a layer its forward never
    uses. The layer is registered after ``net``, so ParityModule's comparison, which pairs the parameters
    with the reference's by position, covers all of ``net``."""

    def __init__(self, reference_path: str) -> None:
        super().__init__(reference_path)
        self.idle = nn.Linear(3, 3)
        self.idle_start = parameters(self.idle)

    def on_train_end(self):
        assert unchanged(self.idle, self.idle_start)


def test_idle_layer_in_two_processes_matches_single_process_dash(tmp_path):
    reference = tmp_path / "trajectory.pt"
    torch.save(reference_trajectory(4), reference)
    # The registry entry with the reference's DASH options (the Trainer builds it without options).
    entry = StrategyRegistry["dash_spawn_find_unused_parameters_true"]
    strategy = entry["strategy"](**entry["init_params"], **DASH_OPTIONS)
    trainer(2, 4, tmp_path, strategy).fit(IdleLayerParityModule(str(reference)))
