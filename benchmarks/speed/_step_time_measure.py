"""The step-time benchmark's timing (``step_time.py``): interleaved rounds, records, tables, JSON."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from _step_time_cases import Case, set_gradients
from common import format_columns, synchronize, write_json
from torch import Tensor

R = TypeVar("R")


@dataclass(frozen=True)
class Record:
    """One row of ``step_time_<device>.json``."""

    device: str
    model: str
    optimizer: str
    solver: str | None
    dtype: str | None
    block_size: int | None
    step_ms: float


@dataclass(frozen=True)
class PeerRecord:
    """One row of ``step_time_peers_<device>.json``."""

    device: str
    model: str
    optimizer: str
    solver: str
    frequency: int
    block_size: int
    step_ms: float
    #: meta_shampoo's step_ms over this row's (same model, frequency, block size); None on its own rows.
    ratio: float | None


# ---------------------------------------------------------------------- timing
def timed_sample(
    optimizer: torch.optim.Optimizer, params: list[Tensor], grads: list[Tensor], steps: int, device: torch.device
) -> float:
    """Mean milliseconds per step over ``steps`` consecutive steps (gradient reset untimed)."""
    total = 0.0
    for _ in range(steps):
        set_gradients(params, grads)
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        total += time.perf_counter() - start
    return 1e3 * total / steps


def run_case(
    case: Case, params: list[Tensor], grads: list[Tensor], warmup: int, samples: int, device: torch.device
) -> None:
    """Build ``case`` fresh, warm it up (at least ``case.min_warmup`` steps), add ``samples`` timings, free it."""
    optimizer = case.build(params)
    try:
        for _ in range(max(warmup, case.min_warmup)):
            timed_sample(optimizer, params, grads, 1, device)
        for _ in range(samples):
            case.samples_ms.append(timed_sample(optimizer, params, grads, case.steps_per_sample, device))
    finally:
        del optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


Tensors = tuple[list[Tensor], list[Tensor]]


def measure_models(
    cases: list[Case],
    tensors: dict[str | None, Tensors],
    rounds: int,
    warmup: int,
    samples: int,
    device: torch.device,
    verbose: bool = True,
) -> None:
    """Interleaved rounds over all cases, each on the parameters and gradients of its model
    (``tensors[case.model]``; ``tensors[None]`` in the solvers suite, whose cases share one model);
    a case that raises is skipped with its reason."""
    for round_index in range(rounds):
        order = list(cases)
        random.Random(round_index).shuffle(order)
        for case in order:
            if case.skipped or (case.max_rounds is not None and round_index >= case.max_rounds):
                continue
            begin = time.perf_counter()
            try:
                # AdamW is cheap: more samples at no cost.
                params, grads = tensors[case.model]
                run_case(case, params, grads, warmup, samples * (5 if case.optimizer == "adamw" else 1), device)
            except Exception as error:  # noqa: BLE001 - a third-party failure must not end the run
                case.skipped = f"{type(error).__name__}: {error}".splitlines()[0][:200]
            if verbose:
                status = case.skipped or f"{case.samples_ms[-1]:.1f} ms"
                print(
                    f"  round {round_index + 1}/{rounds} {label(case):<48} {status} "
                    f"({time.perf_counter() - begin:.1f} s)",
                    flush=True,
                )


def label(case: Case) -> str:
    parts = [case.model, case.optimizer, case.solver, case.dtype]
    parts += [None if case.block_size is None else f"b{case.block_size}"]
    parts += [None if case.frequency is None else f"f{case.frequency}"]
    return " ".join(p for p in parts if p)


def measured(cases: list[Case]) -> list[Case]:
    """The cases that have samples and did not fail."""
    return [c for c in cases if c.samples_ms and not c.skipped]


def make_records(cases: list[Case], device_name: str, model: str) -> list[Record]:
    """One record per measured case: the minimum of its samples (see the module docstring)."""
    return [
        Record(
            device=device_name,
            model=model,
            optimizer=c.optimizer,
            solver=c.solver,
            dtype=c.dtype,
            block_size=c.block_size,
            step_ms=float(min(c.samples_ms)),
        )
        for c in measured(cases)
    ]


def make_peer_records(cases: list[Case], device_name: str) -> list[PeerRecord]:
    """One record per measured case of the peers suite (minimum of its samples), with the ratio
    of meta_shampoo's time at the same model, frequency and block size to the row's."""
    step_ms = {id(c): float(min(c.samples_ms)) for c in measured(cases)}
    meta = {
        (c.model, c.frequency, c.block_size): step_ms[id(c)] for c in measured(cases) if c.optimizer == "meta_shampoo"
    }
    records = []
    for c in measured(cases):
        reference = meta.get((c.model, c.frequency, c.block_size)) if c.optimizer != "meta_shampoo" else None
        records.append(
            PeerRecord(
                device=device_name,
                model=str(c.model),
                optimizer=c.optimizer,
                solver=str(c.solver),
                frequency=int(c.frequency or 1),
                block_size=int(c.block_size or 0),
                step_ms=step_ms[id(c)],
                ratio=None if reference is None else reference / step_ms[id(c)],
            )
        )
    return records


# ---------------------------------------------------------------------- output
def ratios(records: list[Record]) -> list[tuple[float | None, float | None]]:
    """Per record: step time / AdamW's, and (DASH rows) shampoo_loop's time / DASH's."""
    adamw = next((r.step_ms for r in records if r.optimizer == "adamw"), None)
    loops = {(r.solver, r.dtype, r.block_size): r.step_ms for r in records if r.optimizer == "shampoo_loop"}
    out = []
    for r in records:
        vs_adamw = r.step_ms / adamw if adamw else None
        loop = loops.get((r.solver, r.dtype, r.block_size)) if r.optimizer == "dash" else None
        out.append((vs_adamw, loop / r.step_ms if loop else None))
    return out


def format_table(records: list[Record], spreads: list[float] | None = None) -> str:
    """The records with their ratios; ``spreads`` (max / min of each row's samples) if given."""
    header = ["model", "optimizer", "solver", "dtype", "block", "step ms", "x AdamW", "loop / DASH"]
    header += ["spread"] if spreads is not None else []
    rows = []
    for index, (record, (vs_adamw, speedup)) in enumerate(zip(records, ratios(records))):
        rows.append(
            [
                record.model,
                record.optimizer,
                record.solver or "-",
                record.dtype or "-",
                "-" if record.block_size is None else str(record.block_size),
                f"{record.step_ms:.1f}",
                "-" if vs_adamw is None else f"{vs_adamw:.1f}",
                "-" if speedup is None else f"{speedup:.2f}",
            ]
            + ([f"{spreads[index]:.2f}"] if spreads is not None else [])
        )
    return format_columns(header, rows)


def format_peer_table(records: list[PeerRecord], spreads: list[float] | None = None) -> str:
    """The peers suite's records (in case order: model, block, frequency) with ``meta / this``."""
    header = ["model", "block", "f", "optimizer", "solver", "step ms", "meta / this"]
    header += ["spread"] if spreads is not None else []
    rows = []
    for index, record in enumerate(records):
        rows.append(
            [
                record.model,
                str(record.block_size),
                str(record.frequency),
                record.optimizer,
                record.solver,
                f"{record.step_ms:.1f}",
                "-" if record.ratio is None else f"{record.ratio:.2f}",
            ]
            + ([f"{spreads[index]:.2f}"] if spreads is not None else [])
        )
    return format_columns(header, rows)


def write_records(records: list[Record], out_dir: Path, device_name: str) -> Path:
    return write_json(out_dir / f"step_time_{device_name}.json", records)


def write_peer_records(records: list[PeerRecord], out_dir: Path, device_name: str, suite: str = "peers") -> Path:
    return write_json(out_dir / f"step_time_{suite}_{device_name}.json", records)


def run_suite(
    cases: list[Case],
    notes: list[str],
    plan: str,
    timing: Callable[[], None],
    legend: str,
    records_of: Callable[[], list[R]],
    table: Callable[[list[R], list[float]], str],
    write: Callable[[list[R]], Path],
) -> list[R]:
    """Print ``notes`` and ``plan``, run ``timing``, then print the records' table (with each measured
    case's spread, max / min of its samples) under ``legend``, the skipped cases, and the path written."""
    for note in notes:
        print(f"note: {note}")
    print(plan)
    start = time.perf_counter()
    timing()
    records = records_of()
    print(f"\nmeasured in {time.perf_counter() - start:.0f} s; {legend}\n")
    print(table(records, [max(c.samples_ms) / min(c.samples_ms) for c in measured(cases)]))
    for case in cases:
        if case.skipped:
            print(f"skipped {label(case)}: {case.skipped}")
    print(f"\nwrote {write(records)}")
    return records
