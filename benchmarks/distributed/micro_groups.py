"""Micro-groups on sharded parameters: the step's peak memory and time at each memory budget.

The weights of ``--layers`` transformer layers of width ``--width`` (fused QKV, output
projection, 4x MLP; no biases) are FSDP2-sharded over one process (NCCL on a GPU, gloo on
the CPU), given fixed random gradients, and stepped by DASH with a
:class:`~lightning_dash.distributed.ShardedDistributor` at each ``--budgets`` value of
``micro_group_mib`` (``none``: one round). All budgets are interleaved in every round. Each
row reports the micro-groups, the planned peak of whole blocks gathered at once
(``peak_gathered_bytes``), and on CUDA the step's measured peak memory above what was
allocated before it (``torch.cuda.max_memory_allocated``): that also holds the candidate
state every block keeps until the step's verdict (new factors, momentum, roots when due),
which micro-groups do not bound. Step times are medians over rounds of the mean of ``f``
consecutive steps at each precondition frequency ``f``.

One process measures memory and the cost of more, smaller launches; the overlap of one
micro-group's exchange with the next one's compute needs several GPUs.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from common import device_label, markdown_table, resolve_device, results_parser, synchronize, write_json

from lightning_dash import DASH
from lightning_dash.distributed import ShardedDistributor

#: The default output folder: this folder's results/.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    device: str
    budget_mib: float | None
    precondition_frequency: int
    micro_groups: int
    planned_peak_gathered_mib: float
    measured_step_peak_mib: float | None
    step_ms: float


def layers(width: int, depth: int) -> nn.Module:
    shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * depth
    model = nn.ModuleList(nn.Linear(cols, rows, bias=False) for rows, cols in shapes)
    for layer in model:
        fully_shard(layer)
    return model


def give_gradients(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        local = param.to_local()
        noise = torch.randn(local.shape, generator=generator).to(local.device)
        param.grad = DTensor.from_local(
            noise, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )


def measure(optimizer: DASH, device: torch.device, steps: int) -> tuple[float, float | None]:
    """Mean ms of ``steps`` steps and, on CUDA, their peak memory above the start (MiB)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    synchronize(device)
    elapsed = (time.perf_counter() - start) * 1e3 / steps
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if device.type == "cuda" else None
    return elapsed, peak


def main() -> None:
    parser = results_parser(__doc__.splitlines()[0], RESULTS_DIR, None, "cpu, cuda (default: cuda if available)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--budgets", nargs="+", default=["none", "512", "128", "32"])
    parser.add_argument("--frequencies", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = resolve_device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    init_device_mesh(device.type, (1,))
    torch.set_default_device(device)
    try:
        model = layers(args.width, args.layers)
    finally:
        torch.set_default_device(None)
    give_gradients(model, 0)
    budgets = [None if b == "none" else float(b) for b in args.budgets]
    cases = [(b, f) for f in args.frequencies for b in budgets]
    optimizers = {
        case: DASH(
            model.parameters(),
            lr=1e-7,
            block_size=args.block_size,
            precondition_frequency=case[1],
            distributor=ShardedDistributor(micro_group_mib=case[0]),
        )
        for case in cases
    }
    for (_, f), optimizer in optimizers.items():
        measure(optimizer, device, f)  # warm-up: plans the layout, first roots
    times: dict[tuple[float | None, int], list[float]] = {case: [] for case in cases}
    peaks: dict[tuple[float | None, int], list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case, optimizer in optimizers.items():
            elapsed, peak = measure(optimizer, device, case[1])
            times[case].append(elapsed)
            if peak is not None:
                peaks[case].append(peak)
    label = device_label(device)
    rows = []
    for case, optimizer in optimizers.items():
        distributor = optimizer.distributor
        rows.append(
            Row(
                label,
                case[0],
                case[1],
                distributor.micro_groups,
                round(distributor.peak_gathered_bytes / 2**20, 2),
                round(max(peaks[case]), 1) if peaks[case] else None,
                round(statistics.median(times[case]), 2),
            )
        )
    header = ["budget MiB", "f", "micro-groups", "planned gathered MiB", "measured step peak MiB", "step ms"]
    cells = [
        [
            "none" if r.budget_mib is None else r.budget_mib,
            r.precondition_frequency,
            r.micro_groups,
            r.planned_peak_gathered_mib,
            "-" if r.measured_step_peak_mib is None else r.measured_step_peak_mib,
            r.step_ms,
        ]
        for r in rows
    ]
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{label}: {args.layers} layers of width {args.width} ({params / 1e6:.0f}M parameters), "
        f"block {args.block_size}, {args.rounds} rounds"
    )
    print(markdown_table(header, cells))
    print(f"wrote {write_json(args.out / f'micro_groups_{device.type}.json', rows)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
