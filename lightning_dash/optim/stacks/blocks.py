"""Cutting parameters into Shampoo blocks and grouping equal shapes into stacks.

A preconditioned parameter is viewed as a matrix (its :class:`MatrixView`): by
default ``(shape[0], rest)``; a stack of expert matrices or a fused projection is
viewed as ``parts`` matrices one above the other. Each part is cut into
``block_size`` x ``block_size`` tiles from its top-left; its last row and column
of tiles hold the remainders, so no tile spans two parts. Tiles of one shape
that are adjacent in a part form a *region* (at most four per part: the full
tiles, the right strip, the bottom strip and the corner). All blocks of one
shape, across every parameter, form a *stack* that is processed as one
``(n, rows, cols)`` tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The default 2D view of a parameter: ``(shape[0], prod(shape[1:]))``."""
    return int(shape[0]), int(math.prod(shape[1:]))


@dataclass(frozen=True)
class MatrixView:
    """A parameter seen as ``parts`` matrices of ``part_rows x cols``, stacked by rows
    (a contiguous parameter is this ``(parts * part_rows, cols)`` matrix without a copy)."""

    part_rows: int
    cols: int
    parts: int = 1

    @classmethod
    def of(cls, shape: torch.Size | tuple[int, ...]) -> MatrixView:
        """The default view: one ``(shape[0], prod(shape[1:]))`` matrix."""
        rows, cols = matrix_shape(shape)
        return cls(rows, cols)

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts * self.part_rows, self.cols

    def tile_rows_per_part(self, block_size: int) -> int:
        return -(-self.part_rows // block_size)

    def grid(self, block_size: int) -> tuple[int, int]:
        """Tiles down and across the whole view."""
        return self.parts * self.tile_rows_per_part(block_size), -(-self.cols // block_size)

    def tile_row(self, row_start: int, block_size: int) -> int:
        """The grid row of the tile whose first matrix row is ``row_start``."""
        part, within = divmod(row_start, self.part_rows)
        return part * self.tile_rows_per_part(block_size) + within // block_size

    def tile_height(self, tile_row: int, block_size: int) -> int:
        """Rows of the tiles in grid row ``tile_row``."""
        within = tile_row % self.tile_rows_per_part(block_size)
        return min(block_size, self.part_rows - within * block_size)


@dataclass(frozen=True)
class Region:
    """A rectangle of equal-shaped tiles inside one parameter's matrix view."""

    param_index: int
    row_start: int
    col_start: int
    tile_rows: int
    tile_cols: int
    block_shape: tuple[int, int]
    view: MatrixView
    stack_offset: int = 0

    @property
    def num_blocks(self) -> int:
        return self.tile_rows * self.tile_cols

    def single_tiles(self) -> list[Region]:
        """This region as one-tile regions, in row-major order."""
        rows, cols = self.block_shape
        return [
            Region(
                self.param_index,
                self.row_start + row * rows,
                self.col_start + col * cols,
                1,
                1,
                self.block_shape,
                self.view,
            )
            for row in range(self.tile_rows)
            for col in range(self.tile_cols)
        ]

    def window(self, matrix: Tensor) -> Tensor:
        """The region of ``matrix`` viewed as ``(tile_rows, rows, tile_cols, cols)``."""
        rows, cols = self.block_shape
        part = matrix[
            self.row_start : self.row_start + self.tile_rows * rows,
            self.col_start : self.col_start + self.tile_cols * cols,
        ]
        return part.view(self.tile_rows, rows, self.tile_cols, cols)

    def matrix_tiles(self, matrix: Tensor) -> list[Tensor]:
        """This region's tiles of ``matrix`` as ``(tiles, rows, cols)`` views, one per row of
        tiles (a single view when the region is one tile wide), in stack order."""
        rows, cols = self.block_shape
        window = matrix[
            self.row_start : self.row_start + self.tile_rows * rows,
            self.col_start : self.col_start + self.tile_cols * cols,
        ]
        if self.tile_cols == 1:
            return [window.unflatten(0, (self.tile_rows, rows))]
        grid = window.unflatten(1, (self.tile_cols, cols))
        return [grid[row * rows : (row + 1) * rows].transpose(0, 1) for row in range(self.tile_rows)]

    def stack_tiles(self, stack: Tensor) -> list[Tensor]:
        """This region's slice of a stack, cut as :meth:`matrix_tiles` cuts the matrix."""
        part = stack[self.stack_offset : self.stack_offset + self.num_blocks]
        return [part] if self.tile_cols == 1 else list(part.split(self.tile_cols))

    def tiles(self, stack: Tensor) -> Tensor:
        """This region's slice of a stack, viewed as ``(tile_rows, rows, tile_cols, cols)``."""
        rows, cols = self.block_shape
        part = stack[self.stack_offset : self.stack_offset + self.num_blocks]
        return part.view(self.tile_rows, self.tile_cols, rows, cols).permute(0, 2, 1, 3)


def _splits(length: int, block_size: int) -> list[tuple[int, int, int]]:
    """``(start, tile_count, tile_size)`` runs covering ``range(length)``."""
    full, remainder = divmod(length, block_size)
    runs = []
    if full:
        runs.append((0, full, block_size))
    if remainder:
        runs.append((full * block_size, 1, remainder))
    return runs


def param_regions(param_index: int, view: MatrixView, block_size: int) -> list[Region]:
    """Regions of one parameter's matrix view, part by part, in row-major tile order."""
    regions = []
    for part in range(view.parts):
        for row_start, tile_rows, block_rows in _splits(view.part_rows, block_size):
            for col_start, tile_cols, block_cols in _splits(view.cols, block_size):
                regions.append(
                    Region(
                        param_index,
                        part * view.part_rows + row_start,
                        col_start,
                        tile_rows,
                        tile_cols,
                        (block_rows, block_cols),
                        view,
                    )
                )
    return regions


@dataclass
class StackPlan:
    """All regions whose tiles share one block shape, with their offsets in the stack."""

    block_shape: tuple[int, int]
    regions: list[Region] = field(default_factory=list)
    num_blocks: int = 0

    def append(self, region: Region) -> Region:
        placed = Region(**{**region.__dict__, "stack_offset": self.num_blocks})
        self.regions.append(placed)
        self.num_blocks += placed.num_blocks
        return placed

    def subset(self, param_indices: set[int]) -> tuple[StackPlan, list[int]]:
        """The regions of ``param_indices`` as a compact plan, and their blocks' positions here."""
        plan, positions = StackPlan(self.block_shape), []
        for region in self.regions:
            if region.param_index in param_indices:
                plan.append(region)
                positions.extend(range(region.stack_offset, region.stack_offset + region.num_blocks))
        return plan, positions

    def gather(
        self, matrices: dict[int, Tensor], out: Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """Copy the tiles of ``matrices`` (param index -> matrix view) into one stack
        (a new one in ``dtype`` unless ``out`` is given), in one ``cat``."""
        rows, cols = self.block_shape
        if out is None:
            first = next(iter(matrices.values()))
            out = torch.empty(self.num_blocks, rows, cols, dtype=dtype, device=first.device)
        tiles = [tile for region in self.regions for tile in region.matrix_tiles(matrices[region.param_index])]
        return torch.cat(tiles, out=out)

    def add_to(self, params: list[Tensor], update: Tensor) -> None:
        """Add each region's tiles of the stacked ``update`` to its parameter (``params``
        indexed by the regions' ``param_index``)."""
        add_stacks(params, [(self, update)])


def add_stacks(params: list[Tensor], updates: list[tuple[StackPlan, Tensor]]) -> None:
    """Add every stacked update to its parameters' tiles: one foreach call for all of them
    (parameters that are not contiguous take a dense copy each)."""
    targets: list[Tensor] = []
    sources: list[Tensor] = []
    for plan, update in updates:
        for region in plan.regions:
            param = params[region.param_index]
            shape = region.view.shape
            if param.is_contiguous():
                targets += region.matrix_tiles(param.view(shape))
                sources += region.stack_tiles(update)
            else:
                dense = torch.zeros(shape, dtype=update.dtype, device=update.device)
                region.window(dense).copy_(region.tiles(update))
                param.add_(dense.view(param.shape))
    if targets:
        torch._foreach_add_(targets, sources)


def stack_regions(regions: list[Region]) -> list[StackPlan]:
    """Group regions by block shape, stacks in order of first appearance."""
    stacks: dict[tuple[int, int], StackPlan] = {}
    for region in regions:
        stacks.setdefault(region.block_shape, StackPlan(region.block_shape)).append(region)
    return list(stacks.values())
