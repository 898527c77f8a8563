"""Bytes and loss of gradient synchronisation: DDP all-reduce versus DeMo, with DASH.

Two gloo processes train the stdlib byte-level TinyGPT (width 64, two layers,
context 64, 16 sequences per rank and step) from the same initialisation and data
for ``--steps`` steps in each mode:

* ``ddp_adamw``: DDP's averaging all-reduce and AdamW;
* ``ddp_dash``: the same all-reduce and DASH with blocks owned across the ranks;
* ``demo_dash``: DDP's all-reduce off, DeMo's top-k DCT components of each rank's
  local momentum exchanged, and DASH (without a momentum of its own) stepping on
  the decoded mean;
* ``demo``: pure DeMo (sign of the decoded mean, ``lightning_dash.DeMo``).

Bytes are those of gradient synchronisation only, per rank and step: a ring
all-reduce sends and receives ``2 (W - 1) / W`` times the float32 gradient; DeMo
sends its indices and bf16 values once and receives every other rank's. The final
loss is the validation loss on held-out stdlib files (rank 0). Results go to
``benchmarks/distributed/results/demo_sync_<device>.json``.

    .venv/bin/python benchmarks/distributed/demo_sync.py [--steps 300] [--topk 32 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from common import build_optimizer, validation_loss, write_json

from lightning_dash import DeMo
from lightning_dash.distributed import ProcessGroupDistributor
from lightning_dash.distributed.demo_synchronizer import DemoSynchronizer
from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit
from lightning_dash.distributed.gradient_sync import CommStats, counting_allreduce_hook, local_gradient_hook
from lightning_dash.showcase import TinyGPT, load_stdlib_corpus

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

WORLD_SIZE = 2
CONTEXT = 64
BATCH_PER_RANK = 16
LEARNING_RATES = {"ddp_adamw": 3e-3, "ddp_dash": 3e-3, "demo_dash": 3e-3, "demo": 1e-3}


def make_optimizer(mode: str, model: TinyGPT, topk: int, momentum: float):
    lr = LEARNING_RATES[mode]
    if mode == "ddp_adamw":
        return build_optimizer("adamw", model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    if mode == "demo":
        return DeMo(model.parameters(), lr=lr, topk=topk, momentum=momentum)
    # With DeMo the error-feedback accumulator is the momentum; DASH adds none on top
    # (as DashStrategy(gradient_sync="demo") does).
    momentum = 0.0 if mode == "demo_dash" else 0.9
    return build_optimizer(
        "dash",
        model.parameters(),
        lr=lr,
        betas=(momentum, 0.95),
        weight_decay=0.01,
        block_size=256,
        precondition_frequency=10,
        distributor=ProcessGroupDistributor(),
    )


def train(rank: int, mode: str, steps: int, topk: int, momentum: float, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    settle_gloo_workers_at_exit()  # no SIGABRT at exit (see its module)
    corpus = load_stdlib_corpus(max_bytes=1_000_000)
    torch.manual_seed(0)
    model = TinyGPT(context=CONTEXT)
    ddp = DistributedDataParallel(model)
    stats = CommStats()
    local = mode in ("demo_dash", "demo")
    ddp.register_comm_hook(stats, local_gradient_hook if local else counting_allreduce_hook)
    optimizer = make_optimizer(mode, model, topk, momentum)
    synchronizer = DemoSynchronizer(topk=topk, momentum=momentum) if mode == "demo_dash" else None
    generator = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        tokens, targets = corpus.batch("train", BATCH_PER_RANK, CONTEXT, generator)
        optimizer.zero_grad()
        logits = ddp(tokens)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if synchronizer is not None:
            synced = synchronizer.synchronize([p.grad for p in params], list(range(len(params))))
            for param, value in zip(params, synced):
                param.grad.copy_(value)
            stats.record(synchronizer.last_bytes_sent, synchronizer.last_bytes_received)
        optimizer.step()
        if mode == "demo":
            stats.record(optimizer.synchronizer.last_bytes_sent, optimizer.synchronizer.last_bytes_received)
        stats.steps += 1
    if rank == 0:
        per_step = stats.as_dict()
        record = {
            "device": "cpu",
            "mode": mode,
            "steps": steps,
            "topk": topk if local else None,
            "demo_momentum": momentum if local else None,
            "final_loss": validation_loss(model, corpus, 32, CONTEXT, 8),
            "bytes_sent_per_step": per_step["bytes_sent_per_step"],
            "bytes_received_per_step": per_step["bytes_received_per_step"],
        }
        Path(out_file).write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def run_mode(mode: str, steps: int, topk: int = 0, momentum: float = 0.999) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        init_file, out_file = f"{scratch}/init", f"{scratch}/result.json"
        mp.spawn(train, args=(mode, steps, topk, momentum, init_file, out_file), nprocs=WORLD_SIZE, join=True)
        return json.loads(Path(out_file).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--topk", type=int, nargs="+", default=[32, 128])
    args = parser.parse_args()
    records = [run_mode("ddp_adamw", args.steps, 0), run_mode("ddp_dash", args.steps, 0)]
    for topk in args.topk:
        records += [run_mode("demo_dash", args.steps, topk), run_mode("demo", args.steps, topk)]
    reference = records[1]
    print(f"{'mode':>10} {'topk':>5} {'final_loss':>10} {'sent B/step':>12} {'recv B/step':>12} {'vs ddp_dash':>11}")
    for record in records:
        ratio = reference["bytes_sent_per_step"] / record["bytes_sent_per_step"]
        topk = "-" if record["topk"] is None else record["topk"]
        print(
            f"{record['mode']:>10} {topk:>5} {record['final_loss']:>10.4f} {record['bytes_sent_per_step']:>12.0f} "
            f"{record['bytes_received_per_step']:>12.0f} {ratio:>10.1f}x"
        )
    print(f"\nwrote {write_json(RESULTS_DIR / 'demo_sync_cpu.json', records)}")


if __name__ == "__main__":
    main()
