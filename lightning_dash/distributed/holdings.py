"""Which rank holds which rectangle of each parameter's matrix view.

FSDP2 alone cuts dim 0 the way ``torch.chunk`` does: every rank holds a run of rows
(:meth:`Holdings.by_rows`). With tensor parallelism a rank may hold a rectangle (a
row-parallel weight is cut by rows and by columns), and several ranks may hold the same
rectangle (a norm weight replicated over the tensor-parallel ranks, or HSDP's replicas).
The rectangles of one parameter, grouped by equal rectangles into *cells*, tile its
matrix view; each cell lists its holders in rank order. A block's gradient is read
from one holder of each cell it crosses, and its update goes back to all of them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

Span = tuple[int, int]


def row_range(rows: int, world_size: int, rank: int) -> Span:
    """``[start, end)`` of the rows ``rank`` holds of a dimension of ``rows`` (chunk semantics)."""
    chunk = -(-rows // world_size) if rows else 0
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def view_row_range(view_rows: int, leading: int, world_size: int, rank: int) -> Span:
    """``rank``'s rows of a matrix view of ``view_rows`` rows of a parameter whose first
    dimension, the one FSDP2 shards, has ``leading`` entries (a stack of experts viewed
    as one matrix per expert has ``view_rows / leading`` rows per entry)."""
    per_entry = view_rows // leading if leading else 1
    start, end = row_range(leading, world_size, rank)
    return start * per_entry, end * per_entry


def _overlap(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@dataclass(frozen=True)
class Cell:
    """Rows ``rows`` x columns ``cols`` of a matrix view, held whole by each of ``holders``."""

    rows: Span
    cols: Span
    holders: tuple[int, ...]

    def source(self, owner: int) -> int:
        """The holder a block's gradient is read from: its owner when it holds the cell
        (nothing travels), else the lowest holder."""
        return owner if owner in self.holders else self.holders[0]


class ParameterHoldings:
    """The cells of one parameter's matrix view, found by bisection on their edges."""

    def __init__(self, shape: Span, rectangles: list[tuple[Span, Span]]) -> None:
        self.shape = shape
        self.rectangles = rectangles
        holders: dict[tuple[Span, Span], list[int]] = {}
        for rank, (rows, cols) in enumerate(rectangles):
            if rows[0] < rows[1] and cols[0] < cols[1]:
                holders.setdefault((rows, cols), []).append(rank)
        self.cells = [Cell(rows, cols, tuple(ranks)) for (rows, cols), ranks in sorted(holders.items())]
        self._row_edges = sorted({cell.rows[0] for cell in self.cells})
        self._tallest = max((cell.rows[1] - cell.rows[0] for cell in self.cells), default=0)
        self._by_row: dict[int, list[Cell]] = {}
        for cell in self.cells:
            self._by_row.setdefault(cell.rows[0], []).append(cell)

    def tiles_exactly(self) -> bool:
        """Whether the cells cover the matrix view once: no element held by two
        different rectangles, none by no rank."""
        rows, cols = self.shape
        area = sum((c.rows[1] - c.rows[0]) * (c.cols[1] - c.cols[0]) for c in self.cells)
        inside = all(0 <= c.rows[0] and c.rows[1] <= rows and 0 <= c.cols[0] and c.cols[1] <= cols for c in self.cells)
        return area == rows * cols and inside and all(self.cells_over(c.rows, c.cols) == [c] for c in self.cells)

    def cells_over(self, rows: Span, cols: Span) -> list[Cell]:
        """The cells that share elements with rows ``rows`` x columns ``cols``, in order."""
        first = bisect.bisect_right(self._row_edges, rows[0] - self._tallest)
        last = bisect.bisect_left(self._row_edges, rows[1])
        found = []
        for edge in self._row_edges[first:last]:
            for cell in self._by_row[edge]:
                if _overlap(cell.rows, rows) and _overlap(cell.cols, cols):
                    found.append(cell)
        return found


class Holdings:
    """The rectangle each rank holds of each blocked parameter's matrix view (by index)."""

    def __init__(self, world_size: int, parameters: dict[int, ParameterHoldings]) -> None:
        self.world_size = world_size
        self.parameters = parameters

    @classmethod
    def by_rows(cls, shapes: dict[int, Span], leading: dict[int, int], world_size: int) -> Holdings:
        """FSDP2 on a one-dimensional mesh: each rank holds its chunk of dim 0, every column.
        ``shapes``: the matrix views; ``leading``: each parameter's first dimension."""
        return cls(
            world_size,
            {
                index: ParameterHoldings(
                    (rows, cols),
                    [
                        (view_row_range(rows, leading.get(index, rows), world_size, rank), (0, cols))
                        for rank in range(world_size)
                    ],
                )
                for index, (rows, cols) in shapes.items()
            },
        )

    def held(self, index: int, rank: int) -> tuple[Span, Span]:
        """The rows and columns of parameter ``index`` that ``rank`` holds."""
        return self.parameters[index].rectangles[rank]

    def main_holder(self, index: int, rows: Span, cols: Span) -> int | None:
        """The rank that holds most of rows ``rows`` x columns ``cols`` (the lowest of
        equals; None when no rank holds any): the owner that moves fewest elements."""
        best, most = None, 0
        for cell in self.parameters[index].cells_over(rows, cols):
            height = min(rows[1], cell.rows[1]) - max(rows[0], cell.rows[0])
            width = min(cols[1], cell.cols[1]) - max(cols[0], cell.cols[0])
            held = height * width
            if held > most or (held == most and best is not None and cell.holders[0] < best):
                best, most = cell.holders[0], held
        return best
