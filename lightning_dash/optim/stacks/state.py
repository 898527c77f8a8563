"""Optimizer state held as stacks, and its conversion to per-parameter entries.

While training, DASH keeps every statistic in stacked tensors (one per block
shape) so each step is a handful of batched kernels. Users, checkpoints and
trainers see the standard torch layout instead: ``state[param]`` with tensors in
the parameter's own coordinates. :func:`export_stack` and :func:`import_stack`
translate between the two; exported tensors are copies, never views into a stack.

Per-parameter keys of a preconditioned parameter:
``step``, ``momentum`` and ``grafting_rms`` (parameter-shaped; the square root of the
grafting optimizer's second moment, which never overflows where its square would),
``root_valid`` and ``root_failures`` (one entry per tile), and per tile ``(i, j)``
``left_factor_i_j``, ``right_factor_i_j`` (stored divided by the tile's
``factor_scale_i_j``, a float64 scalar, so that statistics of any finite gradient stay
finite), ``left_root_i_j`` and ``right_root_i_j``, each a full square matrix. State dicts
written before ``grafting_rms`` and ``factor_scale`` existed (``grafting_second_moment``,
unscaled factors) load too. In the stacks a side's factor and root share one tensor
(:mod:`.packed`), half the memory of the two full matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from lightning_dash.optim.stacks import packed
from lightning_dash.optim.stacks.blocks import Region, StackPlan

FACTOR_KEYS = ("left_factor", "right_factor", "left_root", "right_root")
FACTOR_SCALE = "factor_scale"
MOMENTUM = "momentum"
GRAFTING_RMS = "grafting_rms"
#: The key under which older state dicts kept the grafting second moment (not its root).
LEGACY_SECOND_MOMENT = "grafting_second_moment"
ROOT_VALID = "root_valid"
ROOT_FAILURES = "root_failures"


def block_matrices(left_pair: Tensor, right_pair: Tensor, block: int) -> dict[str, Tensor]:
    """One block's factors and roots as full matrices (new tensors), under :data:`FACTOR_KEYS`."""
    left, right = left_pair[block : block + 1], right_pair[block : block + 1]
    return {
        "left_factor": packed.factors(left)[0],
        "right_factor": packed.factors(right)[0],
        "left_root": packed.roots(left)[0],
        "right_root": packed.roots(right)[0],
    }


@dataclass
class StackState:
    """Statistics of the ``n`` blocks of one stack of shape ``(n, rows, cols)``.

    ``left_pair`` ``(n, rows + 1, rows)`` holds each block's left factor and left root,
    ``right_pair`` ``(n, cols + 1, cols)`` the right ones (:mod:`.packed`).
    """

    left_pair: Tensor
    right_pair: Tensor
    root_valid: Tensor
    root_failures: Tensor
    factor_scale: Tensor
    momentum: Tensor | None = None
    grafting_rms: Tensor | None = None

    @classmethod
    def zeros(
        cls, num_blocks: int, shape: tuple[int, int], device: torch.device, dtype: torch.dtype = torch.float32
    ) -> StackState:
        """Empty statistics in ``dtype`` (float64 for float64 parameters, else float32)."""
        rows, cols = shape
        return cls(
            left_pair=packed.empty_pairs(num_blocks, rows, device, dtype),
            right_pair=packed.empty_pairs(num_blocks, cols, device, dtype),
            root_valid=torch.zeros(num_blocks, dtype=torch.bool, device=device),
            root_failures=torch.zeros(num_blocks, dtype=torch.int32, device=device),
            factor_scale=torch.zeros(num_blocks, dtype=torch.float64, device=device),
        )

    def ensure(self, name: str) -> Tensor:
        """Allocate an optional elementwise buffer (momentum, second moment) on first use."""
        tensor = getattr(self, name)
        if tensor is None:
            pairs = self.left_pair
            shape = (pairs.shape[0], packed.pair_side(pairs), packed.pair_side(self.right_pair))
            tensor = torch.zeros(shape, device=pairs.device, dtype=pairs.dtype)
            setattr(self, name, tensor)
        return tensor

    def named_fields(self) -> list[tuple[str, Tensor | None]]:
        """Every field's name and value, in declaration order."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def tensors(self) -> list[Tensor]:
        """Every tensor the record holds (for memory accounting)."""
        return [value for f in fields(self) if (value := getattr(self, f.name)) is not None]

    def set_matrices(self, block: int, matrices: dict[str, Tensor]) -> None:
        """Make one block's factors and roots the full matrices ``matrices`` (under :data:`FACTOR_KEYS`)."""
        for side in ("left", "right"):
            pairs = getattr(self, f"{side}_pair")
            full = [matrices[f"{side}_{kind}"].to(pairs.device, pairs.dtype)[None] for kind in ("factor", "root")]
            pairs[block : block + 1] = packed.pack(*full)

    def copy(self) -> StackState:
        """A new record holding the same tensors (fields can then be replaced freely)."""
        return StackState(**{f.name: getattr(self, f.name) for f in fields(self)})

    def select(self, index: Tensor) -> StackState:
        """Copies of the blocks at ``index`` (for steps where only some blocks move)."""
        return StackState(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name).index_select(0, index)
                for f in fields(self)
            }
        )


def _tile_index(region: Region, block_size: int, row: int, col: int) -> tuple[int, int]:
    return region.view.tile_row(region.row_start, block_size) + row, region.col_start // block_size + col


def export_stack(
    plan: StackPlan,
    state: StackState,
    params: list[Tensor],
    block_size: int,
    out: dict[int, dict[str, Tensor]],
) -> None:
    """Add copies of a stack's state to ``out[param_index]`` in parameter coordinates."""
    root_valid, root_failures = state.root_valid.cpu(), state.root_failures.cpu()
    for region in plan.regions:
        param = params[region.param_index]
        shape = region.view.shape
        entry = out.setdefault(region.param_index, {})
        grid = region.view.grid(block_size)
        valid = entry.setdefault(ROOT_VALID, torch.zeros(grid, dtype=torch.bool))
        failures = entry.setdefault(ROOT_FAILURES, torch.zeros(grid, dtype=torch.int32))
        for name in (MOMENTUM, GRAFTING_RMS):
            stacked = getattr(state, name)
            if stacked is not None:
                full = entry.setdefault(name, torch.zeros(param.shape, device=stacked.device, dtype=stacked.dtype))
                region.window(full.view(shape)).copy_(region.tiles(stacked))
        for row in range(region.tile_rows):
            for col in range(region.tile_cols):
                block = region.stack_offset + row * region.tile_cols + col
                i, j = _tile_index(region, block_size, row, col)
                for key, matrix in block_matrices(state.left_pair, state.right_pair, block).items():
                    entry[f"{key}_{i}_{j}"] = matrix
                entry[f"{FACTOR_SCALE}_{i}_{j}"] = state.factor_scale[block].clone()
                valid[i, j] = root_valid[block]
                failures[i, j] = root_failures[block]


def tile_key(name: str, tile: tuple[int, int]) -> str:
    """The state-dict key of one tile's statistic: ``name_i_j``."""
    return f"{name}_{tile[0]}_{tile[1]}"


def export_tiles(plan: StackPlan, state: StackState, block_size: int, out: dict[int, dict[str, Tensor]]) -> None:
    """Add copies of a stack's state to ``out[param_index]``, every statistic of every
    tile under its own key (``momentum_i_j``, ``root_valid_i_j``, ... as well as the
    factors): the form in which each rank writes only the blocks it owns."""
    per_block = {FACTOR_SCALE: state.factor_scale, ROOT_VALID: state.root_valid, ROOT_FAILURES: state.root_failures}
    per_block.update({key: getattr(state, key) for key in ("left_pair", "right_pair", MOMENTUM, GRAFTING_RMS)})
    held = {key: value.cpu() for key, value in per_block.items() if value is not None}
    left_pair, right_pair = held.pop("left_pair"), held.pop("right_pair")
    for region in plan.regions:
        entry = out.setdefault(region.param_index, {})
        for row in range(region.tile_rows):
            for col in range(region.tile_cols):
                block = region.stack_offset + row * region.tile_cols + col
                tile = _tile_index(region, block_size, row, col)
                for key, value in held.items():
                    entry[tile_key(key, tile)] = value[block].clone()
                for key, matrix in block_matrices(left_pair, right_pair, block).items():
                    entry[tile_key(key, tile)] = matrix


def import_stack(
    plan: StackPlan,
    state: StackState,
    params: list[Tensor],
    block_size: int,
    saved: dict[int, dict[str, Tensor]],
    names: list[str],
) -> None:
    """Fill a freshly allocated stack from per-parameter entries (missing ones stay zero).

    An entry holds parameter-shaped ``momentum``/``grafting_rms`` and tile-grid
    ``root_valid``/``root_failures`` (:func:`export_stack`), or every statistic per tile
    (:func:`export_tiles`); only this stack's tiles are read.
    """
    root_valid, root_failures = state.root_valid.cpu(), state.root_failures.cpu()
    rows, cols = packed.pair_side(state.left_pair), packed.pair_side(state.right_pair)
    shapes = {key: (rows, rows) if key.startswith("left") else (cols, cols) for key in FACTOR_KEYS}
    for region in plan.regions:
        entry = saved.get(region.param_index)
        # No factors at all: a parameter without statistics yet. (A retired sharded layout
        # holds only this rank's tiles, so tile (0, 0) need not be among them.)
        if not entry or not any(key.startswith(f"{FACTOR_KEYS[0]}_") for key in entry):
            continue
        param = params[region.param_index]
        shape = region.view.shape
        for name in (MOMENTUM, GRAFTING_RMS):
            if name in entry:  # parameter-shaped
                full = entry[name]
                if full.numel() != param.numel():
                    raise ValueError(
                        f"saved {name} of {names[region.param_index]} has shape "
                        f"{tuple(full.shape)}, expected {tuple(param.shape)}"
                    )
                region.tiles(state.ensure(name)).copy_(region.window(full.reshape(shape)))
        for row in range(region.tile_rows):
            for col in range(region.tile_cols):
                block = region.stack_offset + row * region.tile_cols + col
                tile = _tile_index(region, block_size, row, col)
                matrices = {key: entry.get(tile_key(key, tile)) for key in FACTOR_KEYS}
                for key, saved_block in matrices.items():
                    if saved_block is None or saved_block.shape != shapes[key]:
                        raise ValueError(
                            f"saved state of {names[region.param_index]} does not match block_size="
                            f"{block_size}: missing or mis-shaped {tile_key(key, tile)}"
                        )
                state.set_matrices(block, matrices)
                for name in (MOMENTUM, GRAFTING_RMS):
                    if tile_key(name, tile) in entry:
                        state.ensure(name)[block].copy_(entry[tile_key(name, tile)])
                saved_scale = entry.get(tile_key(FACTOR_SCALE, tile))
                state.factor_scale[block] = 1.0 if saved_scale is None else saved_scale
                for name, target in ((ROOT_VALID, root_valid), (ROOT_FAILURES, root_failures)):
                    target[block] = entry[tile_key(name, tile)] if name not in entry else entry[name][tile]
    state.root_valid.copy_(root_valid)
    state.root_failures.copy_(root_failures)
