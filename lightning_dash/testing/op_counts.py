"""Counting what a piece of code asks of the device: kernel launches and host synchronisations.

A GPU step is fast when the host queues its kernels and never waits for them. Both
properties can be checked on any device, CPU included, by watching the ATen calls a
step makes (:class:`torch.utils._python_dispatch.TorchDispatchMode`) and the tensor
methods that read data back to Python (:class:`torch.overrides.TorchFunctionMode`):

* a *host synchronisation* is a call whose result the host needs before it can go on:
  ``item()``/``bool()`` (``_local_scalar_dense``), ``tolist()``, ``numpy()``,
  data-dependent output shapes (``nonzero``, ``masked_select``, ``unique``, ...), and
  tensors made from Python data during the step (``torch.tensor``: on a GPU a blocking
  upload). On CUDA each of these waits for every kernel queued before it.
* a *launch* is any other ATen call that computes (views, allocations and metadata
  calls excluded). Foreach ops count once: they run a few fused kernels on a GPU.

Reading a host buffer that an earlier asynchronous copy filled (marked by
:func:`~lightning_dash.optim.step.verdict.mark_host_mirror`) is not counted: it waits for that copy's event,
not for the kernels queued since.

``torch.linalg.eigh`` is listed apart (:attr:`OpCounts.device_checked`): on CUDA torch
reads its error code back (its documentation says so), on the CPU it does not wait.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dash.optim.step.verdict import is_host_mirror

#: ATen calls whose result the host must wait for.
SYNCHRONISING_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "nonzero_static",
        "masked_select",
        "unique_dim",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "is_nonzero",
        "equal",
        "lift_fresh",
    }
)

#: Tensor methods that copy data to Python without an ATen call.
HOST_READ_METHODS = frozenset({"tolist", "numpy", "__array__"})

#: ATen calls that wait for the device on CUDA only (torch checks their error codes there).
CUDA_CHECKED_OPS = frozenset({"_linalg_eigh", "linalg_eigh", "_linalg_check_errors"})

#: ATen calls that neither compute nor synchronise.
FREE_OPS = frozenset(
    {"empty", "empty_like", "empty_strided", "detach", "alias", "lift", "set_", "_has_compatible_shallow_copy_type"}
)


def _op_name(func: Any) -> str:
    return func._schema.name.split("::")[-1]


def _is_view(func: Any) -> bool:
    """Whether the call returns an alias of an input without writing to it."""
    returns = func._schema.returns
    if not returns:
        return False
    alias = returns[0].alias_info
    return alias is not None and not alias.is_write


@dataclass
class OpCounts:
    """What one piece of code asked of the device (see the module docstring)."""

    syncs: Counter[str] = field(default_factory=Counter)
    launches: Counter[str] = field(default_factory=Counter)
    device_checked: Counter[str] = field(default_factory=Counter)

    @property
    def sync_count(self) -> int:
        """Host synchronisations on any device."""
        return sum(self.syncs.values())

    @property
    def launch_count(self) -> int:
        """Computing ATen calls (a foreach call counts once)."""
        return sum(self.launches.values())


class _Reads(TorchFunctionMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS and not (args and is_host_mirror(args[0])):
            self.counts.syncs[name] += 1
        return func(*args, **(kwargs or {}))


class _Calls(TorchDispatchMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = _op_name(func)
        if name in SYNCHRONISING_OPS:
            self.counts.syncs[name] += 1
        elif name in CUDA_CHECKED_OPS:
            self.counts.device_checked[name] += 1
            self.counts.launches[name] += 1
        elif name not in FREE_OPS and not _is_view(func):
            self.counts.launches[name] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> tuple[Any, OpCounts]:
    """Run ``fn()`` and count its launches and host synchronisations; returns its result
    and the counts."""
    counts = OpCounts()
    with _Reads(counts), _Calls(counts):
        result = fn()
    return result, counts
