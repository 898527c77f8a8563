"""The device's verdict on each step, read back by the host one step later without waiting.

A step decides on the device whether it is applied (every gradient and update finite)
and how many inverse roots it rejected; the commit is masked by that verdict, so the
host never waits for it. The host still wants the verdict: to undo its step counts
after a skipped step, to count skips and failures, and to stop a run whose roots keep
failing. :class:`VerdictQueue` copies each step's verdict into host memory
asynchronously (pinned memory and an event on CUDA) and hands it to the host at the
start of the next step, or whenever a counter is read.

On CUDA the read waits only for the previous step's event, which has normally passed:
the current forward and backward were queued behind it. Reading a filled host buffer
does not touch the device, so :mod:`~lightning_dash.testing.op_counts` does not count it as a synchronisation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

#: Positions in a verdict vector.
GRAD_BAD, UPDATE_BAD, FAILED_ROOTS, LONGEST_STREAK = range(4)
VERDICT_SIZE = 4


#: Host buffers filled by asynchronous copies, by ``id`` (an attribute set on a tensor would
#: tie its Python object to it, which must then be freed under the GIL, even at exit).
_HOST_MIRRORS: dict[int, weakref.ref[Tensor]] = {}


def mark_host_mirror(tensor: Tensor) -> Tensor:
    """Register ``tensor`` as host memory filled by an asynchronous copy (see
    :mod:`~lightning_dash.testing.op_counts`)."""
    key = id(tensor)
    _HOST_MIRRORS[key] = weakref.ref(tensor, lambda _: _HOST_MIRRORS.pop(key, None))
    return tensor


def is_host_mirror(value: object) -> bool:
    """Whether ``value`` is a buffer :func:`mark_host_mirror` registered."""
    ref = _HOST_MIRRORS.get(id(value))
    return ref is not None and ref() is value


@dataclass
class StepVerdict:
    """What the device decided about one step."""

    grad_bad: bool
    update_bad: bool
    failed_roots: int
    longest_streak: int

    @property
    def applied(self) -> bool:
        return not (self.grad_bad or self.update_bad)


@dataclass
class _Pending:
    host: Tensor
    event: torch.cuda.Event | None
    on_read: Callable[[StepVerdict], None]


class VerdictQueue:
    """Verdict vectors copied to the host asynchronously, read back in order."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    def post(self, verdict: Tensor, on_read: Callable[[StepVerdict], None]) -> None:
        """Start copying ``verdict`` (``VERDICT_SIZE`` values on the device) to the host;
        ``on_read`` gets it when it is collected."""
        cuda = verdict.device.type == "cuda"
        host = mark_host_mirror(torch.empty(VERDICT_SIZE, dtype=torch.float64, pin_memory=cuda))
        host.copy_(verdict.detach(), non_blocking=True)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending.append(_Pending(host, event, on_read))

    def collect(self) -> None:
        """Hand every posted verdict to its callback, oldest first (waiting for its copy)."""
        while self._pending:
            pending = self._pending.pop(0)
            if pending.event is not None:
                pending.event.synchronize()
            values = pending.host.tolist()
            pending.on_read(
                StepVerdict(
                    grad_bad=values[GRAD_BAD] > 0,
                    update_bad=values[UPDATE_BAD] > 0,
                    failed_roots=int(values[FAILED_ROOTS]),
                    longest_streak=int(values[LONGEST_STREAK]),
                )
            )

    def discard(self) -> None:
        """Forget posted verdicts (their step's state is being replaced)."""
        self._pending.clear()
