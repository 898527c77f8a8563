"""The model-family suite's tables (``families.py``): quality against AdamW, and the timing rounds."""

from __future__ import annotations


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The quality table: final loss against AdamW's, divergences, steps to AdamW's final loss per seed.
    (Times are in :func:`timing_table`: the suite's own runs share the machine.)"""
    header = ["family", "contender", "lr", "final val", "x AdamW", "diverged", "steps to AdamW (per seed)"]
    body = [
        [
            row["family"],
            row["contender"],
            f"{row['lr']:.0e}",
            f"{row['final_val']:.4f}",
            f"{row['ratio_to_adamw']:.3f}",
            str(row["diverged"]),
            "/".join("-" if v is None else str(v) for v in row["steps_to_adamw"]),
        ]
        for row in rows
    ]
    return header, body


def timing_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The timing rounds' table (see :func:`timing_rows`)."""
    header = [
        "family",
        "contender",
        "step ms",
        "x AdamW step",
        "roots' share",
        "training s",
        "s to AdamW's final loss",
    ]
    body = [
        [
            row["family"],
            row["contender"],
            f"{row['step_ms']:.1f}",
            f"{row['step_ratio']:.2f}",
            "" if row.get("roots_share") is None else f"{row['roots_share']:.2f}",
            f"{row['train_s']:.1f}",
            "-" if row["seconds_to_adamw"] is None else f"{row['seconds_to_adamw']:.1f}",
        ]
        for row in rows
    ]
    return header, body
