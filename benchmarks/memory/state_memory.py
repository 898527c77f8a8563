"""Optimizer state bytes per model parameter, for DASH and its peers on one model's parameter shapes.

Parameters with the shapes of ``--model`` (default ``gpt2-125m``: vocabulary 50257, 12 layers,
width 768, context 1024, fused QKV, head tied to the token embedding; the models of
``benchmarks/_step_time_cases.py``) get fixed random gradients; no model runs. Each contender
is built fresh on the same parameters, takes ``--steps`` steps, and the state it then holds
is counted. One step (the default) is enough: every contender allocates all its state in its
first step, and both Shampoos compute their roots there (the tests check that 1 and 3 steps
hold the same bytes); each further Shampoo step costs half a minute on 2 CPU cores at gpt2-125m.
The contenders:

* ``adamw``: ``torch.optim.AdamW`` with its defaults;
* ``dash``: :class:`lightning_dash.DASH` with its defaults (block size 1024, roots at step 1,
  then every 10 steps), twice: ``routing`` ``all_matrices`` (every matrix preconditioned) and
  ``hidden`` (``precondition`` = the names of the hidden matrices: the embeddings ``wte`` and
  ``wpe``, and so the tied head, go to the grafting Adam). ``hidden`` is what the default
  routing does with ``model=``; the step-time models are shapes, not modules, so the same
  routing is given by name;
* ``meta_shampoo``: Meta's ``distributed_shampoo.DistributedShampoo`` as
  ``benchmarks/_meta_shampoo.py`` builds it against DASH (``max_preconditioner_dim`` 1024,
  eigh roots, Adam grafting, no factors on vectors), with ``precondition_frequency`` and
  ``start_preconditioning_step`` = ``--steps``: its roots are computed at the last step;
* ``muon``: ``torch.optim.Muon`` on the hidden matrices and ``torch.optim.AdamW`` on the rest
  (embeddings, head, vectors), both counted; off CUDA without Newton-Schulz iterations (they
  hold no state, and their bfloat16 matmuls crawl on a CPU);
* ``soap``: ``heavyball.SOAP`` (eager), which leaves a side longer than its
  ``max_precond_dim`` (2048) unpreconditioned.

A contender whose package is not importable gets a record with a ``note`` and no bytes.

Counted: every tensor reachable from ``optimizer.state`` through dicts, lists, tuples, sets
and dataclasses (Meta's Shampoo keeps its factors in dataclasses), each storage once (by
``untyped_storage().data_ptr()``, so views are not counted twice), the parameters' and their
gradients' storages left out. DASH keeps its statistics in stacked tensors outside
``optimizer.state`` (which holds only the step counts): their bytes are
:meth:`DASH.state_bytes() <lightning_dash.DASH.state_bytes>`, the stacks' and the flat
buffers' of the parameters updated by the grafting optimizer alone. DASH's bytes are also
computed from the shapes alone (:func:`dash_closed_form`) and printed beside the measurement.
On CUDA, ``cuda_allocated_bytes`` is ``torch.cuda.memory_allocated()`` after the steps minus
before the optimizer was built (parameters and gradients already allocated): a cross-check
that also sees whatever an optimizer holds outside its state.

The table is printed and the records are written to ``<out>/state_memory_<device>.json``, a
list of ``{"device", "model", "optimizer", "routing", "block_size", "params", "state_bytes",
"state_bytes_per_param", "cuda_allocated_bytes", "note", "date", "commit"}``.

Run from the repository root (gpt2-125m took 18 minutes on 2 shared CPU cores, almost all of
it in the one root computation of each Shampoo: eigendecompositions of both factors of 171
blocks of up to 1024 x 1024 for DASH's all_matrices and Meta's, of 120 for hidden)::

    flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/memory/state_memory.py --device cpu
    .venv/bin/python benchmarks/memory/state_memory.py --device cuda
    .venv/bin/python benchmarks/memory/state_memory.py --model gpt-tiny --optimizers adamw dash
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib.util
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

import _meta_shampoo
from _state_bytes import BLOCK_SCALAR_BYTES, block_state_bytes
from _step_time_cases import (
    MODELS,
    PEERS,
    heavyball_version,
    make_parameters,
    model_parameter_shapes,
    parameter_count,
    set_gradients,
)
from common import device_label, format_columns, resolve_device, results_parser, write_json

from lightning_dash import DASH

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

Shapes = list[tuple[str, tuple[int, ...]]]

DEFAULT_MODEL = "gpt2-125m"
#: Enough for every contender's state to exist: DASH's roots come at step 1, Meta's at the last.
DEFAULT_STEPS = 1
#: The step-time models' embeddings (the head is tied to ``wte``): not hidden matrices.
EMBEDDINGS = frozenset({"wte", "wpe"})
ALL_MATRICES = "all_matrices"
HIDDEN = "hidden"
FLOAT32_BYTES = 4


@dataclass
class Record:
    """One contender's state on one model and device."""

    device: str
    model: str
    optimizer: str
    routing: str | None
    block_size: int | None
    params: int
    state_bytes: int | None
    state_bytes_per_param: float | None
    cuda_allocated_bytes: int | None
    note: str | None
    date: str
    commit: str | None


@dataclass
class Built:
    """A contender's optimizers (Muon's pair is two) and what its record says about them."""

    optimizers: list[torch.optim.Optimizer]
    block_size: int | None = None
    note: str | None = None


class Unavailable(Exception):
    """A contender that cannot be built here; the message is its record's note."""


# ---------------------------------------------------------------------- counting
def held_tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor in ``value``, through dicts (their values), lists, tuples, sets and dataclasses."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from held_tensors(item)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from held_tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from held_tensors(getattr(value, field.name))


def storage_bytes(tensors: Iterable[Tensor], excluded: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``, those of ``excluded`` left out: a view
    counts its storage once, whatever the number of views."""
    seen = {tensor.untyped_storage().data_ptr() for tensor in excluded}
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizers: list[torch.optim.Optimizer], params: list[Tensor]) -> int:
    """Bytes of the state ``optimizers`` hold for ``params``: their ``optimizer.state``, and for
    DASH its stacks (:meth:`DASH.state_bytes`), which ``optimizer.state`` does not reach."""
    grads = [param.grad for param in params if param.grad is not None]
    tensors = [tensor for optimizer in optimizers for tensor in held_tensors(optimizer.state)]
    stacks = sum(optimizer.state_bytes() for optimizer in optimizers if isinstance(optimizer, DASH))
    return storage_bytes(tensors, [*params, *grads]) + stacks


# ---------------------------------------------------------------------- closed form
def tile_sides(length: int, block_size: int) -> list[int]:
    """The sides of the tiles DASH cuts ``length`` into: whole blocks, then the remainder."""
    return [block_size] * (length // block_size) + ([length % block_size] if length % block_size else [])


def dash_closed_form(shapes: Shapes, preconditioned: frozenset[str], block_size: int) -> int:
    """DASH's state bytes from the shapes alone (float32 parameters, matrices and vectors only).

    A preconditioned tile of ``r x c`` holds two factors and two roots, each side's factor and
    root packed as one square and a row (``r (r + 1) + c (c + 1)`` in all), its momentum and the
    grafting second moment (``r c`` each), all float32, and the per-block vectors
    (``_state_bytes.BLOCK_SCALAR_BYTES``); every other parameter a float32 momentum and second moment
    per element; every parameter a float32 step count.
    """
    total = 0
    for name, shape in shapes:
        if name in preconditioned:
            for rows in tile_sides(shape[0], block_size):
                for cols in tile_sides(math.prod(shape[1:]), block_size):
                    total += block_state_bytes(rows, cols) + BLOCK_SCALAR_BYTES
        else:
            total += 2 * FLOAT32_BYTES * math.prod(shape)
        total += FLOAT32_BYTES
    return total


def matrix_names(shapes: Shapes) -> frozenset[str]:
    """The parameters of two or more dimensions (what ``all_matrices`` preconditions)."""
    return frozenset(name for name, shape in shapes if len(shape) >= 2)


def hidden_names(shapes: Shapes) -> frozenset[str]:
    """The hidden matrices: every matrix but the embeddings (and so the head tied to ``wte``)."""
    return matrix_names(shapes) - EMBEDDINGS


def routed_names(shapes: Shapes, routing: str) -> frozenset[str]:
    """The parameters ``routing`` preconditions."""
    return matrix_names(shapes) if routing == ALL_MATRICES else hidden_names(shapes)


# ---------------------------------------------------------------------- contenders
def adamw(params: list[Tensor], shapes: Shapes, block_size: int, steps: int) -> Built:
    """``torch.optim.AdamW`` with its defaults: two moments per element and a step count per tensor."""
    return Built([torch.optim.AdamW(params)])


def dash(params: list[Tensor], shapes: Shapes, block_size: int, steps: int, routing: str) -> Built:
    """DASH with its defaults and ``precondition="all_matrices"``, or for ``routing="hidden"`` the
    hidden matrices' names (the step-time models are shapes, not modules: no ``model=``)."""
    named = [(name, param) for (name, _), param in zip(shapes, params)]
    rule = ALL_MATRICES if routing == ALL_MATRICES else hidden_names(shapes)
    return Built([DASH(named, block_size=block_size, precondition=rule)], block_size)


def meta_shampoo(params: list[Tensor], shapes: Shapes, block_size: int, steps: int) -> Built:
    """Meta's Distributed Shampoo as ``_meta_shampoo`` matches it with DASH, roots at step ``steps``."""
    if not _meta_shampoo.available():
        raise Unavailable("distributed_shampoo not installed (make .venv/.peers-installed)")
    try:
        from distributed_shampoo import RootInvShampooPreconditionerConfig
    except ImportError as error:
        raise Unavailable(f"distributed_shampoo does not import: {error}") from error
    optimizer = _meta_shampoo.build_meta_shampoo(
        params,
        lr=PEERS.lr,
        betas=PEERS.betas,
        block_size=block_size,
        precondition_frequency=steps,
        grafting_beta2=PEERS.grafting_beta2,
        grafting_epsilon=PEERS.grafting_epsilon,
    )
    packed = getattr(RootInvShampooPreconditionerConfig(), "use_symmetric_packing", False)
    packing = "factors and roots as packed upper triangles" if packed else "full factors and roots"
    return Built([optimizer], block_size, f"distributed_shampoo {_meta_shampoo.version()}: {packing}")


def muon(params: list[Tensor], shapes: Shapes, block_size: int, steps: int) -> Built:
    """``torch.optim.Muon`` on the hidden matrices, ``torch.optim.AdamW`` on everything else.

    Off CUDA without Newton-Schulz iterations: Muon's state (a momentum per matrix) does not
    depend on them, and their bfloat16 matmuls crawl on a CPU (seconds per iteration of one
    768 x 3072 matrix on 2 cores, tens of minutes for gpt2-125m).
    """
    if not hasattr(torch.optim, "Muon"):
        raise Unavailable(f"torch {torch.__version__} has no torch.optim.Muon (torch >= 2.9)")
    hidden = hidden_names(shapes)
    matrices = [param for (name, _), param in zip(shapes, params) if name in hidden]
    rest = [param for (name, _), param in zip(shapes, params) if name not in hidden]
    options = {} if params[0].device.type == "cuda" else {"ns_steps": 0}
    optimizers: list[torch.optim.Optimizer] = []
    if matrices:
        optimizers.append(torch.optim.Muon(matrices, **options))
    if rest:
        optimizers.append(torch.optim.AdamW(rest))
    iterations = "no Newton-Schulz iterations" if options else "default Newton-Schulz iterations"
    note = f"Muon ({iterations}) on {len(matrices)} hidden matrices, AdamW on {len(rest)} other tensors"
    return Built(optimizers, note=note)


def soap(params: list[Tensor], shapes: Shapes, block_size: int, steps: int) -> Built:
    """heavyball's SOAP, eager, with its defaults."""
    if importlib.util.find_spec("heavyball") is None:
        raise Unavailable("heavyball not installed (the bench extra)")
    import heavyball
    import heavyball.utils

    heavyball.utils.compile_mode = None  # eager: compiling would only add minutes
    optimizer = heavyball.SOAP(params)
    note = f"heavyball {heavyball_version()}: max_precond_dim {optimizer.param_groups[0]['max_precond_dim']}"
    return Built([optimizer], note=note)


Build = Callable[[list[Tensor], Shapes, int, int], Built]
#: Each contender: its optimizer name, routing and builder.
CONTENDERS: list[tuple[str, str | None, Build]] = [
    ("adamw", None, adamw),
    ("dash", ALL_MATRICES, functools.partial(dash, routing=ALL_MATRICES)),
    ("dash", HIDDEN, functools.partial(dash, routing=HIDDEN)),
    ("meta_shampoo", ALL_MATRICES, meta_shampoo),
    ("muon", HIDDEN, muon),
    ("soap", ALL_MATRICES, soap),
]
OPTIMIZER_NAMES = tuple(dict.fromkeys(name for name, _, _ in CONTENDERS))


# ---------------------------------------------------------------------- measurement
def commit() -> str | None:
    """The commit the working tree is on (None outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def allocated(device: torch.device) -> int | None:
    """``torch.cuda.memory_allocated`` on a CUDA device once its work is done, None elsewhere."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def measure(
    build: Build, params: list[Tensor], grads: list[Tensor], shapes: Shapes, block_size: int, steps: int
) -> tuple[Built, int, int | None]:
    """Build a contender, take ``steps`` steps, and count its state: the built contender, its
    state bytes and, on CUDA, how much ``memory_allocated`` grew from before it was built."""
    device = params[0].device
    set_gradients(params, grads)  # allocated before the count starts
    before = allocated(device)
    built = build(params, shapes, block_size, steps)
    for _ in range(steps):
        set_gradients(params, grads)
        for optimizer in built.optimizers:
            optimizer.step()
    after = allocated(device)
    held = optimizer_state_bytes(built.optimizers, params)
    growth = None if before is None or after is None else after - before
    return built, held, growth


def dash_note(optimizer: DASH, held: int, closed_form: int) -> str:
    """Roots in use on how many blocks, and the closed form against the measurement."""
    match = "equal" if held == closed_form else f"measured - closed form = {held - closed_form:+,} bytes"
    return (
        f"roots in use on {optimizer.preconditioned_blocks} of {optimizer.owned_blocks} blocks; "
        f"closed form {closed_form:,} bytes ({match})"
    )


def run(
    shapes: Shapes, model: str, device: torch.device, block_size: int, steps: int, optimizers: Iterable[str]
) -> list[Record]:
    """A record per contender of ``optimizers`` on parameters of ``shapes`` on ``device``."""
    params, grads = make_parameters(shapes, device)
    count = parameter_count(shapes)
    label, today, revision = device_label(device), datetime.date.today().isoformat(), commit()
    wanted = set(optimizers)
    records = []
    for name, routing, build in CONTENDERS:
        if name not in wanted:
            continue
        held = growth = None
        start = time.perf_counter()
        try:
            built, held, growth = measure(build, params, grads, shapes, block_size, steps)
        except Unavailable as missing:
            built = Built([], note=str(missing))
        print(f"{name} ({routing or '-'}): {time.perf_counter() - start:.1f} s to build, step and count", flush=True)
        if name == "dash" and held is not None:
            closed_form = dash_closed_form(shapes, routed_names(shapes, routing), block_size)
            built.note = dash_note(built.optimizers[0], held, closed_form)
        per_param = None if held is None else held / count
        fields = (routing, built.block_size, count, held, per_param, growth, built.note)
        records.append(Record(label, model, name, *fields, today, revision))
        del built
        gc.collect()  # optimizers hold reference cycles: free this one's state before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


def format_table(records: list[Record], shapes: Shapes, block_size: int) -> str:
    """The records as a table: state MiB and bytes per parameter, DASH's closed form beside them."""
    header = ["optimizer", "routing", "block", "state MiB", "B/param", "closed form B/param", "CUDA growth B/param"]
    rows = []
    for r in records:
        closed = None
        if r.optimizer == "dash" and r.routing is not None:
            closed = dash_closed_form(shapes, routed_names(shapes, r.routing), block_size) / r.params
        growth = None if r.cuda_allocated_bytes is None else r.cuda_allocated_bytes / r.params
        cells = [r.optimizer, r.routing, r.block_size]
        cells += [None if r.state_bytes is None else r.state_bytes / 2**20, r.state_bytes_per_param, closed, growth]
        rows.append(["-" if c is None else f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells])
    return format_columns(header, rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = results_parser(
        __doc__.splitlines()[0], RESULTS_DIR, None, "cpu, cuda, cuda:1, ... (default: cuda if available)"
    )
    parser.add_argument(
        "--model", choices=sorted(MODELS), default=DEFAULT_MODEL, help=f"parameter shapes (default: {DEFAULT_MODEL})"
    )
    parser.add_argument("--block-size", type=int, default=1024, help="DASH's block_size, Meta's max_preconditioner_dim")
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"steps before counting, at least 1 (default: {DEFAULT_STEPS})"
    )
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZER_NAMES, default=list(OPTIMIZER_NAMES))
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> list[Record]:
    """Measure every contender, print the table and write the records; returns them."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    shapes = model_parameter_shapes(args.model)
    where = f"{len(shapes)} tensors on {device_label(device)}"
    print(f"{args.model}: {parameter_count(shapes):,} parameters in {where}; steps before counting: {args.steps}")
    records = run(shapes, args.model, device, args.block_size, args.steps, args.optimizers)
    print(format_table(records, shapes, args.block_size))
    for record in records:
        if record.note:
            print(f"{record.optimizer} ({record.routing or '-'}): {record.note}")
    path = write_json(args.out / f"state_memory_{device_label(device)}.json", records)
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
