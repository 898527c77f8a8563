"""Which gradient pieces travel to which block owner, and which update pieces come back.

Each rank holds a rectangle of every parameter's matrix view (:mod:`.holdings`: a run
of rows under FSDP2, a rectangle under tensor parallelism, possibly replicated). A
DASH block is a tile of the whole parameter's matrix view, so it may sit on several
ranks. A *piece* is the part of one block inside one holder's rectangle: a gradient
piece comes from one holder of it, update pieces go to all of them. Every rank derives the same list of pieces
from the parameter shapes and the ownership plan (the blocks are a single process's,
whatever the world size), so gradient pieces go to owners and update pieces come back
in one ``all_to_all`` each, in an order both sides agree on without any metadata.

Each side moves its pieces with one gather or scatter over one flat tensor: a holder
over its rectangles of every blocked parameter, end to end (:attr:`PieceExchange.held`),
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
from lightning_dash.distributed.holdings import Holdings
from lightning_dash.optim.stacks import Region, StackPlan, stacks_by_placement


@dataclass(frozen=True)
class Piece:
    """The rows ``rows`` x columns ``cols`` of one block that travel between ``owner`` and
    ``holder``: a gradient piece the holder sends, or an update piece it receives.

    ``owner`` updates the block, which is block ``block`` of its stack ``stack``;
    ``block_row`` and ``block_col`` place the piece inside the block.
    """

    owner: int
    holder: int
    stack: int
    block: int
    param_index: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    block_row: int
    block_col: int = 0

    @property
    def height(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def width(self) -> int:
        return self.cols[1] - self.cols[0]

    @property
    def numel(self) -> int:
        return self.height * self.width


def plan_pieces(
    rank_plans: list[list[StackPlan]], holdings: Holdings, rank: int | None = None
) -> tuple[list[Piece], list[Piece]]:
    """Every gradient piece and every update piece of every rank's blocks, in the
    canonical order: owner, its stack, block, then cell; with ``rank``, only the pieces
    it sends or receives. A block's gradient is read from one holder of each cell it
    crosses (:meth:`Cell.source`); its update goes to every holder of the cell."""
    gradients, updates = [], []
    for owner, plans in enumerate(rank_plans):
        for stack, plan in enumerate(plans):
            block_rows, block_cols = plan.block_shape
            for region in plan.regions:
                cells = holdings.parameters[region.param_index]
                for offset, tile in enumerate(region.single_tiles()):
                    top, left = tile.row_start, tile.col_start
                    block = region.stack_offset + offset
                    for cell in cells.cells_over((top, top + block_rows), (left, left + block_cols)):
                        rows = (max(top, cell.rows[0]), min(top + block_rows, cell.rows[1]))
                        cols = (max(left, cell.cols[0]), min(left + block_cols, cell.cols[1]))
                        source = cell.source(owner)
                        place = (owner, stack, block, region.param_index, rows, cols, rows[0] - top, cols[0] - left)
                        if rank is None or rank in (owner, source):
                            gradients.append(Piece(place[0], source, *place[1:]))
                        for holder in cell.holders:
                            if rank is None or rank in (owner, holder):
                                updates.append(Piece(place[0], holder, *place[1:]))
    return gradients, updates


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
class PieceExchange:
    """One rank's side of the exchange.

    ``gradients_out[r]``: the gradient pieces this rank sends to owner ``r``;
    ``gradients_in[r]``: the gradient pieces of this rank's blocks that rank ``r`` sends;
    ``updates_out[r]``: the update pieces of this rank's blocks that rank ``r`` holds;
    ``updates_in[r]``: the update pieces this rank holds of rank ``r``'s blocks. Without
    replicated cells the update pieces are the gradient pieces, travelling back.
    ``holdings``: every rank's rectangles.
    """

    rank: int
    gradients_out: list[list[Piece]]
    gradients_in: list[list[Piece]]
    updates_out: list[list[Piece]]
    updates_in: list[list[Piece]]
    holdings: Holdings = field(repr=False)

    @cached_property
    def held(self) -> dict[int, tuple[int, int]]:
        """Where each parameter's rectangle sits in this rank's flat holder tensor
        (its rectangles end to end in parameter order): parameter index -> (offset, numel)."""
        placed, offset = {}, 0
        for index in sorted(self.holdings.parameters):
            (top, bottom), (left, right) = self.holdings.held(index, self.rank)
            numel = max(bottom - top, 0) * max(right - left, 0)
            placed[index] = (offset, numel)
            offset += numel
        return placed

    def _holder_runs(self, lists: list[list[Piece]]) -> Runs:
        held = self.held
        pieces = [piece for pieces in lists for piece in pieces]
        rectangles = [self.holdings.held(p.param_index, self.rank) for p in pieces]
        widths = [right - left for _, (left, right) in rectangles]
        return _runs_of_rectangles(
            [
                held[p.param_index][0] + (p.rows[0] - top) * width + p.cols[0] - left
                for p, ((top, _), (left, _)), width in zip(pieces, rectangles, widths)
            ],
            [p.height for p in pieces],
            widths,
            [p.width for p in pieces],
        )

    def _owner_runs(self, plans: list[StackPlan], lists: list[list[Piece]]) -> Runs:
        stack_offsets, offset = [], 0
        for plan in plans:
            stack_offsets.append(offset)
            offset += plan.num_blocks * plan.block_shape[0] * plan.block_shape[1]
        pieces = [piece for pieces in lists for piece in pieces]
        shapes = [plans[p.stack].block_shape for p in pieces]
        return _runs_of_rectangles(
            [
                stack_offsets[p.stack] + p.block * rows * cols + p.block_row * cols + p.block_col
                for p, (rows, cols) in zip(pieces, shapes)
            ],
            [p.height for p in pieces],
            [cols for _, cols in shapes],
            [p.width for p in pieces],
        )

    def gradient_send_runs(self) -> Runs:
        """The outgoing gradients' elements in the flat holder tensor (see :attr:`held`)."""
        return self._holder_runs(self.gradients_out)

    def update_receive_runs(self) -> Runs:
        """Where the incoming updates' elements go in the flat holder tensor."""
        return self._holder_runs(self.updates_in)

    def gradient_receive_runs(self, plans: list[StackPlan]) -> Runs:
        """Where the incoming gradients' elements go in this rank's stacks (``plans``), end to end."""
        return self._owner_runs(plans, self.gradients_in)

    def update_send_runs(self, plans: list[StackPlan]) -> Runs:
        """The outgoing updates' elements in this rank's stacks (``plans``), end to end."""
        return self._owner_runs(plans, self.updates_out)

    @cached_property
    def held_numel(self) -> int:
        """Elements of this rank's flat holder tensor."""
        return sum(numel for _, numel in self.held.values())

    @cached_property
    def split_sizes(self) -> dict[str, list[int]]:
        """Elements per rank of each exchange's piece lists (the ``all_to_all`` split sizes), by the
        lists' names: ``gradients_out``, ``gradients_in``, ``updates_out`` and ``updates_in``."""
        lists = {
            "gradients_out": self.gradients_out,
            "gradients_in": self.gradients_in,
            "updates_out": self.updates_out,
            "updates_in": self.updates_in,
        }
        return {name: [sum(piece.numel for piece in pieces) for pieces in per_rank] for name, per_rank in lists.items()}

    def elements_sent(self) -> int:
        """Elements this rank sends to other ranks in one step: its gradient pieces of
        their blocks, then the update pieces of its blocks that they hold."""
        out, back = self.split_sizes["gradients_out"], self.split_sizes["updates_out"]
        return sum(out) - out[self.rank] + sum(back) - back[self.rank]


def exchange_for(gradients: list[Piece], updates: list[Piece], rank: int, holdings: Holdings) -> PieceExchange:
    """The side of ``rank`` of the exchange of these pieces (see :func:`plan_pieces`; the
    pieces of every rank, or only those ``rank`` sends or receives)."""
    world_size = holdings.world_size
    lists: list[list[list[Piece]]] = [[[] for _ in range(world_size)] for _ in range(4)]
    gradients_out, gradients_in, updates_out, updates_in = lists
    for piece in gradients:
        if piece.holder == rank:
            gradients_out[piece.owner].append(piece)
        if piece.owner == rank:
            gradients_in[piece.holder].append(piece)
    for piece in updates:
        if piece.owner == rank:
            updates_out[piece.holder].append(piece)
        if piece.holder == rank:
            updates_in[piece.owner].append(piece)
    return PieceExchange(rank, gradients_out, gradients_in, updates_out, updates_in, holdings)


def matrix_views(regions: list[Region], params: list[Tensor]) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
    """The matrix view of each blocked parameter (by index) and its first dimension, the
    one FSDP2 shards."""
    shapes = {region.param_index: region.view.shape for region in regions}
    return shapes, {index: int(params[index].shape[0]) for index in shapes}


def row_holdings(regions: list[Region], params: list[Tensor], world_size: int) -> Holdings:
    """What each rank holds of the blocked parameters when FSDP2 shards them by rows."""
    shapes, leading = matrix_views(regions, params)
    return Holdings.by_rows(shapes, leading, world_size)


def holder_preferences(regions: list[Region], holdings: Holdings) -> list[int | None]:
    """For each tile of ``regions``, in order, the rank that holds most of it
    (:meth:`Holdings.main_holder`): the owner LPT prefers among equally loaded ranks."""
    return [
        holdings.main_holder(
            tile.param_index,
            (tile.row_start, tile.row_start + tile.block_shape[0]),
            (tile.col_start, tile.col_start + tile.block_shape[1]),
        )
        for region in regions
        for tile in region.single_tiles()
    ]


def plan_rank(
    regions: list[Region], params: list[Tensor], owners: list[int], holdings: Holdings, rank: int
) -> tuple[list[list[StackPlan]], PieceExchange]:
    """Every rank's stacks given each tile's owner, and ``rank``'s side of the exchange
    (built from only the pieces it sends or receives)."""
    world_size = holdings.world_size
    rank_plans = [stacks_by_placement(owned, params) for owned in split_by_owner(regions, owners, world_size)]
    gradients, updates = plan_pieces(rank_plans, holdings, rank=rank)
    return rank_plans, exchange_for(gradients, updates, rank, holdings)
