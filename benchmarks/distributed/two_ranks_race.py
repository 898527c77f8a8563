"""Two ranks against one, on quality: ``Trainer(strategy="dash")`` on the race's model with one process and with
two gloo ranks.

The two ranks average two half-batch gradients where one process takes the whole batch's: the same sum in
another order, a change of about 1e-7 of every gradient, which training then carries on. What a user needs
is that two ranks end where one process ends as far as training allows. Each run is the race's
byte-level TinyGPT (``benchmarks/races/peers.py``: width ``--width``, depth 2, context 128, 32 windows per
step in all, 200 steps, AdamW's recipe at the race's tuned lr with warm-up and cosine), as the main job's
``GPTModule`` and ``StdlibBytes`` build it (two ranks: 16 windows each, the same 32 windows per step),
converted by ``strategy="dash"`` at DASH's defaults; the final validation loss is on the race's 256
held-out windows. Every run is its own process (two ranks: Lightning's launcher starts the second).

The record (``--out``, default ``results/two_ranks_race_cpu.json``): each run's final validation loss, and
per world size the mean and standard deviation over the seeds; ``difference`` is the two means'
difference and ``within_one_std`` whether it is within the larger of the two standard deviations.

    .venv/bin/python benchmarks/distributed/two_ranks_race.py                 # 3 seeds, about 12 minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules

import torch  # noqa: E402
from _stamp import stamp  # noqa: E402
from common import write_json  # noqa: E402

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: The race's AdamW lr at each width (``benchmarks/races/results/peers_cpu.json``).
RACE_LR = {128: 6e-3, 256: 3e-3}
STEPS, CONTEXT, GLOBAL_BATCH, VAL_WINDOWS, MAX_BYTES = 200, 128, 32, 256, 4_000_000


def train(world_size: int, seed: int, width: int, out: Path) -> None:
    """One run (this process is rank 0, or the only one); rank 0 writes the final validation loss to ``out``."""
    import lightning.pytorch as pl

    import lightning_dash  # noqa: F401  (registers strategy="dash")
    from lightning_dash.showcase.lightning_gpt import GPTModule, StdlibBytes
    from lightning_dash.showcase.quiet import quiet_third_party_output

    quiet_third_party_output()
    torch.set_num_threads(1)
    module = GPTModule(context=CONTEXT, width=width, depth=2, heads=4, lr=RACE_LR[width], seed=seed)
    data = StdlibBytes(CONTEXT, GLOBAL_BATCH // world_size, STEPS, VAL_WINDOWS, MAX_BYTES, seed=seed)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="dash",
        max_steps=STEPS,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    if trainer.global_rank == 0:
        loss = float(trainer.callback_metrics["val_loss"])
        out.write_text(json.dumps({"world_size": world_size, "seed": seed, "final_val_loss": loss}))


def summarise(runs: list[dict]) -> dict:
    """Per world size the mean and standard deviation of the final losses, and whether the means differ by
    no more than the larger standard deviation."""
    by_world = {}
    for world in sorted({r["world_size"] for r in runs}):
        losses = [r["final_val_loss"] for r in runs if r["world_size"] == world]
        by_world[world] = {"mean": statistics.fmean(losses), "std": statistics.stdev(losses) if len(losses) > 1 else 0}
    one, two = by_world.get(1), by_world.get(2)
    summary: dict = {"by_world_size": by_world}
    if one and two:
        summary["difference"] = two["mean"] - one["mean"]
        summary["within_one_std"] = abs(summary["difference"]) <= max(one["std"], two["std"])
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--width", type=int, choices=sorted(RACE_LR), default=128)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "two_ranks_race_cpu.json")
    parser.add_argument("--run", nargs=3, metavar=("WORLD", "SEED", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.run:
        world, seed, out = args.run
        train(int(world), int(seed), args.width, Path(out))
        return {}
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for world in (1, 2):
                out = Path(scratch) / f"w{world}_s{seed}.json"
                command = [sys.executable, str(Path(__file__).resolve()), "--width", str(args.width)]
                subprocess.run([*command, "--run", str(world), str(seed), str(out)], check=True)
                runs.append(json.loads(out.read_text()))
                print(f"world size {world}, seed {seed}: final val loss {runs[-1]['final_val_loss']:.4f}", flush=True)
    report = {**stamp(torch.device("cpu")), "width": args.width, "lr": RACE_LR[args.width], "steps": STEPS}
    report["runs"] = runs
    report.update(summarise(runs))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
