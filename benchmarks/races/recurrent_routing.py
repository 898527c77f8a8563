"""A recurrent language model at a high lr: which routing keeps DASH stable.

The model-family suite's byte-level GRU (embedding 64, GRU 192, output layer 256) on English text
(Python's help topics, split 90/10 by topic), trained in plain PyTorch for ``--steps`` steps on 32
random 64-byte windows per step (the same windows and weights for every contender of a seed):
AdamW (betas 0.9/0.999, weight decay 0.01) with a linear warm-up over the first 5% of the steps
and a cosine to zero, and ``DASH.from_optimizer(adamw, model=model)`` under two routings:

* ``dash``: DASH's defaults (``precondition="auto"``: every matrix, since the model is recurrent);
* ``dash-hidden``: ``precondition="hidden"``, what ``auto`` gave before it looked for recurrent
  layers: the embedding and the output layer follow Adam.

Reports the validation loss (256 fixed held-out windows) after the last step per lr, contender and
seed, and how many runs failed (a final validation loss above 2.2, where a run that exploded ends).

    python benchmarks/races/recurrent_routing.py                        # lr 5e-2 on 6 seeds, 3e-2 on 2
    python benchmarks/races/recurrent_routing.py --lrs 0.05 --seeds 0 1 --contenders adamw dash
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _stamp import stamp  # noqa: E402
from common import format_columns, warmup_cosine, write_json  # noqa: E402
from family_models import ByteGRU, english_bytes  # noqa: E402

from lightning_dash import DASH  # noqa: E402

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

CONTENDERS: dict[str, dict[str, Any] | None] = {"adamw": None, "dash": {}, "dash-hidden": {"precondition": "hidden"}}
#: A final validation loss above this is a failed run (AdamW ends near 1.9, an exploded run near 2.6).
FAILED_ABOVE = 2.2
CONTEXT, BATCH, VALIDATION_WINDOWS = 64, 32, 256


def windows(data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    chunks = torch.stack([data[s : s + CONTEXT + 1] for s in starts.tolist()]).long()
    return chunks[:, :-1], chunks[:, 1:]


def run(job: dict[str, Any]) -> dict[str, Any]:
    """One training run; returns its record (final validation loss, train losses every 10 steps)."""
    torch.set_num_threads(1)
    train, validation = english_bytes()
    generator = torch.Generator().manual_seed(1000 + job["seed"])
    starts = torch.randint(0, train.numel() - CONTEXT - 1, (job["steps"], BATCH), generator=generator)
    stride = (validation.numel() - CONTEXT - 1) // VALIDATION_WINDOWS
    val_x, val_y = windows(validation, torch.arange(VALIDATION_WINDOWS) * stride)

    torch.manual_seed(job["seed"])
    model = ByteGRU()
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"], weight_decay=0.01)
    options = CONTENDERS[job["contender"]]
    if options is not None:
        optimizer = DASH.from_optimizer(optimizer, model=model, **options)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(max(1, job["steps"] // 20), job["steps"]))
    loss_fn = nn.CrossEntropyLoss()
    losses, began = [], time.perf_counter()
    for row in starts:
        x, y = windows(train, row)
        loss = loss_fn(model(x).reshape(-1, 256), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    seconds = time.perf_counter() - began
    model.eval()
    with torch.no_grad():
        final = statistics.fmean(
            loss_fn(model(val_x[i : i + 64]).reshape(-1, 256), val_y[i : i + 64].reshape(-1)).item()
            for i in range(0, VALIDATION_WINDOWS, 64)
        )
    every_tenth = [statistics.fmean(losses[i : i + 10]) for i in range(0, len(losses), 10)]
    return {**job, "final_val": final, "failed": not final <= FAILED_ABOVE, "train_every_10": every_tenth, "s": seconds}


def key(job: dict[str, Any]) -> tuple:
    return job["contender"], job["lr"], job["seed"], job["steps"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", nargs="+", type=float, default=[5e-2, 3e-2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--seeds-below", type=int, default=2, help="seeds of every lr but the first")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--records", type=Path, default=RESULTS_DIR / "recurrent_routing_runs_cpu.jsonl")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "recurrent_routing_cpu.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    jobs = [
        {"contender": contender, "lr": lr, "seed": seed, "steps": args.steps}
        for position, lr in enumerate(args.lrs)
        for seed in (args.seeds if position == 0 else args.seeds[: args.seeds_below])
        for contender in args.contenders
    ]
    records = [json.loads(line) for line in args.records.read_text().splitlines()] if args.records.exists() else []
    done = {key(r) for r in records}
    todo = [job for job in jobs if key(job) not in done]
    args.records.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(args.records.open("a"))
        if args.workers == 1:  # in this process (torch's threads set to one by the run)
            finished = map(run, todo)
        else:
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(args.workers))
            finished = pool.imap_unordered(run, todo)
        for record in finished:
            sink.write(json.dumps(record | stamp(torch.device("cpu"))) + "\n")
            sink.flush()
            records.append(record)
    wanted = {key(job) for job in jobs}
    records = [r for r in records if key(r) in wanted]
    rows = []
    for lr in args.lrs:
        for contender in args.contenders:
            runs = [r for r in records if r["lr"] == lr and r["contender"] == contender]
            runs.sort(key=lambda r: r["seed"])
            finals = [r["final_val"] for r in runs]
            rows.append(
                {
                    "lr": lr,
                    "contender": contender,
                    "seeds": [r["seed"] for r in runs],
                    "final_val": finals,
                    "mean": statistics.fmean(finals),
                    "failed": sum(r["failed"] for r in runs),
                }
            )
    header = ["lr", "contender", "final validation loss per seed", "mean", "failed"]
    body = [
        [f"{r['lr']:.0e}", r["contender"], " ".join(f"{v:.3f}" for v in r["final_val"]), f"{r['mean']:.3f}"]
        + [f"{r['failed']}/{len(r['final_val'])}"]
        for r in rows
    ]
    print(format_columns(header, body))
    summary = {"stamp": stamp(torch.device("cpu")), "steps": args.steps, "failed_above": FAILED_ABOVE, "rows": rows}
    write_json(args.out, summary)
    return summary


if __name__ == "__main__":
    main()
