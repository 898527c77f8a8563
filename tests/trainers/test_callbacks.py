"""The Lightning callbacks driving DASH, run through a real single-process CPU Trainer."""

from __future__ import annotations

import csv
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LambdaCallback
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dash import DASH, DashStrategy
from lightning_dash.callbacks import (
    DashMonitor,
    GraftingSchedule,
    PreconditionerSchedule,
)
from lightning_dash.integration import dash_metrics

LR = 0.01
GRAFT_EPS = 1e-8


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*smaller than the logging interval.*")


def dataset(samples: int = 32) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 6, generator=generator)
    y = torch.tanh(x @ torch.randn(6, 2, generator=generator)) + 0.1 * torch.randn(samples, 2, generator=generator)
    return TensorDataset(x, y)


class TinyModule(pl.LightningModule):
    """A two-layer MLP whose optimizer is DASH over two param groups (or SGD).

    ``records`` holds, per optimizer step, what the optimizer saw right before the step
    and the parameters right after it.
    """

    def __init__(
        self, optimizer: str = "dash", nan_at_step: int | None = None, batch_size: int = 8, **dash_options: Any
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
        self.optimizer_kind = optimizer
        self.nan_at_step = nan_at_step
        self.batch_size = batch_size
        self.dash_options = {"lr": LR, "block_size": 8, "precondition_frequency": 1, "inverse_root_method": "newton_db"}
        self.dash_options.update(dash_options)
        self.records: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        if self.nan_at_step is not None and self.trainer.global_step == self.nan_at_step:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=LR)
        groups = [{"params": self.net[0].parameters()}, {"params": self.net[2].parameters(), "lr": LR / 2}]
        return DASH(groups, **self.dash_options)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.records.append(
            {
                "step": self.trainer.global_step,
                "blend": [g["shampoo_blend"] for g in optimizer.param_groups],
                "frequency": [g["precondition_frequency"] for g in optimizer.param_groups],
                "start": [g["start_preconditioning_step"] for g in optimizer.param_groups],
                "lr": [g["lr"] for g in optimizer.param_groups],
                "grafting": optimizer.grafting,
                "before": [p.detach().clone() for p in self.parameters()],
                "grads": [p.grad.detach().clone() for p in self.parameters()],
            }
        )

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        record = self.records[-1] if self.records else None
        if record is None or "after" in record:
            return  # an accumulation batch: no optimizer step
        record["after"] = [p.detach().clone() for p in self.parameters()]
        optimizer = self.trainer.optimizers[0]
        record["left_root"] = optimizer.state_dict()["state"][0]["left_root_0_0"].clone()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)


def make_trainer(tmp_path: Path, max_steps: int, callbacks: list[Callback], **options: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "callbacks": callbacks,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    settings.update(options)
    return pl.Trainer(**settings)


def fit(
    tmp_path: Path, max_steps: int, callbacks: list[Callback], module: TinyModule | None = None, **options: Any
) -> TinyModule:
    module = module if module is not None else TinyModule()
    make_trainer(tmp_path, max_steps, callbacks, **options).fit(module)
    return module


def ramp(step: int, start: int, span: int) -> float:
    return min(max((step - start) / span, 0.0), 1.0)


# --------------------------------------------------------------------------- GraftingSchedule
def test_blend_follows_the_linear_ramp_in_every_group(tmp_path):
    module = fit(tmp_path, 9, [GraftingSchedule(start_step=2, span_steps=4)])
    assert [r["step"] for r in module.records] == list(range(9))
    expected = [0.0, 0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [r["blend"] for r in module.records] == [[b, b] for b in expected]
    assert expected == [ramp(s, 2, 4) for s in range(9)]


def test_ramp_counts_optimizer_steps_under_gradient_accumulation(tmp_path):
    module = fit(tmp_path, 5, [GraftingSchedule(start_step=1, span_steps=2)], accumulate_grad_batches=2)
    assert [r["step"] for r in module.records] == list(range(5))
    assert [r["blend"][0] for r in module.records] == [0.0, 0.0, 0.5, 1.0, 1.0]


def test_blend_zero_takes_exactly_the_adam_step(tmp_path):
    grafted = fit(tmp_path, 1, [GraftingSchedule(start_step=5, span_steps=5)]).records[0]
    assert grafted["blend"] == [0.0, 0.0]
    for before, grad, after, lr in zip(
        grafted["before"], grafted["grads"], grafted["after"], [LR, LR, LR / 2, LR / 2], strict=True
    ):
        # Step 1 from zero state, bias-corrected: m_hat = g, v_hat = g^2.
        adam = before - lr * grad / (grad.abs() + GRAFT_EPS)
        torch.testing.assert_close(after, adam, rtol=1e-6, atol=1e-7)

    # Without the schedule (blend 1) the matrices take the grafted Shampoo step instead (grafted in the
    # Frobenius norm at lr_scale 1 here, so that both steps have the same norm exactly).
    shampoo = fit(tmp_path, 1, [], TinyModule(grafting_norm="frobenius", lr_scale=1.0)).records[0]
    assert shampoo["blend"] == [1.0, 1.0]
    for k in (1, 3):  # biases: always the grafting step
        torch.testing.assert_close(shampoo["after"][k], grafted["after"][k])
    for k in (0, 2):  # weights: same norm (grafted), different direction
        delta_shampoo = shampoo["after"][k] - shampoo["before"][k]
        delta_adam = grafted["after"][k] - grafted["before"][k]
        assert not torch.allclose(delta_shampoo, delta_adam, atol=1e-5)
        torch.testing.assert_close(delta_shampoo.norm(), delta_adam.norm(), rtol=1e-4, atol=0.0)


def test_grafting_switches_once_at_switch_step(tmp_path):
    schedule = GraftingSchedule(start_step=0, span_steps=2, final_grafting="sgd", switch_step=3)
    module = fit(tmp_path, 6, [schedule])
    assert [r["grafting"] for r in module.records] == ["adam"] * 3 + ["sgd"] * 3
    assert schedule.switched and module.trainer.optimizers[0].grafting == "sgd"
    # From step t = 4 on, the first bias moves by an SGD step: lr times the bias-corrected Nesterov momentum
    # 0.9 m_t + 0.1 g_t, whose weights sum to 1 - 0.9^(t+1).
    momentum = torch.zeros(5)
    for record in module.records[:4]:
        momentum = 0.9 * momentum + 0.1 * record["grads"][1]
    nesterov = 0.9 * momentum + 0.1 * module.records[3]["grads"][1]
    sgd_step = module.records[3]["after"][1] - module.records[3]["before"][1]
    torch.testing.assert_close(sgd_step, -LR * nesterov / (1 - 0.9**5), rtol=1e-5, atol=1e-8)
    assert GraftingSchedule(1, 4, final_grafting="rmsprop").switch_step == 5


def _run_with_checkpoint(
    tmp_path: Path, make_callback: Callable[[], Callback], first: int, total: int
) -> tuple[TinyModule, TinyModule, TinyModule, list[dict[str, Any]]]:
    """An uninterrupted run, and the same run stopped after ``first`` steps and resumed.

    Full-batch training, so every step sees the same data whatever the loop position.
    """
    straight = fit(tmp_path / "straight", total, [make_callback()], module=TinyModule(batch_size=32))
    first_module = TinyModule(batch_size=32)
    first_callback = make_callback()
    trainer = make_trainer(tmp_path / "first", first, [first_callback])
    trainer.fit(first_module)
    ckpt = tmp_path / "first.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"][first_callback.state_key]
    assert saved == first_callback.state_dict()

    resumed_callback = make_callback()
    seen_at_start: list = []
    probe = LambdaCallback(on_fit_start=lambda *_: seen_at_start.append(resumed_callback.state_dict()))
    resumed = TinyModule(batch_size=32)
    make_trainer(tmp_path / "resumed", total, [resumed_callback, probe]).fit(resumed, ckpt_path=ckpt)
    assert seen_at_start == [saved]
    return straight, first_module, resumed, seen_at_start


def test_grafting_schedule_survives_checkpoint_and_resume(tmp_path):
    def make() -> GraftingSchedule:
        return GraftingSchedule(start_step=2, span_steps=4, final_grafting="rmsprop", switch_step=3)

    straight, _, resumed, seen = _run_with_checkpoint(tmp_path, make, first=4, total=8)
    assert seen[0]["switched"] is True
    assert [r["step"] for r in resumed.records] == [4, 5, 6, 7]
    assert [r["blend"][0] for r in resumed.records] == [ramp(s, 2, 4) for s in range(4, 8)]
    assert [r["grafting"] for r in resumed.records] == ["rmsprop"] * 4
    # The resumed run takes the same steps as an uninterrupted one.
    assert [r["blend"] for r in straight.records[4:]] == [r["blend"] for r in resumed.records]
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grafting_schedule_state_dict_restores_configuration():
    source = GraftingSchedule(start_step=3, span_steps=7, final_grafting="adagrad", switch_step=9)
    saved = {**source.state_dict(), "switched": True}  # as checkpointed after the switch
    target = GraftingSchedule(start_step=0, span_steps=1)
    assert target.state_key != source.state_key
    target.load_state_dict(saved)
    assert target.state_dict() == saved and target.switched
    assert target.state_key == source.state_key
    assert [target.blend(s) for s in (2, 3, 10, 11)] == [0.0, 0.0, 1.0, 1.0]
    assert target.blend(6) == pytest.approx(3 / 7)


# --------------------------------------------------------------------------- PreconditionerSchedule
def test_frequency_changes_at_milestones_and_roots_follow(tmp_path):
    schedule = PreconditionerSchedule({0: 1, 4: 3}, start_preconditioning_step=2)
    module = fit(tmp_path, 11, [schedule], module=TinyModule(precondition_frequency=10))
    frequency = [1 if s < 4 else 3 for s in range(11)]
    assert [r["frequency"] for r in module.records] == [[f, f] for f in frequency]
    assert all(r["start"] == [2, 2] for r in module.records)

    # Independent rule: the root is recomputed on step t (from 1) when t >= 2 and (t - 2) % f == 0.
    expected = [t >= 2 and (t - 2) % frequency[t - 1] == 0 for t in range(1, 12)]
    assert expected == [False, True, True, True, True, False, False, True, False, False, True]
    previous = torch.zeros(5, 5)
    changed = []
    for record in module.records:
        changed.append(not torch.equal(record["left_root"], previous))
        previous = record["left_root"]
    assert changed == expected


def test_frequency_before_first_milestone_is_the_optimizers(tmp_path):
    schedule = PreconditionerSchedule([(3, 2), (5, 7)])
    module = fit(tmp_path, 6, [schedule], module=TinyModule(precondition_frequency=5))
    assert [r["frequency"][0] for r in module.records] == [5, 5, 5, 2, 2, 7]
    assert all(r["start"] == [1, 1] for r in module.records)


def test_preconditioner_schedule_survives_checkpoint_and_resume(tmp_path):
    def make() -> PreconditionerSchedule:
        return PreconditionerSchedule({0: 1, 3: 2, 6: 4}, start_preconditioning_step=2)

    straight, first, resumed, seen = _run_with_checkpoint(tmp_path, make, first=4, total=8)
    assert seen[0] == {"milestones": [[0, 1], [3, 2], [6, 4]], "start_preconditioning_step": 2}
    assert [r["frequency"][1] for r in first.records] == [1, 1, 1, 2]
    assert [r["frequency"][1] for r in resumed.records] == [2, 2, 4, 4]
    assert all(r["start"] == [2, 2] for r in resumed.records)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- DashMonitor
def read_metrics(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def test_monitor_writes_metrics_on_logging_steps(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    fit(tmp_path, 6, [DashMonitor(logging_interval=2)], logger=logger, log_every_n_steps=1)
    rows = [row for row in read_metrics(logger) if row.get("dash/optimizer_step_ms")]
    # Logged after optimizer steps 2, 4, 6, at the index Lightning gives those batches' metrics.
    assert [int(row["step"]) for row in rows] == [1, 3, 5]
    losses = {int(r["step"]) for r in read_metrics(logger) if r.get("train_loss")}
    assert {1, 3, 5} <= losses
    for row in rows:
        assert 0.0 < float(row["dash/optimizer_step_ms"]) < 10_000.0
        assert float(row["dash/root_failures"]) == 0.0
        assert float(row["dash/nonfinite_grad_skips"]) == 0.0
        residual = float(row["dash/root_residual"])  # roots are recomputed every step here
        assert math.isfinite(residual) and 0.0 <= residual < 1.0
    assert all(float(row["dash/ownership_balance"]) == 1.0 for row in rows)
    # The solver in use is logged once, as a hyperparameter (this module asks for newton_db).
    hparams = (Path(logger.log_dir) / "hparams.yaml").read_text()
    assert "dash/inverse_root_method: newton_db" in hparams


def test_monitor_logs_what_auto_chose(tmp_path):
    logger = CSVLogger(tmp_path, name="auto")
    module = TinyModule()
    module.dash_options["inverse_root_method"] = "auto"
    fit(tmp_path, 1, [DashMonitor()], module=module, logger=logger)
    # on the CPU, "auto" is eigh at every block size (benchmarks/speed/results/solver_choice_cpu.json)
    assert "dash/inverse_root_method: eigh" in (Path(logger.log_dir) / "hparams.yaml").read_text()


def test_monitor_counts_skipped_nonfinite_gradients_and_omits_missing_residual(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    module = TinyModule(nan_at_step=1, precondition_frequency=2, root_schedule="from_start")
    fit(tmp_path, 4, [DashMonitor()], module=module, logger=logger)
    rows = {int(r["step"]): r for r in read_metrics(logger) if r.get("dash/optimizer_step_ms")}
    assert sorted(rows) == [0, 1, 2, 3]
    # The second step has NaN gradients: the whole step is skipped (counted once) and the
    # step counts stay put, so the following calls are DASH steps t = 2 and t = 3.
    assert [float(rows[s]["dash/nonfinite_grad_skips"]) for s in range(4)] == [0.0, 1.0, 1.0, 1.0]
    # Frequency 2 from the start step: roots on t = 1 and t = 3; t = 2 computes none, so no residual is logged.
    assert [bool(rows[s]["dash/root_residual"]) for s in (0, 2, 3)] == [True, False, True]


def test_monitor_logs_asynchronous_root_counters(tmp_path):
    class Quiet(TinyModule):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            pass  # TinyModule reads state_dict() here, which would swap pending roots in early

    def emulate(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].roots.pipeline.emulate = True  # CPU stand-in for the side stream

    logger = CSVLogger(tmp_path, name="async")
    fit(
        tmp_path,
        4,
        [LambdaCallback(on_train_start=emulate), DashMonitor()],
        module=Quiet(async_preconditioning=True),
        logger=logger,
    )
    rows = [row for row in read_metrics(logger) if row.get("dash/optimizer_step_ms")]
    # Frequency 1, staleness 1: the roots of step t are swapped in at step t + 1, found ready.
    assert [float(row["dash/async_roots_hidden"]) for row in rows] == [0.0, 1.0, 2.0, 3.0]
    assert all(float(row["dash/async_roots_waited"]) == 0.0 for row in rows)
    assert all(float(row["dash/async_wait_ms"]) == 0.0 for row in rows)
    # The residual is that of the roots swapped in, so the first step has none.
    assert [bool(row["dash/root_residual"]) for row in rows] == [False, True, True, True]

    plain = CSVLogger(tmp_path, name="sync")
    fit(tmp_path, 1, [DashMonitor()], logger=plain)
    assert not any(key.startswith("dash/async") for key in read_metrics(plain)[0])


def test_monitor_without_logger_logs_nothing(tmp_path):
    with pytest.warns(UserWarning, match="no logger"):
        fit(tmp_path, 2, [DashMonitor()])
    assert not list(tmp_path.rglob("*.csv"))


def test_monitor_logs_the_shared_metrics_and_the_strategys_gradient_traffic(tmp_path):
    """Under DashStrategy the metrics are dash_metrics' with the strategy's counted traffic."""
    logger = CSVLogger(tmp_path, name="run")
    module = TinyModule(optimizer="sgd")
    fit(tmp_path, 2, [DashMonitor()], module=module, logger=logger, strategy=DashStrategy(start_method="popen"))
    optimizer = module.trainer.optimizers[0]
    expected = set(dash_metrics(optimizer, 0.0, module.trainer.strategy.comm_stats))
    assert {"dash/grad_sync_bytes_sent_per_step", "dash/grad_sync_bytes_received_per_step"} <= expected
    for row in read_metrics(logger):
        assert {key for key, value in row.items() if key.startswith("dash/") and value} == expected
        assert float(row["dash/grad_sync_bytes_sent_per_step"]) == 0.0  # one process: no traffic


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("build", "error", "name"),
    [
        (lambda: GraftingSchedule(-1, 2), ValueError, "start_step"),
        (lambda: GraftingSchedule(0, -1), ValueError, "span_steps"),
        (lambda: GraftingSchedule(1.5, 2), TypeError, "start_step"),
        (lambda: GraftingSchedule(0, 2, final_grafting="lion"), ValueError, "final_grafting"),
        (lambda: GraftingSchedule(0, 2, switch_step=3), ValueError, "switch_step"),
        (lambda: GraftingSchedule(0, 2, final_grafting="sgd", switch_step=-1), ValueError, "switch_step"),
        (lambda: PreconditionerSchedule({}), ValueError, "milestones"),
        (lambda: PreconditionerSchedule({0: 0}), ValueError, "milestones"),
        (lambda: PreconditionerSchedule({-1: 2}), ValueError, "milestones"),
        (lambda: PreconditionerSchedule([(0, 1), (0, 2)]), ValueError, "milestones"),
        (lambda: PreconditionerSchedule([(0, 1, 2)]), ValueError, "milestones"),
        (lambda: PreconditionerSchedule(5), TypeError, "milestones"),
        (
            lambda: PreconditionerSchedule({0: 1}, start_preconditioning_step=0),
            ValueError,
            "start_preconditioning_step",
        ),
        (lambda: DashMonitor(0), ValueError, "logging_interval"),
        (lambda: DashMonitor(True), TypeError, "logging_interval"),
    ],
)
def test_invalid_arguments_name_the_argument(build, error, name):
    with pytest.raises(error, match=name):
        build()


@pytest.mark.parametrize(
    "callback",
    [GraftingSchedule(0, 2), PreconditionerSchedule({0: 1}), DashMonitor()],
    ids=["grafting", "preconditioner", "monitor"],
)
def test_non_dash_optimizer_is_refused(tmp_path, callback):
    with pytest.raises(TypeError, match=r"DASH optimizer.*torch\.optim\.sgd\.SGD"):
        fit(tmp_path, 1, [callback], module=TinyModule(optimizer="sgd"))
