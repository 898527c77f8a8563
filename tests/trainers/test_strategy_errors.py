"""``strategy="dash"`` where plain Lightning would work: no optimizer, unused parameters, the standalone
``pytorch_lightning`` package; and a clear error for sharding options, which belong to the FSDP strategy.

Every fit runs a real Lightning Trainer on CPU (two gloo processes where it says so).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import pytorch_lightning
import torch
from helpers.lightning_parity import (  # noqa: F401 (clean_process_group: an autouse fixture)
    DASH_OPTIONS,
    ParityModule,
    clean_process_group,
    reference_trajectory,
    release_process_group,
    trainer,
)
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import StrategyRegistry
from pytorch_lightning.demos.boring_classes import BoringModel as StandaloneBoringModel
from torch import nn

import lightning_dash
from lightning_dash import DASH, DashFabricFSDPStrategy, DashFabricStrategy, DashFSDPStrategy, DashStrategy
from lightning_dash.integration.namespaces import register_strategies, standalone_module


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


@pytest.mark.multiprocess
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


def test_sharding_options_left_at_none_are_not_refused():
    # LightningCLI passes every DDP argument, DistributedDataParallel's mixed_precision and device_mesh as None.
    assert DashStrategy(mixed_precision=None, device_mesh=None).conversion.overrides == {}


STRATEGY_CLASSES = [DashStrategy, DashFSDPStrategy, DashFabricStrategy, DashFabricFSDPStrategy]


@pytest.mark.parametrize("strategy_class", STRATEGY_CLASSES, ids=lambda cls: cls.__name__)
def test_a_fork_server_is_refused_by_name_and_every_other_start_method_is_taken(strategy_class):
    # Under a fork server Lightning leaves a CPU module in shared memory: every rank would step one copy.
    with pytest.raises(ValueError, match=r"start_method must be one of \('popen', 'spawn', 'fork'\), got 'forkserver'"):
        strategy_class(start_method="forkserver")
    for start_method in ("popen", "spawn", "fork"):
        assert strategy_class(start_method=start_method, block_size=8).conversion.overrides == {"block_size": 8}


# Parameters without gradients (find_unused_parameters)


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
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


@pytest.mark.multiprocess
def test_idle_layer_in_two_processes_matches_single_process_dash(tmp_path):
    reference = tmp_path / "trajectory.pt"
    torch.save(reference_trajectory(4), reference)
    # The registry entry with the reference's DASH options (the Trainer builds it without options).
    entry = StrategyRegistry["dash_spawn_find_unused_parameters_true"]
    strategy = entry["strategy"](**entry["init_params"], **DASH_OPTIONS)
    trainer(2, 4, tmp_path, strategy).fit(IdleLayerParityModule(str(reference)))


# The standalone pytorch_lightning package


def standalone_trainer(
    devices: int, strategy: str | pytorch_lightning.strategies.Strategy, root: Path
) -> pytorch_lightning.Trainer:
    """A quiet CPU ``pytorch_lightning.Trainer`` of three steps."""
    return pytorch_lightning.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=3,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_pytorch_lightning_trainer_trains_with_dash(tmp_path):
    model = StandaloneBoringModel()
    before = parameters(model)
    run = standalone_trainer(1, "dash", tmp_path)
    run.fit(model)
    assert isinstance(run.strategy, pytorch_lightning.strategies.DDPStrategy)
    optimizer = run.optimizers[0]
    assert isinstance(optimizer, DASH) and optimizer.grafting == "sgd"  # BoringModel's SGD, converted
    assert not torch.equal(model.layer.weight, before[0])


class StandaloneDashChecks(StandaloneBoringModel):
    def on_train_end(self):
        optimizer = self.trainer.optimizers[0]
        assert isinstance(optimizer, DASH) and optimizer.block_size == 16
        assert optimizer.distributor.world_size == 2


@pytest.mark.multiprocess
def test_pytorch_lightning_strategy_with_options_in_two_spawned_processes(tmp_path):
    """The ranks unpickle the standalone DashStrategy: its renamed module is importable by name."""
    strategy_class = standalone_module("lightning_dash.strategies.dash_ddp", "pytorch_lightning").DashStrategy
    assert issubclass(strategy_class, pytorch_lightning.strategies.DDPStrategy)
    standalone_trainer(2, strategy_class(start_method="spawn", block_size=16), tmp_path).fit(StandaloneDashChecks())


def test_registering_again_changes_nothing():
    registries = (StrategyRegistry, pytorch_lightning.strategies.StrategyRegistry)
    before = [{name: entry["strategy"] for name, entry in registry.items()} for registry in registries]
    lightning_dash.register_strategies()
    assert [{name: entry["strategy"] for name, entry in registry.items()} for registry in registries] == before


def run_with_blocked(packages: tuple[str, ...], body: str) -> str:
    """Run ``body`` in a fresh interpreter in which ``packages`` (top-level names) cannot be found."""
    script = textwrap.dedent(f"""
        import importlib.abc, importlib.util, sys
        BLOCKED = {packages!r}
        real_find_spec = importlib.util.find_spec
        def find_spec(name, *args):
            return None if name.split(".")[0] in BLOCKED else real_find_spec(name, *args)
        importlib.util.find_spec = find_spec
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)")
                return None
        sys.meta_path.insert(0, Block())
        """) + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.multiprocess
def test_without_the_standalone_packages_nothing_of_them_is_imported():
    output = run_with_blocked(
        ("pytorch_lightning", "lightning_fabric"),
        """
        import lightning_dash
        from lightning.pytorch.strategies import StrategyRegistry
        assert type(StrategyRegistry.get("dash")) is lightning_dash.DashStrategy
        print(sorted({m.split(".")[0] for m in sys.modules} & {"pytorch_lightning", "lightning_fabric"}))
        """,
    )
    assert output.split() == ["[]"]


@pytest.mark.multiprocess
def test_pytorch_lightning_without_the_unified_package(tmp_path):
    output = run_with_blocked(
        ("lightning",),
        f"""
        import lightning_dash
        import pytorch_lightning
        from pytorch_lightning.demos.boring_classes import BoringModel
        run = pytorch_lightning.Trainer(
            accelerator="cpu", devices=1, strategy="dash", max_steps=2, default_root_dir={str(tmp_path)!r},
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        run.fit(BoringModel())
        print(type(run.optimizers[0]).__name__, hasattr(lightning_dash, "DashStrategy"))
        print(sorted(m for m in sys.modules if m.split(".")[0] == "lightning"))
        """,
    )
    assert output.split() == ["DASH", "False", "[]"]


# The mechanism, with modules written here: a Fabric strategy module and one that imports bare `lightning`

FABRIC_PROBE = """
from lightning.fabric.strategies import DDPStrategy


class ProbeStrategy(DDPStrategy):
    pass


def register_strategies(registry):
    if "dash_probe" not in registry:
        registry.register("dash_probe", ProbeStrategy, start_method="spawn")
"""


def test_fabric_module_is_registered_in_both_fabric_namespaces(tmp_path, monkeypatch):
    import lightning.fabric
    import lightning_fabric

    (tmp_path / "dash_probe_fabric.py").write_text(FABRIC_PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    register_strategies(trainer_modules=(), fabric_modules=("dash_probe_fabric",))
    unified = lightning.fabric.strategies.STRATEGY_REGISTRY.get("dash_probe")
    standalone = lightning_fabric.strategies.STRATEGY_REGISTRY.get("dash_probe")
    assert isinstance(unified, lightning.fabric.strategies.DDPStrategy)
    assert not isinstance(unified, lightning_fabric.strategies.DDPStrategy)
    assert isinstance(standalone, lightning_fabric.strategies.DDPStrategy)
    assert type(standalone).__module__ == "lightning_dash.integration._lightning_fabric.dash_probe_fabric"
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=1, strategy="dash_probe")
    assert type(fabric.strategy) is type(standalone)


def test_module_importing_bare_lightning_is_refused_for_a_copy(tmp_path, monkeypatch):
    (tmp_path / "dash_probe_bare.py").write_text("import lightning\n\n\ndef register_strategies(registry):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="dash_probe_bare imports lightning:"):
        register_strategies(trainer_modules=("dash_probe_bare",), fabric_modules=())
