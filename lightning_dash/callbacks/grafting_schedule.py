"""Ramp DASH from its grafting optimizer's step to the grafted Shampoo step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dash.optim import DASH
from lightning_dash.optim.step.grafting import GRAFTING_TYPES
from lightning_dash.optim.validation import check_choice, check_int


def _dash_optimizer(trainer: pl.Trainer, callback: Callback) -> DASH:
    """The trainer's single optimizer, unwrapped, checked to be a :class:`DASH`.

    Shared by the callbacks of this package: each one drives or reads one DASH instance.
    """
    name = type(callback).__name__
    optimizers = trainer.optimizers
    if len(optimizers) != 1:
        raise ValueError(f"{name} expects exactly one optimizer (a DASH), the trainer has {len(optimizers)}")
    optimizer = getattr(optimizers[0], "_optimizer", optimizers[0])
    if not isinstance(optimizer, DASH):
        raise TypeError(
            f"{name} works only with the DASH optimizer, but configure_optimizers returned "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        )
    return optimizer


class GraftingSchedule(Callback):
    """Blend DASH's step linearly from pure grafting to the grafted Shampoo direction.

    Every parameter group's ``shampoo_blend`` is 0 (the grafting optimizer's step, e.g.
    Adam) until optimizer step ``start_step``, rises linearly, and is 1 (full Shampoo
    direction, grafted) from step ``start_step + span_steps`` on. Early Kronecker factors
    hold few gradients, so ramping in their direction avoids a jump in the update when the
    preconditioner takes over. Optionally the grafting type changes once, to
    ``final_grafting``, when ``switch_step`` optimizer steps have been taken.

    Steps are ``trainer.global_step`` (optimizer steps taken, so gradient accumulation
    does not stretch the schedule); the value set before a step is the one for
    ``global_step`` at that moment: ``start_step=0`` ramps from the very first step.

    Args:
        start_step: optimizer steps taken when the ramp begins (blend 0 up to it).
        span_steps: length of the ramp in optimizer steps; 0 switches abruptly to 1.
        final_grafting: grafting type to switch to ("adam", "adagrad", "rmsprop", "sgd",
            "none"); None keeps the optimizer's.
        switch_step: optimizer steps taken when ``final_grafting`` is applied; defaults
            to the end of the ramp. Requires ``final_grafting``.
    """

    def __init__(
        self,
        start_step: int,
        span_steps: int,
        final_grafting: str | None = None,
        switch_step: int | None = None,
    ) -> None:
        self._configure(start_step, span_steps, final_grafting, switch_step)
        self._switched = False

    def _configure(self, start_step: int, span_steps: int, final_grafting: str | None, switch_step: int | None) -> None:
        self.start_step = check_int("start_step", start_step, low=0)
        self.span_steps = check_int("span_steps", span_steps, low=0)
        if final_grafting is not None:
            check_choice("final_grafting", final_grafting, GRAFTING_TYPES)
        if switch_step is not None:
            if final_grafting is None:
                raise ValueError("switch_step is given but final_grafting is None: nothing to switch to")
            switch_step = check_int("switch_step", switch_step, low=0)
        elif final_grafting is not None:
            switch_step = self.start_step + self.span_steps
        self.final_grafting: str | None = final_grafting
        self.switch_step: int | None = switch_step

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            start_step=self.start_step,
            span_steps=self.span_steps,
            final_grafting=self.final_grafting,
            switch_step=self.switch_step,
        )

    @property
    def switched(self) -> bool:
        """Whether ``final_grafting`` has been applied."""
        return self._switched

    def blend(self, step: int) -> float:
        """The ``shampoo_blend`` for the step taken after ``step`` optimizer steps."""
        if step < self.start_step:
            return 0.0
        if self.span_steps == 0 or step >= self.start_step + self.span_steps:
            return 1.0
        return (step - self.start_step) / self.span_steps

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _dash_optimizer(trainer, self)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        optimizer = _dash_optimizer(trainer, self)
        step = trainer.global_step
        value = self.blend(step)
        for group in optimizer.param_groups:
            group["shampoo_blend"] = value
        if self.final_grafting is not None and not self._switched and step >= self.switch_step:
            optimizer.grafting = self.final_grafting
            self._switched = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "start_step": self.start_step,
            "span_steps": self.span_steps,
            "final_grafting": self.final_grafting,
            "switch_step": self.switch_step,
            "switched": self._switched,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._configure(
            state_dict["start_step"],
            state_dict["span_steps"],
            state_dict["final_grafting"],
            state_dict["switch_step"],
        )
        self._switched = bool(state_dict["switched"])
