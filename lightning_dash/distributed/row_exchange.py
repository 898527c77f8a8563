"""Which gradient rows travel to which block owner when parameters are sharded by rows.

FSDP2 cuts dim 0 of every parameter the way ``torch.chunk`` does: ``ceil(rows / N)``
rows per rank, the last ranks holding fewer (or none). A DASH block is a tile of the
whole parameter's matrix view, so its rows may sit on several ranks. A *piece* is the
part of one block that one rank holds. Every rank derives the same list of pieces
from the parameter shapes and the ownership plan (the blocks are a single process's,
whatever the world size), so gradient pieces go to owners and update pieces come back
in one ``all_to_all`` each, in an order both sides agree on without any metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from lightning_dash.optim.blocks import StackPlan


def row_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of the rows ``rank`` holds of a dimension of ``rows`` (chunk semantics)."""
    chunk = -(-rows // world_size) if rows else 0
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


@dataclass(frozen=True)
class Piece:
    """The rows ``rows`` x columns ``cols`` of one block that rank ``holder`` holds.

    ``owner`` updates the block, which is block ``block`` of its stack ``stack``;
    ``block_row`` is the first of these rows counted inside the block.
    """

    owner: int
    holder: int
    stack: int
    block: int
    param_index: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    block_row: int

    @property
    def height(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def width(self) -> int:
        return self.cols[1] - self.cols[0]

    @property
    def numel(self) -> int:
        return self.height * self.width


def view_row_range(view_rows: int, leading: int, world_size: int, rank: int) -> tuple[int, int]:
    """``rank``'s rows of a matrix view of ``view_rows`` rows of a parameter whose first
    dimension, the one FSDP2 shards, has ``leading`` entries (a stack of experts viewed
    as one matrix per expert has ``view_rows / leading`` rows per entry)."""
    per_entry = view_rows // leading if leading else 1
    start, end = row_range(leading, world_size, rank)
    return start * per_entry, end * per_entry


def holders_of(top: int, height: int, view_rows: int, leading: int, world_size: int) -> range:
    """The ranks that may hold rows ``[top, top + height)`` of the matrix view: only the
    ranks whose chunks the rows cross, found by division (not by visiting every rank)."""
    chunk = -(-leading // world_size) if leading else 0
    span = chunk * (view_rows // leading if leading else 1)  # view rows per rank's chunk
    if span == 0 or height == 0:
        return range(0)
    return range(top // span, min((top + height - 1) // span, world_size - 1) + 1)


def main_holder(top: int, height: int, view_rows: int, leading: int, world_size: int) -> int | None:
    """The rank that holds most of rows ``[top, top + height)`` of the matrix view (the
    lowest of equals; None when no rank holds any): the owner that moves fewest rows."""
    holders = holders_of(top, height, view_rows, leading, world_size)
    best, most = None, 0
    # ranks strictly between the first and the last hold whole chunks, equal to the second's
    for holder in sorted({*holders[:2], *holders[-1:]}):
        start, end = view_row_range(view_rows, leading, world_size, holder)
        held = min(top + height, end) - max(top, start)
        if held > most:
            best, most = holder, held
    return best


def plan_pieces(
    rank_plans: list[list[StackPlan]],
    shapes: dict[int, tuple[int, int]],
    world_size: int,
    leading: dict[int, int] | None = None,
    rank: int | None = None,
) -> list[Piece]:
    """Every piece of every rank's blocks, in the canonical order: owner, its stack,
    block, then holder; with ``rank``, only the pieces it sends or receives (what its
    side of the exchange needs). ``shapes`` are the matrix views of the parameters by
    index, ``leading`` their first dimensions where the view's rows differ from it."""
    leading = leading or {}
    pieces = []
    for owner, plans in enumerate(rank_plans):
        for stack, plan in enumerate(plans):
            block_rows, block_cols = plan.block_shape
            for region in plan.regions:
                rows = shapes[region.param_index][0]
                entries = leading.get(region.param_index, rows)
                for offset, tile in enumerate(region.single_tiles()):
                    top, left = tile.row_start, tile.col_start
                    for holder in holders_of(top, block_rows, rows, entries, world_size):
                        if rank is not None and rank not in (owner, holder):
                            continue
                        start, end = view_row_range(rows, entries, world_size, holder)
                        low, high = max(top, start), min(top + block_rows, end)
                        if low < high:
                            pieces.append(
                                Piece(
                                    owner,
                                    holder,
                                    stack,
                                    region.stack_offset + offset,
                                    region.param_index,
                                    (low, high),
                                    (left, left + block_cols),
                                    low - top,
                                )
                            )
    return pieces


@dataclass
class RowExchange:
    """One rank's side of the exchange.

    ``outgoing[r]``: the pieces this rank holds of rank ``r``'s blocks (gradients go
    out in this order, updates come back in it); ``incoming[r]``: the pieces of this
    rank's blocks that rank ``r`` holds; ``first_rows``: this rank's first row of each
    parameter's matrix view, ``columns`` the view's columns.
    """

    rank: int
    outgoing: list[list[Piece]]
    incoming: list[list[Piece]]
    first_rows: dict[int, int]
    columns: dict[int, int] = field(default_factory=dict)

    def local_matrix(self, param_index: int, local: Tensor) -> Tensor:
        """This rank's shard of parameter ``param_index`` as rows of its matrix view."""
        return local.view(-1, self.columns[param_index])

    @property
    def outgoing_sizes(self) -> list[int]:
        return [sum(piece.numel for piece in pieces) for pieces in self.outgoing]

    @property
    def incoming_sizes(self) -> list[int]:
        return [sum(piece.numel for piece in pieces) for pieces in self.incoming]

    def elements_sent(self) -> int:
        """Elements this rank sends to other ranks in one step: its gradient pieces of
        their blocks, then the update pieces of its blocks that they hold."""
        out, back = self.outgoing_sizes, self.incoming_sizes
        return sum(out) - out[self.rank] + sum(back) - back[self.rank]


def exchange_for(
    pieces: list[Piece],
    rank: int,
    world_size: int,
    shapes: dict[int, tuple[int, int]],
    leading: dict[int, int] | None = None,
) -> RowExchange:
    """The side of ``rank`` of the exchange of ``pieces`` (see :func:`plan_pieces`; the
    pieces of every rank, or only those ``rank`` sends or receives)."""
    leading = leading or {}
    outgoing: list[list[Piece]] = [[] for _ in range(world_size)]
    incoming: list[list[Piece]] = [[] for _ in range(world_size)]
    for piece in pieces:
        if piece.holder == rank:
            outgoing[piece.owner].append(piece)
        if piece.owner == rank:
            incoming[piece.holder].append(piece)
    first_rows = {
        index: view_row_range(rows, leading.get(index, rows), world_size, rank)[0]
        for index, (rows, _) in shapes.items()
    }
    return RowExchange(rank, outgoing, incoming, first_rows, {index: cols for index, (_, cols) in shapes.items()})
