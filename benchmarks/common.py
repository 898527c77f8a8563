"""What the benchmark scripts share: devices, optimizers, the schedule, evaluation, tables, JSON.

Not a benchmark itself: the scripts in the folders below this one import it (each puts its own
folder and this one on ``sys.path`` first, so that they also run as
``python benchmarks/<folder>/<script>.py`` and when loaded by path from the tests). It imports
nothing but torch and :class:`lightning_dash.DASH` from the package, so that scripts run against
an older checkout on ``PYTHONPATH`` (``damping.py``, ``compare_revisions.py``) still import it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_dash import DASH

#: The repository root: results folders are shown relative to it.
ROOT = Path(__file__).resolve().parents[1]
#: Names :func:`build_optimizer` knows.
OPTIMIZERS = ("adamw", "dash")


# ---------------------------------------------------------------------- devices
def resolve_device(name: str | None) -> torch.device:
    """The requested device, or CUDA when available, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def device_label(device: torch.device) -> str:
    """``cpu`` or a short GPU name from ``torch.cuda.get_device_name`` (``h100``, ``a100``, ...)."""
    if device.type != "cuda":
        return device.type
    return short_gpu_name(torch.cuda.get_device_name(device))


def short_gpu_name(full_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``; ``"NVIDIA GeForce RTX 4090"`` -> ``"rtx4090"``."""
    vendor_words = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct"}
    words = [w for w in re.split(r"\s+", full_name.lower()) if w and w not in vendor_words]
    kept = []
    for word in words:
        kept.append(word.split("-")[0])
        if any(ch.isdigit() for ch in word):
            break
    label = re.sub(r"[^a-z0-9]", "", "".join(kept))
    return label or "cuda"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- training
def build_optimizer(name: str, params: Iterable[torch.Tensor], **hyperparameters: Any) -> torch.optim.Optimizer:
    """``adamw`` (``torch.optim.AdamW``) or ``dash`` (:class:`~lightning_dash.DASH`) on ``params``.

    ``hyperparameters`` go to the constructor as they are; what a script leaves out
    is that optimizer's own default (AdamW's ``weight_decay`` is 0.01, DASH's 0).
    """
    if name == "adamw":
        return torch.optim.AdamW(params, **hyperparameters)
    if name == "dash":
        return DASH(params, **hyperparameters)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """Learning-rate factor after ``step`` scheduler steps: linear warm-up, then cosine to zero."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def validation_loss(
    model: torch.nn.Module,
    corpus: Any,
    batch_size: int,
    context: int,
    batches: int,
    seed: int = 1,
    eval_mode: bool = True,
) -> float:
    """Mean loss of ``model`` (a :class:`~lightning_dash.showcase.TinyGPT`) over ``batches`` validation
    batches of a :class:`~lightning_dash.showcase.ByteCorpus`, drawn with a fixed ``seed`` (the same
    batches for every run), without gradients; the model is left in train mode.

    TinyGPT has no dropout, but in eval mode PyTorch takes its fused transformer path, whose
    roundoff differs (by ~1e-8 in the loss); ``eval_mode=False`` keeps train mode, as
    ``soak.py`` has always evaluated.
    """
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    model.train(not eval_mode)
    with torch.no_grad():
        losses = []
        for _ in range(batches):
            tokens, targets = corpus.batch("validation", batch_size, context, generator)
            losses.append(model.loss(tokens.to(device), targets.to(device)).item())
    model.train()
    return sum(losses) / len(losses)


# ---------------------------------------------------------------------- output
def results_parser(
    description: str, results_dir: Path, device_default: str | None, device_help: str
) -> argparse.ArgumentParser:
    """A script's argument parser with the flags every results-writing benchmark takes: ``--device``
    (``device_default``, described by ``device_help``) and ``--out``, the results folder (default
    ``results_dir``, the script's folder's ``results/``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default=device_default, help=device_help)
    shown = results_dir.relative_to(ROOT) if results_dir.is_relative_to(ROOT) else results_dir
    parser.add_argument("--out", type=Path, default=results_dir, help=f"results folder (default: {shown})")
    return parser


def format_columns(header: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: every cell right-aligned to its column's widest, two spaces between."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *rows])


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (for pasting into docs/benchmarks.md): a header, its rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, data: list | dict, indent: int = 2) -> Path:
    """Write ``data`` to ``path`` as JSON, creating its folder; returns ``path``. A list is one of
    records, dataclasses or plain dicts; a dict is written as it is."""
    if isinstance(data, list):
        data = [asdict(record) if is_dataclass(record) else record for record in data]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path
