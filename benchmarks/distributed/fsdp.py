"""DASH on FSDP2 on the CPU: optimizer state and traffic per rank, and step time against AdamW.

For each world size (spawned gloo processes, one thread each) a small GPT (width 190,
5 heads of 38, MLP 760, vocabulary 1003, context 64, 4 layers: 2.1M parameters; most
dims do not divide by 4, so FSDP2 pads its shards) is built twice from the same seed,
``fully_shard`` is applied to every transformer block and then to the root, and one
copy is trained by DASH with :class:`~lightning_dash.distributed.ShardedDistributor`
(``block_size`` 256: 49 blocks), the other by ``torch.optim.AdamW``. The global batch
(8 sequences of random tokens) is split over the ranks.

Measured per rank: ``DASH.state_bytes()`` (max, mean and total over ranks),
``ShardedDistributor.bytes_sent`` per step (max and mean), the AdamW state
(``exp_avg`` and ``exp_avg_sq`` shards) and ``opt.ownership_balance``. The check
``max state <= 1.1 * total / N + largest block's state`` (a block's state: two factors
and two roots, ``2 (rows^2 + cols^2)``, momentum and grafting second moment,
``2 rows cols``, float32) is recorded and printed; so is whether the measured state and
traffic equal the plan :mod:`fsdp_estimate` computes from the shapes alone.

FSDP2's own traffic per step and rank, for comparison, from the parameter shapes (no
mixed precision here: float32 parameters and gradients, 4 bytes each; ring
collectives)::

    (N - 1) * sum_p S_p * (g_p * 4 + 4),   S_p = ceil(rows_p / N) * cols_p

where ``S_p`` is the padded shard of parameter ``p`` and ``g_p`` the number of its
all-gathers per step: 2 (forward and again in backward, ``reshard_after_forward=True``)
for the transformer blocks, 1 for the root module (embeddings, final norm, LM head),
which FSDP2 does not reshard after forward; the last term is the reduce-scatter of the
gradients. The same quantity is also counted from the inputs of FSDP2's collectives
in one step (``fsdp_counted_bytes_per_step``).

Step time is that of one training step (forward, backward, optimizer), the slowest
rank's, after a barrier. The two contenders alternate in rounds of ``--steps-per-round``
steps (default: ``precondition_frequency``, so that each round of DASH holds one root
refresh), the order flipping every round, after ``--warmup`` untimed steps each.
``step_ms`` is the median over the timed steps (root refreshes are rare, so it is
close to a step without one), ``amortized_ms`` the median over rounds of each round's
mean, ``opt_ms`` the median time of ``optimizer.step()`` alone. With more ranks than
cores the processes share cores, and the times include that.

Results go to ``benchmarks/distributed/results/fsdp_cpu.json``. Run from the repository root::

    .venv/bin/python benchmarks/distributed/fsdp.py
    .venv/bin/python benchmarks/distributed/fsdp.py --world-sizes 2 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _records import Quantities, column_cells, record_type
from _state_bytes import BLOCK_SCALAR_BYTES
from common import format_columns, write_json
from fsdp_estimate import fsdp_bytes_per_step, meta_parameters, sharded_plan

from lightning_dash import DASH
from lightning_dash.distributed import ShardedDistributor
from lightning_dash.distributed.gloo_exit import settle_gloo_workers_at_exit

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

RESULTS_PATH = RESULTS_DIR / "fsdp_cpu.json"
BOUND_SLACK = 1.1
FSDP_FORMULA = (
    "(N - 1) * sum_p ceil(rows_p / N) * cols_p * (g_p * 4 + 4): float32 parameters all-gathered g_p times "
    "(2 for the transformer blocks: forward and backward; 1 for the root module, which FSDP2 does not reshard "
    "after forward), float32 gradients reduce-scattered once; ring collectives"
)


Settings = record_type(
    "Settings",
    "The model's dimensions, the batch, DASH's and AdamW's options and the timing rounds.",
    """
    width                   int    = 190
    heads                   int    = 5
    ffn                     int    = 760
    vocab                   int    = 1003
    context                 int    = 64
    layers                  int    = 4
    batch                   int    = 8
    block_size              int    = 256
    lr                      float  = 1e-3
    weight_decay            float  = 0.01
    precondition_frequency  int    = 10
    warmup                  int    = 3
    rounds                  int    = 6
    steps_per_round         int    = 10
    """,
)


# ---------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm causal self-attention and GELU MLP."""

    def __init__(self, s: Settings) -> None:
        super().__init__()
        self.heads = s.heads
        self.ln1 = nn.LayerNorm(s.width)
        self.qkv = nn.Linear(s.width, 3 * s.width)
        self.proj = nn.Linear(s.width, s.width)
        self.ln2 = nn.LayerNorm(s.width)
        self.fc = nn.Linear(s.width, s.ffn)
        self.out = nn.Linear(s.ffn, s.width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, s: Settings) -> None:
        super().__init__()
        self.token = nn.Embedding(s.vocab, s.width)
        self.position = nn.Parameter(0.02 * torch.randn(s.context, s.width))
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.token(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sharded_gpt(s: Settings) -> GPT:
    torch.manual_seed(0)
    model = GPT(s)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def parameter_layout(s: Settings) -> tuple[list[tuple[int, ...]], list[bool]]:
    """Shapes in ``model.parameters()`` order, and which belong to the root FSDP module."""
    with torch.device("meta"):
        model = GPT(s)
    named = list(model.named_parameters())
    return [tuple(p.shape) for _, p in named], [not name.startswith("blocks.") for name, _ in named]


# ---------------------------------------------------------------------- one process
class CollectiveCounter:
    """Bytes this rank sends in FSDP2's all-gathers and reduce-scatters (ring algorithms),
    counted from the collectives' inputs while active."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.bytes = 0
        self._depth = 0
        self._saved: dict[str, Callable] = {}

    def _wrap(self, name: str, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                tensor = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
                size = tensor.numel() * tensor.element_size()
                # all-gather: the shard goes to N - 1 ranks; reduce-scatter: (N - 1) / N of the input leaves.
                sent = size * (self.world_size - 1)
                self.bytes += sent if name.startswith("all_gather") else sent // self.world_size
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> CollectiveCounter:
        for name in self.NAMES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def local_bytes(tensor: Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def train_step(model: GPT, optimizer: torch.optim.Optimizer, tokens: Tensor, targets: Tensor) -> tuple[float, float]:
    """One step after a barrier: (seconds of the whole step, seconds of ``optimizer.step()``)."""
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    middle = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    return end - start, end - middle


def worker(rank: int, world_size: int, s: Settings, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(minutes=10)
    )
    settle_gloo_workers_at_exit()  # no SIGABRT at exit (see its module)
    try:
        generator = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(4):
            tokens = torch.randint(s.vocab, (s.batch, s.context + 1), generator=generator)
            batches.append((tokens[:, :-1].chunk(world_size)[rank], tokens[:, 1:].chunk(world_size)[rank]))
        models = {"adamw": sharded_gpt(s), "dash": sharded_gpt(s)}
        optimizers = {
            "adamw": torch.optim.AdamW(
                models["adamw"].parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay
            ),
            "dash": DASH(
                models["dash"].parameters(),
                distributor=ShardedDistributor(),
                lr=s.lr,
                weight_decay=s.weight_decay,
                block_size=s.block_size,
                precondition_frequency=s.precondition_frequency,
            ),
        }
        counter = CollectiveCounter(world_size)
        taken = 0
        for step in range(s.warmup):
            for name in ("adamw", "dash"):
                if name == "adamw" and step == 0:
                    with counter:
                        train_step(models[name], optimizers[name], *batches[0])
                else:
                    train_step(models[name], optimizers[name], *batches[step % len(batches)])
        dash = optimizers["dash"]
        sent_before = dash.distributor.bytes_sent
        times: dict[str, list[list[float]]] = {"adamw": [], "dash": []}
        opt_times: dict[str, list[float]] = {"adamw": [], "dash": []}
        for round_ in range(s.rounds):
            for name in ("adamw", "dash") if round_ % 2 == 0 else ("dash", "adamw"):
                times[name].append([])
                for step in range(s.steps_per_round):
                    total, opt = train_step(models[name], optimizers[name], *batches[step % len(batches)])
                    times[name][-1].append(total)
                    opt_times[name].append(opt)
                if name == "dash":
                    taken += s.steps_per_round
        adamw_state = sum(
            local_bytes(value)
            for entry in optimizers["adamw"].state.values()
            for key, value in entry.items()
            if key in ("exp_avg", "exp_avg_sq")
        )
        mine = {
            "rank": rank,
            "dash_state_bytes": dash.state_bytes(),
            "owned_blocks": dash.owned_blocks,
            "adamw_state_bytes": adamw_state,
            "dash_bytes_sent_per_step": (dash.distributor.bytes_sent - sent_before) / max(taken, 1),
            "elements_per_step": dash.distributor.elements_per_step,
            "ownership_balance": dash.ownership_balance,
            "fsdp_counted_bytes_per_step": counter.bytes,
            "times": times,
            "opt_times": opt_times,
            "nonfinite_skips": dash.nonfinite_grad_skips + dash.nonfinite_update_skips,
        }
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            Path(out_file).write_text(json.dumps(gathered))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- driver
def run(world_size: int, s: Settings) -> list[dict]:
    """Every rank's measurements from one spawned run of ``world_size`` processes."""
    with tempfile.TemporaryDirectory() as scratch:
        init_file, out_file = f"{scratch}/init", f"{scratch}/ranks.json"
        mp.spawn(worker, args=(world_size, s, init_file, out_file), nprocs=world_size, join=True)
        return json.loads(Path(out_file).read_text())


def slowest(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """Per round and step, the slowest rank's time."""
    return [[max(values) for values in zip(*rounds)] for rounds in zip(*per_rank)]


def summarize(world_size: int, s: Settings, ranks: list[dict], wall_s: float) -> dict:
    shapes, root = parameter_layout(s)
    plan = sharded_plan(meta_parameters(shapes, torch.float32), world_size, s.block_size, s.precondition_frequency)
    state = [r["dash_state_bytes"] for r in ranks]
    sent = [r["dash_bytes_sent_per_step"] for r in ranks]
    adamw = [r["adamw_state_bytes"] for r in ranks]
    total = sum(state)
    bound = BOUND_SLACK * total / world_size + plan.largest_block_state_bytes
    timing = {}
    for name in ("adamw", "dash"):
        rounds = slowest([r["times"][name] for r in ranks])
        timing[name] = {
            "step_ms": 1e3 * statistics.median([t for round_ in rounds for t in round_]),
            "amortized_ms": 1e3 * statistics.median([statistics.fmean(round_) for round_ in rounds]),
            "opt_ms": 1e3 * statistics.median([max(v) for v in zip(*[r["opt_times"][name] for r in ranks])]),
        }
    planned_state = [b + BLOCK_SCALAR_BYTES * n for b, n in zip(plan.state_bytes, plan.owned_blocks)]
    return {
        "world_size": world_size,
        "parameters": sum(math.prod(shape) for shape in shapes),
        "blocks": plan.blocks,
        "block_size": s.block_size,
        "ownership_balance": ranks[0]["ownership_balance"],
        "dash_state_bytes": state,
        "dash_state_bytes_max": max(state),
        "dash_state_bytes_mean": total / world_size,
        "dash_state_bytes_total": total,
        "largest_block_state_bytes": plan.largest_block_state_bytes,
        "state_bound_bytes": bound,
        "state_bound_holds": max(state) <= bound,
        "adamw_state_bytes_max": max(adamw),
        "adamw_state_bytes_mean": sum(adamw) / world_size,
        "dash_bytes_sent_per_step": sent,
        "dash_bytes_sent_per_step_max": max(sent),
        "dash_bytes_sent_per_step_mean": sum(sent) / world_size,
        "fsdp_bytes_per_step": fsdp_bytes_per_step(shapes, world_size, 4, 4, gathered_once=root),
        "fsdp_counted_bytes_per_step": max(r["fsdp_counted_bytes_per_step"] for r in ranks),
        "matches_plan": state == planned_state and [r["elements_per_step"] for r in ranks] == plan.elements_sent,
        "adamw_step_ms": timing["adamw"]["step_ms"],
        "dash_step_ms": timing["dash"]["step_ms"],
        "step_ratio": timing["dash"]["step_ms"] / timing["adamw"]["step_ms"],
        "adamw_amortized_ms": timing["adamw"]["amortized_ms"],
        "dash_amortized_ms": timing["dash"]["amortized_ms"],
        "amortized_ratio": timing["dash"]["amortized_ms"] / timing["adamw"]["amortized_ms"],
        "adamw_opt_ms": timing["adamw"]["opt_ms"],
        "dash_opt_ms": timing["dash"]["opt_ms"],
        "timed_steps": s.rounds * s.steps_per_round,
        "nonfinite_skips": sum(r["nonfinite_skips"] for r in ranks),
        "wall_s": wall_s,
    }


#: The printed table: header, then the template of its cells (see :func:`_records.column_cells`).
TABLE = """
    ranks                        {world_size}
    balance                      {ownership_balance:.3f}
    state max/mean/total KiB     {state}
    bound KiB                    {state_bound_bytes/KiB:.0f}
    holds                        {holds}
    AdamW state KiB              {adamw_state_bytes_max/KiB:.0f}
    DASH sent max/mean KiB/step  {dash_bytes_sent_per_step_max/KiB:.0f} / {dash_bytes_sent_per_step_mean/KiB:.0f}
    FSDP2 KiB/step (counted)     {fsdp_bytes_per_step/KiB:.0f} ({fsdp_counted_bytes_per_step/KiB:.0f})
    AdamW ms                     {adamw_step_ms:.1f}
    DASH ms                      {dash_step_ms:.1f}
    ratio                        {step_ratio:.2f}
    amortized ratio              {amortized_ratio:.2f}
    opt ms AdamW/DASH            {adamw_opt_ms:.1f} / {dash_opt_ms:.1f}
"""


def format_table(records: list[dict]) -> str:
    state = "{dash_state_bytes_max/KiB:.0f} / {dash_state_bytes_mean/KiB:.0f} / {dash_state_bytes_total/KiB:.0f}"
    rows = [
        {**r, "state": state.format_map(Quantities(r)), "holds": "yes" if r["state_bound_holds"] else "NO"}
        for r in records
    ]
    return format_columns(*column_cells(TABLE, rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    default = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--warmup", type=int, default=default.warmup)
    parser.add_argument("--rounds", type=int, default=default.rounds)
    parser.add_argument("--steps-per-round", type=int, default=None, help="default: precondition_frequency")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and one short round (for the tests)")
    return parser.parse_args(argv)


SMOKE = Settings(width=18, heads=2, ffn=38, vocab=37, context=8, layers=1, batch=4, block_size=8, warmup=1)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    base = SMOKE if args.smoke else Settings()
    s = Settings(
        **{
            **asdict(base),
            "warmup": args.warmup,
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round or base.precondition_frequency,
        }
    )
    records = []
    for world_size in args.world_sizes:
        start = time.perf_counter()
        ranks = run(world_size, s)
        records.append(summarize(world_size, s, ranks, time.perf_counter() - start))
        print(f"{world_size} rank(s): {records[-1]['wall_s']:.0f} s", flush=True)
    print(format_table(records))
    for r in records:
        verdict = "holds" if r["state_bound_holds"] else "DOES NOT hold"
        print(
            f"{r['world_size']} rank(s): max state {r['dash_state_bytes_max']} <= {BOUND_SLACK} * total / N + "
            f"largest block {r['largest_block_state_bytes']} = {r['state_bound_bytes']:.0f}: {verdict}; "
            f"state and traffic as planned from shapes: {r['matches_plan']}"
        )
    report = {
        "device": "cpu",
        "backend": "gloo",
        "threads_per_process": 1,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "settings": asdict(s),
        "fsdp_formula": FSDP_FORMULA,
        "state_bound": f"max state <= {BOUND_SLACK} * total / N + largest block's state "
        "(4 * (2 (rows^2 + cols^2) + 2 rows cols) bytes)",
        "records": records,
    }
    print(f"\nwrote {write_json(args.out, report)}")
    return report


if __name__ == "__main__":
    main()
