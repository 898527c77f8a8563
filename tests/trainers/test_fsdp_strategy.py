"""``Trainer(strategy="dash_fsdp")`` in real gloo runs of 1, 2 and 4 processes.

The model has tied weights, 1-D parameters and first dimensions that do not divide by
the world size (FSDP2 pads). Inside each rank, after every optimizer step, the
parameters (gathered from their shards) are compared with single-process DASH on the
same global batches, computed here without Lightning or FSDP.
"""

from __future__ import annotations

import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from helpers.fsdp_parity import (
    DASH_OPTIONS,
    EVEN_HIDDEN,
    HybridShardedLMModule,
    LMModule,
    TensorParallelLMModule,
    TinyLM,
    reference_trajectory,
    trainer,
)
from helpers.lightning_parity import PARITY_NUMERICS, clean_process_group, release_process_group  # noqa: F401 (an autouse fixture)
from helpers.spawning import START_METHOD
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.data import DataLoader

from lightning_dash import DashStrategy
from lightning_dash.strategies.dash_fsdp import DashFSDPStrategy


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reference") / "trajectory.pt"
    torch.save(reference_trajectory(8), path)
    return str(path)


@pytest.mark.multiprocess
def test_unchanged_module_is_sharded_and_matches_single_process_dash(reference_file, tmp_path):
    """Two spawned ranks (four: the resume from two below, HSDP and tensor parallelism)."""
    trainer(2, 5, tmp_path, start_method="spawn").fit(LMModule(reference_file))


@pytest.fixture(scope="module")
def even_reference_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tensor_parallel_reference") / "reference.pt"
    torch.save(reference_trajectory(10, EVEN_HIDDEN), path)
    return str(path)


@pytest.mark.multiprocess
def test_tensor_parallel_matches_one_process_and_resumes_under_other_layouts(even_reference_file, tmp_path):
    """2 x 2 (data x tensor parallel) from scratch, then from its checkpoint at 4 x 1 with the
    blocks exchanged in micro-groups (at most one float32 8 x 8 block per rank each), then in
    one process (1 x 1), then at 2 x 2 again writing a single file, which DDP (``"dash"``) resumes
    on 2 ranks: every step on the single-process trajectory."""
    single_file = {"save_distributed_checkpoint": False}
    legs = [(4, 2, {}), (4, 1, {"micro_group_mib": 0.001}), (1, 1, {}), (4, 2, single_file)]
    previous = None
    for number, (devices, tensor, options) in enumerate(legs):
        checkpoint = tmp_path / f"leg{number}.ckpt"
        strategy_options = {"tensor_parallel_size": tensor, **options}
        trainer(devices, 2 * (number + 1), tmp_path, strategy_options=strategy_options).fit(
            TensorParallelLMModule(even_reference_file, str(checkpoint)), ckpt_path=previous
        )
        release_process_group()
        assert checkpoint.is_dir() == (options is not single_file)
        previous = checkpoint
    checked = DDPChecked(even_reference_file)
    checked.hidden = EVEN_HIDDEN
    checked.model = TinyLM(EVEN_HIDDEN)
    ddp = DashStrategy(start_method=START_METHOD, **DASH_OPTIONS)
    trainer(2, 2 * len(legs) + 2, tmp_path, strategy=ddp).fit(checked, ckpt_path=previous)


@pytest.mark.multiprocess
def test_module_that_shards_itself_in_configure_model(reference_file, tmp_path):
    trainer(2, 3, tmp_path).fit(LMModule(reference_file, shard_itself=True))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "first,second,distributed",
    [(2, 1, True), (2, 2, False), (2, 4, True)],
)
def test_checkpoints_resume_exactly_at_another_world_size(reference_file, tmp_path, first, second, distributed):
    checkpoint = tmp_path / "half.ckpt"
    options = {"save_distributed_checkpoint": distributed}
    trainer(first, 4, tmp_path, strategy_options=options).fit(LMModule(reference_file, str(checkpoint)))
    release_process_group()
    assert checkpoint.is_dir() == distributed
    trainer(second, 8, tmp_path, strategy_options=options).fit(LMModule(reference_file), ckpt_path=checkpoint)


@pytest.mark.multiprocess
def test_hsdp_in_configure_model_matches_one_process_and_resumes_under_fsdp(reference_file, tmp_path):
    """HSDP over 4 ranks (2 replicas of 2 shards) as configure_model applies it; its distributed
    checkpoint then resumes under plain FSDP2 on 2 ranks, every step on the trajectory."""
    checkpoint = tmp_path / "hsdp.ckpt"
    options = {"save_distributed_checkpoint": True}
    trainer(4, 4, tmp_path, strategy_options=options).fit(HybridShardedLMModule(reference_file, str(checkpoint)))
    release_process_group()
    trainer(2, 8, tmp_path, strategy_options=options).fit(LMModule(reference_file), ckpt_path=checkpoint)


@pytest.mark.multiprocess
def test_checkpoints_move_between_ddp_and_fsdp(reference_file, tmp_path):
    from_ddp = tmp_path / "ddp.ckpt"
    ddp = DashStrategy(start_method=START_METHOD, **DASH_OPTIONS)
    trainer(2, 3, tmp_path, strategy=ddp).fit(DDPChecked(reference_file, str(from_ddp)))
    release_process_group()
    from_fsdp = tmp_path / "fsdp.ckpt"
    trainer(2, 6, tmp_path).fit(LMModule(reference_file, str(from_fsdp)), ckpt_path=from_ddp)
    release_process_group()
    ddp = DashStrategy(start_method=START_METHOD, **DASH_OPTIONS)
    trainer(2, 8, tmp_path, strategy=ddp).fit(DDPChecked(reference_file), ckpt_path=from_fsdp)


class DDPChecked(LMModule):
    """The same module under DDP (parameters are whole tensors there)."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        assert isinstance(self.trainer.strategy, DDPStrategy)
        if self.reference is None:
            self.reference = torch.load(self.reference_path)
        step = self.trainer.global_step
        start = dict(TinyLM(self.hidden).named_parameters())
        for name, param in self.model.named_parameters():
            expected = self.reference[step - 1][name]
            assert (param.detach() - expected).norm() <= 1e-4 * (expected - start[name].detach()).norm() + 1e-6, name


class TrafficChecked(LMModule):
    """bf16 autocast: the loss is checked finite and the exchange's bytes against its plan."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        assert torch.isfinite(outputs["loss"])
        distributor = self.trainer.optimizers[0].distributor
        stats = self.trainer.strategy.comm_stats
        # float32 gradient rows to the owners and float32 update rows back, every step
        assert stats.optimizer_bytes_sent == 4 * distributor.elements_per_step * self.trainer.global_step > 0
        assert stats.steps == self.trainer.global_step


@pytest.mark.multiprocess
def test_bf16_mixed_and_the_traffic_the_monitor_logs(reference_file, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_dash.callbacks import DashMonitor

    strategy = DashFSDPStrategy(start_method=START_METHOD, **DASH_OPTIONS)
    run = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=3,
        precision="bf16-mixed",
        logger=CSVLogger(tmp_path),
        callbacks=[DashMonitor(logging_interval=1)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    run.fit(TrafficChecked(reference_file))
    lines = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    exchange = [float(row.split(",")[header.index("dash/optimizer_bytes_sent_per_step")]) for row in lines[1:]]
    fsdp = [float(row.split(",")[header.index("dash/grad_sync_bytes_sent_per_step")]) for row in lines[1:]]
    groups = {row.split(",")[header.index("dash/micro_groups")] for row in lines[1:]}
    peaks = {float(row.split(",")[header.index("dash/peak_gathered_bytes")]) for row in lines[1:]}
    assert groups == {"1.0"} and len(peaks) == 1 and peaks.pop() > 0
    assert len(exchange) == 3 and len(set(exchange)) == 1 and exchange[0] > 0
    # FSDP2 on rank 0 (W - 1 = 1): its float32 rows of every parameter (ceil(rows / 2) each), gathered
    # twice in the blocks (resharded after the forward), once in the root unit, and reduce-scattered once.
    expected = sum(
        -(-p.shape[0] // 2) * p[0].numel() * 4 * (3 if name.startswith("blocks.") else 2)
        for name, p in TinyLM().named_parameters()
    )
    assert fsdp == [expected] * 3


@pytest.mark.multiprocess
def test_resuming_with_another_block_size_names_it(reference_file, tmp_path):
    checkpoint = tmp_path / "half.ckpt"
    trainer(2, 2, tmp_path).fit(LMModule(reference_file, str(checkpoint)))
    release_process_group()
    other = DashFSDPStrategy(start_method=START_METHOD, **{**DASH_OPTIONS, "block_size": 16})
    with pytest.raises(Exception, match="written with block_size=8 and this optimizer has block_size=16"):
        trainer(2, 4, tmp_path, strategy=other).fit(LMModule(reference_file), ckpt_path=checkpoint)


class KilledWhileSavingLast(LMModule):
    """Rank 1 is killed (SIGKILL) right after writing its shard of ``last.ckpt`` at step 4,
    before the checkpoint's metadata: what a crash in the middle of a save leaves."""

    def on_save_checkpoint(self, checkpoint):
        if self.trainer.global_step < 4 or self.trainer.global_rank != 1:
            return
        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def write_then_die(writer, plan, planner):
            written = write_data(writer, plan, planner)
            if "last" in str(writer.path):
                written.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        FileSystemWriter.write_data = write_then_die


@pytest.mark.multiprocess
def test_a_rank_killed_while_saving_leaves_the_last_complete_checkpoint(reference_file, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(steps: int, module: LMModule, **fit) -> None:
        strategy = DashFSDPStrategy(start_method=START_METHOD, save_distributed_checkpoint=True, **DASH_OPTIONS)
        saving = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, every_n_train_steps=2)
        pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=steps,
            callbacks=[saving],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(module, **fit)

    with pytest.raises(Exception, match="SIGKILL|exit code|terminated"):
        run(6, KilledWhileSavingLast(reference_file))
    release_process_group()
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 2
    # resumed, every step equals single-process DASH again (LMModule checks each one): nothing mixed
    run(6, LMModule(reference_file), ckpt_path=last)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy_class", [DashFSDPStrategy, DashStrategy])
def test_resuming_from_a_truncated_file_names_it(reference_file, tmp_path, strategy_class):
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": TinyLM().state_dict(), "padding": torch.zeros(4096)}, whole)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(whole.read_bytes()[:5000])
    strategy = strategy_class(start_method=START_METHOD, **DASH_OPTIONS)
    with pytest.raises(Exception, match="truncated.ckpt .*truncated or corrupted"):
        trainer(2, 4, tmp_path, strategy=strategy).fit(LMModule(reference_file), ckpt_path=truncated)


class KernelShardedOnInputChannels(pl.LightningModule):
    """A convolution whose ``configure_model`` shards the 3-D kernel on its input channels
    (``Shard(1)``): not a rectangle of the kernel's (out, in * k) matrix view."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for name, placement in (("weight", Shard(1)), ("bias", Shard(0))):
            value = getattr(self.conv, name).detach()
            setattr(self.conv, name, nn.Parameter(distribute_tensor(value, mesh, [placement])))

    def training_step(self, batch, batch_idx):
        raise AssertionError("the placement is refused at setup, before any step")

    def train_dataloader(self):
        return DataLoader(torch.randn(4, 4, 8), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.multiprocess
def test_a_placement_dash_cannot_exchange_is_refused_at_setup_by_module_path(tmp_path):
    refusal = r"conv\.weight of shape \(6, 4, 3\) is placed as \(Shard\(dim=1\),\)"
    with pytest.raises(Exception, match=refusal) as raised:
        trainer(1, 2, tmp_path).fit(KernelShardedOnInputChannels())
    message = str(raised.value)
    assert "Shard(1) on a 2-D weight only" in message and "setup_optimizers" in message
