"""Optimizer step time before and after a change of the package: step_time.py on two revisions, interleaved.

``--before`` and ``--after`` are git revisions of this repository; ``--after``
defaults to the working tree, uncommitted changes included. Each revision other
than the working tree is checked out as a temporary ``git worktree`` (removed at
the end). For ``--rounds`` rounds, ``benchmarks/speed/step_time.py`` then runs once on
the before revision and once on the after revision (before, after, before,
after, ...), each time as a fresh process with ``PYTHONPATH`` set to the
revision's root, so that ``import lightning_dash`` is that revision's package
(checked before the first round). The harness is the working tree's
``step_time.py`` (beside this script) and the shared modules it imports, for both
revisions, so only the package differs; a revision's own copy of the benchmarks, wherever
it kept them, is never run.
``--after`` equal to ``--before`` gives an A/A run: how far apart the same
package measures on this machine.

Each run of step_time.py is one round of its own (``--rounds 1``) without the
per-block loop baseline and the third-party optimizers (``--no-loop
--no-third-party``: neither is the package's step). The arguments after ``--``
go to step_time.py (model, block sizes, solvers, dtypes, samples, warm-up,
device); without any, :data:`DEFAULT_STEP_TIME_ARGS`. A case's time in a round
is the one step_time.py records, the minimum over its samples. Per case, the
table gives the median over rounds of the before and of the after times, their
ratio after / before, and the lowest and highest ratio of one round's after time
to the same round's before time. AdamW, which such a change does not touch,
shows how far the machine alone moves a ratio.

Writes ``--out`` (default ``benchmarks/speed/results/compare_revisions_<device>.json``):
``"before"`` and ``"after"`` (the revision as given, its commit and subject; for
the working tree, the commit it is on and its changed files under
``lightning_dash/``), ``"machine"`` (platform, processor, CPU count, Python,
torch and its thread count, load average before and after), ``"step_time_args"``,
``"runs"`` (every run: round, revision, wall seconds, step_time.py's records,
skipped cases) and ``"cases"`` (per case: the time of every round on both sides,
the medians, the ratio, its min and max over rounds).

Run from the repository root on an otherwise idle machine. The default, 6 rounds of
AdamW, DASH with each of the four solvers (float32 matmuls) and dash_f10 on gpt-2.5m
with block size 512, takes about 7 minutes on 2 cores (estimated from the step times
in ``results/step_time_cpu.json``: about 30 s per step_time.py run, 12 runs)::

    .venv/bin/python benchmarks/speed/compare_revisions.py --before a793752
    .venv/bin/python benchmarks/speed/compare_revisions.py --before a793752 --rounds 2 --out /tmp/smoke.json -- \\
        --model gpt-tiny --block-sizes 32 --solvers eigh --dtypes float32   # a smoke run, 1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _environment import cpu_name
from common import format_columns, write_json

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: The working tree's step-time script: the harness for both revisions.
STEP_TIME = Path(__file__).resolve().parent / "step_time.py"
#: step_time.py's arguments when none are given after ``--`` (see the module docstring).
DEFAULT_STEP_TIME_ARGS = (
    "--model gpt-2.5m --block-sizes 512 --solvers eigh newton_db coupled_newton chebyshev --dtypes float32 "
    "--warmup 1 --samples 3"
).split()
#: What this script sets itself: one round per process, the package's optimizers only.
FIXED_STEP_TIME_ARGS = ["--rounds", "1", "--no-loop", "--no-third-party"]
SIDES = ("before", "after")
#: What names a case: its model, and the solvers suite's records have a dtype, the peers and defaults suites' a root
#: frequency.
CASE_FIELDS = ("model", "optimizer", "solver", "dtype", "block_size", "frequency")


# ---------------------------------------------------------------------- revisions
def git(*args: str, cwd: Path = STEP_TIME.parent) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def describe(rev: str) -> dict:
    """The revision as given, its full commit hash and subject (an unknown revision stops the script)."""
    try:
        commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"compare_revisions: {rev!r} is not a commit of this repository") from None
    return {"rev": rev, "commit": commit, "subject": git("log", "-1", "--format=%s", commit)}


def describe_working_tree(root: Path) -> dict:
    """The commit the working tree is on and its uncommitted changes to the package."""
    changed = git("status", "--porcelain", "--", "lightning_dash", cwd=root).splitlines()
    return {
        "rev": "working tree",
        "commit": git("rev-parse", "HEAD", cwd=root),
        "subject": git("log", "-1", "--format=%s", cwd=root),
        "changed_files": changed,
    }


def add_worktree(commit: str, path: Path, stack: ExitStack) -> Path:
    """Check ``commit`` out at ``path``; the worktree is removed when ``stack`` closes."""
    git("worktree", "add", "--detach", str(path), commit)
    stack.callback(remove_worktree, path)
    return path


def remove_worktree(path: Path) -> None:
    try:
        git("worktree", "remove", "--force", str(path))
    except subprocess.CalledProcessError:
        git("worktree", "prune")


def package_location(root: Path) -> str:
    """Where ``import lightning_dash`` resolves with ``PYTHONPATH=root``; stops the script unless inside root."""
    # find_spec locates the package without running it (its __init__ imports Lightning when installed)
    probe = "import importlib.util; print(importlib.util.find_spec('lightning_dash').origin)"
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, env=environment(root), check=True, capture_output=True, text=True
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"compare_revisions: with PYTHONPATH={root}, lightning_dash is {found}")
    return found


def environment(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root)}


# ---------------------------------------------------------------------- runs
def run_step_time(root: Path, step_time_args: list[str], out_dir: Path) -> dict:
    """One step_time.py process on the package at ``root``: its records, skipped cases and wall time."""
    command = [sys.executable, str(STEP_TIME), *FIXED_STEP_TIME_ARGS, *step_time_args, "--out", str(out_dir)]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=root, env=environment(root), capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise SystemExit(f"compare_revisions: step_time.py failed on {root} (exit {done.returncode}):\n{tail}")
    (path,) = out_dir.glob("step_time_*.json")
    return {
        "wall_s": wall_s,
        "records": json.loads(path.read_text()),
        "skipped": [line for line in done.stdout.splitlines() if line.startswith("skipped ")],
    }


def case_key(record: dict) -> tuple:
    return tuple(record.get(name) for name in CASE_FIELDS)


def case_label(key: tuple) -> str:
    model, optimizer, solver, dtype, block_size, frequency = key
    block = None if block_size is None else f"b{block_size}"
    period = None if frequency is None else f"f{frequency}"
    return " ".join(str(p) for p in (model, optimizer, solver, dtype, block, period) if p)


# ---------------------------------------------------------------------- summary
def summarize(runs: list[dict], rounds: int) -> list[dict]:
    """Per case (in step_time.py's order): every round's time on both sides (None where the case
    did not run), the medians over rounds, their ratio after / before, and the min and max over
    rounds of one round's after time over its before time."""
    times: dict[tuple, dict[str, list[float | None]]] = {}
    for run in runs:
        for record in run["records"]:
            sides = times.setdefault(case_key(record), {side: [None] * rounds for side in SIDES})
            sides[run["revision"]][run["round"] - 1] = record["step_ms"]
    cases = []
    for key, sides in times.items():
        before = [t for t in sides["before"] if t is not None]
        after = [t for t in sides["after"] if t is not None]
        paired = [a / b for b, a in zip(sides["before"], sides["after"]) if a is not None and b is not None]
        before_ms = statistics.median(before) if before else None
        after_ms = statistics.median(after) if after else None
        cases.append(
            {
                **dict(zip(CASE_FIELDS, key)),
                "before_ms": sides["before"],
                "after_ms": sides["after"],
                "before_median_ms": before_ms,
                "after_median_ms": after_ms,
                "ratio": after_ms / before_ms if before and after else None,
                "ratio_min": min(paired, default=None),
                "ratio_max": max(paired, default=None),
            }
        )
    return cases


def format_summary(cases: list[dict]) -> str:
    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = ["case", "before ms", "after ms", "after / before", "min-max over rounds", "rounds"]
    rows = [
        [
            case_label(case_key(case)),
            number(case["before_median_ms"], ".2f"),
            number(case["after_median_ms"], ".2f"),
            number(case["ratio"], ".3f"),
            f"{number(case['ratio_min'], '.3f')}-{number(case['ratio_max'], '.3f')}",
            str(sum(b is not None and a is not None for b, a in zip(case["before_ms"], case["after_ms"]))),
        ]
        for case in cases
    ]
    return format_columns(header, rows)


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": cpu_name(platform.processor()),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    own, step_time_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s --before REV [options] [-- step_time.py arguments]"
    )
    parser.add_argument("--before", required=True, help="git revision measured first in each round")
    parser.add_argument("--after", default=None, help="git revision (default: the working tree as it is)")
    parser.add_argument("--rounds", type=int, default=6, help="before/after pairs (default: %(default)s)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default: benchmarks/speed/results/compare_revisions_<device>.json)",
    )
    args = parser.parse_args(own)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if any(arg == "--out" or arg.startswith("--out=") for arg in step_time_args):
        parser.error("--out after '--': this script chooses step_time.py's output folder")
    args.step_time_args = step_time_args or list(DEFAULT_STEP_TIME_ARGS)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    root = Path(git("rev-parse", "--show-toplevel"))
    revisions = {"before": describe(args.before)}
    revisions["after"] = describe_working_tree(root) if args.after is None else describe(args.after)
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="compare_revisions_")))
        roots = {}
        for side in SIDES:
            if side == "after" and args.after is None:
                roots[side] = root
            else:
                roots[side] = add_worktree(revisions[side]["commit"], scratch / side, stack)
            revisions[side]["package"] = package_location(roots[side])
        for side in SIDES:
            info = revisions[side]
            dirty = f", {len(info['changed_files'])} changed package files" if info.get("changed_files") else ""
            print(f"{side}: {info['rev']} = {info['commit'][:10]} {info['subject'][:60]!r}{dirty}")
        print(f"step_time.py {' '.join(FIXED_STEP_TIME_ARGS + args.step_time_args)}")
        load_before = os.getloadavg()
        if load_before[0] > 0.5:
            print(
                f"warning: load average {load_before[0]:.1f} on {os.cpu_count()} CPUs; other processes slow "
                "step_time.py's threads unevenly, so the ratios measure them as much as the change"
            )
        runs = []
        for round_index in range(1, args.rounds + 1):
            for side in SIDES:
                run = run_step_time(roots[side], args.step_time_args, scratch / f"round{round_index}_{side}")
                runs.append({"round": round_index, "revision": side, **run})
                times = ", ".join(f"{case_label(case_key(r))} {r['step_ms']:.1f}" for r in run["records"])
                print(f"  round {round_index}/{args.rounds} {side:<6} {run['wall_s']:5.1f} s: {times} ms", flush=True)
                for line in run["skipped"]:
                    print(f"    {line}")
    cases = summarize(runs, args.rounds)
    print(f"\nmedian over {args.rounds} rounds of step_time.py's step ms (minimum over its samples)\n")
    print(format_summary(cases))
    report = {
        **revisions,
        "machine": {**machine(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "step_time_args": FIXED_STEP_TIME_ARGS + args.step_time_args,
        "runs": runs,
        "cases": cases,
    }
    device = runs[0]["records"][0]["device"] if runs and runs[0]["records"] else "cpu"
    out = args.out or RESULTS_DIR / f"compare_revisions_{device}.json"
    print(f"\nwrote {write_json(out, report, indent=1)}")
    return report


if __name__ == "__main__":
    main()
