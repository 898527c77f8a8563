"""The shape of one optimizer step on a device: host synchronisations and kernel launches.

Exact counts, not timings (:mod:`lightning_dash.testing.op_counts` watches the ATen calls
and host reads of one ``step()``), so the numbers hold on any machine and predict how a
step behaves on a GPU: a host synchronisation stalls the launch queue, and launches
that grow with the number of layers make the host the bottleneck of a deep model.

GPT-2-style parameter shapes of width 64 (fused QKV, 4x MLP, biases, LayerNorms), 6 and
24 layers, block size 1024, Adam grafting. For each inverse-root solver: a step that
recomputes the roots and one that does not (the second and third step; the first builds
the stacks). The same step on FSDP2 row shards (``ShardedDistributor``, two gloo processes
on this machine, the parameters ``fully_shard``-ed as one unit, the ``auto`` solver): the
gradient and update rows that cross ranks included. Meta's Distributed Shampoo (when
installed, see ``benchmarks/_meta_shampoo.py``) with the same blocks, grafting and eigh
roots, for comparison.

Run from the repository root (about a minute)::

    .venv/bin/python benchmarks/speed/step_shape.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

import _meta_shampoo
from _step_time_cases import GPTShape, gpt_parameter_shapes, make_parameters, set_gradients
from common import format_columns, write_json

from lightning_dash import DASH
from lightning_dash.distributed import ShardedDistributor
from lightning_dash.optim.roots import INVERSE_ROOT_METHODS
from lightning_dash.testing.op_counts import OpCounts, count_ops

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"

WIDTH = 64
BLOCK_SIZE = 1024


@dataclass(frozen=True)
class Record:
    """The counts of one step."""

    optimizer: str
    solver: str
    layers: int
    refresh: bool
    host_syncs: int
    launches: int
    syncs_by_op: dict[str, int]
    cuda_checked: dict[str, int]


def parameters(layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shapes = gpt_parameter_shapes(GPTShape(width=WIDTH, layers=layers, vocab=256, context=64))
    return make_parameters(shapes, torch.device("cpu"))


def count_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor], steps: int):
    counts: list[OpCounts] = []
    for _ in range(steps):
        set_gradients(params, grads)
        counts.append(count_ops(optimizer.step)[1])
    return counts


def record(name: str, solver: str, layers: int, refresh: bool, counts: OpCounts) -> Record:
    return Record(
        name,
        solver,
        layers,
        refresh,
        counts.sync_count,
        counts.launch_count,
        dict(counts.syncs),
        dict(counts.device_checked),
    )


def dash_records(layers: int) -> list[Record]:
    records = []
    for solver in ("auto", *INVERSE_ROOT_METHODS):
        params, grads = parameters(layers)
        # roots at steps 1 and 3 (frequency 2): step 2 keeps them, step 3 recomputes them
        optimizer = DASH(
            params, lr=1e-3, block_size=BLOCK_SIZE, inverse_root_method=solver, precondition_frequency=2, epsilon=1e-4
        )
        _, keep, refresh = count_steps(optimizer, params, grads, 3)
        records += [record("dash", solver, layers, True, refresh), record("dash", solver, layers, False, keep)]
    return records


def _fsdp2_rank(rank: int, world_size: int, layers: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    params, grads = parameters(layers)
    holder = torch.nn.Module()
    holder.params = torch.nn.ParameterList(params)
    fully_shard(holder)
    sharded = list(holder.parameters())
    optimizer = DASH(
        sharded,
        lr=1e-3,
        block_size=BLOCK_SIZE,
        precondition_frequency=2,
        epsilon=1e-4,
        distributor=ShardedDistributor(),
    )
    counts = []
    for _ in range(3):
        for param, grad in zip(sharded, grads):
            param.grad = distribute_tensor(grad, param.device_mesh, param.placements)
        counts.append(count_ops(optimizer.step)[1])
    name = f"dash_fsdp2_{world_size}_ranks"
    records = [record(name, "auto", layers, True, counts[2]), record(name, "auto", layers, False, counts[1])]
    if rank == 0:
        Path(folder, "records.json").write_text(json.dumps([asdict(r) for r in records]))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # past gloo's teardown race (lightning_dash.distributed.gloo_exit)


def fsdp2_records(layers: int, world_size: int = 2) -> list[Record]:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_fsdp2_rank, args=(world_size, layers, folder), nprocs=world_size)
        return [Record(**r) for r in json.loads(Path(folder, "records.json").read_text())]


def meta_records(layers: int) -> list[Record]:
    params, grads = parameters(layers)
    optimizer = _meta_shampoo.build_meta_shampoo(
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        block_size=BLOCK_SIZE,
        precondition_frequency=2,
        grafting_beta2=0.999,
        grafting_epsilon=1e-8,
    )
    # its first roots come at step 2 (its start step is the frequency); step 3 keeps them, 4 recomputes
    _, _, keep, refresh = count_steps(optimizer, params, grads, 4)
    return [record("meta_shampoo", "eigh", layers, True, refresh), record("meta_shampoo", "eigh", layers, False, keep)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 24])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    records: list[Record] = []
    for layers in args.layers:
        records += dash_records(layers)
        records += fsdp2_records(layers)
        if _meta_shampoo.available():
            records += meta_records(layers)
    rows = [
        [
            r.optimizer,
            r.solver,
            str(r.layers),
            "yes" if r.refresh else "no",
            str(r.host_syncs),
            str(r.launches),
            ", ".join(f"{k} {v}" for k, v in r.cuda_checked.items()) or "-",
        ]
        for r in records
    ]
    header = ["optimizer", "solver", "layers", "refresh", "host syncs", "launches", "syncs on CUDA only"]
    print(format_columns(header, rows))
    print(f"wrote {write_json(args.out / 'step_shape.json', records)}")


if __name__ == "__main__":
    main()
