"""Validation loss against steps and wall time: AdamW and DASH on the stdlib byte-level GPT.

Both optimizers train the same :class:`~lightning_dash.showcase.TinyGPT` on the
Python standard library's own source (``load_stdlib_corpus``; validation on
held-out files) with a plain PyTorch loop and the same schedule: linear warm-up
over the first ``--warmup`` steps, then cosine decay to zero. For a seed, the
initial weights and the order of the training batches are the same for both
optimizers and every learning rate.

Every optimizer runs at every learning rate of its grid (``--adamw-lrs``,
``--dash-lrs``) for every seed (``--seeds``). The best learning rate of each
optimizer is the one with the lowest final validation loss **averaged over the
seeds**. The target of a seed is AdamW's final validation loss at its best
learning rate on that seed; ``steps_to_adamw_final`` of any run is the first
evaluation step at which its validation loss is at or below that target (null if
never; for AdamW at its best learning rate this is typically the last step). The
printed ratio is DASH's steps to the target (at DASH's best learning rate) over
AdamW's, per seed, with mean, standard deviation and range over seeds; the same
for training wall time, measured and estimated as steps times a robust step time
(the median over 10-step windows of the mean step time, which keeps DASH's root
steps amortised but discounts windows slowed down by other processes on a shared
machine).

AdamW: ``betas=(0.9, 0.95)``, weight decay 0.01. DASH: the same betas and weight
decay, Adam grafting (its second-moment decay 0.95 as AdamW's), ``block_size=256``,
``precondition_frequency=10``, the default solver (eigh since 0.2; the table in docs/benchmarks.md was
measured with 0.1, whose default was newton_db). Wall time counts
training steps only (data, forward, backward, optimizer), not evaluations.

Outputs, in ``--out`` (default ``benchmarks/races/results``):

* ``convergence_<device>.json``: one record per optimizer x lr x seed,
  ``{"device", "optimizer", "lr", "seed", "steps", "final_val_loss",
  "steps_to_adamw_final", "wall_s"}``;
* ``convergence_curves_<device>.json``: per run (``device``, ``optimizer``,
  ``lr``, ``seed``, ``median_step_ms``), the evaluations ``{"step", "wall_s", "val_loss"}``;
* ``convergence_<device>.png``: mean validation loss over seeds at each
  optimizer's best learning rate, against steps and against wall time.

Defaults (CPU-sized): width 128, depth 2, 4 heads, context 64, batch 32, 400 steps
with 20 warm-up steps, evaluation every 10 steps on 8 fixed validation batches,
learning rates 3e-3, 1e-2 and 3e-2 for both optimizers, seeds 0, 1 and 2.

Run from the repository root (the CPU default, 18 runs, took 12 minutes on 2 cores)::

    flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/races/convergence.py
    .venv/bin/python benchmarks/races/convergence.py --device cuda --width 256 --depth 4 --steps 2000
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _curves import Point, first_reaching
from _records import record_type
from _timing import robust_step_ms
from common import (
    OPTIMIZERS,
    build_optimizer,
    device_label,
    format_columns,
    resolve_device,
    results_parser,
    synchronize,
    validation_loss,
    warmup_cosine,
    write_json,
)

from lightning_dash import RootComputationError
from lightning_dash.showcase import ByteCorpus, TinyGPT, load_stdlib_corpus

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01
DASH_BLOCK_SIZE = 256
DASH_FREQUENCY = 10


Settings = record_type(
    "Settings",
    "Model, data and schedule shared by every run.",
    """
    steps         int  = 400
    warmup        int  = 20
    batch_size    int  = 32
    context       int  = 64
    width         int  = 128
    depth         int  = 2
    heads         int  = 4
    eval_every    int  = 10
    eval_batches  int  = 8
    corpus_bytes  int  = 2_000_000
    """,
)


@dataclass(frozen=True)
class Run:
    """One training run and its evaluations (the last one at the final step)."""

    optimizer: str
    lr: float
    seed: int
    curve: list[Point]
    #: median over 10-step windows of the mean step time (see :func:`_timing.robust_step_ms`)
    median_step_ms: float

    @property
    def final_val_loss(self) -> float:
        return self.curve[-1].val_loss

    @property
    def steps(self) -> int:
        return self.curve[-1].step

    @property
    def wall_s(self) -> float:
        return self.curve[-1].wall_s


@dataclass(frozen=True)
class Record:
    """One row of ``convergence_<device>.json``."""

    device: str
    optimizer: str
    lr: float
    seed: int
    steps: int
    final_val_loss: float
    steps_to_adamw_final: int | None
    wall_s: float


# ---------------------------------------------------------------------- training
def hyperparameters(name: str, lr: float) -> dict:
    """The options every run of optimizer ``name`` is built with (see the module docstring)."""
    if name == "adamw":
        return dict(lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    if name == "dash":
        return dict(
            lr=lr,
            betas=BETAS,
            weight_decay=WEIGHT_DECAY,
            grafting_beta2=BETAS[1],
            block_size=DASH_BLOCK_SIZE,
            precondition_frequency=DASH_FREQUENCY,
        )
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def evaluate(model: TinyGPT, corpus: ByteCorpus, settings: Settings) -> float:
    """Mean loss over fixed validation batches (the same for every run)."""
    return validation_loss(model, corpus, settings.batch_size, settings.context, settings.eval_batches)


def train_run(
    optimizer_name: str,
    lr: float,
    seed: int,
    corpus: ByteCorpus,
    settings: Settings,
    device: torch.device,
    build: Callable[[str, torch.nn.Module, float], torch.optim.Optimizer] | None = None,
) -> Run:
    """Train one model; evaluate at step 0, every ``eval_every`` steps and at the end.
    ``build(name, model, lr)`` makes the optimizer (default: :func:`hyperparameters`)."""
    torch.manual_seed(seed)
    model = TinyGPT(context=settings.context, width=settings.width, depth=settings.depth, heads=settings.heads).to(
        device
    )
    if build is None:
        optimizer = build_optimizer(optimizer_name, model.parameters(), **hyperparameters(optimizer_name, lr))
    else:
        optimizer = build(optimizer_name, model, lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings.warmup, settings.steps))
    data_order = torch.Generator().manual_seed(seed)
    curve = [Point(0, 0.0, evaluate(model, corpus, settings))]
    trained_s, failed, step_s = 0.0, False, []
    for step in range(1, settings.steps + 1):
        if not failed:
            synchronize(device)
            start = time.perf_counter()
            tokens, targets = corpus.batch("train", settings.batch_size, settings.context, data_order)
            optimizer.zero_grad(set_to_none=True)
            model.loss(tokens.to(device), targets.to(device)).backward()
            try:
                optimizer.step()
            except RootComputationError as error:  # a diverged run: its remaining losses are NaN
                print(f"    {optimizer_name} lr {lr:g} seed {seed} stopped at step {step}: {error}")
                failed = True
            schedule.step()
            synchronize(device)
            step_s.append(time.perf_counter() - start)
            trained_s += step_s[-1]
        if step % settings.eval_every == 0 or step == settings.steps:
            loss = math.nan if failed else evaluate(model, corpus, settings)
            curve.append(Point(step, trained_s, loss))
    return Run(optimizer_name, lr, seed, curve, robust_step_ms(step_s, DASH_FREQUENCY))


def warm_up(corpus: ByteCorpus, settings: Settings, device: torch.device) -> None:
    """A few untimed steps of each optimizer, so one-time costs (kernel selection, the
    solver's cached iteration schedules) land in no run's wall time."""
    short = Settings(**{**asdict(settings), "steps": 2, "warmup": 1, "eval_every": 2, "eval_batches": 1})
    for name in OPTIMIZERS:
        train_run(name, 1e-3, 0, corpus, short, device)


# ---------------------------------------------------------------------- analysis
def best_lrs(runs: list[Run]) -> dict[str, float]:
    """Per optimizer, the learning rate with the lowest final validation loss averaged over
    seeds (a learning rate with a diverged, non-finite run never wins)."""
    losses: dict[tuple[str, float], list[float]] = {}
    for run in runs:
        losses.setdefault((run.optimizer, run.lr), []).append(run.final_val_loss)

    def score(key: tuple[str, float]) -> float:
        values = losses[key]
        return statistics.mean(values) if all(math.isfinite(v) for v in values) else math.inf

    best: dict[str, float] = {}
    for name, lr in sorted(losses):
        if name not in best or score((name, lr)) < score((name, best[name])):
            best[name] = lr
    return best


def adamw_targets(runs: list[Run], adamw_lr: float) -> dict[int, float]:
    """Per seed, AdamW's final validation loss at its best learning rate."""
    return {run.seed: run.final_val_loss for run in runs if run.optimizer == "adamw" and run.lr == adamw_lr}


def make_records(runs: list[Run], device_name: str) -> list[Record]:
    """One record per run; the target of a seed is AdamW's final loss at its best learning rate."""
    targets = adamw_targets(runs, best_lrs(runs)["adamw"])
    records = []
    for run in runs:
        reached = first_reaching(run.curve, targets[run.seed]) if run.seed in targets else None
        records.append(
            Record(
                device=device_name,
                optimizer=run.optimizer,
                lr=run.lr,
                seed=run.seed,
                steps=run.steps,
                final_val_loss=run.final_val_loss,
                steps_to_adamw_final=None if reached is None else reached.step,
                wall_s=run.wall_s,
            )
        )
    return records


@dataclass(frozen=True)
class Ratio:
    """DASH over AdamW, per seed, to AdamW's final loss: steps, measured training time,
    and time estimated as steps x median step time (robust to a busy shared machine)."""

    seeds: list[int]
    steps: list[float | None]
    wall: list[float | None]
    median_time: list[float | None]


def dash_over_adamw(runs: list[Run]) -> Ratio:
    """Per seed: DASH's steps (and seconds) to the target over AdamW's, both at their best lr."""
    best = best_lrs(runs)
    targets = adamw_targets(runs, best["adamw"])
    by_key = {(run.optimizer, run.seed): run for run in runs if run.lr == best[run.optimizer]}
    seeds = sorted(targets)
    steps, wall, median_time = [], [], []
    for seed in seeds:
        adamw_run, dash_run = by_key[("adamw", seed)], by_key.get(("dash", seed))
        adamw = first_reaching(adamw_run.curve, targets[seed])
        dash = None if dash_run is None else first_reaching(dash_run.curve, targets[seed])
        steps.append(None if dash is None else dash.step / adamw.step)
        wall.append(None if dash is None else dash.wall_s / adamw.wall_s)
        median_time.append(
            None if dash is None else dash.step * dash_run.median_step_ms / (adamw.step * adamw_run.median_step_ms)
        )
    return Ratio(seeds, steps, wall, median_time)


def spread(values: list[float | None]) -> str:
    """``mean ± std (min-max)`` over the defined values; how many never reached the target."""
    defined = [v for v in values if v is not None]
    missing = len(values) - len(defined)
    if not defined:
        return "never reached"
    std = statistics.stdev(defined) if len(defined) > 1 else 0.0
    text = f"{statistics.mean(defined):.3f} ± {std:.3f} (min {min(defined):.3f}, max {max(defined):.3f})"
    return text + (f"; {missing} seed(s) never reached" if missing else "")


def mean_curve(runs: list[Run]) -> tuple[list[int], list[float], list[float]]:
    """Steps, mean training seconds and mean validation loss over runs with the same evaluation steps."""
    steps = [point.step for point in runs[0].curve]
    wall = [statistics.mean(run.curve[i].wall_s for run in runs) for i in range(len(steps))]
    loss = [statistics.mean(run.curve[i].val_loss for run in runs) for i in range(len(steps))]
    return steps, wall, loss


# ---------------------------------------------------------------------- output
def format_table(records: list[Record], best: dict[str, float]) -> str:
    groups: dict[tuple[str, float], list[Record]] = {}
    for record in records:
        groups.setdefault((record.optimizer, record.lr), []).append(record)
    header = ["optimizer", "lr", "best", "final val loss (mean over seeds)", "per seed", "steps to target", "train s"]
    rows = []
    for (name, lr), group in sorted(groups.items()):
        losses = [r.final_val_loss for r in group]
        rows.append(
            [
                name,
                f"{lr:g}",
                "*" if best.get(name) == lr else "",
                f"{statistics.mean(losses):.4f}",
                " ".join(f"{loss:.4f}" for loss in losses),
                " ".join("-" if r.steps_to_adamw_final is None else str(r.steps_to_adamw_final) for r in group),
                f"{statistics.mean(r.wall_s for r in group):.1f}",
            ]
        )
    return format_columns(header, rows)


def curves_json(runs: list[Run], device_name: str) -> list[dict]:
    return [
        {
            "device": device_name,
            "optimizer": run.optimizer,
            "lr": run.lr,
            "seed": run.seed,
            "median_step_ms": run.median_step_ms,
            "curve": [asdict(point) for point in run.curve],
        }
        for run in runs
    ]


def plot(runs: list[Run], best: dict[str, float], path: Path, title: str) -> None:
    """Two panels: mean validation loss at each optimizer's best lr against steps and wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_wall) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for name in OPTIMIZERS:
        chosen = [run for run in runs if run.optimizer == name and run.lr == best.get(name)]
        if not chosen:
            continue
        steps, wall, loss = mean_curve(chosen)
        lows = [min(run.curve[i].val_loss for run in chosen) for i in range(len(steps))]
        highs = [max(run.curve[i].val_loss for run in chosen) for i in range(len(steps))]
        label = f"{name} (lr {best[name]:g}, mean of {len(chosen)} seeds)"
        for axis, x in ((by_step, steps), (by_wall, wall)):
            line = axis.plot(x[1:], loss[1:], label=label)[0]
            axis.fill_between(x[1:], lows[1:], highs[1:], color=line.get_color(), alpha=0.2)
    targets = adamw_targets(runs, best["adamw"])
    # zoom on the part after the initial drop: the y range starts at a tenth of training
    _, _, adamw_loss = mean_curve([run for run in runs if run.optimizer == "adamw" and run.lr == best["adamw"]])
    cut = max(1, len(adamw_loss) // 10)
    by_step.set_ylim(top=adamw_loss[cut] + 0.05 * (adamw_loss[cut] - min(adamw_loss)))
    for axis in (by_step, by_wall):
        axis.axhline(
            statistics.mean(targets.values()), color="grey", linestyle="--", linewidth=0.8, label="AdamW final (mean)"
        )
        axis.grid(alpha=0.3)
    by_step.set_xlabel("optimizer step")
    by_wall.set_xlabel("training wall time (s)")
    by_step.set_ylabel("validation loss (nats/byte)")
    by_step.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(runs: list[Run], records: list[Record], out_dir: Path, device_name: str, title: str) -> list[Path]:
    records_path = write_json(out_dir / f"convergence_{device_name}.json", records)
    curves_path = write_json(
        out_dir / f"convergence_curves_{device_name}.json", curves_json(runs, device_name), indent=1
    )
    png_path = out_dir / f"convergence_{device_name}.png"
    plot(runs, best_lrs(runs), png_path, title)
    return [records_path, curves_path, png_path]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = Settings()
    parser = results_parser(__doc__.splitlines()[0], RESULTS_DIR, None, "cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
    parser.add_argument("--dash-lrs", type=float, nargs="+", default=[3e-3, 1e-2, 3e-2])
    for name in (
        "steps",
        "warmup",
        "batch_size",
        "context",
        "width",
        "depth",
        "heads",
        "eval_every",
        "eval_batches",
        "corpus_bytes",
    ):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(defaults, name), help="default: %(default)s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    device_name = device_label(device)
    settings = Settings(**{name: getattr(args, name) for name in Settings.__dataclass_fields__})
    corpus = load_stdlib_corpus(max_bytes=settings.corpus_bytes)
    print(
        f"{device_name}, torch {torch.__version__}, {torch.get_num_threads()} threads; corpus "
        f"{corpus.train.numel():,} training / {corpus.validation.numel():,} validation bytes"
    )
    print(f"settings: {settings}")
    grid = [
        (name, lr, seed)
        for seed in args.seeds
        for name, lrs in (("adamw", args.adamw_lrs), ("dash", args.dash_lrs))
        for lr in lrs
    ]
    start = time.perf_counter()
    warm_up(corpus, settings, device)
    runs = []
    for index, (name, lr, seed) in enumerate(grid, 1):
        run = train_run(name, lr, seed, corpus, settings, device)
        runs.append(run)
        print(
            f"  [{index}/{len(grid)}] {name:<5} lr {lr:<7g} seed {seed}: final val loss "
            f"{run.final_val_loss:.4f}, {run.wall_s:.1f} s training, median step {run.median_step_ms:.1f} ms",
            flush=True,
        )
    best = best_lrs(runs)
    records = make_records(runs, device_name)
    print(
        f"\n{len(grid)} runs in {time.perf_counter() - start:.0f} s; best lr by final val loss averaged over "
        f"seeds: AdamW {best['adamw']:g}, DASH {best['dash']:g} (* below); target per seed = AdamW's final "
        "val loss at its best lr\n"
    )
    print(format_table(records, best))
    ratio = dash_over_adamw(runs)
    print(f"\nDASH / AdamW steps to AdamW's final loss, seeds {ratio.seeds}: {spread(ratio.steps)}")
    print(f"DASH / AdamW training time to it, measured:                 {spread(ratio.wall)}")
    print(f"DASH / AdamW training time to it, steps x median step time: {spread(ratio.median_time)}")
    for name in OPTIMIZERS:
        medians = [run.median_step_ms for run in runs if run.optimizer == name]
        print(
            f"median step time of {name}: {statistics.median(medians):.1f} ms "
            f"(runs range {min(medians):.1f}-{max(medians):.1f} ms)"
        )
    title = (
        f"TinyGPT width {settings.width}, depth {settings.depth}, context {settings.context} on stdlib bytes, "
        f"{settings.steps} steps ({device_name})"
    )
    for path in write_outputs(runs, records, args.out, device_name, title):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
