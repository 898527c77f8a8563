"""Change how often DASH recomputes its inverse roots as training goes on."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dash.callbacks.grafting_schedule import _dash_optimizer
from lightning_dash.optim.validation import check_int

Milestones = Mapping[int, int] | Iterable[tuple[int, int]]


def _check_milestones(milestones: Milestones) -> tuple[tuple[int, int], ...]:
    """``(step, frequency)`` pairs sorted by step; steps unique and >= 0, frequencies >= 1."""
    if isinstance(milestones, Mapping):
        pairs = list(milestones.items())
    elif isinstance(milestones, (str, bytes)) or not isinstance(milestones, Iterable):
        raise TypeError(f"milestones must be a dict or a list of (step, frequency) pairs, got {milestones!r}")
    else:
        pairs = list(milestones)
    if not pairs:
        raise ValueError("milestones must not be empty")
    checked = []
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Iterable) or len(tuple(pair)) != 2:
            raise ValueError(f"milestones entries must be (step, frequency) pairs, got {pair!r}")
        step, frequency = tuple(pair)
        checked.append(
            (
                check_int("milestones step", step, low=0),
                check_int(f"milestones frequency (step {step})", frequency, low=1),
            )
        )
    steps = [step for step, _ in checked]
    if len(set(steps)) != len(steps):
        raise ValueError(f"milestones steps must be unique, got {sorted(steps)}")
    return tuple(sorted(checked))


class PreconditionerSchedule(Callback):
    """Set every group's ``precondition_frequency`` at given optimizer steps.

    Frequent roots matter most early, while the Kronecker factors change quickly; later
    they change slowly and recomputing less often saves most of the preconditioner's
    cost. ``{0: 1, 100: 10}`` recomputes the roots every step at first and every 10th
    step once 100 optimizer steps have been taken (``trainer.global_step``). Before the
    first milestone the optimizer keeps its own frequency. The value of the latest
    milestone is applied again at the start of every fit, so a resumed run continues
    with the right frequency.

    Args:
        milestones: ``{optimizer steps taken: frequency}`` or a list of such pairs.
        start_preconditioning_step: if given, written to every group at fit start: the
            first step (counted from 1) that uses the Shampoo direction.
    """

    def __init__(self, milestones: Milestones, start_preconditioning_step: int | None = None) -> None:
        self._configure(milestones, start_preconditioning_step)
        self._applied: int | None = None

    def _configure(self, milestones: Milestones, start_preconditioning_step: int | None) -> None:
        self.milestones: tuple[tuple[int, int], ...] = _check_milestones(milestones)
        if start_preconditioning_step is not None:
            start_preconditioning_step = check_int("start_preconditioning_step", start_preconditioning_step, low=1)
        self.start_preconditioning_step: int | None = start_preconditioning_step
        self._steps = [step for step, _ in self.milestones]

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            milestones=self.milestones, start_preconditioning_step=self.start_preconditioning_step
        )

    def frequency(self, step: int) -> int | None:
        """The scheduled frequency after ``step`` optimizer steps (None before the first milestone)."""
        position = bisect.bisect_right(self._steps, step) - 1
        return self.milestones[position][1] if position >= 0 else None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = _dash_optimizer(trainer, self)
        if self.start_preconditioning_step is not None:
            for group in optimizer.param_groups:
                group["start_preconditioning_step"] = self.start_preconditioning_step
        self._applied = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        position = bisect.bisect_right(self._steps, trainer.global_step) - 1
        if position < 0 or position == self._applied:
            return
        frequency = self.milestones[position][1]
        for group in _dash_optimizer(trainer, self).param_groups:
            group["precondition_frequency"] = frequency
        self._applied = position

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "milestones": [list(pair) for pair in self.milestones],
            "start_preconditioning_step": self.start_preconditioning_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._configure([tuple(pair) for pair in state_dict["milestones"]], state_dict["start_preconditioning_step"])
        self._applied = None
