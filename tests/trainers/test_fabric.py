"""``Fabric(strategy="dash")`` and ``Fabric(strategy="dash_fsdp")`` in real gloo runs of 1 and 2 processes.

Every run trains test_fsdp_strategy's ``TinyLM`` (tied weights, odd widths) with the AdamW + StepLR a user
writes and, inside each rank after every optimizer step, compares the parameters (gathered from their
shards under FSDP2) with single-process DASH on the same global batches, computed without Fabric. A resumed
run must continue exactly like the uninterrupted one, so a checkpoint that lost DASH's statistics fails it.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import lightning.fabric
import lightning_fabric
import pytest
import torch
from helpers.fsdp_parity import (
    DASH_OPTIONS,
    EVEN_HIDDEN,
    ODD_HIDDEN,
    TinyLM,
    adamw_with_schedule,
    apply_tensor_parallel,
    full,
    global_batch,
    lm_loss,
    reference_trajectory,
)
from helpers.lightning_parity import clean_process_group  # noqa: F401 (an autouse fixture)
from helpers.spawning import START_METHOD
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_dash import DASH, DashFabricFSDPStrategy, DashFabricStrategy

#: A collective that does not complete fails the test after this long instead of Fabric's 30 minutes.
TIMEOUT = timedelta(seconds=120)


@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    return reference_trajectory(6)


def ddp(start_method: str = START_METHOD, **options) -> DashFabricStrategy:
    return DashFabricStrategy(start_method=start_method, timeout=TIMEOUT, **options)


def fsdp(start_method: str = START_METHOD, **options) -> DashFabricFSDPStrategy:
    return DashFabricFSDPStrategy(start_method=start_method, timeout=TIMEOUT, **options)


def launch(strategy, devices: int, function, *args, **kwargs):
    return Fabric(accelerator="cpu", devices=devices, strategy=strategy).launch(function, *args, **kwargs)


def train(
    fabric,
    reference: list[dict[str, torch.Tensor]],
    steps: int,
    load: Path | None = None,
    save: Path | None = None,
    save_at: int | None = None,
    pass_scheduler: bool = True,
    setup_first: bool = False,
    hidden: tuple[int, int] = ODD_HIDDEN,
) -> dict[str, object]:
    """Train with the user's AdamW + StepLR up to ``steps`` (from a checkpoint's step after ``load``),
    checked against ``reference`` after every step; save after step ``save_at`` to ``save``.

    ``setup_first``: set up the model, then create the optimizer and set it up (the FSDP way of Fabric's
    docs); else create both first, then ``fabric.setup(model, optimizer)``, with the scheduler
    (``pass_scheduler``) or not. ``hidden``: the blocks' widths. Each data-parallel group
    (every rank, without tensor parallelism) trains on its rows of the global batch."""
    net = TinyLM(hidden)
    if setup_first:
        model = fabric.setup_module(net)
        optimizer, scheduler = adamw_with_schedule(net.parameters())
        optimizer = fabric.setup_optimizers(optimizer)
    else:
        optimizer, scheduler = adamw_with_schedule(net.parameters())
        if pass_scheduler:
            model, optimizer, scheduler = fabric.setup(net, optimizer, scheduler=scheduler)
        else:
            model, optimizer = fabric.setup(net, optimizer)
    dash = optimizer.optimizer
    assert isinstance(dash, DASH) and dash.distributor.world_size == fabric.world_size
    # A scheduler given to fabric.setup is pointed at the DASH; one that was not keeps driving the same groups.
    assert (scheduler.optimizer is dash) == (pass_scheduler and not setup_first)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if load is not None:
        fabric.load(load, state)
    start = dict(TinyLM(hidden).named_parameters())
    mesh = getattr(fabric.strategy, "device_mesh", None)
    rank, size = (fabric.global_rank, fabric.world_size) if mesh is None else data_parallel_rank(mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(state["step"], steps):
            tokens = global_batch(step)[rank::size]
            fabric.backward(lm_loss(model, tokens))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            for name, param in net.named_parameters():
                expected, initial = reference[step][name], start[name].detach()
                assert (full(param) - expected).norm() <= 1e-4 * (expected - initial).norm() + 1e-6, (step, name)
            assert dash.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5 ** ((step + 1) // 2))
            if step + 1 == save_at:
                state["step"] = step + 1
                fabric.save(save, state)
    # The scheduler saw its optimizer step first (torch warns otherwise), whichever optimizer it holds.
    assert not [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return {
        "strategy": type(fabric.strategy).__module__,
        "dtensors": all(isinstance(p, DTensor) for p in net.parameters()),
        "mesh_dims": max(p.device_mesh.ndim if isinstance(p, DTensor) else 0 for p in net.parameters()),
    }


def data_parallel_rank(mesh) -> tuple[int, int]:
    data = mesh["data_parallel"]
    return data.get_local_rank(), data.size()


# Registration and options


@pytest.mark.parametrize("namespace", [lightning.fabric, lightning_fabric])
def test_every_fabric_ddp_name_has_a_dash_twin_and_dash_fsdp_is_registered(namespace):
    registry, strategies = namespace.strategies.STRATEGY_REGISTRY, namespace.strategies
    ddp_names = [name for name, entry in registry.items() if entry["strategy"] is strategies.DDPStrategy]
    assert {"ddp_spawn", "ddp_notebook", "ddp_find_unused_parameters_true"} <= set(ddp_names)
    for name in ddp_names:
        twin = registry["dash" + name.removeprefix("ddp")]
        assert issubclass(twin["strategy"], strategies.DDPStrategy)
        assert twin["strategy"].__name__ == "DashFabricStrategy"
        assert twin["init_params"] == registry[name]["init_params"]
    for name, start_method in (("dash_fsdp", "popen"), ("dash_fsdp_spawn", "spawn"), ("dash_fsdp_fork", "fork")):
        strategy = registry.get(name)
        assert isinstance(strategy, strategies.ModelParallelStrategy) and strategy.start_method == start_method


def test_fabric_resolves_the_names_to_our_strategies():
    assert isinstance(Fabric(accelerator="cpu", devices=2, strategy="dash").strategy, DashFabricStrategy)
    assert isinstance(Fabric(accelerator="cpu", devices=2, strategy="dash_fsdp").strategy, DashFabricFSDPStrategy)


def test_standalone_lightning_fabric_gets_its_own_copies():
    for name, module in (("dash", "fabric_ddp"), ("dash_fsdp_spawn", "fabric_fsdp")):
        strategy = lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy=name).strategy
        assert type(strategy).__module__ == f"lightning_dash.integration._lightning_fabric.{module}"
        assert isinstance(strategy, lightning_fabric.strategies.ParallelStrategy)
        assert not isinstance(strategy, lightning.fabric.strategies.ParallelStrategy)


def test_options_are_checked_when_the_strategy_is_built():
    assert ddp(block_size=8, find_unused_parameters=True).conversion.overrides == {"block_size": 8}
    assert DashFabricFSDPStrategy(config=None, epsilon=1e-4).conversion.overrides == {"epsilon": 1e-4}
    with pytest.raises(ValueError, match=r"\['auto_wrap_policy'\].*strategy=\"dash_fsdp\""):
        DashFabricStrategy(auto_wrap_policy={nn.Linear})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['blok_size'\]"):
        DashFabricStrategy(blok_size=8)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['find_unused_parameters'\]"):
        DashFabricFSDPStrategy(find_unused_parameters=True)
    assert DashFabricFSDPStrategy(micro_group_mib=64).conversion.micro_group_mib == 64.0
    with pytest.raises(ValueError, match="micro_group_mib applies where parameters are sharded"):
        DashFabricStrategy(micro_group_mib=64)


# Training, parity and checkpoints


@pytest.mark.multiprocess
def test_ddp_matches_single_process_dash_and_resumes_at_one_process_and_under_fsdp(tmp_path, reference):
    checkpoint = tmp_path / "ddp.ckpt"
    result = launch(ddp(start_method="spawn", **DASH_OPTIONS), 2, train, reference, 3, save=checkpoint, save_at=3)
    assert result["strategy"] == "lightning_dash.fabric.fabric_ddp" and not result["dtensors"]
    assert checkpoint.is_file()
    launch(ddp(**DASH_OPTIONS), 1, train, reference, 6, load=checkpoint)
    launch(fsdp(**DASH_OPTIONS), 2, train, reference, 5, load=checkpoint)


@pytest.mark.multiprocess
def test_fsdp_matches_single_process_dash_and_resumes_at_one_and_two_processes_and_under_ddp(tmp_path, reference):
    """The AdamW is created before ``fabric.setup(model, optimizer)``, which shards the model: the
    optimizer must step the sharded parameters. The scheduler stays attached to the AdamW."""
    folder = tmp_path / "fsdp"
    result = launch(fsdp(**DASH_OPTIONS), 2, train, reference, 4, save=folder, save_at=2, pass_scheduler=False)
    assert result["strategy"] == "lightning_dash.fabric.fabric_fsdp" and result["dtensors"]
    assert (folder / "meta.pt").is_file() and len(list(folder.glob("*.distcp"))) == 2
    for devices in (1, 2):
        launch(fsdp(**DASH_OPTIONS), devices, train, reference, 5, load=folder, pass_scheduler=False)
    launch(ddp(**DASH_OPTIONS), 2, train, reference, 5, load=folder)


@pytest.mark.multiprocess
def test_tensor_parallel_matches_single_process_dash_and_resumes_without_it(tmp_path):
    reference = reference_trajectory(6, EVEN_HIDDEN)
    folder = tmp_path / "tensor_parallel"
    strategy = fsdp(parallelize_fn=apply_tensor_parallel, tensor_parallel_size=2, **DASH_OPTIONS)
    result = launch(strategy, 4, train, reference, 4, save=folder, save_at=2, hidden=EVEN_HIDDEN)
    assert result["dtensors"] and result["mesh_dims"] == 2
    launch(fsdp(**DASH_OPTIONS), 2, train, reference, 5, load=folder, hidden=EVEN_HIDDEN)


@pytest.mark.multiprocess
def test_fsdp_full_checkpoint_file_with_the_optimizer_set_up_after_the_model(tmp_path, reference):
    checkpoint = tmp_path / "fsdp.ckpt"
    options = {"save_distributed_checkpoint": False, **DASH_OPTIONS}
    launch(fsdp(**options), 2, train, reference, 2, save=checkpoint, save_at=2, setup_first=True)
    assert checkpoint.is_file()
    assert set(torch.load(checkpoint, weights_only=True)) == {"model", "optimizer", "scheduler", "step"}
    launch(fsdp(**DASH_OPTIONS), 2, train, reference, 5, load=checkpoint, setup_first=True)


def dash_as_is(fabric, folder: Path) -> None:
    """A DASH the user built is set up unchanged; saving it works (and does not hang) with and without
    ``collective_state_dict``, and each checkpoint restores the run exactly."""
    net = TinyLM()
    dash = DASH.from_optimizer(adamw_with_schedule(net.parameters())[0], **DASH_OPTIONS)
    model, optimizer = fabric.setup(net, dash)
    assert optimizer.optimizer is dash and dash.distributor.world_size == 2

    def step(index: int) -> list[torch.Tensor]:
        fabric.backward(lm_loss(model, global_batch(index)[fabric.global_rank :: 2]))
        optimizer.step()
        optimizer.zero_grad()
        return [full(p).detach().clone() for p in net.parameters()]

    step(0), step(1)
    for collective in (True, False):
        dash.collective_state_dict = collective
        whole = optimizer.state_dict()  # collective: the whole state on rank 0
        assert bool(whole) == (fabric.global_rank == 0)
        assert not whole or any(key.startswith("left_factor") for entry in whole["state"].values() for key in entry)
        fabric.save(folder / f"collective_{collective}.ckpt", {"model": model, "optimizer": optimizer, "step": 2})
    after = step(2)
    for collective in (True, False):
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(folder / f"collective_{collective}.ckpt", state)
        assert state["step"] == 2
        assert all(torch.equal(a, b) for a, b in zip(step(2), after, strict=True)), collective


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,options", [("dash", {}), ("dash_fsdp", {"save_distributed_checkpoint": False})])
def test_dash_is_used_as_is_and_saved_whole_without_hanging(tmp_path, name, options):
    strategy = ddp(**options) if name == "dash" else fsdp(**options)
    launch(strategy, 2, dash_as_is, tmp_path)


@pytest.mark.multiprocess
def test_standalone_lightning_fabric_trains_with_dash(tmp_path, reference):
    entry = lightning_fabric.strategies.STRATEGY_REGISTRY["dash_spawn"]  # with the reference's DASH options
    strategy = entry["strategy"](**entry["init_params"], timeout=TIMEOUT, **DASH_OPTIONS)
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    result = fabric.launch(train, reference, 3, save=tmp_path / "standalone.ckpt", save_at=3)
    assert result["strategy"] == "lightning_dash.integration._lightning_fabric.fabric_ddp"
