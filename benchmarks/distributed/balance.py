"""Load balance of DASH's block ownership on Llama/Qwen3-style dense models.

Each block's cost is :func:`lightning_dash.distributed.block_cost` (flops of one
step with the roots amortized over ``precondition_frequency = 10`` steps). For
every model and world size, the imbalance ``max / mean`` of the per-rank cost is
measured for

* ``block_lpt``: DASH's plan, greedy LPT over blocks (:func:`plan_ownership`),
* ``param_round_robin``: matrix parameter ``i`` on rank ``i % world_size``,
* ``param_greedy``: greedy LPT over whole matrix parameters (a parameter costs
  the sum of its blocks),

next to two lower bounds on any block-level plan, relative to the mean:
``lower_bound = max(largest block, mean) / mean`` and the sharper
``count_bound``, which adds the pigeonhole argument that some rank holds
``k + 1`` of the ``k * world_size + 1`` largest blocks. 1-D parameters (norms)
have no blocks and are left out of all three plans.

Shapes are written from the model configurations (head dim 128; no downloads).
The table is printed and written as a JSON list of records to
``benchmarks/distributed/results/balance.json``. Run from the repository root::

    .venv/bin/python benchmarks/distributed/balance.py
    .venv/bin/python benchmarks/distributed/balance.py --world-sizes 8 16 --block-size 512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _records import record_type, report_records

from lightning_dash.distributed import (
    block_cost,
    block_shapes,
    greedy_parameters,
    plan_ownership,
    round_robin_parameters,
)

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

RESULTS_PATH = RESULTS_DIR / "balance.json"
HEAD_DIM = 128


ModelConfig = record_type(
    "ModelConfig",
    "The dimensions of a dense decoder that fix its parameter shapes (head dim :data:`HEAD_DIM`).",
    """
    layers    int
    hidden    int
    ffn       int
    heads     int
    kv_heads  int
    vocab     int  = 151936
    """,
)

MODELS = {
    "qwen3-1.7b": ModelConfig(layers=28, hidden=2048, ffn=6144, heads=16, kv_heads=8),
    "llama-3-8b": ModelConfig(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
    "qwen3-32b": ModelConfig(layers=64, hidden=5120, ffn=25600, heads=64, kv_heads=8),
}


Record = record_type(
    "Record",
    "One row of the table and of ``balance.json``: the imbalance (max / mean) of each plan and the bounds.",
    """
    model              str
    world_size         int
    blocks             int
    lower_bound        float  {:.3f}
    count_bound        float  {:.3f}
    block_lpt          float  {:.3f}
    param_round_robin  float  {:.3f}
    param_greedy       float  {:.3f}
    """,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 32, 64, 256])
    parser.add_argument("--block-size", type=int, default=1024)
    return parser.parse_args()


def param_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    """Embedding, decoder layers, final norm and LM head, in module order."""
    h, attention, kv = config.hidden, config.heads * HEAD_DIM, config.kv_heads * HEAD_DIM
    layer = [
        (attention, h),
        (kv, h),
        (kv, h),
        (h, attention),
        (config.ffn, h),
        (config.ffn, h),
        (h, config.ffn),
        (h,),
        (h,),
    ]
    return [(config.vocab, h), *layer * config.layers, (h,), (config.vocab, h)]


def parameter_block_costs(shapes: list[tuple[int, ...]], block_size: int) -> list[list[float]]:
    """Block costs of each matrix parameter (1-D parameters are dropped)."""
    return [
        [block_cost(rows, cols) for rows, cols in block_shapes([shape], block_size)]
        for shape in shapes
        if len(shape) >= 2
    ]


def count_bound(costs: list[float], world_size: int) -> float:
    """Lower bound on the makespan over the mean: some rank holds k + 1 of the top k m + 1 blocks."""
    ordered = sorted(costs, reverse=True)
    mean = sum(costs) / world_size
    bound = max(mean, ordered[0])
    for k, index in enumerate(range(world_size, len(ordered), world_size), start=1):
        bound = max(bound, (k + 1) * ordered[index])
    return bound / mean


def measure(model: str, per_param: list[list[float]], world_size: int) -> Record:
    costs = [cost for blocks in per_param for cost in blocks]
    param_costs = [sum(blocks) for blocks in per_param]
    mean = sum(costs) / world_size
    return Record(
        model=model,
        world_size=world_size,
        blocks=len(costs),
        lower_bound=max(max(costs), mean) / mean,
        count_bound=count_bound(costs, world_size),
        block_lpt=plan_ownership(costs, world_size).max_over_mean,
        param_round_robin=round_robin_parameters(param_costs, world_size).max_over_mean,
        param_greedy=greedy_parameters(param_costs, world_size).max_over_mean,
    )


def main() -> None:
    args = parse_args()
    records = []
    for model, config in MODELS.items():
        per_param = parameter_block_costs(param_shapes(config), args.block_size)
        records.extend(measure(model, per_param, world_size) for world_size in args.world_sizes)
    report_records(records, RESULTS_PATH)


if __name__ == "__main__":
    main()
