"""The race's records (``peers.py``): merging, best learning rates, summary rows, lr transfer."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from _curves import Point, first_reaching
from _peers_contenders import TRANSFER_DASH
from _peers_train import finite_or_none


# ---------------------------------------------------------------------- records
def record_key(record: dict[str, Any]) -> tuple:
    """Records are keyed by optimizer, width, lr, seed and steps."""
    return (record["optimizer"], record["width"], record["lr"], record["seed"], record["steps"])


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with ``new`` added: a new record replaces an old one with the same key, and an
    optimizer that now has runs at a width and step count loses its ``unavailable`` record there."""
    ran = {(r["optimizer"], r["width"], r["steps"]) for r in new if r["status"] != "unavailable"}
    keys = {record_key(r) for r in new}
    kept = [
        r
        for r in old
        if record_key(r) not in keys
        and not (r["status"] == "unavailable" and (r["optimizer"], r["width"], r["steps"]) in ran)
    ]
    return kept + new


def load_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return json.loads(path.read_text())["records"]


def curve_points(record: dict) -> list[Point]:
    return [Point(s, w, math.nan if v is None else v) for s, w, v in record["curve"]]


def runs_of(records: list[dict], name: str, width: int, steps: int) -> list[dict]:
    return [
        r
        for r in records
        if r["optimizer"] == name and r["width"] == width and r["steps"] == steps and r["status"] != "unavailable"
    ]


def loss_score(runs: list[dict]) -> float:
    """Mean final loss of runs; infinite if one diverged."""
    losses = [r["final_val_loss"] for r in runs]
    if not losses or any(v is None or not math.isfinite(v) for v in losses):
        return math.inf
    return statistics.mean(losses)


def best_lr(records: list[dict], name: str, width: int, steps: int) -> float | None:
    """The lr with the lowest final validation loss, averaged over the seeds run at every lr
    (over all its seeds when no seed was run at every lr); a diverged run never wins."""
    runs = runs_of(records, name, width, steps)
    by_lr: dict[float, list[dict]] = {}
    for run in runs:
        by_lr.setdefault(run["lr"], []).append(run)
    if not by_lr:
        return None
    common = set.intersection(*({r["seed"] for r in group} for group in by_lr.values()))

    def score(lr: float) -> float:
        chosen = [r for r in by_lr[lr] if r["seed"] in common] or by_lr[lr]
        return loss_score(chosen)

    return min(sorted(by_lr), key=score)


def steps_to(record: dict, target: float) -> Point | None:
    """The first evaluation (after step 0) at or below ``target``."""
    return first_reaching(curve_points(record), target)


# ---------------------------------------------------------------------- analysis
def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summary_rows(records: list[dict], width: int, steps: int, names: list[str]) -> list[dict]:
    """One row per contender at its best lr (see the module docstring)."""
    adamw_lr = best_lr(records, "adamw", width, steps)
    targets = {
        r["seed"]: r["final_val_loss"]
        for r in runs_of(records, "adamw", width, steps)
        if r["lr"] == adamw_lr and r["final_val_loss"] is not None
    }
    adamw_steps = {}
    for r in runs_of(records, "adamw", width, steps):
        if r["lr"] == adamw_lr and r["seed"] in targets:
            reached = steps_to(r, targets[r["seed"]])
            adamw_steps[r["seed"]] = reached
    rows = []
    for name in names:
        unavailable = [
            r
            for r in records
            if r["optimizer"] == name and r["width"] == width and r["steps"] == steps and r["status"] == "unavailable"
        ]
        lr = best_lr(records, name, width, steps)
        if lr is None:
            if unavailable:
                rows.append({"optimizer": name, "status": "unavailable", "note": unavailable[0]["note"]})
            continue
        runs = sorted((r for r in runs_of(records, name, width, steps) if r["lr"] == lr), key=lambda r: r["seed"])
        finals = [r["final_val_loss"] for r in runs]
        finite = [v for v in finals if v is not None]
        reached_steps, ratios, walls, estimates = [], [], [], []
        fastest_train_ms = min(r["train_step_ms"] for r in runs)
        for r in runs:
            if r["seed"] not in targets:
                continue
            point = steps_to(r, targets[r["seed"]])
            base = adamw_steps.get(r["seed"])
            reached_steps.append(None if point is None else point.step)
            ratios.append(None if point is None or base is None else point.step / base.step)
            walls.append(None if point is None else point.wall_s)
            estimates.append(None if point is None else point.step * fastest_train_ms / 1e3)
        mean, sd = mean_sd(finite) if finite else (math.nan, math.nan)
        rows.append(
            {
                "optimizer": name,
                "status": "ok" if len(finite) == len(finals) else "diverged",
                "best_lr": lr,
                "seeds": [r["seed"] for r in runs],
                "params": runs[0]["params"],
                "final_val_loss": finals,
                "final_val_loss_mean": finite_or_none(mean),
                "final_val_loss_sd": finite_or_none(sd),
                "steps_to_adamw_final": reached_steps,
                "steps_ratio_to_adamw": ratios,
                "wall_s_to_adamw_final": walls,
                "estimated_s_to_adamw_final": estimates,
                "wall_s": statistics.mean(r["wall_s"] for r in runs),
                "opt_step_ms": min(r["opt_step_ms"] for r in runs),
                "opt_step_robust_ms": statistics.median(r["opt_step_robust_ms"] for r in runs),
                "opt_step_median_ms": statistics.median(r["opt_step_median_ms"] for r in runs),
                "opt_step_mean_ms": statistics.median(r["opt_step_mean_ms"] for r in runs),
                "train_step_ms": fastest_train_ms,
                "train_step_robust_ms": statistics.median(r["train_step_robust_ms"] for r in runs),
                "state_bytes": runs[0]["state_bytes"],
                "state_bytes_walk": runs[0]["state_bytes_walk"],
            }
        )
    return rows


def lr_sweep(records: list[dict], width: int, steps: int, names: list[str]) -> dict[str, dict[str, float | None]]:
    """Per contender, lr -> mean final validation loss over the seeds run at that lr."""
    sweep = {}
    for name in names:
        by_lr: dict[float, list[dict]] = {}
        for run in runs_of(records, name, width, steps):
            by_lr.setdefault(run["lr"], []).append(run)
        if by_lr:
            sweep[name] = {f"{lr:g}": finite_or_none(loss_score(by_lr[lr])) for lr in sorted(by_lr)}
    return sweep


def lr_transfer(records: list[dict], width: int, steps: int, dash: str = TRANSFER_DASH) -> dict[str, Any] | None:
    """AdamW's and DASH's best lr, their ratio, and DASH's final loss at AdamW's best lr against at
    its own (the seeds both lrs were run with)."""
    adamw_lr, dash_lr = best_lr(records, "adamw", width, steps), best_lr(records, dash, width, steps)
    if adamw_lr is None or dash_lr is None:
        return None
    runs = runs_of(records, dash, width, steps)
    at = {lr: {r["seed"]: r for r in runs if r["lr"] == lr} for lr in (adamw_lr, dash_lr)}
    seeds = sorted(set(at[adamw_lr]) & set(at[dash_lr]))
    own = loss_score([at[dash_lr][s] for s in seeds]) if seeds else math.inf
    borrowed = loss_score([at[adamw_lr][s] for s in seeds]) if seeds else math.inf
    return {
        "width": width,
        "dash": dash,
        "adamw_best_lr": adamw_lr,
        "dash_best_lr": dash_lr,
        "ratio": dash_lr / adamw_lr,
        "seeds": seeds,
        "dash_loss_at_own_best": finite_or_none(own),
        "dash_loss_at_adamw_best": finite_or_none(borrowed),
        "lost": finite_or_none(borrowed - own) if seeds else None,
        **converted_transfer(records, width, steps, adamw_lr, loss_score(list(at[dash_lr].values()))),
    }


def converted_transfer(
    records: list[dict], width: int, steps: int, adamw_lr: float, own: float
) -> dict[str, float | list[int] | None]:
    """``from_optimizer``'s DASH (AdamW's lr times its ``lr_scale``) at AdamW's best lr: its mean final loss
    over the seeds it ran, and that minus ``own``, DASH's at its own best lr (every seed run there)."""
    runs = [r for r in runs_of(records, "dash-from-adamw", width, steps) if r["lr"] == adamw_lr]
    if not runs:
        return {}
    loss = loss_score(runs)
    return {
        "converted_seeds": sorted(r["seed"] for r in runs),
        "converted_loss_at_adamw_best": finite_or_none(loss),
        "converted_lost": finite_or_none(loss - own),
    }
