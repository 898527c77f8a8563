"""DASH's optimizer state per block from its shape alone: the one formula the memory estimates share."""

from __future__ import annotations

FLOAT32 = 4
#: ``DASH.state_bytes()`` per block beyond its statistics: ``root_valid`` (bool), ``root_failures``
#: (int32), ``factor_scale`` (float64).
BLOCK_SCALAR_BYTES = 1 + 4 + 8


def block_state_bytes(rows: int, cols: int, element_bytes: int = FLOAT32) -> int:
    """The statistics of one ``rows x cols`` block: each side's factor and root packed as one square
    and a row (``rows (rows + 1)`` and ``cols (cols + 1)`` elements), momentum and the grafting second
    moment (``rows cols`` each)."""
    return element_bytes * (rows * (rows + 1) + cols * (cols + 1) + 2 * rows * cols)
