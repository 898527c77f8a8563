"""One run of the race (``peers.py``): the model, the data, the training loop and its record."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from _curves import Point
from _environment import race_environment
from _peers_contenders import (
    TIMING_WINDOW,
    VALIDATION_SEED,
    Contender,
    build,
    optimizer_options,
    state_bytes,
    state_walk_bytes,
)
from _records import record_type
from _timing import robust_step_ms, window_ms
from common import synchronize
from torch import Tensor

from lightning_dash import RootComputationError
from lightning_dash.showcase import TinyGPT, load_stdlib_corpus
from lightning_dash.showcase.lightning_gpt import warmup_cosine
from lightning_dash.showcase.stdlib_text import ByteCorpus, RandomWindows


# ---------------------------------------------------------------------- training
class Settings(
    record_type(
        "Settings",
        "The fields of :class:`Settings`.",
        """
        steps            int    = 200
        batch_size       int    = 32
        context          int    = 128
        depth            int    = 2
        heads            int    = 4
        warmup_fraction  float  = 0.05
        eval_every       int    = 10
        val_windows      int    = 256
        max_bytes        int    = 4_000_000
        """,
    )
):
    """Model, data, schedule and evaluation shared by every run (width varies per run)."""

    @property
    def warmup(self) -> int:
        return max(1, round(self.warmup_fraction * self.steps))

    @classmethod
    def from_args(cls, args: Any) -> Settings:
        """The settings a race's command line gives (its flags of the same names; warm-up as default)."""
        names = ("steps", "batch_size", "context", "depth", "heads", "eval_every", "val_windows", "max_bytes")
        return cls(**{name: getattr(args, name) for name in names})


@dataclass
class Data:
    """The corpus and the fixed validation windows (inputs, targets)."""

    corpus: ByteCorpus
    val_tokens: Tensor
    val_targets: Tensor


def load_data(settings: Settings) -> Data:
    corpus = load_stdlib_corpus(max_bytes=settings.max_bytes)
    windows = RandomWindows(corpus.validation, settings.context, settings.val_windows, seed=VALIDATION_SEED)
    pairs = [windows[i] for i in range(len(windows))]
    return Data(corpus, torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))


def make_model(width: int, seed: int, settings: Settings) -> TinyGPT:
    """The main job's model with the seed's initial weights (``GPTModule`` seeds the same way)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyGPT(context=settings.context, width=width, depth=settings.depth, heads=settings.heads)


def evaluate(model: TinyGPT, data: Data, device: torch.device, batch: int = 64) -> float:
    """Mean loss over the fixed validation windows (eval mode, as Lightning's validation)."""
    model.eval()
    losses, counts = [], []
    with torch.no_grad():
        for start in range(0, data.val_tokens.shape[0], batch):
            tokens = data.val_tokens[start : start + batch].to(device)
            targets = data.val_targets[start : start + batch].to(device)
            losses.append(model.loss(tokens, targets).item() * tokens.shape[0])
            counts.append(tokens.shape[0])
    model.train()
    return sum(losses) / sum(counts)


def train_run(
    contender: Contender,
    lr: float,
    seed: int,
    width: int,
    settings: Settings,
    data: Data,
    device: torch.device,
    muon_adamw_lr: float,
) -> dict[str, Any]:
    """One run; returns its record (see :func:`record_key`). Raises :class:`Unavailable`."""
    model = make_model(width, seed, settings).to(device)
    optimizer = build(contender, model, lr, muon_adamw_lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings.warmup, settings.steps))
    windows = RandomWindows(data.corpus.train, settings.context, settings.steps * settings.batch_size, seed)
    curve = [Point(0, 0.0, evaluate(model, data, device))]
    trained_s, status, note = 0.0, "ok", None
    step_s: list[float] = []
    opt_s: list[float] = []
    for step in range(1, settings.steps + 1):
        if status == "ok":
            synchronize(device)
            start = time.perf_counter()
            pairs = [windows[i] for i in range((step - 1) * settings.batch_size, step * settings.batch_size)]
            tokens = torch.stack([p[0] for p in pairs]).to(device)
            targets = torch.stack([p[1] for p in pairs]).to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = model.loss(tokens, targets)
            loss.backward()
            synchronize(device)
            before_step = time.perf_counter()
            try:
                optimizer.step()
            except RootComputationError as error:
                status, note = "diverged", f"step {step}: {error}"
            synchronize(device)
            after_step = time.perf_counter()
            schedule.step()
            synchronize(device)
            step_s.append(time.perf_counter() - start)
            opt_s.append(after_step - before_step)
            trained_s += step_s[-1]
            if not math.isfinite(loss.item()):
                status, note = "diverged", f"training loss {loss.item()} at step {step}"
        if step % settings.eval_every == 0 or step == settings.steps:
            value = evaluate(model, data, device) if status == "ok" else math.nan
            if not math.isfinite(value) and status == "ok":
                status, note = "diverged", f"validation loss {value} at step {step}"
            curve.append(Point(step, trained_s, value))
    return {
        "optimizer": contender.name,
        "width": width,
        "params": sum(p.numel() for p in model.parameters()),
        "lr": lr,
        "seed": seed,
        "steps": settings.steps,
        "status": status,
        "note": note,
        "options": optimizer_options(contender, lr, muon_adamw_lr, optimizer),
        "settings": asdict(settings),
        "environment": race_environment(),
        "initial_val_loss": curve[0].val_loss,
        "final_val_loss": finite_or_none(curve[-1].val_loss),
        "wall_s": trained_s,
        "train_step_ms": min(window_ms(step_s, TIMING_WINDOW)),
        "train_step_robust_ms": robust_step_ms(step_s, TIMING_WINDOW),
        "opt_step_ms": min(window_ms(opt_s, TIMING_WINDOW)),
        "opt_step_robust_ms": robust_step_ms(opt_s, TIMING_WINDOW),
        "opt_step_median_ms": 1e3 * statistics.median(opt_s),
        "opt_step_mean_ms": 1e3 * statistics.mean(opt_s),
        "train_window_ms": [round(v, 3) for v in window_ms(step_s, TIMING_WINDOW)],
        "opt_window_ms": [round(v, 3) for v in window_ms(opt_s, TIMING_WINDOW)],
        "state_bytes": state_bytes(optimizer),
        "state_bytes_walk": state_walk_bytes(optimizer),
        "curve": [[p.step, round(p.wall_s, 4), finite_or_none(p.val_loss)] for p in curve],
    }


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def unavailable_record(name: str, width: int, steps: int, reason: str) -> dict[str, Any]:
    return {
        "optimizer": name,
        "width": width,
        "lr": None,
        "seed": None,
        "steps": steps,
        "status": "unavailable",
        "note": reason,
    }
