"""Paper estimate of DASH on FSDP2 for Qwen3-8B: optimizer state and traffic per rank, from shapes alone.

No processes and no real tensors: the parameters are ``meta`` tensors of Qwen3-8B's
shapes (from its ``config.json``: hidden 4096, intermediate 12288, 36 layers, 32
query and 8 key/value heads of dim 128, vocabulary 151936, untied embeddings), in
the order ``model.parameters()`` lists them. :func:`sharded_plan` builds exactly the
plan :class:`~lightning_dash.distributed.ShardedDistributor` builds at its first step
(``matrix_regions`` -> ``block_cost`` -> ``holder_preferences`` -> ``lpt_assign`` ->
``plan_rank``, the distributor's own planning functions), for every rank, and
counts from it, per rank:

* DASH state bytes (float32 statistics): for each owned ``rows x cols`` block, left and
  right factor and their roots, each side's pair packed as one square and a row,
  ``rows (rows + 1) + cols (cols + 1)``, plus momentum and the grafting
  second moment, ``2 rows cols``; plus momentum and second moment of the rank's row shard
  of every 1-D parameter. (``DASH.state_bytes()`` also counts 13 bytes of per-block
  scalars: root validity, failure count and factor scale.)
* DASH bytes sent per step: the gradient rows this rank holds of other ranks' blocks
  plus the update rows of its own blocks that other ranks hold, float32 both ways
  (``PieceExchange.elements_sent() * 4``).
* AdamW state bytes: two float32 buffers over the rank's row shard of every parameter
  (``8 P / N`` on average).
* FSDP2's own bytes sent per step and rank, assuming bf16 parameters all-gathered twice
  (forward, and again in backward: ``reshard_after_forward=True``) and float32 gradients
  reduce-scattered, with bandwidth-optimal (ring) collectives:
  ``(N - 1) * S * (2 * 2 + 4)`` where ``S = sum_p ceil(rows_p / N) * cols_p`` is one
  rank's padded shard. FSDP2 does not reshard its root module after forward, so if the
  embeddings, final norm and LM head stay in the root they are gathered only once:
  ``fsdp_root_once_bytes_per_step`` is that variant.

Results go to ``benchmarks/distributed/results/fsdp_qwen3_8b_estimate.json``. With ``--meshes``
(data-parallel x tensor-parallel sizes) it plans tensor parallelism instead, for Qwen3-8B
and a 70B-class model (Llama-3-70B's widths in Qwen3's layout), with
:mod:`_tensor_parallel_plan`, into ``fsdp_tensor_parallel_estimate.json``. Run from the
repository root::

    .venv/bin/python benchmarks/distributed/fsdp_estimate.py
    .venv/bin/python benchmarks/distributed/fsdp_estimate.py --world-sizes 64 --block-size 512
    .venv/bin/python benchmarks/distributed/fsdp_estimate.py --meshes 32x8 128x8
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _records import column_cells, record_type
from _state_bytes import FLOAT32, block_state_bytes
from _tensor_parallel_plan import tensor_parallel_plan
from common import format_columns, write_json

from lightning_dash.distributed.assignment import block_cost, imbalance, lpt_assign
from lightning_dash.distributed.holdings import row_range
from lightning_dash.distributed.piece_exchange import (
    exchange_for,
    holder_preferences,
    plan_pieces,
    plan_rank,
    row_holdings,
)
from lightning_dash.optim.config import DashConfig
from lightning_dash.optim.stacks.blocks import MatrixView
from lightning_dash.optim.stacks.layout import matrix_regions

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

RESULTS_PATH = RESULTS_DIR / "fsdp_qwen3_8b_estimate.json"
TENSOR_PARALLEL_PATH = RESULTS_DIR / "fsdp_tensor_parallel_estimate.json"
FSDP_ASSUMPTION = (
    "bf16 parameters all-gathered in forward and again in backward, float32 gradients reduce-scattered; "
    "ring collectives: each rank sends (N - 1) * S elements per collective, S = sum_p ceil(rows_p / N) * "
    "cols_p its padded shard; bytes = (N - 1) * S * (2 + 2 + 4)"
)


Qwen3Config = record_type(
    "Qwen3Config",
    "The fields of a Qwen3 ``config.json`` that fix the parameter shapes.",
    """
    hidden_size          int   = 4096
    intermediate_size    int   = 12288
    num_hidden_layers    int   = 36
    num_attention_heads  int   = 32
    num_key_value_heads  int   = 8
    head_dim             int   = 128
    vocab_size           int   = 151936
    tie_word_embeddings  bool  = False
    """,
)
QWEN3_8B = Qwen3Config()
#: A 70B-class shape list: Llama-3-70B's widths (hidden 8192, MLP 28672, 80 layers, 64 query
#: and 8 key/value heads, vocabulary 128256) in Qwen3's layout (with its q/k norms).
CLASS_70B = Qwen3Config(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
)


def qwen3_parameters(config: Qwen3Config = QWEN3_8B) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes in ``model.parameters()`` order (Linear weights are ``(out, in)``)."""
    h, ffn, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    out = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        out += [
            (prefix + "self_attn.q_proj.weight", (q, h)),
            (prefix + "self_attn.k_proj.weight", (kv, h)),
            (prefix + "self_attn.v_proj.weight", (kv, h)),
            (prefix + "self_attn.o_proj.weight", (h, q)),
            (prefix + "self_attn.q_norm.weight", (d,)),
            (prefix + "self_attn.k_norm.weight", (d,)),
            (prefix + "mlp.gate_proj.weight", (ffn, h)),
            (prefix + "mlp.up_proj.weight", (ffn, h)),
            (prefix + "mlp.down_proj.weight", (h, ffn)),
            (prefix + "input_layernorm.weight", (h,)),
            (prefix + "post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        out.append(("lm_head.weight", (config.vocab_size, h)))
    return out


def meta_parameters(shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Stand-ins with the shapes and dtype of the parameters and no storage."""
    return [torch.empty(tuple(shape), dtype=dtype, device="meta") for shape in shapes]


def local_rows(rows: int, world_size: int, rank: int) -> int:
    start, end = row_range(rows, world_size, rank)
    return end - start


def padded_shard(shapes: Sequence[Sequence[int]], world_size: int) -> int:
    """Elements of one rank's FSDP2 shard of every parameter, dim 0 padded to a multiple of N."""
    return sum(-(-shape[0] // world_size) * math.prod(shape[1:]) for shape in shapes)


def fsdp_bytes_per_step(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    param_bytes: int,
    grad_bytes: int,
    gathered_once: Sequence[bool] | None = None,
) -> int:
    """Bytes one rank sends per step in FSDP2's collectives (ring algorithms).

    Each parameter's padded shard ``S_p`` goes to ``N - 1`` ranks in every all-gather
    (twice per step, forward and backward, or once when ``gathered_once[p]``: the root
    module, which FSDP2 does not reshard after forward) and ``(N - 1) S_p`` gradient
    elements leave each rank in the reduce-scatter.
    """
    once = gathered_once or [False] * len(shapes)
    total = 0
    for shape, single in zip(shapes, once):
        shard = padded_shard([shape], world_size)
        total += (world_size - 1) * shard * ((1 if single else 2) * param_bytes + grad_bytes)
    return total


@dataclass
class ShardedPlan:
    """Per-rank numbers of :class:`~lightning_dash.distributed.ShardedDistributor`'s plan."""

    world_size: int
    blocks: int
    pieces: int
    balance: float
    owned_blocks: list[int]
    state_bytes: list[int]
    elements_sent: list[int]
    largest_block_state_bytes: int
    #: Seconds for everything a single rank computes at its first step (owners, every
    #: rank's stacks, the pieces it sends or receives, its exchange and its row runs), and for every piece
    #: and the other ranks' exchanges.
    rank_setup_s: float
    all_exchanges_s: float
    #: Of all gradient elements of the blocks, the share held by a rank other than the block's owner.
    moved_fraction: float
    #: Bytes rank 0 keeps to move its pieces: the start and length of every row run, both sides.
    exchange_index_bytes: int


def sharded_plan(
    params: list[torch.Tensor],
    world_size: int,
    block_size: int,
    precondition_frequency: int = 10,
    root_iterations: int = 10,
    prefer_holders: bool = True,
) -> ShardedPlan:
    """The plan of ``ShardedDistributor.plan_stacks`` for every rank, from parameter stand-ins.

    One parameter group with one ``precondition_frequency``; blocks are owned from
    scratch (a distributor that has not planned before). ``prefer_holders=False`` gives
    the plan of plain LPT (version 0.5's), which ignored where the rows were.
    """
    start = time.perf_counter()
    views = [MatrixView.of(p.shape) if p.dim() >= 2 and p.numel() > 0 else None for p in params]
    regions = matrix_regions(views, block_size)
    tiles = [tile for region in regions for tile in region.single_tiles()]
    costs = [block_cost(*tile.block_shape, precondition_frequency, root_iterations) for tile in tiles]
    holdings = row_holdings(regions, params, world_size)
    preferred = holder_preferences(regions, holdings) if prefer_holders else None
    owners = lpt_assign(costs, world_size, preferred=preferred)
    rank_plans, first = plan_rank(regions, params, owners, holdings, rank=0)
    exchanges = [first]
    runs = [first.gradient_send_runs(), first.gradient_receive_runs(rank_plans[0])]
    setup = time.perf_counter() - start
    start = time.perf_counter()
    pieces, updates = plan_pieces(rank_plans, holdings)
    exchanges += [exchange_for(pieces, updates, rank, holdings) for rank in range(1, world_size)]
    others = time.perf_counter() - start
    loads = [0.0] * world_size
    for owner, cost in zip(owners, costs):
        loads[owner] += cost
    vectors = [param.shape[0] for param in params if param.dim() == 1]
    state, owned = [], []
    for rank, plans in enumerate(rank_plans):
        blocks = sum(block_state_bytes(*plan.block_shape) * plan.num_blocks for plan in plans)
        elementwise = sum(2 * FLOAT32 * local_rows(rows, world_size, rank) for rows in vectors)
        state.append(blocks + elementwise)
        owned.append(sum(plan.num_blocks for plan in plans))
    return ShardedPlan(
        world_size=world_size,
        blocks=len(tiles),
        pieces=len(pieces),
        balance=imbalance(loads),
        owned_blocks=owned,
        state_bytes=state,
        elements_sent=[exchange.elements_sent() for exchange in exchanges],
        largest_block_state_bytes=max(block_state_bytes(*tile.block_shape) for tile in tiles),
        rank_setup_s=setup,
        all_exchanges_s=others,
        moved_fraction=sum(p.numel for p in pieces if p.holder != p.owner) / sum(p.numel for p in pieces),
        exchange_index_bytes=sum(r.offsets.nbytes + r.jumps.nbytes for r in runs),
    )


def adamw_state_bytes(shapes: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """Two float32 buffers over each rank's row shard of every parameter."""
    return [
        sum(2 * FLOAT32 * local_rows(shape[0], world_size, rank) * math.prod(shape[1:]) for shape in shapes)
        for rank in range(world_size)
    ]


def estimate(config: Qwen3Config, world_size: int, block_size: int) -> dict:
    named = qwen3_parameters(config)
    shapes = [shape for _, shape in named]
    root = [not name.startswith("model.layers.") for name, _ in named]
    plan = sharded_plan(meta_parameters(shapes), world_size, block_size)
    plain = sharded_plan(meta_parameters(shapes), world_size, block_size, prefer_holders=False)
    sent = [FLOAT32 * elements for elements in plan.elements_sent]
    adamw = adamw_state_bytes(shapes, world_size)
    return {
        "world_size": world_size,
        "block_size": block_size,
        "parameters": sum(math.prod(shape) for shape in shapes),
        "blocks": plan.blocks,
        "pieces": plan.pieces,
        "ownership_balance": plan.balance,
        "ownership_balance_plain_lpt": plain.balance,
        "moved_fraction": plan.moved_fraction,
        "moved_fraction_plain_lpt": plain.moved_fraction,
        "owned_blocks_max": max(plan.owned_blocks),
        "owned_blocks_min": min(plan.owned_blocks),
        "dash_state_bytes_max": max(plan.state_bytes),
        "dash_state_bytes_mean": sum(plan.state_bytes) / world_size,
        "dash_state_bytes_total": sum(plan.state_bytes),
        "largest_block_state_bytes": plan.largest_block_state_bytes,
        "adamw_state_bytes_max": max(adamw),
        "adamw_state_bytes_mean": sum(adamw) / world_size,
        "dash_bytes_sent_per_step_max": max(sent),
        "dash_bytes_sent_per_step_mean": sum(sent) / world_size,
        "fsdp_bytes_per_step": fsdp_bytes_per_step(shapes, world_size, param_bytes=2, grad_bytes=4),
        "fsdp_root_once_bytes_per_step": fsdp_bytes_per_step(shapes, world_size, 2, 4, gathered_once=root),
        "rank_setup_s": plan.rank_setup_s,
        "all_exchanges_s": plan.all_exchanges_s,
        "exchange_index_bytes_rank0": plan.exchange_index_bytes,
    }


#: The printed table: header, then the template of its cells (see :func:`_records.column_cells`).
TABLE = """
    ranks                        {world_size}
    blocks                       {blocks}
    pieces                       {pieces}
    balance                      {ownership_balance:.3f}
    DASH state max/mean GiB      {dash_state_bytes_max/GiB:.3f} / {dash_state_bytes_mean/GiB:.3f}
    AdamW state GiB              {adamw_state_bytes_mean/GiB:.3f}
    DASH sent max/mean GiB/step  {dash_bytes_sent_per_step_max/GiB:.3f} / {dash_bytes_sent_per_step_mean/GiB:.3f}
    FSDP2 sent GiB/step          {fsdp_bytes_per_step/GiB:.3f}
    DASH/FSDP2 sent              {dash_bytes_sent_per_step_mean/fsdp_bytes_per_step:.2%}
    setup s                      {rank_setup_s:.2f}
    index MiB                    {exchange_index_bytes_rank0/MiB:.1f}
    rows moved (plain LPT)       {moved_fraction:.1%} ({moved_fraction_plain_lpt:.1%})
"""


def format_table(records: list[dict]) -> str:
    return format_columns(*column_cells(TABLE, records))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--block-size", type=int, default=DashConfig().block_size)
    parser.add_argument("--meshes", nargs="+", help="data-parallel x tensor-parallel sizes, e.g. 32x8")
    parser.add_argument(
        "--micro-group-mib",
        type=float,
        default=512.0,
        help="with --meshes: the micro-group budget whose peak gathered bytes are reported (default 512)",
    )
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


TENSOR_PARALLEL_TABLE = """
    model                        {model}
    mesh (DP x TP)               {data_parallel}x{tensor_parallel}
    blocks                       {blocks}
    balance                      {ownership_balance:.3f}
    DASH state max/mean GiB      {dash_state_bytes_max/GiB:.3f} / {dash_state_bytes_mean/GiB:.3f}
    AdamW state max GiB          {adamw_state_bytes_max/GiB:.3f}
    gathered grads max GiB       {gathered_bytes_max/GiB:.3f}
    micro-groups (budget MiB)    {micro_groups} ({micro_group_mib})
    peak gathered max GiB        {peak_gathered_bytes_max/GiB:.3f}
    DASH sent max/mean GiB/step  {dash_bytes_sent_per_step_max/GiB:.3f} / {dash_bytes_sent_per_step_mean/GiB:.3f}
    FSDP2 sent GiB/step          {fsdp_bytes_per_step/GiB:.3f}
    plan s                       {plan_s:.1f}
"""


def tensor_parallel_main(args: argparse.Namespace) -> dict:
    records = []
    for model, config in (("Qwen3-8B", QWEN3_8B), ("70B-class", CLASS_70B)):
        for mesh in args.meshes:
            dp, tp = (int(size) for size in mesh.lower().split("x"))
            record = tensor_parallel_plan(qwen3_parameters(config), dp, tp, args.block_size, args.micro_group_mib)
            records.append({"model": model, **record})
            print(format_columns(*column_cells(TENSOR_PARALLEL_TABLE, records[-1:])), flush=True)
    report = {
        "styles": "column-parallel q/k/v/gate/up, embedding and head (rows over TP, then DP); row-parallel o/down "
        "(rows over DP, columns over TP); norms replicated over TP, rows over DP",
        "dash_state": "per block 4 * (rows (rows + 1) + cols (cols + 1) + 2 rows cols) bytes, plus 8 bytes per element "
        "of 1-D shards",
        "gathered": "gradient elements of the blocks a rank owns, float32: what its exchange receives at once",
        "peak_gathered": "the most bytes of whole blocks (float32 gradients and updates) a rank holds at once when "
        "its blocks travel in micro-groups of micro_group_mib, the next micro-group's gradients included",
        "fsdp_assumption": "FSDP2 over the DP ranks of each TP index; " + FSDP_ASSUMPTION,
        "records": records,
    }
    print(f"\nwrote {write_json(args.out or TENSOR_PARALLEL_PATH, report)}")
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.meshes:
        return tensor_parallel_main(args)
    records = []
    for world_size in args.world_sizes:
        start = time.perf_counter()
        record = estimate(QWEN3_8B, world_size, args.block_size)
        record["wall_s"] = time.perf_counter() - start
        records.append(record)
    print(format_table(records))
    report = {
        "model": "Qwen3-8B",
        "config": asdict(QWEN3_8B),
        "dtypes": "bf16 parameters, float32 gradients and optimizer state",
        "dash_state": "per block 4 * (rows (rows + 1) + cols (cols + 1) + 2 rows cols) bytes, plus 8 bytes per element "
        "of 1-D shards",
        "dash_traffic": "gradient rows to block owners and update rows back, float32 (PieceExchange.elements_sent * 4)",
        "adamw_state": "2 float32 buffers per element of the rank's row shard",
        "fsdp_assumption": FSDP_ASSUMPTION,
        "records": records,
    }
    print(f"\nwrote {write_json(args.out or RESULTS_PATH, report)}")
    return report


if __name__ == "__main__":
    main()
