"""Model-family suite: AdamW against ``strategy="dash"`` on unchanged LightningModules.

Every family of :mod:`family_models` (a CNN on images, a GRU, GPT pretraining, GPT fine-tuning
from a checkpoint, a residual MLP on tabular data of 350 and of 3,500 rows, an embedding-heavy
bag-of-words classifier, a mixture-of-experts transformer with 3-D expert weights, a Hugging Face
GPT-2), and the five of :mod:`family_models_wider` (an encoder-decoder transformer, a U-Net, a
Hugging Face BERT classifier, the GPT at 3x its steps, the GRU at a hotter lr) and the six of
:mod:`family_models_sensitive` (recurrent models at a high lr, one with gradient clipping, and classifiers
whose validation loss comes from a few confident errors, which also record their accuracy) is a
LightningModule whose ``configure_optimizers`` returns AdamW with warm-up + cosine. It is
trained through ``lightning.Trainer`` twice per seed: once as it is, once with
``strategy=DashStrategy(**variant)`` added (``{}``: DASH's defaults), nothing else changed.

Protocol: AdamW's lr is tuned per family on the family's grid (3x apart) by the mean final
validation loss over ``--seeds``, extended by one 3x step at an edge (``--extend-edges``
times). Every DASH variant then runs at AdamW's best lr on every seed. Per run: validation
loss before training and every tenth of the steps; training time counts the training batches
only (forward, backward, optimizer step, schedule), not the evaluations. A run *diverges*
when a loss is not finite or its final validation loss is above the initial model's.

Per family and contender, at AdamW's best lr: mean final validation loss over the seeds, its
ratio to AdamW's, divergences, the mean training-step time and its ratio to AdamW's, and the
steps and training seconds to AdamW's final loss of the same seed (first evaluation at or
below it). Runs go to ``--records`` (JSON lines, appended as they finish; a rerun skips the
runs already there) and the summary to ``--out``; ``--report-only`` rebuilds the summary.

    python benchmarks/races/families.py                      # every family, 2 seeds, 2 worker processes
    python benchmarks/races/families.py --families cnn mlp --seeds 0
    python benchmarks/races/families.py --variant dash-f10='{"precondition_frequency": 10}'
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _environment import suite_environment  # noqa: E402
from _families_report import table, timing_table  # noqa: E402
from common import format_columns, markdown_table, write_json  # noqa: E402
from family_models import FAMILIES as FIRST_FAMILIES  # noqa: E402
from family_models import Family  # noqa: E402
from family_models_sensitive import SENSITIVE  # noqa: E402
from family_models_wider import WIDER  # noqa: E402
from typing_extensions import override  # noqa: E402

from lightning_dash import DashStrategy  # noqa: E402
from lightning_dash.showcase.quiet import quiet_third_party_output  # noqa: E402

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: The first nine families, the five of :mod:`family_models_wider` and the six of :mod:`family_models_sensitive`.
FAMILIES: dict[str, Family] = {**FIRST_FAMILIES, **WIDER, **SENSITIVE}

#: DASH variants every run of the suite includes: DASH's defaults, and version 0.4's defaults by name (as
#: near as today's DASH gets: 0.4 also stepped 1-D parameters at 8x the lr, which ``lr_scale`` no longer does).
VARIANTS: dict[str, dict[str, Any]] = {
    "dash": {},
    "dash-v0.4": {
        "lr_scale": 8.0,
        "root_order": 2,
        "nesterov": True,
        "precondition_frequency": 2,
        "epsilon": 1e-6,
        "precondition": "all_matrices",
    },
}
#: Timed beside DASH in the timing rounds only: the same run with the roots computed once (at the first
#: step) instead of every ``precondition_frequency`` steps, so that ``1 - its training s / DASH's`` is the
#: share of DASH's training time that goes to refreshing roots.
ROOTS_ONCE = ("dash-roots-once", {"precondition_frequency": 10**6})
EVALUATIONS = 10
#: Per-group options a DASH record states as its first group holds them (converted from AdamW, or set).
RECORDED_GROUP_OPTIONS = ("epsilon", "precondition_frequency", "betas", "grafting_beta2", "weight_decay")


# ---------------------------------------------------------------------- one run
def run(job: dict[str, Any]) -> dict[str, Any]:
    """Train one family with one contender at one lr and seed; the record of the run."""
    quiet_third_party_output()
    warnings.filterwarnings("ignore", category=UserWarning, module=r"lightning")
    family = FAMILIES[job["family"]]
    module = family.module(job["lr"], job["seed"])
    steps = job["steps"]
    tracker = Tracker(family, every=max(1, steps // EVALUATIONS))
    strategy = "auto" if job["contender"] == "adamw" else DashStrategy(**job["options"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=family.gradient_clip_val,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[tracker],
    )
    trainer.fit(module, train_dataloaders=family.train_loader(job["seed"], steps))
    optimizer = trainer.optimizers[0]
    final = tracker.curve[-1][2] if tracker.curve else math.nan
    diverged = not math.isfinite(final) or not tracker.finite or final > tracker.initial
    record = {
        **job,
        "optimizer": type(optimizer).__name__,
        "initial_val": tracker.initial,
        "final_val": final if math.isfinite(final) else None,
        "final_metric": evaluate(module, tracker.batches, family.metric) if family.metric is not None else None,
        "diverged": diverged,
        "curve": tracker.curve,
        "train_s": sum(tracker.step_s),
        # the training batches' mean loss over the last tenth of the steps: with the validation loss,
        # whether a contender that ends behind fit the training data less or generalised worse
        "final_train_loss": statistics.fmean(tracker.train_losses[-max(1, steps // EVALUATIONS) :])
        if tracker.train_losses
        else None,
        "step_ms_median": 1e3 * statistics.median(tracker.step_s) if tracker.step_s else None,
        "step_ms_mean": 1e3 * statistics.fmean(tracker.step_s) if tracker.step_s else None,
    }
    if job["contender"] != "adamw":
        record["dash_config"] = {k: repr(v) for k, v in optimizer.config.changed().items()}
        record["dash_group"] = {k: optimizer.param_groups[0][k] for k in RECORDED_GROUP_OPTIONS}
    return record


def evaluate(module: torch.nn.Module, batches: list, metric: Any = None) -> float:
    """Mean validation loss, or ``metric(net, batch)`` when given (weighted by batch rows), in eval mode,
    without gradients."""
    was_training = module.training
    module.eval()
    total, rows = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            value = module.loss(batch) if metric is None else metric(module.net, batch)
            total += float(value) * batch[0].shape[0]
            rows += batch[0].shape[0]
    module.train(was_training)
    return total / rows


class Tracker(pl.Callback):
    """Times each training batch and evaluates every ``every`` steps (outside the timing)."""

    def __init__(self, family: Family, every: int) -> None:
        self.batches = family.validation_batches()
        self.every = every
        self.step_s: list[float] = []
        self.train_losses: list[float] = []
        self.curve: list[tuple[int, float, float]] = []
        self.initial = math.nan
        self.finite = True
        self.started = 0.0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.initial = evaluate(pl_module, self.batches)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, index: int) -> None:
        self.started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        self.step_s.append(time.perf_counter() - self.started)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.train_losses.append(float(loss))
        if not torch.isfinite(loss).all():
            self.finite = False
            trainer.should_stop = True
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps or not self.finite:
            value = evaluate(pl_module, self.batches)
            self.curve.append((step, sum(self.step_s), value if math.isfinite(value) else math.inf))


# ---------------------------------------------------------------------- the protocol
def job_key(job: dict[str, Any]) -> str:
    return json.dumps(
        [job["family"], job["contender"], job["options"], job["lr"], job["seed"], job["steps"], job.get("repeat")],
        sort_keys=True,
    )


def load_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_jobs(jobs: list[dict[str, Any]], records_path: Path, workers: int) -> list[dict[str, Any]]:
    """Run the jobs not yet in ``records_path`` on ``workers`` processes (one torch thread each),
    appending each record as it finishes; all records of the file afterwards."""
    done = {job_key(r) for r in load_records(records_path)}
    todo = [job for job in jobs if job_key(job) not in done]
    records_path.parent.mkdir(parents=True, exist_ok=True)
    if todo:
        context = multiprocessing.get_context("spawn")
        with context.Pool(workers, initializer=torch.set_num_threads, initargs=(1,), maxtasksperchild=None) as pool:
            for record in pool.imap_unordered(run, todo):
                with records_path.open("a") as out:
                    out.write(json.dumps(record) + "\n")
                print(
                    f"{record['family']:>10} {record['contender']:>12} lr {record['lr']:.0e} seed {record['seed']}: "
                    f"{record['final_val']} ({record['step_ms_median']:.1f} ms/step)",
                    flush=True,
                )
    return load_records(records_path)


def runs_of(records: list[dict], family: str, contender: str, lr: float | None = None) -> list[dict]:
    return [
        r
        for r in records
        if r["family"] == family and r["contender"] == contender and (lr is None or math.isclose(r["lr"], lr))
    ]


def mean_final(runs: list[dict]) -> float:
    """Mean final validation loss; infinite when any run diverged to a non-finite loss."""
    values = [r["final_val"] if r["final_val"] is not None else math.inf for r in runs]
    return statistics.fmean(values) if values else math.nan


def best_adamw_lr(records: list[dict], family: str, seeds: list[int]) -> float | None:
    """AdamW's lr with the lowest mean final loss among the lrs run on every seed."""
    lrs = sorted({r["lr"] for r in runs_of(records, family, "adamw")})
    complete = [lr for lr in lrs if {r["seed"] for r in runs_of(records, family, "adamw", lr)} >= set(seeds)]
    if not complete:
        return None
    return min(
        complete, key=lambda lr: mean_final([r for r in runs_of(records, family, "adamw", lr) if r["seed"] in seeds])
    )


def tune_adamw(
    family: Family, seeds: list[int], steps: int, records_path: Path, workers: int, extend_edges: int
) -> float:
    """AdamW's best lr on the family's grid, extending the grid by 3x at an edge."""
    grid = list(family.adamw_lrs)
    for _ in range(extend_edges + 1):
        jobs = [adamw_job(family.name, lr, seed, steps) for lr in grid for seed in seeds]
        records = run_jobs(jobs, records_path, workers)
        best = best_adamw_lr(records, family.name, seeds)
        assert best is not None
        if math.isclose(best, max(grid)):
            grid.append(max(grid) * 3)
        elif math.isclose(best, min(grid)):
            grid.insert(0, min(grid) / 3)
        else:
            break
    return best


def adamw_job(family: str, lr: float, seed: int, steps: int) -> dict[str, Any]:
    return {"family": family, "contender": "adamw", "options": {}, "lr": lr, "seed": seed, "steps": steps}


def seconds_to(record: dict, target: float) -> tuple[int, float] | None:
    """The first evaluation (step, training seconds) at or below ``target``."""
    for step, seconds, value in record["curve"]:
        if value <= target:
            return step, seconds
    return None


def summarise(records: list[dict], families: list[str], contenders: list[str], seeds: list[int]) -> list[dict]:
    """One row per family and contender at AdamW's best lr (see the module docstring)."""
    rows = []
    for family in families:
        lr = best_adamw_lr(records, family, seeds)
        if lr is None:
            continue
        adamw = {r["seed"]: r for r in runs_of(records, family, "adamw", lr) if r["seed"] in seeds}
        adamw_final = mean_final(list(adamw.values()))
        adamw_step = statistics.fmean(r["step_ms_median"] for r in adamw.values())
        for contender in ["adamw", *contenders]:
            runs = [r for r in runs_of(records, family, contender, lr) if r["seed"] in seeds]
            if not runs:
                continue
            reached = [seconds_to(r, adamw[r["seed"]]["final_val"]) for r in runs if r["seed"] in adamw]
            step_ms = statistics.fmean(r["step_ms_median"] for r in runs)
            rows.append(
                {
                    "family": family,
                    "contender": contender,
                    "lr": lr,
                    "seeds": sorted(r["seed"] for r in runs),
                    "final_val": mean_final(runs),
                    "ratio_to_adamw": mean_final(runs) / adamw_final,
                    "diverged": sum(r["diverged"] for r in runs),
                    "step_ms": step_ms,
                    "step_ratio": step_ms / adamw_step,
                    "steps_to_adamw": [None if x is None else x[0] for x in reached],
                    "seconds_to_adamw": [None if x is None else round(x[1], 2) for x in reached],
                    "adamw_seconds": [round(adamw[r["seed"]]["train_s"], 2) for r in runs if r["seed"] in adamw],
                }
            )
    return rows


def run_timing(
    steps: dict[str, int],
    variants: dict[str, dict],
    seed: int,
    repeats: int,
    records_path: Path,
    best: dict[str, float],
) -> list[dict]:
    """``repeats`` rounds of AdamW and every variant at AdamW's best lr, one process, interleaved
    (AdamW, variants, AdamW, ...), so that a busy machine slows every contender alike."""
    jobs = []
    for family, family_steps in steps.items():
        for repeat in range(repeats):
            for contender, options in [("adamw", {}), *variants.items()]:
                job = {"family": family, "contender": contender, "options": options, "lr": best[family]}
                jobs.append({**job, "seed": seed, "steps": family_steps, "repeat": repeat})
    return run_jobs(jobs, records_path, workers=1)


def timing_rows(records: list[dict]) -> list[dict]:
    """Per family and contender: the median over repeats of the median step time, its ratio to
    AdamW's, the training seconds to AdamW's final loss (median over repeats), and the share of
    the training seconds that refreshing roots takes (against the same options with roots
    computed once)."""
    rows = []
    for family in dict.fromkeys(r["family"] for r in records):
        adamw = runs_of(records, family, "adamw")
        target = adamw[0]["final_val"]  # deterministic: every repeat ends at the same loss
        adamw_ms = statistics.median(r["step_ms_median"] for r in adamw)
        for contender in dict.fromkeys(r["contender"] for r in records if r["family"] == family):
            runs = runs_of(records, family, contender)
            reached = [seconds_to(r, target) for r in runs]
            seconds = [x[1] for x in reached if x is not None]
            rows.append(
                {
                    "family": family,
                    "contender": contender,
                    "options": runs[0]["options"],
                    "step_ms": statistics.median(r["step_ms_median"] for r in runs),
                    "step_ratio": statistics.median(r["step_ms_median"] for r in runs) / adamw_ms,
                    "train_s": statistics.median(r["train_s"] for r in runs),
                    "seconds_to_adamw": statistics.median(seconds) if len(seconds) == len(runs) else None,
                }
            )
    for row in rows:  # refreshes are one step in ``precondition_frequency``: compare whole runs, not medians
        once = [
            other
            for other in rows
            if row["contender"] not in ("adamw", ROOTS_ONCE[0])
            and other["family"] == row["family"]
            and other["contender"] == ROOTS_ONCE[0]
            and other["options"] == {**row["options"], **ROOTS_ONCE[1]}
        ]
        row["roots_share"] = 1 - once[0]["train_s"] / row["train_s"] if once else None
    return rows


#: Contenders the plot shows (the others stay in the JSON): AdamW, DASH as each suite ran it ("dash": the defaults
#: of its day), spectral grafting and version 0.4's.
PLOTTED = ("adamw", "dash", "dash-spectral", "dash-v0.4", "v0.4-code")


def plot(records: list[dict], rows: list[dict], path: Path) -> Path | None:
    """Validation loss against steps, one panel per family, the :data:`PLOTTED` contenders of ``rows``
    at AdamW's best lr on the first seed (None when matplotlib is not installed). Steps, not seconds:
    the suite's runs share the machine; the timing rounds measure time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    families = list(dict.fromkeys(row["family"] for row in rows))
    columns = min(4, len(families))
    figure, axes = plt.subplots(
        math.ceil(len(families) / columns), columns, figsize=(4 * columns, 3.2 * math.ceil(len(families) / columns))
    )
    for axis, family in zip(getattr(axes, "flat", [axes]), families):
        for row in (r for r in rows if r["family"] == family and r["contender"] in PLOTTED):
            runs = [r for r in runs_of(records, family, row["contender"], row["lr"]) if r["seed"] == row["seeds"][0]]
            if runs:
                curve = [(step, value) for step, _, value in runs[0]["curve"] if math.isfinite(value)]
                axis.plot(*zip(*curve), marker=".", label=row["contender"])
        axis.set_title(family)
        axis.set_xlabel("step")
        axis.set_ylabel("validation loss")
        axis.set_yscale("log")
        axis.legend(fontsize=7)
    for axis in list(getattr(axes, "flat", [axes]))[len(families) :]:
        axis.set_visible(False)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--extend-edges", type=int, default=1)
    parser.add_argument("--max-steps", type=int, help="cap every family's steps (a quick look; the tests' tiny suite)")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=JSON", help="add a DASH variant (its options)"
    )
    parser.add_argument("--only-variants", nargs="*", help="run only these DASH variants (default: all)")
    parser.add_argument("--records", type=Path, default=RESULTS_DIR / "families_runs_cpu.jsonl")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "families_cpu.json")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument(
        "--timing", type=int, default=0, metavar="N", help="then N interleaved timing rounds, one process, first seed"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    variants = dict(VARIANTS)
    for text in args.variant:
        name, _, options = text.partition("=")
        variants[name] = json.loads(options)
    if args.only_variants is not None:
        variants = {name: variants[name] for name in args.only_variants}
    steps = {
        name: FAMILIES[name].steps if args.max_steps is None else min(FAMILIES[name].steps, args.max_steps)
        for name in args.families
    }
    if not args.report_only:
        for name in args.families:
            family = FAMILIES[name]
            lr = tune_adamw(family, args.seeds, steps[name], args.records, args.workers, args.extend_edges)
            jobs = [
                {"family": name, "contender": variant, "options": options, "lr": lr, "seed": seed, "steps": steps[name]}
                for variant, options in variants.items()
                for seed in args.seeds
            ]
            run_jobs(jobs, args.records, args.workers)
    records = load_records(args.records)
    contenders = sorted({r["contender"] for r in records} - {"adamw"}, key=lambda c: (c not in VARIANTS, c))
    rows = summarise(records, args.families, contenders, args.seeds)
    header, body = table(rows)
    print(format_columns(header, body))
    grids = {f: sorted({r["lr"] for r in runs_of(records, f, "adamw")}) for f in args.families}
    timing_path = args.records.with_suffix(".timing.jsonl")
    if args.timing and not args.report_only:
        best = {f: lr for f in args.families if (lr := best_adamw_lr(records, f, args.seeds)) is not None}
        timed = {name: variants[name] for name in contenders if name in variants}
        if "dash" in timed:
            timed[ROOTS_ONCE[0]] = {**timed["dash"], **ROOTS_ONCE[1]}
        run_timing({f: steps[f] for f in best}, timed, args.seeds[0], args.timing, timing_path, best)
    timing = timing_rows(load_records(timing_path)) if timing_path.exists() else []
    if timing:
        print(format_columns(*timing_table(timing)))
    summary = {
        "environment": suite_environment(),
        "families": {f: FAMILIES[f].description for f in args.families},
        "adamw_grids": grids,
        "variants": {name: variants.get(name) for name in contenders},
        "rows": rows,
        "timing": timing,
        "markdown": markdown_table(header, body),
        "timing_markdown": markdown_table(*timing_table(timing)) if timing else None,
    }
    write_json(args.out, summary)
    plot(records, rows, args.out.with_suffix(".png"))
    return summary


if __name__ == "__main__":
    main()
