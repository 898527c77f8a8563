"""The model-family suite's tables (``families.py``): quality against AdamW, and the timing rounds."""

from __future__ import annotations

from _records import column_cells

#: The quality table: header, then the template of its cells (see :func:`_records.column_cells`).
QUALITY = """
    family                     {family}
    contender                  {contender}
    lr                         {lr:.0e}
    final val                  {final_val:.4f}
    x AdamW                    {ratio_to_adamw:.3f}
    diverged                   {diverged}
    steps to AdamW (per seed)  {steps}
"""
#: The timing rounds' table.
TIMING = """
    family                   {family}
    contender                {contender}
    step ms                  {step_ms:.1f}
    x AdamW step             {step_ratio:.2f}
    roots' share             {roots}
    training s               {train_s:.1f}
    s to AdamW's final loss  {seconds}
"""


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The quality table: final loss against AdamW's, divergences, steps to AdamW's final loss per seed.
    (Times are in :func:`timing_table`: the suite's own runs share the machine.)"""
    steps = ["/".join("-" if v is None else str(v) for v in row["steps_to_adamw"]) for row in rows]
    return column_cells(QUALITY, [{**row, "steps": text} for row, text in zip(rows, steps)])


def timing_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The timing rounds' table (see :func:`timing_rows`)."""
    filled = [
        {
            **row,
            "roots": "" if row.get("roots_share") is None else f"{row['roots_share']:.2f}",
            "seconds": "-" if row["seconds_to_adamw"] is None else f"{row['seconds_to_adamw']:.1f}",
        }
        for row in rows
    ]
    return column_cells(TIMING, filled)
