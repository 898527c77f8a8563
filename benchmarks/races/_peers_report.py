"""The race's output (``peers.py``): tables, plots, the printed report and the results JSON."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from _peers_analysis import curve_points, lr_sweep, lr_transfer, record_key, summary_rows
from _peers_contenders import CONTENDERS
from common import format_columns, markdown_table


# ---------------------------------------------------------------------- output
def fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def seeds_text(values: list, spec: str) -> str:
    """Per-seed values, ``-`` for a seed that never reached; the mean of the defined ones first."""
    defined = [v for v in values if v is not None]
    if not values:
        return "-"
    head = format(statistics.mean(defined), spec) if defined else "never"
    if len(values) == 1:
        return head
    return f"{head} ({' '.join(fmt(v, spec) for v in values)})"


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = [
        "optimizer",
        "best lr",
        "seeds",
        "final val loss",
        "steps to AdamW final",
        "/ AdamW",
        "train s to it",
        "est. s",
        "opt step ms",
        "state MiB",
    ]
    body = []
    for row in rows:
        if row["status"] == "unavailable":
            body.append([row["optimizer"], "unavailable"] + [""] * (len(header) - 2))
            continue
        finals = [v for v in row["final_val_loss"] if v is not None]
        if finals:
            loss = f"{row['final_val_loss_mean']:.4f} ± {row['final_val_loss_sd']:.4f}"
            if len(finals) > 1:
                loss += f" ({min(finals):.4f}-{max(finals):.4f})"
            if len(finals) < len(row["final_val_loss"]):
                loss += " (some diverged)"
        else:
            loss = "diverged"
        body.append(
            [
                row["optimizer"],
                f"{row['best_lr']:g}",
                str(len(row["seeds"])),
                loss,
                seeds_text(row["steps_to_adamw_final"], ".0f"),
                seeds_text(row["steps_ratio_to_adamw"], ".2f"),
                seeds_text(row["wall_s_to_adamw_final"], ".1f"),
                seeds_text(row["estimated_s_to_adamw_final"], ".1f"),
                f"{row['opt_step_ms']:.1f}",
                f"{row['state_bytes'] / 2**20:.2f}",
            ]
        )
    return header, body


def sweep_text(sweep: dict[str, dict[str, float | None]]) -> str:
    return "\n".join(
        f"  {name:<22} " + "  ".join(f"{lr}: {fmt(loss)}" for lr, loss in losses.items())
        for name, losses in sweep.items()
    )


def transfer_text(transfer: dict[str, Any]) -> str:
    return (
        f"  width {transfer['width']}: best lr AdamW {transfer['adamw_best_lr']:g}, {transfer['dash']} "
        f"{transfer['dash_best_lr']:g} (ratio {transfer['ratio']:g}); {transfer['dash']} final loss at its own "
        f"best {fmt(transfer['dash_loss_at_own_best'])}, at AdamW's best {fmt(transfer['dash_loss_at_adamw_best'])} "
        f"(lost {fmt(transfer['lost'])}; seeds {transfer['seeds']})"
        + (
            f"; from_optimizer(AdamW) at AdamW's best {fmt(transfer['converted_loss_at_adamw_best'])} "
            f"(lost {fmt(transfer['converted_lost'])}; seeds {transfer['converted_seeds']})"
            if "converted_seeds" in transfer
            else ""
        )
    )


def plot(records: list[dict], rows: list[dict], path: Path, title: str, target: float | None) -> None:
    """Two panels: mean validation loss at each contender's best lr against steps and against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_wall) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors = plt.get_cmap("tab10").colors
    tail_low, tail_high = math.inf, -math.inf
    # The contenders only (a --dash-variant of an investigation is in the table, not in the plot).
    for index, row in enumerate(r for r in rows if r["status"] != "unavailable" and r["optimizer"] in CONTENDERS):
        runs = [
            r
            for r in records
            if r["optimizer"] == row["optimizer"]
            and r["lr"] == row["best_lr"]
            and r["seed"] in row["seeds"]
            and r["width"] == row["width"]
            and r["steps"] == row["steps"]
        ]
        curves = [curve_points(r) for r in runs]
        length = min(len(c) for c in curves)
        steps = [curves[0][i].step for i in range(1, length)]
        wall = [statistics.mean(c[i].wall_s for c in curves) for i in range(1, length)]
        loss = [statistics.mean(c[i].val_loss for c in curves) for i in range(1, length)]
        style = "-" if row["optimizer"].startswith("dash") else "--"
        if index >= len(colors):  # a colour's second use: another line style
            style = "-." if style == "-" else ":"
        label = f"{row['optimizer']} (lr {row['best_lr']:g}, {len(curves)} seed{'s' if len(curves) > 1 else ''})"
        color = colors[index % len(colors)]
        by_step.plot(steps, loss, style, color=color, label=label)
        by_wall.plot(wall, loss, style, color=color, label=label)
        finite = [v for v in loss if math.isfinite(v)]
        if finite:
            tail_low = min(tail_low, min(finite))
            tail_high = max(tail_high, finite[len(finite) // 5] if len(finite) > 5 else finite[-1])
    if math.isfinite(tail_low) and tail_high > tail_low:
        by_step.set_ylim(tail_low - 0.05 * (tail_high - tail_low), tail_high)
    for axis in (by_step, by_wall):
        if target is not None:
            axis.axhline(target, color="grey", linestyle=":", linewidth=0.9, label="AdamW final (mean)")
        axis.grid(alpha=0.3)
    by_step.set_xlabel("optimizer step")
    by_wall.set_xlabel("training wall time (s, evaluations excluded)")
    by_step.set_ylabel("validation loss (nats/byte)")
    by_wall.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report(records: list[dict], out: Path, device_name: str) -> dict:
    """Print the tables and write the summary and the plots of every width and step count in
    ``records``; returns the summary."""
    summary: dict[str, Any] = {"widths": {}, "lr_transfer": []}
    groups = sorted({(r["width"], r["steps"]) for r in records})
    for width, steps in groups:
        ran = {r["optimizer"] for r in records if r["width"] == width and r["steps"] == steps}
        present = [n for n in CONTENDERS if n in ran] + sorted(ran - set(CONTENDERS))  # variants last
        rows = summary_rows(records, width, steps, present)
        for row in rows:
            row.update(width=width, steps=steps)
        sweep = lr_sweep(records, width, steps, present)
        transfer = lr_transfer(records, width, steps)
        params = next((r["params"] for r in records if r["width"] == width and "params" in r), None)
        key = f"w{width}_s{steps}"
        summary["widths"][key] = {"width": width, "steps": steps, "params": params, "rows": rows, "lr_sweep": sweep}
        if transfer is not None:
            summary["lr_transfer"].append(transfer)
        header, body = table_rows(rows)
        print(f"\nwidth {width} ({params:,} parameters), {steps} steps; at each contender's best lr:")
        print(format_columns(header, body))
        print("final validation loss per lr (mean over the seeds run at it):")
        print(sweep_text(sweep))
        summary["widths"][key]["markdown"] = markdown_table(header, body)
        adamw = next((row for row in rows if row["optimizer"] == "adamw" and row["status"] != "unavailable"), None)
        target = adamw["final_val_loss_mean"] if adamw else None
        png = out / f"peers_{device_name}_w{width}.png"
        shape = next((r["settings"] for r in records if r["width"] == width and "settings" in r), {})
        title = (
            f"TinyGPT width {width} ({params:,} params), depth {shape.get('depth')}, context {shape.get('context')}, "
            f"{steps} steps, stdlib bytes ({device_name})"
        )
        if any(row["status"] != "unavailable" for row in rows):
            plot(records, rows, png, title, target)
            print(f"wrote {png}")
    if summary["lr_transfer"]:
        print("\nlr transfer (AdamW's best lr used for DASH):")
        for transfer in summary["lr_transfer"]:
            print(transfer_text(transfer))
    return summary


def write_results(path: Path, records: list[dict], summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "summary": summary,
        "records": sorted(records, key=lambda r: tuple(str(v) for v in record_key(r))),
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
