"""Validation histories from Lightning's ``CSVLogger`` files, the comparison table and its plot.

Shared by the examples so that "steps to reach AdamW's final validation loss" is
computed one way, from the same files a reader can open.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class History:
    """One run's validation points: optimizer steps, losses and seconds since training started."""

    name: str
    steps: list[int]
    losses: list[float]
    seconds: list[float]


@dataclass(frozen=True)
class Row:
    """One optimizer's line of the comparison table."""

    optimizer: str
    lr: float
    final_val_loss: float
    steps_to_target: int | None
    seconds_to_target: float | None
    wall_time_s: float
    metrics_csv: str


def read_history(name: str, metrics_csv: Path) -> History:
    """The rows of ``metrics_csv`` that hold ``val_loss``, in step order.

    Lightning logs metrics at the number of optimizer steps taken so far minus one
    (``step`` counts from 0), so the optimizer step of a row is ``step + 1``.
    """
    points = []
    with open(metrics_csv, newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("val_loss"):
                points.append((int(row["step"]) + 1, float(row["val_loss"]), float(row.get("elapsed_s") or "nan")))
    points.sort()
    return History(name, [p[0] for p in points], [p[1] for p in points], [p[2] for p in points])


def first_reaching(history: History, target: float) -> int | None:
    """Index of the first validation point at or below ``target`` (None if never)."""
    return next((i for i, loss in enumerate(history.losses) if loss <= target), None)


def compare(histories: Sequence[History], lrs: Sequence[float], paths: Sequence[Path]) -> list[Row]:
    """Table rows; the target is the final validation loss of the first history (the baseline)."""
    target = histories[0].losses[-1]
    rows = []
    for history, lr, path in zip(histories, lrs, paths):
        index = first_reaching(history, target)
        rows.append(
            Row(
                optimizer=history.name,
                lr=lr,
                final_val_loss=history.losses[-1],
                steps_to_target=None if index is None else history.steps[index],
                seconds_to_target=None if index is None else history.seconds[index],
                wall_time_s=history.seconds[-1],
                metrics_csv=str(path),
            )
        )
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width text table of ``rows``."""
    target = f"{rows[0].optimizer}'s final"
    header = (
        f"{'optimizer':<10} {'lr':>8} {'final val loss':>15} {'steps to ' + target:>26} "
        f"{'time to it (s)':>15} {'wall time (s)':>14}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        steps = "n/a" if row.steps_to_target is None else str(row.steps_to_target)
        seconds = "n/a" if row.seconds_to_target is None else f"{row.seconds_to_target:.1f}"
        lines.append(
            f"{row.optimizer:<10} {row.lr:>8.2g} {row.final_val_loss:>15.4f} {steps:>26} "
            f"{seconds:>15} {row.wall_time_s:>14.1f}"
        )
    return "\n".join(lines)


def write_json(rows: Sequence[Row], config: dict, path: Path) -> None:
    """The table and the run's settings as JSON."""
    path.write_text(json.dumps({"config": config, "results": [asdict(row) for row in rows]}, indent=2) + "\n")


def plot(histories: Sequence[History], path: Path, title: str = "", time_caution: str | None = None) -> None:
    """Two panels: validation loss against optimizer steps and against wall time (titled with
    ``time_caution`` when the timing was disturbed, see :mod:`~lightning_dash.showcase.contention`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for history in histories:
        by_step.plot(history.steps, history.losses, marker="o", markersize=3, label=history.name)
        by_time.plot(history.seconds, history.losses, marker="o", markersize=3, label=history.name)
    by_step.axhline(histories[0].losses[-1], color="grey", linewidth=0.8, linestyle="--")
    by_time.axhline(histories[0].losses[-1], color="grey", linewidth=0.8, linestyle="--")
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel("wall time since training started (s)")
    for axes in (by_step, by_time):
        axes.set_ylabel("validation loss (nats/byte)")
        axes.grid(alpha=0.3)
        axes.legend()
    if time_caution:
        by_time.set_title(time_caution, color="firebrick")
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=120)
    plt.close(figure)
