"""DASH's optimizer step and state against torchtitan's AdamW, in torchtitan's own container.

torchtitan's Llama debug model (6 layers, width 256, vocabulary 2048, 6.2M parameters), one
process, fixed seeded gradients: the step of torchtitan's ``default_adamw`` container against the
step of ``lightning_dash.torchtitan``'s ``dash_optimizers`` (DASH on every matrix but the embedding
and the output layer, which keep AdamW; DASH's defaults otherwise). Contenders alternate round by
round; each sample is one whole root period (``precondition_frequency`` steps), the step time its
mean; the result is the median over rounds. State: the bytes of the tensors each container keeps.

Runs where torchtitan is installed (``make test-torchtitan`` builds ``.venv-torchtitan``)::

    .venv-torchtitan/bin/python benchmarks/speed/torchtitan_step.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared modules
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: its scripts and helpers

from _environment import suite_environment
from _stamp import stamp
from common import results_parser, write_json

from lightning_dash import DASH

RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESULTS_NAME = "torchtitan_step_cpu.json"


def debug_model() -> torch.nn.Module:
    """torchtitan's Llama debug model, built as its trainer builds it, with seeded weights."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec.model.update_from_config(config=config)
    torch.manual_seed(0)
    model = config.model_spec.model.build()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.02)
    return model


def containers(model: torch.nn.Module) -> dict[str, torch.optim.Optimizer]:
    """The two contenders over ``model``: torchtitan's AdamW recipe, and the same with DASH."""
    from torchtitan.components.optimizer import default_adamw

    from lightning_dash.torchtitan.config_registry import dash_optimizers

    adamw = default_adamw(lr=8e-4)
    adamw.implementation = "foreach"  # "fused", torchtitan's default, is for CUDA
    return {"adamw": adamw.build(model_parts=[model]), "dash": dash_optimizers(lr=8e-4).build(model_parts=[model])}


def state_bytes(container: torch.optim.Optimizer) -> int:
    """Bytes of the distinct tensors the container's optimizers keep (DASH: its own count)."""
    total, seen = 0, set()
    for optimizer in container.optimizers:
        if isinstance(optimizer, DASH):
            total += optimizer.state_bytes()
            continue
        for entry in optimizer.state.values():
            for value in entry.values():
                if torch.is_tensor(value) and value.untyped_storage().data_ptr() not in seen:
                    seen.add(value.untyped_storage().data_ptr())
                    total += value.untyped_storage().nbytes()
    return total


def main(argv: list[str] | None = None) -> dict:
    parser = results_parser(__doc__.splitlines()[0], RESULTS_DIR, "cpu", "the device (cpu only)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    model = debug_model()
    generator = torch.Generator().manual_seed(1)
    grads = {name: torch.randn(param.shape, generator=generator) * 1e-2 for name, param in model.named_parameters()}
    contenders = containers(model)
    period = contenders["dash"].optimizers[-1].param_groups[0]["precondition_frequency"]
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds + 1):  # the first round warms up (builds state, first roots)
        for name, container in contenders.items():
            start = time.perf_counter()
            for _ in range(period):
                for param_name, param in model.named_parameters():
                    param.grad = grads[param_name]
                container.step()
            samples[name].append((time.perf_counter() - start) / period * 1000)
    step_ms = {name: statistics.median(values[1:]) for name, values in samples.items()}
    memory = {name: state_bytes(container) for name, container in contenders.items()}
    report = {
        **stamp(torch.device("cpu")),
        "environment": suite_environment(),
        "model": "llama3 debugmodel",
        "parameters": sum(param.numel() for param in model.parameters()),
        "precondition_frequency": period,
        "step_ms": step_ms,
        "samples_ms": samples,
        "state_bytes": memory,
        "ratios": {"step": step_ms["dash"] / step_ms["adamw"], "state": memory["dash"] / memory["adamw"]},
    }
    print(
        f"step: AdamW {step_ms['adamw']:.1f} ms, DASH {step_ms['dash']:.1f} ms ({report['ratios']['step']:.2f}x); "
        f"state: AdamW {memory['adamw'] / 2**20:.1f} MiB, DASH {memory['dash'] / 2**20:.1f} MiB "
        f"({report['ratios']['state']:.2f}x)"
    )
    print(f"wrote {write_json(args.out / RESULTS_NAME, report)}")
    return report


if __name__ == "__main__":
    main()
