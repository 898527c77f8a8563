"""Which inverse-root solver ``inverse_root_method="auto"`` uses, per device type and block size.

A pure lookup in recorded choices, so that "auto" costs nothing at run time and gives the
same answer on every rank and every run (a per-run timing would make two identical jobs
differ). Each device type has a :class:`SolverTable`: the solver chosen for each recorded
block size. A block size maps to its bucket, the smallest recorded size at least as large
(a 100-block uses the 128 entry), or the largest recorded size for anything bigger.

* ``cpu``: measured by ``benchmarks/speed/solver_choice.py`` (results in
  ``benchmarks/speed/results/solver_choice_cpu.json``): per size, the fastest solver whose
  roots of realistic factors (a full-rank and a rank-deficient one, DASH's default damping
  and solver settings) are within :data:`REQUIRED_RELATIVE_ERROR` of a float64 ``eigh``
  and pass the optimizer's acceptance test. ``tests/optim/test_solver_choice.py`` keeps the
  table equal to the recorded winners.
* ``cuda``: ``newton_db`` at every size, not measured here (no GPU); see :data:`CUDA_TABLE`.
* any other device type: ``eigh``, the reference solver (exact at any damping, nothing to tune).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from lightning_dash.optim.roots.common import INVERSE_ROOT_METHODS

__all__ = [
    "CPU_TABLE",
    "CUDA_TABLE",
    "FALLBACK_METHOD",
    "REQUIRED_RELATIVE_ERROR",
    "SOLVER_TABLES",
    "SolverTable",
    "choose_inverse_root_method",
    "explain_choice",
]

#: The accuracy a measured choice must reach: largest relative Frobenius error of a root
#: against the float64 ``eigh`` root, on a full-rank and a rank-deficient factor (the
#: threshold of ``benchmarks/speed/solver_choice.py``). ``eigh`` is the reference and always qualifies.
REQUIRED_RELATIVE_ERROR = 1e-2

#: The solver of device types without a table.
FALLBACK_METHOD = "eigh"


@dataclass(frozen=True)
class SolverTable:
    """The solver chosen per block-size bucket on one device type, and where the choice comes from.

    Attributes:
        choices: ``(recorded block size, method)`` pairs in increasing size.
        source: one line naming the measurement (or the reason) behind the choices.
    """

    choices: tuple[tuple[int, str], ...]
    source: str

    def __post_init__(self) -> None:
        sizes = [size for size, _ in self.choices]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"choices need distinct positive block sizes in increasing order, got {sizes}")
        unknown = [method for _, method in self.choices if method not in INVERSE_ROOT_METHODS]
        if unknown:
            raise ValueError(f"choices name unknown solvers {unknown}; known: {INVERSE_ROOT_METHODS}")

    def bucket(self, block_size: int) -> int:
        """The recorded size whose choice ``block_size`` uses: the smallest recorded size
        ``>= block_size``, or the largest recorded size when ``block_size`` exceeds them all."""
        return next((size for size, _ in self.choices if size >= block_size), self.choices[-1][0])

    def method_for(self, block_size: int) -> str:
        """The solver chosen for blocks of side ``block_size``."""
        return dict(self.choices)[self.bucket(block_size)]


#: Measured with ``flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/speed/solver_choice.py``
#: on a 2-core AMD EPYC (KVM guest, 2.6 GHz), torch 2.13.0+cpu, 2026-11-24; stacks of 4M
#: elements (16384 blocks of 16 ... 1 of 2048). eigh won at every size, 2.1x (16) to 11x
#: (2048) faster than the fastest qualifying Newton solver: on CPU an eigendecomposition
#: costs a few matmuls' worth of flops, while at the default damping Newton-DB ran 13 + 9
#: iterations of 3 batched matmuls and coupled Newton 20 of 4. (Newton-DB has since become one
#: pass of 44 matmuls, benchmarks/speed/newton_cost.py: still 4.4-6.5x eigh's time, so the choice stands.)
#: Even at 16384 blocks of 16,
#: where torch's CPU eigh loops over the blocks, it took 15 us per block. Chebyshev never
#: qualified (errors 0.3-0.85: its degree-40 interpolant is accurate only above ~7.5e-3 of
#: the scale, and the default damping is 1e-6).
CPU_TABLE = SolverTable(
    choices=(
        (16, "eigh"),
        (32, "eigh"),
        (64, "eigh"),
        (128, "eigh"),
        (256, "eigh"),
        (512, "eigh"),
        (1024, "eigh"),
        (2048, "eigh"),
    ),
    source="measured: benchmarks/speed/solver_choice.py, 2-core AMD EPYC, torch 2.13.0+cpu, 2026-11-24",
)

#: Not measured here (no GPU). The DASH paper (Modoranu et al., "DASH: Faster Shampoo via
#: Batched Block Preconditioning and Efficient Inverse-Root Solvers", arXiv:2602.02016)
#: finds Newton-DB with power-iteration scaling the fastest accurate solver on GPU, where
#: batched matmuls are cheap. ``eigh`` on CUDA also makes the host wait for the device:
#: torch checks its error code on the host after every call, which stalls the step and
#: the asynchronous root pipeline.
CUDA_TABLE = SolverTable(
    choices=((2048, "newton_db"),),
    source="not measured here, no GPU: the DASH paper finds Newton-DB with power-iteration scaling fastest "
    "on GPU, and eigh on CUDA synchronises with the host",
)

#: Device type -> table; device types not listed use :data:`FALLBACK_METHOD`.
SOLVER_TABLES: Mapping[str, SolverTable] = MappingProxyType({"cpu": CPU_TABLE, "cuda": CUDA_TABLE})


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def choose_inverse_root_method(device: torch.device | str, block_size: int) -> str:
    """The inverse-root solver ``"auto"`` resolves to for blocks of side ``block_size`` on ``device``.

    Looks the block size's bucket up in the device type's table (``"cuda:1"`` is
    ``cuda``); device types without a table get :data:`FALLBACK_METHOD`. Always one
    of :data:`~lightning_dash.optim.roots.common.INVERSE_ROOT_METHODS`.
    """
    _check_block_size(block_size)
    table = SOLVER_TABLES.get(_device_type(device))
    return FALLBACK_METHOD if table is None else table.method_for(block_size)


def explain_choice(device: torch.device | str, block_size: int) -> str:
    """One line for the log: the chosen solver and why, e.g. ``"auto -> eigh for 1024-blocks
    on cpu (measured: benchmarks/speed/solver_choice.py, ...)"``."""
    method = choose_inverse_root_method(device, block_size)
    kind = _device_type(device)
    table = SOLVER_TABLES.get(kind)
    reason = "no table for this device type: the reference solver" if table is None else table.source
    return f"auto -> {method} for {block_size}-blocks on {kind} ({reason})"
