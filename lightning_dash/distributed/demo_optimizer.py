"""Pure DeMo (arXiv 2411.19870): sign descent on DCT top-k synchronized decoupled momentum.

For comparison with DASH. Each step: decoupled weight decay ``p <- (1 - lr wd) p``,
then ``s = synchronizer.synchronize(grads, keys)`` and ``p <- p - lr sign(s)``.

DeMo is an optimizer whose step *is* a gradient synchronisation, so it lives with
the communication code; it accepts any object with a ``synchronize(grads, keys)``
method (default: a :class:`~lightning_dash.distributed.demo_synchronizer.DemoSynchronizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_dash.distributed.demo_synchronizer import DemoSynchronizer

SYNCHRONIZER_KEY = "demo_synchronizer"


def _check_nonnegative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
        raise ValueError(f"{name} must be a non-negative float, got {value!r}")


class DeMo(torch.optim.Optimizer):
    """Sign-SGD on DeMo-synchronized momentum.

    Args:
        params: parameters or param groups (``lr`` and ``weight_decay`` per group).
        lr: step size; every element with a non-zero synchronized value moves by exactly lr.
        weight_decay: decoupled, multiplicative ``p <- (1 - lr wd) p`` before the update.
        synchronizer: an object with ``synchronize(grads: list[Tensor], keys: list[int])
            -> list[Tensor]`` (e.g. :class:`~lightning_dash.distributed.demo_synchronizer.DemoSynchronizer`);
            None builds a ``DemoSynchronizer(topk, chunk_size, momentum)`` on the default group.
        topk: DCT coefficients kept per chunk (default synchronizer only).
        chunk_size: largest chunk side (default synchronizer only).
        momentum: decay of the local momentum (default synchronizer only).

    Keys passed to the synchronizer are parameter indices in ``param_groups`` order
    (the numbering of :meth:`state_dict`). Parameters without a gradient are skipped;
    in a distributed run every rank must have gradients for the same parameters.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        synchronizer: Any | None = None,
        topk: int = 32,
        chunk_size: int = 64,
        momentum: float = 0.999,
    ) -> None:
        _check_nonnegative("lr", lr)
        _check_nonnegative("weight_decay", weight_decay)
        if synchronizer is None:
            synchronizer = DemoSynchronizer(topk=topk, chunk_size=chunk_size, momentum=momentum)
        elif not callable(getattr(synchronizer, "synchronize", None)):
            raise ValueError("synchronizer must have a synchronize(grads, keys) method")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        for group in self.param_groups:
            _check_nonnegative("lr", group["lr"])
            _check_nonnegative("weight_decay", group["weight_decay"])
        self.synchronizer = synchronizer

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One DeMo step; returns the closure's loss (None without a closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads: list[Tensor] = []
        keys: list[int] = []
        targets: list[tuple[Tensor, float]] = []
        index = 0
        for group in self.param_groups:
            lr, weight_decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                key = index
                index += 1
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("DeMo does not support sparse gradients")
                if weight_decay != 0.0:
                    param.mul_(1.0 - lr * weight_decay)
                grads.append(param.grad)
                keys.append(key)
                targets.append((param, lr))
        if not grads:
            return loss
        synchronized = self.synchronizer.synchronize(grads, keys)
        for (param, lr), update in zip(targets, synchronized):
            param.add_(torch.sign(update).to(param.dtype), alpha=-lr)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The standard layout plus the synchronizer's (per-rank) state under ``demo_synchronizer``."""
        state = super().state_dict()
        sync_state = getattr(self.synchronizer, "state_dict", None)
        if callable(sync_state):
            state[SYNCHRONIZER_KEY] = sync_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the standard layout and, when present, the synchronizer's state."""
        state_dict = dict(state_dict)
        sync_state = state_dict.pop(SYNCHRONIZER_KEY, None)
        super().load_state_dict(state_dict)
        if sync_state is not None:
            load = getattr(self.synchronizer, "load_state_dict", None)
            if not callable(load):
                raise ValueError("state_dict holds synchronizer state but the synchronizer has no load_state_dict")
            load(sync_state)
