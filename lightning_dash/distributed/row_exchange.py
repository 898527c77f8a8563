"""Which gradient rows travel to which block owner when parameters are sharded by rows.

FSDP2 cuts dim 0 of every parameter the way ``torch.chunk`` does: ``ceil(rows / N)``
rows per rank, the last ranks holding fewer (or none). A DASH block is a tile of the
whole parameter's matrix view, so its rows may sit on several ranks. A *piece* is the
part of one block that one rank holds. Every rank derives the same list of pieces
from the parameter shapes and the ownership plan (the blocks are a single process's,
whatever the world size), so gradient pieces go to owners and update pieces come back
in one ``all_to_all`` each, in an order both sides agree on without any metadata.

Each side moves its pieces with one gather or scatter over one flat tensor: a holder
over its row shards of every blocked parameter, end to end (:attr:`RowExchange.held`),
an owner over its stacks, end to end. Every row of a piece is a run of consecutive
elements on both sides, so a side's whole part is a list of runs (:class:`Runs`), kept
per layout (two integers a run); the element positions are expanded from it for one
exchange and freed, rather than kept (8 bytes an element).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from lightning_dash.distributed.block_exchange import split_by_owner
from lightning_dash.optim.stacks import Region, StackPlan, stacks_by_placement


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


@dataclass(frozen=True)
class Runs:
    """Where the elements of an exchanged buffer sit in a flat tensor, as runs of
    consecutive elements: the buffer is run 0, then run 1, ...; run ``k`` is ``lengths[k]``
    elements of the flat tensor from ``starts[k]`` (see :meth:`of`).

    Kept as each run's offset in the buffer and its *jump*: how far its first position
    lies past the position before it in the buffer (the first run: its start). Positions
    are then a running sum of ones and jumps: one fill, one small scatter and one scan,
    with no host synchronisation.
    """

    offsets: Tensor
    jumps: Tensor
    total: int

    @classmethod
    def of(cls, starts: Tensor, lengths: Tensor) -> Runs:
        nonempty = lengths > 0
        starts, lengths = starts[nonempty], lengths[nonempty]
        last = starts + lengths - 1
        before = torch.cat([last.new_zeros(1), last[:-1]])
        return cls(torch.cumsum(lengths, 0) - lengths, starts - before, int(lengths.sum()))

    def to(self, device: torch.device) -> Runs:
        return Runs(self.offsets.to(device), self.jumps.to(device), self.total)

    def positions(self) -> Tensor:
        """The flat position of every element of the buffer, in buffer order."""
        steps = torch.ones(self.total, dtype=torch.int64, device=self.offsets.device)
        return steps.index_copy_(0, self.offsets, self.jumps).cumsum_(0)


def _runs_of_rectangles(bases: list[int], heights: list[int], steps: list[int], widths: list[int]) -> Runs:
    """The runs of rectangles laid end to end in a buffer: rectangle ``i`` is
    ``heights[i]`` rows of ``widths[i]`` elements, row ``j`` starting at
    ``bases[i] + j * steps[i]`` of the flat tensor."""
    heights_t = torch.tensor(heights, dtype=torch.int64)
    rectangle = torch.repeat_interleave(torch.arange(len(heights)), heights_t)
    first_row = torch.cumsum(heights_t, 0) - heights_t
    row = torch.arange(len(rectangle)) - first_row[rectangle]
    starts = torch.tensor(bases, dtype=torch.int64)[rectangle] + row * torch.tensor(steps, dtype=torch.int64)[rectangle]
    return Runs.of(starts, torch.tensor(widths, dtype=torch.int64)[rectangle])


@dataclass
class RowExchange:
    """One rank's side of the exchange.

    ``outgoing[r]``: the pieces this rank holds of rank ``r``'s blocks (gradients go
    out in this order, updates come back in it); ``incoming[r]``: the pieces of this
    rank's blocks that rank ``r`` holds; ``held_rows``: the rows of each parameter's
    matrix view this rank holds, ``columns`` the view's columns.
    """

    rank: int
    outgoing: list[list[Piece]]
    incoming: list[list[Piece]]
    held_rows: dict[int, tuple[int, int]]
    columns: dict[int, int] = field(default_factory=dict)

    @cached_property
    def held(self) -> dict[int, tuple[int, int]]:
        """Where each parameter's row shard sits in this rank's flat holder tensor
        (its shards end to end in parameter order): parameter index -> (offset, numel)."""
        placed, offset = {}, 0
        for index in sorted(self.held_rows):
            start, end = self.held_rows[index]
            numel = (end - start) * self.columns[index]
            placed[index] = (offset, numel)
            offset += numel
        return placed

    def holder_runs(self) -> Runs:
        """The outgoing buffer's elements in the flat holder tensor (see :attr:`held`)."""
        held = self.held
        pieces = [piece for pieces in self.outgoing for piece in pieces]
        return _runs_of_rectangles(
            [
                held[p.param_index][0]
                + (p.rows[0] - self.held_rows[p.param_index][0]) * self.columns[p.param_index]
                + p.cols[0]
                for p in pieces
            ],
            [p.height for p in pieces],
            [self.columns[p.param_index] for p in pieces],
            [p.width for p in pieces],
        )

    def owner_runs(self, plans: list[StackPlan]) -> Runs:
        """The incoming buffer's elements in this rank's stacks (``plans``), end to end."""
        stack_offsets, offset = [], 0
        for plan in plans:
            stack_offsets.append(offset)
            offset += plan.num_blocks * plan.block_shape[0] * plan.block_shape[1]
        pieces = [piece for pieces in self.incoming for piece in pieces]
        block_numel = [plans[p.stack].block_shape[0] * p.width for p in pieces]
        return _runs_of_rectangles(
            [stack_offsets[p.stack] + p.block * size + p.block_row * p.width for p, size in zip(pieces, block_numel)],
            [p.height for p in pieces],
            [p.width for p in pieces],
            [p.width for p in pieces],
        )

    @cached_property
    def held_numel(self) -> int:
        """Elements of this rank's flat holder tensor."""
        return sum(numel for _, numel in self.held.values())

    @cached_property
    def outgoing_sizes(self) -> list[int]:
        return [sum(piece.numel for piece in pieces) for pieces in self.outgoing]

    @cached_property
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
    held_rows = {
        index: view_row_range(rows, leading.get(index, rows), world_size, rank) for index, (rows, _) in shapes.items()
    }
    return RowExchange(rank, outgoing, incoming, held_rows, {index: cols for index, (_, cols) in shapes.items()})


def matrix_views(regions: list[Region], params: list[Tensor]) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
    """The matrix view of each blocked parameter (by index) and its first dimension, the
    one FSDP2 shards: what :func:`plan_pieces` and :func:`exchange_for` take."""
    shapes = {region.param_index: region.view.shape for region in regions}
    return shapes, {index: int(params[index].shape[0]) for index in shapes}


def holder_preferences(regions: list[Region], params: list[Tensor], world_size: int) -> list[int | None]:
    """For each tile of ``regions``, in order, the rank that holds most of its rows
    (:func:`main_holder`): the owner LPT prefers among equally loaded ranks."""
    shapes, leading = matrix_views(regions, params)
    return [
        main_holder(
            tile.row_start, tile.block_shape[0], shapes[tile.param_index][0], leading[tile.param_index], world_size
        )
        for region in regions
        for tile in region.single_tiles()
    ]


def plan_rank(
    regions: list[Region], params: list[Tensor], owners: list[int], world_size: int, rank: int
) -> tuple[list[list[StackPlan]], RowExchange]:
    """Every rank's stacks given each tile's owner, and ``rank``'s side of the row exchange
    (built from only the pieces it sends or receives)."""
    shapes, leading = matrix_views(regions, params)
    rank_plans = [stacks_by_placement(owned, params) for owned in split_by_owner(regions, owners, world_size)]
    pieces = plan_pieces(rank_plans, shapes, world_size, leading, rank=rank)
    return rank_plans, exchange_for(pieces, rank, world_size, shapes, leading)
