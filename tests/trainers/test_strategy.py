"""``Trainer(strategy="dash")`` in real two-process gloo runs and in one process.

Every two-process run checks, inside each rank after every optimizer step, that the
parameters equal a single-process DASH run on the same global batches (computed
here without Lightning) and are bit-identical across ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from helpers.lightning_parity import (
    ParityModule,
    assert_identical_across_ranks,
    dataset,
    network,
    reference_trajectory,
    release_process_group,
    trainer,
)
from helpers.option_values import NON_DEFAULT, assert_carries, user_optimizer
from helpers.spawning import START_METHOD
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader

import lightning_dash  # registers the strategies
from lightning_dash import DASH, DashConfig, DashStrategy
from lightning_dash.optim.config import OPTION_NAMES


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reference") / "trajectory.pt"
    torch.save(reference_trajectory(8), path)
    return str(path)


@pytest.mark.multiprocess
def test_two_processes_match_single_process_dash_and_each_other(reference_file, tmp_path):
    trainer(2, 6, tmp_path).fit(ParityModule(reference_file))


@pytest.mark.multiprocess
def test_two_processes_close_to_one_process_stay_within_roundoff_of_one_process(tmp_path):
    """With ``DashConfig.close_to_one_process()`` (only the block size is small, so that the network has
    several blocks to own), the ranks' other summation order stays at roundoff over 12 steps: within 1e-4
    of the movement of single-process DASH on the global batch. (The defaults are held to moving no
    further than torch's Muon, in tests/optim/test_bad_gradients.py.)"""
    options = {"block_size": 16, **DashConfig.close_to_one_process().changed()}
    path = tmp_path / "defaults.pt"
    torch.save(reference_trajectory(12, options), path)
    strategy = DashStrategy(start_method=START_METHOD, **options)
    trainer(2, 12, tmp_path, strategy).fit(ParityModule(str(path)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("first,second", [(2, 2), (2, 1), (1, 2)])
def test_checkpoint_resume_is_exact_across_world_sizes(reference_file, tmp_path, first, second):
    before = trainer(first, 4, tmp_path)
    checkpoint = tmp_path / "half.ckpt"
    before.fit(ParityModule(reference_file, str(checkpoint)))
    release_process_group()
    saved = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]
    # The full state of every parameter is in the file, whichever rank owned it.
    assert sorted(saved["state"]) == list(range(6))
    assert {"left_factor_0_0", "left_factor_2_0", "right_root_0_0", "momentum"} <= set(saved["state"][0])
    assert saved["state"][0]["root_valid"].all()

    trainer(second, 8, tmp_path).fit(ParityModule(reference_file), ckpt_path=checkpoint)


class FreezeThenUnfreeze(BaseFinetuning):
    """Lightning's own fine-tuning callback: the first layer joins at epoch 1."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer, lr=0.01)


class FinetuneModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()
        self.initial_first_layer = self.net[0].weight.detach().clone()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=8, shuffle=False)

    def on_train_epoch_end(self):
        changed = not torch.equal(self.net[0].weight, self.initial_first_layer)
        assert changed == (self.current_epoch >= 1)
        assert len(self.trainer.optimizers[0].param_groups) == (2 if self.current_epoch >= 1 else 1)
        assert_identical_across_ranks(self, self.trainer.world_size)


@pytest.mark.multiprocess
def test_base_finetuning_adds_groups_mid_training(tmp_path):
    run = trainer(
        2,
        -1,
        tmp_path,
        DashStrategy(start_method=START_METHOD, block_size=16),
        max_epochs=2,
        callbacks=[FreezeThenUnfreeze()],
    )
    run.fit(FinetuneModule())


class IdenticalAcrossRanks(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert isinstance(trainer.optimizers[0], DASH)
        assert all(torch.isfinite(p).all() for p in pl_module.parameters())
        assert_identical_across_ranks(pl_module, trainer.world_size)


@pytest.mark.multiprocess
def test_unchanged_demo_module_with_accumulation_clipping_and_bf16(tmp_path):
    """Lightning's BoringModel (SGD + StepLR) trains unchanged under strategy="dash"."""
    run = trainer(
        2,
        6,
        tmp_path,
        "dash_spawn",
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        precision="bf16-mixed",
        callbacks=[IdenticalAcrossRanks()],
    )
    run.fit(BoringModel())


def test_single_device_run_converts_and_keeps_the_schedule(tmp_path):
    model = BoringModel()
    before = model.layer.weight.detach().clone()
    run = trainer(1, 3, tmp_path, "dash")
    run.fit(model)
    optimizer = run.optimizers[0]
    assert isinstance(optimizer, DASH) and optimizer.grafting == "sgd"
    # StepLR(step_size=1, gamma=0.1) stepped once per epoch: still 0.1 after 3 steps of epoch 0.
    assert run.lr_scheduler_configs[0].scheduler.optimizer is optimizer
    assert not torch.equal(model.layer.weight, before)


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_every_dash_option_by_keyword_or_config_reaches_the_converted_optimizer(name):
    for strategy in (
        DashStrategy(**{name: NON_DEFAULT[name]}),
        DashStrategy(config=DashConfig(**{name: NON_DEFAULT[name]})),
    ):
        assert dict(strategy.conversion.overrides) == {name: NON_DEFAULT[name]}
        assert_carries(strategy.conversion.convert(user_optimizer()), name, NON_DEFAULT[name])


class TwoGroupModule(BoringModel):
    """BoringModel with a second layer in its own AdamW parameter group."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.layer(x))

    def configure_optimizers(self):
        return torch.optim.AdamW([{"params": self.layer.parameters()}, {"params": self.head.parameters()}])


def test_fit_converts_with_every_option_keywords_winning_over_config(tmp_path):
    config = DashConfig(block_size=64, grafting_beta2=0.5, max_consecutive_root_failures=None)
    keywords = {name: value for name, value in NON_DEFAULT.items() if name != "grafting_beta2"}
    run = trainer(1, 1, tmp_path, DashStrategy(config=config, **keywords))
    run.fit(TwoGroupModule())
    optimizer = run.optimizers[0]
    assert isinstance(optimizer, DASH)
    for name, value in NON_DEFAULT.items():
        assert_carries(optimizer, name, value)


@pytest.mark.parametrize(
    "kwargs,error,name",
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"inverse_root_method": "qr"}, ValueError, "inverse_root_method"),
        ({"root_order": 3}, ValueError, "root_order"),
        ({"root_order": True}, ValueError, "root_order"),
        ({"communication_dtype": torch.int8}, ValueError, "communication_dtype"),
        ({"micro_group_mib": 64}, ValueError, "micro_group_mib applies where parameters are sharded"),
        ({"epsilon": -1.0}, ValueError, "epsilon"),
        ({"chebyshev_degree": 1}, ValueError, "chebyshev_degree"),
        ({"grafting_epsilon": 0.0}, ValueError, "grafting_epsilon"),
        ({"max_consecutive_root_failures": 0}, ValueError, "max_consecutive_root_failures"),
        ({"nesterov": 1}, TypeError, "nesterov"),
        ({"factor_decay": 1.5}, ValueError, "factor_decay"),
        ({"config": {"block_size": 8}}, TypeError, "config"),
    ],
)
def test_bad_strategy_option_is_a_clear_error(kwargs, error, name):
    with pytest.raises(error, match=name):
        DashStrategy(**kwargs)


def test_unsupported_optimizer_is_named(tmp_path):
    class LBFGSModel(BoringModel):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    run = trainer(1, 1, tmp_path, "dash")
    with pytest.raises(TypeError, match="LBFGS"):
        run.fit(LBFGSModel())


class ScheduledModule(FinetuneModule):
    """AdamW module trained with the DASH callbacks; checks what each rank's optimizer sees."""

    def __init__(self, checkpoint_path: str) -> None:
        super().__init__()
        self.checkpoint_path = checkpoint_path

    def on_train_batch_end(self, outputs, batch, batch_idx):
        optimizer = self.trainer.optimizers[0]
        step = self.trainer.global_step  # steps taken; the blend applied to step `step` was set before it
        assert optimizer.param_groups[0]["shampoo_blend"] == pytest.approx(min(max((step - 1 - 2) / 4, 0.0), 1.0))
        assert optimizer.param_groups[0]["precondition_frequency"] == (1 if step - 1 < 3 else 5)
        assert optimizer.ownership_balance >= 1.0
        assert_identical_across_ranks(self, self.trainer.world_size)

    def on_train_epoch_end(self):
        pass

    def on_train_end(self):
        self.trainer.save_checkpoint(self.checkpoint_path)


@pytest.mark.multiprocess
def test_callbacks_in_two_processes_and_their_checkpointed_state(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_dash.callbacks import DashMonitor, GraftingSchedule, PreconditionerSchedule

    checkpoint = tmp_path / "scheduled.ckpt"
    callbacks = [GraftingSchedule(start_step=2, span_steps=4), PreconditionerSchedule({0: 1, 3: 5}), DashMonitor()]
    run = trainer(
        2,
        8,
        tmp_path,
        DashStrategy(start_method=START_METHOD, block_size=16),
        callbacks=callbacks,
        logger=CSVLogger(tmp_path, name="csv"),
    )
    run.fit(ScheduledModule(str(checkpoint)))
    saved = torch.load(checkpoint, weights_only=False)
    states = {key.split("{")[0]: value for key, value in saved["callbacks"].items()}
    assert set(states) >= {"GraftingSchedule", "PreconditionerSchedule"}
    metrics = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    header, *rows = metrics.strip().splitlines()
    assert "dash/optimizer_step_ms" in header and "dash/ownership_balance" in header
    assert "dash/grad_sync_bytes_sent_per_step" in header
    assert len(rows) >= 8


def test_registration_adds_dash_names_and_keeps_builtins():
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    for name, start_method in (("dash", "popen"), ("dash_spawn", "spawn"), ("dash_fork", "fork")):
        assert type(StrategyRegistry.get(name)) is DashStrategy
        assert StrategyRegistry[name]["init_params"] == {"start_method": start_method}
    assert type(StrategyRegistry.get("ddp")) is DDPStrategy
    lightning_dash.register_strategies()  # idempotent: a second import-time call must not raise


ONE_DEVICE_RUN = """
import torch
import torch.distributed as dist
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
import lightning_dash

class Watch(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        assert not dist.is_initialized(), "a process group during training"
    def on_validation_batch_end(self, trainer, *args):
        assert not dist.is_initialized(), "a process group during validation"

options = dict(accelerator="cpu", devices=1, max_steps=4, limit_val_batches=2, logger=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch()])
model = BoringModel()
trainer = pl.Trainer(strategy="dash", default_root_dir=ROOT, **options)
trainer.fit(model)
trainer.validate(model)
trainer.test(model)
assert type(trainer.optimizers[0]).__name__ == "DASH" and trainer.strategy.model is model
resumed = pl.Trainer(strategy="dash", default_root_dir=ROOT, **dict(options, max_steps=6))
resumed.fit(BoringModel(), ckpt_path=trainer.checkpoint_callback.best_model_path)
assert resumed.global_step == 6 and not dist.is_initialized()
print("no process group")
"""


@pytest.mark.multiprocess
def test_one_device_runs_without_a_process_group_or_its_messages(tmp_path):
    """``devices=1``: fit, validate, test and a resume run in one process with no process group and
    no DDP wrapper, and print nothing about distributed initialisation (a fresh interpreter, so no
    group from another test can be there)."""
    script = tmp_path / "one_device.py"
    script.write_text(f"ROOT = {str(tmp_path)!r}\n" + ONE_DEVICE_RUN)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no process group" in result.stdout
    output = result.stdout + result.stderr
    assert "Initializing distributed" not in output and "distributed_backend" not in output, output


class TensorParallelInConfigureModel(BoringModel):
    """A user's own tensor parallelism (``parallelize_module`` on a mesh of every rank), then ``"dash"``."""

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(self.layer, init_device_mesh("cpu", (self.trainer.world_size,)), ColwiseParallel())


@pytest.mark.multiprocess
def test_a_tensor_parallel_model_is_refused_before_ddp_wraps_it_with_the_fix(tmp_path):
    """Without the check, DDP's first broadcast fails inside torch ("no sharding strategy registered")."""
    strategy = DashStrategy(start_method=START_METHOD)
    refusal = r"parameter layer\.weight is a DTensor placed as \(Shard\(dim=0\),\)"
    with pytest.raises(Exception, match=refusal) as raised:
        trainer(2, 2, tmp_path, strategy=strategy).fit(TensorParallelInConfigureModel())
    assert "use strategy 'dash_fsdp'" in str(raised.value) and "configure_ddp" not in str(raised.value)
