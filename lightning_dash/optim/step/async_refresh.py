"""Inverse roots recomputed on a side CUDA stream, swapped in with bounded staleness.

``DASH(async_preconditioning=True, max_staleness=k)`` hands the roots that fall due
at optimizer step ``t`` to a :class:`RootPipeline` instead of computing them in
line. The pipeline only moves work between streams and decides *when* results are
used; what is computed (the solver) and how results are accepted (keep the
previous root where the new one is not finite) stay with the optimizer, passed in
as callables.

Timeline of one launch (``t`` counts optimizer steps that moved parameters):

* step ``t``, after the statistics update: the due factors are snapshotted (fresh
  copies, bias-corrected) on the main stream; the side stream waits for the main
  stream, runs the solver on the snapshots and records an event. Step ``t`` itself
  preconditions with the previous roots.
* steps ``t + 1 ... t + k``, at the start of each (before any statistics move):
  the launch is *swapped in* at the first of these steps where its event has
  completed (``event.query()``, no host wait), and at step ``t + k`` at the latest,
  where the main stream waits on the event (``wait_event``: a device-side wait,
  the host does not block). A launch still pending when new roots fall due is
  swapped in (waiting if needed) before the new launch, so at most one is in
  flight.
* the launch is *closed* at step ``t + k`` or at the next step where roots fall
  due, whichever comes first, and the optimizer then counts its root failures
  (a collective across ranks). Both steps are the same on every rank, unlike the
  moment an event completes, so every rank calls that collective together.

Memory safety: the snapshots were allocated on the main stream and are read on
the side stream, so they are marked with ``record_stream(side)`` and also kept
referenced until the swap; the solver's outputs are allocated on the side stream
and read on the main stream after ``wait_event``, so they are marked with
``record_stream(main)`` before the main stream touches them.

Off CUDA the pipeline is never used and the optimizer stays synchronous.
``emulate=True`` (a test hook) runs the same bookkeeping without a side stream:
the solver runs at launch on the current stream and the swap happens at the
deadline (or earlier when new roots fall due, or when settled), a deterministic
stand-in for "the event is never early".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

#: ``install(payload, results) -> failure tensors``: accepts the roots on the main stream.
Install = Callable[[Any, Any], list[Tensor]]


class CudaOps:
    """The CUDA calls the pipeline makes, in one place (tests replace them to check their
    order on machines without a GPU)."""

    def handles(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def use_stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def new_event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def record_stream(self, tensor: Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


@dataclass
class _Launch:
    """One batch of root computations in flight (or computed and not yet swapped in)."""

    launched_at: int
    deadline: int
    payload: Any
    snapshots: list[Tensor]
    results: Any = None
    outputs: list[Tensor] = field(default_factory=list)
    event: Any = None  # a CUDA event recorded on the side stream after the solver
    device: torch.device | None = None
    swapped: bool = False


class RootPipeline:
    """Side-stream root computations with swaps after at most ``max_staleness`` steps.

    Counters (this process only):

    * ``hidden``: launches swapped in without waiting (their event had completed);
    * ``waited``: launches the main stream had to wait for (deadline, a new launch,
      or a checkpoint);
    * :attr:`wait_ms`: device time the main stream stalled in those waits, measured
      by CUDA timing events recorded on the main stream around ``wait_event``; a
      stall is added once both of its events have completed.
    """

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        #: Optimizer steps seen so far (only relative values matter).
        self.clock = 0
        self.hidden = 0
        self.waited = 0
        #: Test hook: deterministic emulation without a side stream (see module docstring).
        self.emulate = False
        #: Swap in at the first step where the event has completed (False: at the deadline).
        self.swap_when_ready = True
        #: Test hook: called on the side stream after the solver, before its event is recorded
        #: (e.g. to delay the event). A delay before the solver would not do: the host blocks
        #: once a stream holds about a thousand launches it has not started, so a stalled solver
        #: stalls the host too (seen on an H100).
        self.before_event: Callable[[], None] | None = None
        self.ops = CudaOps()
        self._pending: _Launch | None = None
        self._uncounted: list[Tensor] = []
        self._streams: dict[torch.device, Any] = {}
        self._stalls: list[tuple[Any, Any]] = []
        self._wait_ms = 0.0

    # ------------------------------------------------------------------ queries
    def handles(self, device: torch.device) -> bool:
        """Whether parameters on ``device`` go through the pipeline (CUDA, or emulation)."""
        return self.emulate or self.ops.handles(device)

    @property
    def pending(self) -> bool:
        """Whether a launch is open (in flight, or swapped in and not yet closed)."""
        return self._pending is not None

    @property
    def pending_deadline(self) -> int | None:
        return None if self._pending is None else self._pending.deadline

    @property
    def wait_ms(self) -> float:
        """Milliseconds the main stream stalled on side-stream events (completed stalls)."""
        still = []
        for start, end in self._stalls:
            if end.query():
                self._wait_ms += start.elapsed_time(end)
            else:
                still.append((start, end))
        self._stalls = still
        return self._wait_ms

    # ------------------------------------------------------------------ step protocol
    def begin_step(self, roots_due: bool, install: Install) -> bool:
        """Start an optimizer step: swap in what is ready or due; close the launch when due.

        Call before any statistics move. Returns True when the open launch was closed,
        i.e. its failures (:meth:`take_failures`) must be counted in this step.
        """
        self.clock += 1
        launch = self._pending
        if launch is None:
            return False
        closing = roots_due or self.clock >= launch.deadline
        if not launch.swapped:
            if closing:
                self._swap(launch, install, force=True)
            elif self.swap_when_ready and launch.event is not None and launch.event.query():
                self._swap(launch, install, force=False)
        if closing:
            self._pending = None
        return closing

    def launch(self, payload: Any, snapshots: list[Tensor], solve: Callable[[], Any], device: torch.device) -> None:
        """Start the root computation of this step (after the statistics update).

        ``snapshots`` are the tensors ``solve`` reads: fresh copies nobody else writes.
        ``solve()`` returns the results handed to ``install`` at the swap; every tensor
        attribute ``root``/``residual`` of its items is treated as an output.
        """
        if self._pending is not None:
            raise RuntimeError("a root launch is still open; begin_step() closes it when roots fall due")
        launch = _Launch(self.clock, self.clock + self.max_staleness, payload, list(snapshots), device=device)
        self._pending = launch
        if not snapshots:
            launch.swapped = True  # nothing is due on this rank; the launch only keeps the schedule
            return
        if self.emulate or not self.ops.handles(device):
            launch.results = solve()
            return
        ops = self.ops
        main = ops.current_stream(device)
        side = self._side_stream(device)
        side.wait_stream(main)  # the statistics and the snapshots are written before the solver reads them
        with ops.use_stream(side):
            launch.results = solve()
            if self.before_event is not None:
                self.before_event()
            launch.event = ops.new_event()
            launch.event.record(side)
        for tensor in launch.snapshots:
            ops.record_stream(tensor, side)
        launch.outputs = [
            value
            for item in launch.results
            for value in (getattr(item, "root", None), getattr(item, "residual", None))
            if isinstance(value, Tensor)
        ]

    def take_failures(self) -> list[Tensor]:
        """Failure tensors of the roots swapped in since the last count."""
        failures, self._uncounted = self._uncounted, []
        return failures

    def settle(self, install: Install, close: bool) -> bool:
        """Swap the open launch in now (the main stream waits if needed).

        With ``close`` the launch is also closed and True is returned when failures
        must be counted now; without it the launch stays open (swapped) and is closed
        at its usual step, so a rank settling alone changes no collective schedule.
        """
        launch = self._pending
        if launch is None:
            return False
        if not launch.swapped:
            self._swap(launch, install, force=True)
        if close:
            self._pending = None
        return close

    def discard(self) -> None:
        """Drop the open launch without using it (the optimizer state is being replaced)."""
        launch, self._pending = self._pending, None
        if launch is not None and launch.event is not None:
            launch.event.synchronize()  # nothing of it is still running when its memory is freed
        self._uncounted = []

    # ------------------------------------------------------------------ internals
    def _side_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = self.ops.new_stream(device)
        return stream

    def _swap(self, launch: _Launch, install: Install, force: bool) -> bool:
        """Accept the launch's roots on the main stream; False if not ready and not forced."""
        if launch.event is not None:
            ops = self.ops
            main = ops.current_stream(launch.device)
            if launch.event.query():
                self.hidden += 1
                main.wait_event(launch.event)  # already complete: free, keeps the ordering explicit
            elif not force:
                return False
            else:
                start, end = ops.new_event(timing=True), ops.new_event(timing=True)
                start.record(main)
                main.wait_event(launch.event)  # a device-side wait: the host does not block
                end.record(main)
                self._stalls.append((start, end))
                self.waited += 1
            for tensor in launch.outputs:
                ops.record_stream(tensor, main)
        else:
            self.hidden += 1  # emulation: computed at launch, nothing to wait for
        self._uncounted.extend(install(launch.payload, launch.results))
        # The snapshots were marked with record_stream(side), so their memory is reused
        # only after the side stream's work on them; the outputs likewise for the main stream.
        launch.payload, launch.results, launch.snapshots, launch.outputs = None, None, [], []
        launch.swapped = True
        return True
