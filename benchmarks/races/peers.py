"""Convergence race: DASH against AdamW, Muon, SOAP, PSGD-Kron and Meta's Distributed Shampoo.

Every contender trains the main job's byte-level GPT (``examples/train_char_gpt.py``:
:class:`~lightning_dash.showcase.TinyGPT`, depth 2, 4 heads, context 128, batch 32, on the
Python standard library's source, 4 MB read, validation on held-out files) with a plain
PyTorch loop instead of Lightning: the same model, data and schedule, without the trainer's
per-step overhead, so that the optimizer step can be timed on its own. For a seed, every
run starts from the same weights (``torch.manual_seed(seed)`` as ``GPTModule`` does) and sees
the same batches in the same order (``RandomWindows(train, 128, steps * 32, seed)``, the main
job's training data); validation is the main job's fixed set of held-out windows
(``RandomWindows(validation, 128, --val-windows, seed=12345)``). Schedule: linear warm-up over
5% of the steps, then cosine decay to 0.1 of the peak
(:func:`lightning_dash.showcase.lightning_gpt.warmup_cosine`, the main job's).

Contenders (:data:`CONTENDERS`; ``--optimizers`` selects some; ``betas=(0.9, 0.95)`` and
decoupled weight decay 0.01 wherever an optimizer takes them):

* ``adamw``: ``torch.optim.AdamW``.
* ``muon``: ``torch.optim.Muon`` (its defaults: momentum 0.95, Nesterov, 5 Newton-Schulz steps,
  ``adjust_lr_fn="original"``) on the hidden 2-D weights (attention in/out projections, MLP),
  and, as its documentation recommends, AdamW on the rest (byte embedding, position table,
  output head, biases, LayerNorms), both inside one :class:`MuonWithAdamW` so the schedule scales
  both. The Muon lr is swept on its own grid; the AdamW part takes ``--muon-adamw-lr`` (default:
  AdamW's best lr at the same width, from the records).
* ``muon-match-rms``: the same, with ``adjust_lr_fn="match_rms_adamw"`` (Muon's lr scaled by
  0.2 sqrt(max(rows, cols)): its update RMS about AdamW's, meant to let AdamW's lr carry over), on AdamW's
  lr grid; recorded as ``unavailable`` where the installed torch's Muon does not take it.
* ``soap``: ``heavyball.SOAP`` with its defaults (``precondition_frequency=2``,
  ``shampoo_beta=0.95``, ``max_precond_dim=2048``); ``psgd-kron``: ``heavyball.PSGDKron`` with its
  defaults (annealed preconditioner-update probability, ``precond_lr=0.1``). heavyball compiles
  with ``torch.compile`` by default; here it runs eager (``heavyball.utils.compile_mode = None``),
  as every other contender does.
* ``meta-shampoo``: ``distributed_shampoo.DistributedShampoo`` (``../shared/peers/README.md``) as
  ``_meta_shampoo.build_meta_shampoo`` builds it for the step-time benchmark (eigh roots, Adam
  grafting with beta2 0.95 and epsilon 1e-8, epsilon 1e-12, ``max_preconditioner_dim=256``,
  roots every 10 steps from step 10, no factors on vectors), with decoupled weight decay 0.01
  set on its groups (it reads ``weight_decay`` at every step): Meta's recipe (:data:`META_RECIPE`:
  fourth roots, ``L^(-1/4) G R^(-1/4)``, every 10 steps, plain momentum).
* ``meta-shampoo-dash-recipe``: the same with DASH's recipe (:data:`DASH_RECIPE`, DASH 0.4's
  defaults, the ones behind the recorded DASH runs): square roots ``L^(-1/2) G R^(-1/2)``
  (``inverse_exponent_override={2: 0.5}``), roots every 2 steps (from step 2, the earliest Meta
  accepts; DASH starts at step 1) and DASH's Nesterov direction (``beta3 = beta1**2``; see
  ``_meta_shampoo``), on a grid around DASH's best lr. Records state the recipe and the
  ``beta3`` and exponents read back from the built optimizer.
* ``meta-ec-shampoo`` and ``meta-soap``: Meta's eigenvalue-corrected Shampoo as its README's
  "replace AdamW" example builds it (``_meta_shampoo.build_meta_eigenvalue_corrected``): Adam's
  second moment in the eigenbasis of the Kronecker factors, no grafting, epsilon 1e-12, the
  eigenbasis every 10 steps by ``eigh`` (``DefaultEigenvalueCorrectedShampooConfig``) or by
  warm-started QR (``DefaultSOAPConfig``), vectors on Adam, AdamW's weight decay; on AdamW's grid.
* DASH variants, each a name and its options (:data:`DASH_VARIANTS`): DASH's defaults (inverse
  square roots, Nesterov momentum, roots every 2 steps, Adam grafting) with ``block_size=256`` and
  ``inverse_root_method`` ``eigh`` or ``newton_db``; the ``-hidden`` variants add
  ``precondition="hidden"`` (embeddings, output head, tied weights and vectors go to the grafting
  optimizer) with ``model=model``; TinyGPT's position table is a bare parameter, not an
  ``nn.Embedding``, so "hidden" still preconditions it (Muon's split above gives it to AdamW). A
  variant whose options this version of DASH does not know is recorded as ``unavailable`` and
  skipped. Records state the DASH options as the optimizer resolved them (:data:`DASH_RECORDED`).
* ``dash-from-adamw``: the AdamW above handed to ``DASH.from_optimizer`` (``block_size=256``), as
  the trainers' conversions do: AdamW's lr, DASH's ``lr_scale`` for Adam sources. It runs at AdamW's
  best lr of the width only (the claim it tests: a tuned AdamW recipe is a good DASH recipe).
* ``dash-strategy-defaults``: what ``strategy="dash"`` makes of that AdamW (``from_optimizer`` with
  the model, so ``"auto"`` routing keeps the byte embedding and the head on Adam; every other
  option DASH's default, block size 1024 included), also at AdamW's best lr only.
  ``--strategy-variant NAME=JSON`` adds the same with some DASH options set (the damping,
  grafting-norm and refresh sweeps of docs/benchmarks.md), also at AdamW's best lr only.

Protocol, per width (``--widths``; the first is the main size, the others are "larger"): each
contender runs every lr of its grid (``--lrs-<name>``; halvings and doublings: AdamW 3e-3 to
2.4e-2 around the main job's AdamW lr, 6e-3, SOAP 3e-3 to 1.2e-2; Meta's Shampoo and PSGD-Kron
6e-3 to 2.4e-2; DASH 1.2e-2 to 9.6e-2, around 8x AdamW's; Meta's Shampoo with DASH's recipe 2.4e-2 to
9.6e-2, around DASH's best; Muon 0.01 to 0.04 around its documented 0.02, ``muon-match-rms`` AdamW's) with
the first seed of ``--seeds``; its best lr is the one with the lowest final validation loss
(averaged over the seeds run at every lr of the grid). When that is the grid's largest (smallest)
lr, the grid is extended by one doubling (halving), ``--extend-edges`` times. The other seeds then
run at the best lr. At a larger width only
``--large-optimizers`` run, with ``--large-seeds``, at two lrs: the contender's best at the main
width and the better of that lr's grid neighbours there (DASH variants also at AdamW's best lr at
that width, for the lr-transfer summary).

Per run: validation loss every ``--eval-every`` steps; wall time counts training steps only
(data, forward, backward, optimizer step, schedule), not evaluations; the optimizer step
(``optimizer.step()``) is timed on its own. Step times are taken per 10-step window (the mean
over the window: every window holds whole refresh cycles of DASH (5) and of Meta's Shampoo (1, or 5
with DASH's recipe), so
refreshes are amortised): ``opt_step_ms`` and ``train_step_ms`` are the fastest window's (other processes on
a shared machine only ever add time; the table takes the fastest over the seeds), ``*_robust_ms``
the median window's (``convergence.robust_step_ms``), and the window means are recorded;
``opt_step_median_ms`` (refresh steps excluded in effect) and ``opt_step_mean_ms`` (every step)
too. ``state_bytes``: DASH's ``state_bytes()`` (its stacked statistics,
roots, momentum and grafting buffers live outside ``optimizer.state``, which holds only step
counters), for the others the bytes of every distinct tensor storage reachable from
``optimizer.state`` (parameters excluded); ``state_bytes_walk`` is the latter for all.

Table, per width, at each contender's best lr: final validation loss (mean ± standard deviation
and range over seeds), steps to AdamW's final loss (the target of a seed: AdamW's final
validation loss at its best lr on that seed; the first evaluation at or below it; null if never)
and its ratio to AdamW's, training seconds to it (measured, and estimated as steps x the fastest
window's training-step time), optimizer-step time and state bytes. The lr-transfer summary gives, per width,
the best lr of AdamW and of ``dash-eigh``, their ratio, DASH's final loss at AdamW's best lr
against at its own best, and ``dash-from-adamw``'s at AdamW's best lr.

Outputs in ``--out`` (default ``benchmarks/races/results``): ``peers_<device>.json`` (``records``: one per
optimizer x width x lr x seed x steps, with its curve; ``summary``: the tables), merged with the
file already there (a new record replaces one with the same key, others are kept), and
``peers_<device>_w<width>.png`` (mean validation loss at the best lr against steps and against
training wall time). ``--report-only`` rebuilds the summary and the plots from the JSON.

Threads: one by default (``--threads``). On this project's 2-core machine, shared with test runs
that do not wait for the benchmarks, a busy second process slowed torch's two threads about 10x
(AdamW's 200 steps: 24 s alone, 272 s beside a test run), while one thread keeps to its core.
The thread count changes losses in their last digits (other splits of the sums), not the race.

Defaults (what ``make bench-peers`` runs): 200 steps, evaluation every 10 steps on 256 validation
windows, widths 128 (478,976 parameters) and 256 (1,744,128: 3.6x), seeds 0 1 2 at both. A race split over
processes runs each with its own ``--out`` and joins them with ``--merge``. Run from the repository
root::

    flock /tmp/cpu_heavy.lock .venv/bin/python benchmarks/races/peers.py
    .venv/bin/python benchmarks/races/peers.py --optimizers dash-eigh-hidden,dash-newton_db-hidden
    .venv/bin/python benchmarks/races/peers.py --report-only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _environment import race_environment
from _peers_analysis import best_lr, load_records, lr_sweep, merge, record_key, runs_of
from _peers_contenders import CONTENDERS, FROM_ADAMW, GRAFTED_LRS, LARGE_DEFAULT, Contender, Unavailable
from _peers_report import fmt, report, write_results
from _peers_train import Data, Settings, load_data, train_run, unavailable_record
from common import device_label, resolve_device, results_parser

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------- protocol
def neighbour_lrs(records: list[dict], contender: Contender, main_width: int, steps: int) -> list[float]:
    """At a larger width: the contender's best lr at the main width and the better of its grid neighbours
    there (the grid's middle two when the main width has no runs)."""
    best = best_lr(records, contender.name, main_width, steps)
    grid = sorted(contender.lrs)
    if best is None:
        middle = len(grid) // 2
        return grid[max(0, middle - 1) : middle + 1]
    swept = lr_sweep(records, main_width, steps, [contender.name]).get(contender.name, {})
    ordered = sorted({*grid, best})
    index = ordered.index(best)
    candidates = [ordered[i] for i in (index - 1, index + 1) if 0 <= i < len(ordered)]

    def score(lr: float) -> float:
        value = swept.get(f"{lr:g}")
        return math.inf if value is None else value

    return sorted([best, min(candidates, key=score)]) if candidates else [best]


def warm_up(contenders: list[Contender], width: int, settings: Settings, data: Data, device: torch.device) -> None:
    """Two untimed steps of each contender, so that one-time costs (imports, kernel selection) land in
    no run's time."""
    short = replace(settings, steps=2, eval_every=2)
    for contender in contenders:
        try:
            train_run(contender, contender.lrs[0], 0, width, short, data, device, 6e-3)
        except Unavailable:
            pass


def edge_extension(records: list[dict], name: str, width: int, steps: int) -> float | None:
    """When the best lr is the largest (smallest) of those run, twice (half) that lr, else None."""
    lrs = sorted({r["lr"] for r in runs_of(records, name, width, steps)})
    best = best_lr(records, name, width, steps)
    if best is None or len(lrs) < 2:
        return None
    if best == lrs[-1]:
        return float(f"{2 * best:.6g}")
    if best == lrs[0]:
        return float(f"{best / 2:.6g}")
    return None


def parse_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = Settings()
    parser = results_parser(__doc__.splitlines()[0], RESULTS_DIR, "cpu", "cpu, cuda, ... (default: cpu)")
    parser.add_argument(
        "--optimizers",
        type=parse_list,
        default=None,
        help="comma-separated contenders (default: all, or none besides the --dash-variant ones)",
    )
    parser.add_argument(
        "--large-optimizers",
        type=parse_list,
        default=list(LARGE_DEFAULT),
        help="the contenders run at the widths after the first (default: %(default)s)",
    )
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256], help="the first is the main width")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the first sweeps the lrs")
    parser.add_argument("--large-seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds at the larger widths")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--val-windows", type=int, default=defaults.val_windows)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--context", type=int, default=defaults.context)
    parser.add_argument("--depth", type=int, default=defaults.depth)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--max-bytes", type=int, default=defaults.max_bytes)
    for name, contender in CONTENDERS.items():
        parser.add_argument(
            f"--lrs-{name}",
            dest=f"lrs_{name.replace('-', '_')}",
            type=float,
            nargs="+",
            default=list(contender.lrs),
            help="lr grid (default: %(default)s)",
        )
    parser.add_argument(
        "--dash-variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help='an extra DASH variant, its options as JSON (they override the shared ones; "lrs": its grid), '
        'e.g. \'dash-f2={"inverse_root_method": "eigh", "precondition_frequency": 2, "lrs": [0.006]}\'; '
        "(runs with the --optimizers given, else alone)",
    )
    parser.add_argument(
        "--strategy-variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="what strategy='dash' makes of AdamW's recipe with these DASH options set (run at AdamW's best lr "
        "only, as dash-strategy-defaults), e.g. 'eps-1e-4={\"epsilon\": 1e-4}'",
    )
    parser.add_argument(
        "--muon-adamw-lr",
        type=float,
        default=None,
        help="lr of the AdamW part of muon (default: AdamW's best at the same width, else 6e-3)",
    )
    parser.add_argument(
        "--extend-edges",
        type=int,
        default=2,
        help="at the main width, times a grid is extended by one doubling (halving) when its best lr is its "
        "largest (smallest) (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default: %(default)s; on a shared 2-core machine a second busy process slowed "
        "two threads 10x, see the module docstring)",
    )
    parser.add_argument("--resume", action="store_true", help="skip runs whose key is already in the JSON")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        help="results files whose records join the JSON first (a race split over processes with their own --out)",
    )
    parser.add_argument("--report-only", action="store_true", help="rebuild the table and plots from the JSON")
    args = parser.parse_args(argv)
    if args.optimizers is None:
        args.optimizers = [] if args.dash_variant or args.strategy_variant else list(CONTENDERS)
    args.registry = dict(CONTENDERS)
    variants = [("--dash-variant", text, "dash") for text in args.dash_variant]
    variants += [("--strategy-variant", text, "strategy") for text in args.strategy_variant]
    for flag, text, family in variants:
        name, _, options = text.partition("=")
        try:
            options = json.loads(options)
        except json.JSONDecodeError as error:
            parser.error(f"{flag} {text!r}: {error}")
        lrs = tuple(options.pop("lrs", GRAFTED_LRS if family == "dash" else CONTENDERS["adamw"].lrs))
        options = {key: tuple(value) if isinstance(value, list) else value for key, value in options.items()}
        args.registry[name] = Contender(name, family, lrs, options)
        if name not in args.optimizers:
            args.optimizers.append(name)
    unknown = set(args.optimizers) - set(args.registry)
    if unknown:
        parser.error(f"unknown optimizer(s) {sorted(unknown)}; known: {list(args.registry)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    device_name = device_label(device)
    settings = Settings.from_args(args)
    path = args.out / f"peers_{device_name}.json"
    records = load_records(path)
    for other in args.merge:
        records = merge(records, load_records(other))
    # AdamW first: muon's AdamW part and the DASH lrs at larger widths use AdamW's best lr.
    registry = args.registry
    names = sorted(args.optimizers, key=lambda n: (n != "adamw", list(registry).index(n)))
    print(f"{device_name}, {race_environment()}")
    print(f"settings: {settings}")
    start = time.perf_counter()
    if not args.report_only:
        data = load_data(settings)
        print(f"corpus {data.corpus.train.numel():,} training / {data.corpus.validation.numel():,} validation bytes")
        main_width = args.widths[0]
        warm_up([registry[n] for n in names], main_width, settings, data, device)
        for width in args.widths:
            large = width != main_width
            seeds = args.large_seeds if large else args.seeds
            for name in names:
                if large and name not in args.large_optimizers:
                    continue
                flag = f"lrs_{name.replace('-', '_')}"
                contender = registry[name]
                if name in CONTENDERS:
                    contender = replace(contender, lrs=tuple(getattr(args, flag)))
                if contender.family in FROM_ADAMW:  # the claim under test: AdamW's best lr, unchanged
                    adamw_lr = best_lr(records, "adamw", width, settings.steps)
                    lrs = [adamw_lr] if adamw_lr is not None else list(contender.lrs)
                elif large:
                    lrs = neighbour_lrs(records, contender, main_width, settings.steps)
                    adamw_lr = best_lr(records, "adamw", width, settings.steps)
                    if contender.family == "dash" and adamw_lr is not None and adamw_lr not in lrs:
                        lrs = sorted([*lrs, adamw_lr])
                else:
                    lrs = list(contender.lrs)
                records, ok = run_grid(records, contender, lrs, seeds[:1], width, settings, data, device, args, path)
                if not ok:
                    continue
                for _ in range(0 if large or contender.family in FROM_ADAMW else args.extend_edges):
                    beyond = edge_extension(records, name, width, settings.steps)
                    if beyond is None:
                        break
                    print(f"  {name}: best lr at the edge of the grid; adding {beyond:g}")
                    records, _ = run_grid(
                        records, contender, [beyond], seeds[:1], width, settings, data, device, args, path
                    )
                chosen = best_lr(records, name, width, settings.steps)
                rest = seeds[1:]
                records, _ = run_grid(records, contender, [chosen], rest, width, settings, data, device, args, path)
        print(f"\nruns took {time.perf_counter() - start:.0f} s")
    summary = report(records, args.out, device_name)
    write_results(path, records, summary)
    print(f"wrote {path}")
    return summary


def run_grid(
    records: list[dict],
    contender: Contender,
    lrs: list[float],
    seeds: list[int],
    width: int,
    settings: Settings,
    data: Data,
    device: torch.device,
    args: argparse.Namespace,
    path: Path,
) -> tuple[list[dict], bool]:
    """Run ``contender`` at every lr x seed, merging each record into ``records`` (and the JSON, so an
    interrupted race keeps what it measured); False when the contender is unavailable."""
    existing = {record_key(r) for r in records if r["status"] != "unavailable"}
    for lr in lrs:
        for seed in seeds:
            key = (contender.name, width, lr, seed, settings.steps)
            if args.resume and key in existing:
                continue
            muon_lr = args.muon_adamw_lr or best_lr(records, "adamw", width, settings.steps) or 6e-3
            try:
                record = train_run(contender, lr, seed, width, settings, data, device, muon_lr)
            except Unavailable as error:
                print(f"  {contender.name}: unavailable ({error})")
                records = merge(records, [unavailable_record(contender.name, width, settings.steps, str(error))])
                write_results(path, records, {})
                return records, False
            records = merge(records, [record])
            write_results(path, records, {})
            print(
                f"  {contender.name:<22} w{width} lr {lr:<7g} seed {seed}: {record['status']}, final val loss "
                f"{fmt(record['final_val_loss'])}, {record['wall_s']:.1f} s training, opt step "
                f"{record['opt_step_ms']:.1f} ms, state {record['state_bytes'] / 2**20:.2f} MiB",
                flush=True,
            )
    return records, True


if __name__ == "__main__":
    main()
