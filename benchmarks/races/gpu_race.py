"""GPU convergence race: wall time to AdamW's loss on a GPT-2-small-shaped byte model, DASH against its peers.

The CPU race (``peers.py``) at the size a GPU trains: :class:`~lightning_dash.showcase.TinyGPT` at width
768, depth 12, 12 heads, context 512, byte vocabulary (about 85M parameters), batch 16, on the Python
standard library's source (4 MB read, validation on held-out files; the corpus is on every machine with
Python, so no data travels). Parameters stay float32 and the forward pass runs under
``torch.autocast(dtype=torch.bfloat16)`` on CUDA (``--autocast``/``--no-autocast``), as users train. A
plain PyTorch loop, with the race's pieces: its model and initial weights, its batches
(``RandomWindows(train, context, steps x batch, seed)``), its fixed validation windows, its warm-up +
cosine schedule (5% warm-up, decay to 0.1 of the peak), its contenders' builders and its state bytes.

Contenders, in this order, from the same weights on the same batches (``betas=(0.9, 0.95)``, decoupled
weight decay 0.01):

1. ``adamw``: ``torch.optim.AdamW`` on an lr grid (``--adamw-lrs``). Its best lr (lowest final
   validation loss) is AdamW's tuned lr; that run's final loss is the TARGET.
2. ``dash``: ``DASH(model.parameters(), lr=<AdamW's best lr>, betas, weight_decay, model=model)``, all else
   DASH's defaults (block size, root period, routing, precision): DASH from AdamW's recipe.
3. ``dash_lr_scale``: the same with ``lr_scale`` (``--dash-lr-scales``, one run each).
4. ``muon``: the race's ``torch.optim.Muon`` (lr 0.02) with AdamW (at AdamW's best lr) on the embedding,
   position table, head and vectors (``MuonWithAdamW``).
5. ``meta_shampoo``: Meta's Distributed Shampoo (``_meta_shampoo.build_meta_shampoo``: eigh roots of
   ``L^(-1/4) G R^(-1/4)``, Adam grafting) with block size 1024, roots every 10 steps, at AdamW's best lr;
   ``unavailable`` where ``distributed_shampoo`` is not installed.

Without ``adamw`` in ``--optimizers`` the others take the first of ``--adamw-lrs`` and have no target.

Measured per run, after one untimed warm-up run of a few steps per contender (kernels, cuBLAS and
cuSOLVER handles): every step is timed with ``time.perf_counter`` between device synchronisations, the
training step (batch to the device, forward, backward, optimizer step, schedule) and the optimizer step
alone; evaluations are left off the training clock. ``train_step_ms`` and ``optimizer_step_ms`` are the
medians over the steps after the first 10, ``*_mean_ms`` the means over the same steps (root refreshes
included). ``peak_memory_bytes``: ``torch.cuda.max_memory_allocated`` since the run's start (null on the
CPU). ``state_bytes``: the race's count (DASH's own, else the tensors reachable from
``optimizer.state``). ``curve``: ``[step, training seconds, validation loss]`` every ``--eval-every`` steps.
``status``: ``ok``; ``diverged``; ``budget`` when the run's wall clock (``--run-budget-s``, evaluations
included) ran out before its last step (the run stops there, evaluated, and keeps its curve); ``error``
(any other exception, its text in ``note``); ``unavailable``. Scored against the target: the first
evaluation at or below it (``steps_to_adamw_final``, ``seconds_to_adamw_final``), the best AdamW run's
training seconds to its last step (``adamw_seconds``) and their ratio (``time_ratio``).

Output: ``<out>/gpu_<device>.json`` (``gpu_h100.json``), a list of one record per run, rewritten after
every run so that a killed race keeps what it measured; a table at the end. Records carry the GPU records'
stamp (``_stamp``: device as torch names it, date, commit from ``DASH_COMMIT`` or git, torch version). On a
GPU machine, from the repository root (about three to four minutes on an H100, more with Meta's Shampoo)::

    PYTHONUNBUFFERED=1 python3 benchmarks/races/gpu_race.py --device cuda --out "$OUT"

(``--out`` defaults to ``benchmarks/races/results``) and a CPU smoke run (under a minute)::

    .venv/bin/python benchmarks/races/gpu_race.py --device cpu --out /tmp/gpu_race --width 32 --depth 1 --heads 2 \\
        --context 32 --batch-size 4 --steps 20 --eval-every 10 --val-windows 16 --max-bytes 200000
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout's package where none is installed

import _meta_shampoo
import _stamp
from _curves import Point, first_reaching
from _peers_contenders import BETAS, CONTENDERS, META_FREQUENCY, WEIGHT_DECAY, Unavailable, build, state_bytes
from _peers_train import Data, Settings, evaluate, load_data, make_model
from common import device_label, format_columns, resolve_device, results_parser, synchronize, write_json

from lightning_dash import DASH, RootComputationError
from lightning_dash.showcase.lightning_gpt import warmup_cosine
from lightning_dash.showcase.stdlib_text import RandomWindows

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: The contenders, in the order they run (AdamW first: the others take its best lr).
ORDER = ("adamw", "dash", "dash_lr_scale", "muon", "meta_shampoo")
#: Muon's documented lr (the race's grid centre).
MUON_LR = 0.02
#: Meta's Shampoo tiles matrices as DASH's default block size does.
META_BLOCK_SIZE = 1024
#: Steps left out of the step-time statistics (allocator growth, first roots).
UNTIMED_STEPS = 10
#: Steps of the warm-up run: past Meta's first root computation (at its root period).
WARM_UP_STEPS = META_FREQUENCY + 1


# ---------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Setup:
    """What every run shares: the model's shape, the data and schedule, the device, the clock's limit."""

    settings: Settings
    width: int
    seed: int
    device: torch.device
    autocast: bool
    budget_s: float


@dataclass(frozen=True)
class Run:
    """One run to make: its record's name, its lr, how its optimizer is built and what it is built with."""

    optimizer: str
    lr: float
    make: Callable[[nn.Module], torch.optim.Optimizer]
    options: dict[str, Any]


@dataclass
class Progress:
    """What a run has measured so far, kept when it stops early or fails."""

    options: dict[str, Any]
    status: str = "ok"
    note: str | None = None
    params: int | None = None
    curve: list[Point] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    opt_s: list[float] = field(default_factory=list)
    state_bytes: int | None = None
    peak_memory_bytes: int | None = None

    @property
    def trained_s(self) -> float:
        return sum(self.step_s)

    def stop(self, status: str, note: str) -> None:
        self.status, self.note = status, note


def adamw_run(lr: float) -> Run:
    return Run("adamw", lr, lambda model: build(CONTENDERS["adamw"], model, lr, lr), shared_options())


def dash_run(name: str, lr: float, **options: Any) -> Run:
    """DASH from AdamW's recipe: its lr, betas and weight decay, the model for the routing, DASH's defaults."""

    def make(model: nn.Module) -> torch.optim.Optimizer:
        return DASH(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, model=model, **options)

    return Run(name, lr, make, shared_options() | options)


def muon_run(adamw_lr: float) -> Run:
    def make(model: nn.Module) -> torch.optim.Optimizer:
        return build(CONTENDERS["muon"], model, MUON_LR, adamw_lr)

    return Run("muon", MUON_LR, make, shared_options() | {"adamw_lr": adamw_lr})


def meta_shampoo_run(lr: float) -> Run:
    options = {"block_size": META_BLOCK_SIZE, "precondition_frequency": META_FREQUENCY}
    options |= {"root_order": _meta_shampoo.META_ROOT_ORDER, "grafting": "adam"}
    return Run("meta_shampoo", lr, lambda model: build_meta_shampoo(model, lr), shared_options() | options)


def build_meta_shampoo(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Meta's Shampoo as the race builds it, at DASH's default block size (:class:`Unavailable` without it)."""
    if not _meta_shampoo.available():
        raise Unavailable(f"{_meta_shampoo.MODULE} is not installed")
    optimizer = _meta_shampoo.build_meta_shampoo(
        model.parameters(),
        lr=lr,
        betas=BETAS,
        block_size=META_BLOCK_SIZE,
        precondition_frequency=META_FREQUENCY,
        grafting_beta2=BETAS[1],
        grafting_epsilon=1e-8,
    )
    for group in optimizer.param_groups:  # decoupled weight decay, read at every step
        group["weight_decay"] = WEIGHT_DECAY
    return optimizer


def shared_options() -> dict[str, Any]:
    return {"betas": list(BETAS), "weight_decay": WEIGHT_DECAY}


def followers(names: list[str], adamw_lr: float, lr_scales: list[float]) -> list[Run]:
    """The runs after AdamW's, in :data:`ORDER`, at AdamW's best lr."""
    runs = {
        "dash": [dash_run("dash", adamw_lr)],
        "dash_lr_scale": [dash_run("dash_lr_scale", adamw_lr, lr_scale=scale) for scale in lr_scales],
        "muon": [muon_run(adamw_lr)],
        "meta_shampoo": [meta_shampoo_run(adamw_lr)],
    }
    return [run for name in ORDER if name in names and name != "adamw" for run in runs[name]]


def resolved_options(run: Run, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The run's options, and for DASH every option as it resolved them (block size, root period, precision)."""
    if not isinstance(optimizer, DASH):
        return dict(run.options)
    config = optimizer.config
    resolved = {spec.name: jsonable(getattr(config, spec.name)) for spec in fields(config)}
    resolved["inverse_root_method_in_use"] = optimizer.inverse_root_method_in_use
    resolved["precondition_frequency"] = optimizer.param_groups[0]["precondition_frequency"]
    return run.options | resolved


def jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [jsonable(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# ---------------------------------------------------------------------- training
def attempt(run: Run, setup: Setup, data: Data) -> Progress:
    """One run; a failure is recorded in its progress (status ``error`` or ``unavailable``), not raised."""
    progress = Progress(options=dict(run.options))
    try:
        release_memory(setup.device)
        train(run, setup, data, progress)
        if setup.device.type == "cuda":
            progress.peak_memory_bytes = torch.cuda.max_memory_allocated(setup.device)
    except Unavailable as error:
        progress.stop("unavailable", str(error))
    except Exception as error:  # one contender's failure (out of memory, a bug) must not end the race
        traceback.print_exc()
        progress.stop("error", f"{type(error).__name__}: {error}"[:2000])
    return progress


def release_memory(device: torch.device) -> None:
    """Free the last run's tensors and restart the peak-memory count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@dataclass(frozen=True)
class Loop:
    """A run's model, optimizer, schedule and batches."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    windows: RandomWindows


def train(run: Run, setup: Setup, data: Data, progress: Progress) -> None:
    """Train from the seed's weights on the seed's batches, filling ``progress`` as it goes."""
    started = time.perf_counter()
    settings = setup.settings
    model = make_model(setup.width, setup.seed, settings).to(setup.device)
    progress.params = sum(p.numel() for p in model.parameters())
    optimizer = run.make(model)
    progress.options = resolved_options(run, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings.warmup, settings.steps))
    windows = RandomWindows(data.corpus.train, settings.context, settings.steps * settings.batch_size, setup.seed)
    loop = Loop(model, optimizer, schedule, windows)
    progress.curve.append(Point(0, 0.0, validate(model, data, setup)))
    for step in range(1, settings.steps + 1):
        try:
            loss = timed_step(loop, step, setup, progress)
        except RootComputationError as error:
            progress.stop("diverged", f"step {step}: {error}")
            break
        if not math.isfinite(loss):
            progress.stop("diverged", f"training loss {loss} at step {step}")
            break
        out_of_time = time.perf_counter() - started > setup.budget_s
        due = step % settings.eval_every == 0 or step == settings.steps or out_of_time
        if due and not checkpoint(model, data, setup, step, progress):
            break
        if out_of_time and step < settings.steps:
            progress.stop("budget", f"stopped after step {step} of {settings.steps}: {setup.budget_s:g} s ran out")
            break
    progress.state_bytes = state_bytes(optimizer)


def checkpoint(model: nn.Module, data: Data, setup: Setup, step: int, progress: Progress) -> bool:
    """Evaluate and add the point to the curve; False (and ``diverged``) when the loss is not finite."""
    value = validate(model, data, setup)
    progress.curve.append(Point(step, progress.trained_s, value))
    if not math.isfinite(value):
        progress.stop("diverged", f"validation loss {value} at step {step}")
    return math.isfinite(value)


def validate(model: nn.Module, data: Data, setup: Setup) -> float:
    """The race's validation loss, under the training's autocast."""
    with torch.autocast(setup.device.type, dtype=torch.bfloat16, enabled=setup.autocast):
        return evaluate(model, data, setup.device)


def batch(windows: RandomWindows, step: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs and targets on the device (the race's order: step ``s`` takes windows ``(s - 1) b``
    to ``s b - 1``)."""
    pairs = [windows[i] for i in range((step - 1) * size, step * size)]
    return torch.stack([p[0] for p in pairs]).to(device), torch.stack([p[1] for p in pairs]).to(device)


def timed_step(loop: Loop, step: int, setup: Setup, progress: Progress) -> float:
    """One training step, timed whole (batch included) and its optimizer step alone; returns the training loss."""
    device = setup.device
    synchronize(device)
    start = time.perf_counter()
    tokens, targets = batch(loop.windows, step, setup.settings.batch_size, device)
    loop.optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.autocast):
        loss = loop.model.loss(tokens, targets)
    loss.backward()
    synchronize(device)
    before_step = time.perf_counter()
    loop.optimizer.step()
    synchronize(device)
    after_step = time.perf_counter()
    loop.schedule.step()
    synchronize(device)
    progress.step_s.append(time.perf_counter() - start)
    progress.opt_s.append(after_step - before_step)
    return loss.item()


# ---------------------------------------------------------------------- records
def record(run: Run, setup: Setup, progress: Progress, stamp: dict[str, Any]) -> dict[str, Any]:
    """The run's JSON record (scores are filled in by :func:`score`)."""
    settings = setup.settings
    last = progress.curve[-1].val_loss if progress.curve else math.nan
    finished = progress.status in ("ok", "budget") and math.isfinite(last)
    return {
        "device": stamp["device"],
        "model": f"tinygpt-w{setup.width}-d{settings.depth}-c{settings.context}",
        "params": progress.params,
        "optimizer": run.optimizer,
        "lr": run.lr,
        "options": progress.options,
        "status": progress.status,
        "note": progress.note,
        **step_times(progress),
        "roofline_ms": None,
        "state_bytes": progress.state_bytes,
        "state_bytes_per_param": per_param(progress.state_bytes, progress.params),
        "peak_memory_bytes": progress.peak_memory_bytes,
        "final_loss": last if finished else None,
        "target_loss": None,
        "steps_to_adamw_final": None,
        "seconds_to_adamw_final": None,
        "adamw_seconds": None,
        "time_ratio": None,
        "curve": [
            [p.step, round(p.wall_s, 4), p.val_loss if math.isfinite(p.val_loss) else None] for p in progress.curve
        ],
        "steps": settings.steps,
        "batch_size": settings.batch_size,
        "context": settings.context,
        "autocast": setup.autocast,
        "seed": setup.seed,
        **{key: stamp[key] for key in ("date", "commit", "torch", "float32_matmul_precision")},
    }


def step_times(progress: Progress) -> dict[str, float | None]:
    """Medians and means in milliseconds over the steps after the first :data:`UNTIMED_STEPS` (all of a
    shorter run)."""
    times: dict[str, float | None] = {}
    for name, seconds in (("train_step", progress.step_s), ("optimizer_step", progress.opt_s)):
        timed = seconds[UNTIMED_STEPS:] or seconds
        times[f"{name}_ms"] = 1e3 * statistics.median(timed) if timed else None
        times[f"{name}_mean_ms"] = 1e3 * statistics.mean(timed) if timed else None
    return times


def per_param(total: int | None, params: int | None) -> float | None:
    return total / params if total is not None and params else None


def best_adamw(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """AdamW's run with the lowest final loss (finished runs before stopped ones), or None."""
    runs = [r for r in records if r["optimizer"] == "adamw" and r["final_loss"] is not None]
    return min(runs, key=lambda r: (r["status"] != "ok", r["final_loss"]), default=None)


def score(records: list[dict[str, Any]]) -> None:
    """Fill in every record's steps and seconds to AdamW's final loss, and their ratio to AdamW's time."""
    target_run = best_adamw(records)
    if target_run is None:
        return
    target = target_run["final_loss"]
    adamw_seconds = target_run["curve"][-1][1]
    for r in records:
        curve = [Point(*point) for point in r["curve"] if point[2] is not None]
        reached = first_reaching(curve, target)
        r["target_loss"] = target
        r["adamw_seconds"] = adamw_seconds
        r["steps_to_adamw_final"] = reached.step if reached else None
        r["seconds_to_adamw_final"] = reached.wall_s if reached else None
        r["time_ratio"] = reached.wall_s / adamw_seconds if reached and adamw_seconds > 0 else None


def stamp_of(device: torch.device) -> dict[str, Any]:
    """What every record says about where and when it ran: the GPU records' stamp and torch's float32
    matmul precision (the default is full float32: no TF32 in DASH's or Muon's float32 matmuls)."""
    return _stamp.stamp(device) | {"float32_matmul_precision": torch.get_float32_matmul_precision()}


# ---------------------------------------------------------------------- output
def cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(records: list[dict[str, Any]]) -> str:
    """The printed summary: one line per run."""
    header = ["optimizer", "lr", "status", "final", "steps->T", "s->T", "ratio", "step ms", "opt ms", "B/param"]
    return format_columns([*header, "peak GiB"], [row(r) for r in records])


def row(r: dict[str, Any]) -> list[str]:
    scale = f" x{r['options']['lr_scale']:g}" if r["optimizer"] == "dash_lr_scale" else ""
    peak = r["peak_memory_bytes"] / 2**30 if r["peak_memory_bytes"] is not None else None
    return [
        r["optimizer"] + scale,
        cell(r["lr"], "g"),
        r["status"],
        cell(r["final_loss"], ".4f"),
        cell(r["steps_to_adamw_final"], "d"),
        cell(r["seconds_to_adamw_final"], ".1f"),
        cell(r["time_ratio"], ".2f"),
        cell(r["train_step_ms"], ".1f"),
        cell(r["optimizer_step_ms"], ".2f"),
        cell(r["state_bytes_per_param"], ".1f"),
        cell(peak, ".2f"),
    ]


# ---------------------------------------------------------------------- main
def float_list(text: str) -> list[float]:
    return [float(item) for item in text.split(",") if item]


def name_list(text: str) -> list[str]:
    names = [item for item in text.split(",") if item]
    unknown = sorted(set(names) - set(ORDER))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown optimizer(s) {unknown}; known: {list(ORDER)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = results_parser(
        __doc__.splitlines()[0], RESULTS_DIR, None, "cpu, cuda, ... (default: cuda where available)"
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--val-windows", type=int, default=128, help="fixed held-out windows per evaluation")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="stdlib source read")
    parser.add_argument("--adamw-lrs", type=float_list, default=[1.5e-3, 3e-3, 6e-3], help="comma-separated")
    parser.add_argument("--dash-lr-scales", type=float_list, default=[4.0], help="comma-separated; one run each")
    parser.add_argument("--optimizers", type=name_list, default=list(ORDER), help="comma-separated subset")
    parser.add_argument(
        "--run-budget-s",
        type=float,
        default=150.0,
        help="wall seconds per run, evaluations included (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--autocast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bfloat16 autocast of the forward pass (default: on CUDA only)",
    )
    return parser.parse_args(argv)


def make_setup(args: argparse.Namespace) -> Setup:
    device = resolve_device(args.device)
    settings = Settings.from_args(args)
    autocast = device.type == "cuda" if args.autocast is None else args.autocast
    return Setup(settings, args.width, args.seed, device, autocast, args.run_budget_s)


def warm_up(args: argparse.Namespace, setup: Setup, data: Data) -> None:
    """A short untimed run of each contender, so that one-time costs (kernels, handles) land in no record."""
    short = replace(setup, settings=replace(setup.settings, steps=min(WARM_UP_STEPS, setup.settings.steps)))
    first = args.adamw_lrs[0]
    runs = [adamw_run(first)] if "adamw" in args.optimizers else []
    for run in [*runs, *followers(args.optimizers, first, args.dash_lr_scales[:1])]:
        progress = attempt(run, short, data)
        print(f"warm-up {run.optimizer}: {progress.status}", flush=True)


def race(
    runs: list[Run], setup: Setup, data: Data, stamp: dict[str, Any], records: list[dict[str, Any]], path: Path
) -> None:
    """Make the runs one after the other, adding each record to ``records`` and rewriting the JSON after each
    (so that a killed race keeps what it measured)."""
    for run in runs:
        progress = attempt(run, setup, data)
        records.append(record(run, setup, progress, stamp))
        score(records)
        write_json(path, records)
        last = records[-1]
        print(
            f"{run.optimizer:<14} lr {run.lr:<8g} {last['status']:<11} final {cell(last['final_loss'], '.4f')}, "
            f"{progress.trained_s:.1f} s training, step {cell(last['train_step_ms'], '.1f')} ms",
            flush=True,
        )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the race; returns the records it wrote."""
    args = parse_args(argv)
    setup = make_setup(args)
    stamp = stamp_of(setup.device)
    path = args.out / f"gpu_{device_label(setup.device)}.json"
    data = load_data(setup.settings)
    print(f"{stamp['device']}, torch {stamp['torch']}, autocast {setup.autocast}, width {setup.width}")
    print(f"{setup.settings}\ncorpus {data.corpus.train.numel():,} training bytes -> {path}", flush=True)
    warm_up(args, setup, data)
    records: list[dict[str, Any]] = []
    adamw_runs = [adamw_run(lr) for lr in args.adamw_lrs] if "adamw" in args.optimizers else []
    race(adamw_runs, setup, data, stamp, records, path)
    best = best_adamw(records)
    adamw_lr = best["lr"] if best else args.adamw_lrs[0]
    race(followers(args.optimizers, adamw_lr, args.dash_lr_scales), setup, data, stamp, records, path)
    print(f"\ntarget: AdamW's final loss {cell(best['final_loss'] if best else None, '.4f')}")
    print(table(records))
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
