"""DASH: Shampoo with every equal-shaped block of every parameter processed as one stack."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor

from lightning_dash.optim.async_roots import RootPipeline
from lightning_dash.optim.blocks import Region, StackPlan, matrix_shape, param_regions, stack_regions
from lightning_dash.optim.conversion import DEFAULT_FACTOR_DECAY, dash_group_settings
from lightning_dash.optim.distributor import BlockDistributor
from lightning_dash.optim.factors import accumulate_factors
from lightning_dash.optim.grafting import (
    GRAFTING_TYPES,
    graft_norm,
    grafting_direction,
    next_rms,
    uses_second_moment,
)
from lightning_dash.optim.roots import RootResult, RootSettings, failure_residual, inverse_root
from lightning_dash.optim.state import (
    GRAFTING_RMS,
    MOMENTUM,
    ROOT_FAILURES,
    ROOT_VALID,
    StackState,
    check_loadable,
    export_stack,
    import_stack,
    upgrade_entry,
)
from lightning_dash.optim.validation import (
    check_async_preconditioning,
    check_choice,
    check_group,
    check_max_staleness,
    check_optimizer_options,
)

PerBlock = Union[float, Tensor]

#: Relative damping of the factors (see ``epsilon``), chosen by measurement
#: (``benchmarks/damping.py``, README: Damping).
DEFAULT_EPSILON = 1e-6


class RootComputationError(RuntimeError):
    """A block's inverse root failed ``max_consecutive_root_failures`` times in a row."""


@dataclass
class _Stack:
    """One stack: its plan (which tiles of which parameters) and its state."""

    plan: StackPlan
    state: StackState
    update_offset: int = 0


@dataclass
class _VectorGroup:
    """The one-dimensional parameters of one param group on one device, as flat buffers."""

    group_index: int
    param_indices: list[int]
    offsets: list[int]
    numels: list[int]
    momentum: Tensor
    rms: Tensor


@dataclass
class _VectorWork:
    """The candidate step of the moving one-dimensional parameters of one group."""

    vector: _VectorGroup
    params: list[Tensor]
    numels: list[int]
    index: Optional[Tensor]
    momentum: Optional[Tensor]
    rms: Tensor
    update: Tensor

    def update_views(self) -> list[Tensor]:
        """The flat update cut into one tensor per parameter, shaped like it."""
        return [u.view(p.shape).to(p.dtype) for u, p in zip(self.update.split(self.numels), self.params)]

    def commit(self) -> None:
        """Make the candidate momentum and second moment the group's state."""
        if self.index is None:
            if self.momentum is not None:
                self.vector.momentum = self.momentum
            self.vector.rms = self.rms
        else:
            if self.momentum is not None:
                self.vector.momentum[self.index] = self.momentum
            self.vector.rms[self.index] = self.rms


@dataclass
class _Exchange:
    """Every rank's stacks and where their updates sit in the gathered flat buffers."""

    plans: list[list[StackPlan]]
    offsets: list[list[int]]
    size: int


@dataclass
class _Layout:
    """Where every parameter's state lives while training."""

    params: list[Tensor]
    group_of: list[int]
    names: list[str]
    steps: list[int]
    stacks: list[_Stack]
    vectors: list[_VectorGroup]
    exchange: Optional[_Exchange] = None


@dataclass
class _StackWork:
    """The blocks of one stack that move in the current step."""

    stack: _Stack
    plan: StackPlan
    index: Optional[Tensor]
    state: StackState
    momentum: Tensor
    steps: list[int]
    groups: list[dict[str, Any]]
    due: Optional[Tensor]
    due_regions: list[int]

    def commit(self) -> None:
        """Make the candidate state the stack's state (fields are replaced, so objects
        that hold the stack's state, such as pending asynchronous roots, stay valid)."""
        if self.index is None:
            self.stack.state.assign(self.state)
        else:
            self.stack.state.commit(self.index, self.state)


@dataclass
class _RootRequest:
    """One batched solver call: every due factor of one size (a fresh, bias-corrected copy)."""

    inputs: Tensor
    eps: Tensor
    scale: Tensor
    min_eps: float
    pieces: list[tuple[int, str]]  # (target, "left" | "right") of each consecutive piece
    counts: list[int]  # blocks in each piece


@dataclass
class _RootJob:
    """The roots due in one step: solver calls, and the (state, blocks) each result goes to."""

    targets: list[tuple[StackState, Optional[Tensor]]]
    requests: list[_RootRequest]


def _stack_positions(work: _StackWork) -> Optional[Tensor]:
    """Positions in the whole stack of the work's due blocks (None: every block)."""
    if work.index is None:
        return work.due
    return work.index if work.due is None else work.index[work.due]


#: Options DASH keeps per parameter group (everything else is optimizer-wide).
_GROUP_KEYS = frozenset({
    "lr", "betas", "epsilon", "weight_decay", "grafting_beta2", "grafting_epsilon",
    "precondition_frequency", "start_preconditioning_step", "shampoo_blend",
})


def _committed_streaks(layout: "_Layout") -> list[tuple[StackPlan, Tensor]]:
    """Every stack's plan with its committed per-block root failure streaks."""
    return [(stack.plan, stack.state.root_failures) for stack in layout.stacks]


def _state_dtype(param: Tensor) -> torch.dtype:
    """Optimizer state of float64 parameters is float64; of every other dtype, float32."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _stacks_by_placement(regions: list[Region], params: list[Tensor]) -> list[StackPlan]:
    """Stacks of equal block shape, apart for each device and state dtype."""
    placement = lambda region: (params[region.param_index].device, _state_dtype(params[region.param_index]))  # noqa: E731
    keys = dict.fromkeys(placement(region) for region in regions)
    return [plan for key in keys for plan in stack_regions([r for r in regions if placement(r) == key])]


def _roots_due(step: int, group: dict[str, Any]) -> bool:
    """Whether a block at its ``step`` recomputes its roots: at start, start + f, ..."""
    start = group["start_preconditioning_step"]
    return step >= start and (step - start) % group["precondition_frequency"] == 0


def _per_block(values: list[float], counts: list[int], device: torch.device) -> PerBlock:
    """One value per region expanded to one per block: a float when all agree."""
    first = values[0]
    if all(value == first for value in values):
        return first
    expanded = torch.tensor(values, dtype=torch.float32).repeat_interleave(torch.tensor(counts))
    return expanded.to(device)


def _blockwise(value: PerBlock) -> PerBlock:
    """Shape a per-block vector to broadcast over ``(n, rows, cols)``."""
    return value.view(-1, 1, 1) if isinstance(value, Tensor) else value


class DASH(torch.optim.Optimizer):
    """Shampoo with batched block processing, batched inverse roots and grafting.

    Each parameter of two or more dimensions is viewed as a matrix, cut into
    ``block_size`` tiles, and every tile keeps Kronecker factors
    ``L <- b2 L + (1 - b2) G G^T`` and ``R <- b2 R + (1 - b2) G^T G``. Its update is
    ``L^(-1/4) M R^(-1/4)`` (M the gradient momentum), rescaled per block to the
    norm of the grafting optimizer's update. One-dimensional parameters use the
    grafting optimizer alone (Adam when ``grafting="none"``). All tiles of one shape,
    from every parameter and group, are updated together by batched matmuls.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: learning rate.
        betas: ``(momentum of the gradient, decay of the Kronecker factors)``;
            a momentum of 0 disables it, a decay of 1.0 accumulates AdaGrad-style sums.
        epsilon: damping added to the (bias-corrected) factors before the roots:
            ``L + epsilon * ||L||_F * I`` (relative to the factor's Frobenius norm, an
            upper bound of its largest eigenvalue), or ``L + epsilon * I`` with
            ``relative_epsilon=False``. Relative damping makes the update independent
            of the gradients' scale and keeps roundoff in the near-null space of
            rank-deficient factors from being amplified.
        relative_epsilon: whether ``epsilon`` is relative (default) or absolute.
        weight_decay: decoupled weight decay, ``W <- W (1 - lr wd)``.
        block_size: largest tile side; remainders form smaller tiles.
        precondition_frequency: recompute the roots every this many steps.
        start_preconditioning_step: first step that uses the Shampoo direction;
            earlier steps follow the grafting direction.
        inverse_root_method: "eigh" (default), "coupled_newton", "newton_db" or
            "chebyshev". ``eigh`` treats the roundoff-level near-null space of a
            rank-deficient factor as exactly null, so roundoff in the gradients is not
            amplified; the iterative solvers cannot, and amplify it more at small
            ``epsilon`` (README: Damping).
        matrix_scaling: "frobenius" or "power_iteration" (Newton and Chebyshev solvers).
        matmul_dtype: float32, bfloat16 or float16 for the solver matmuls.
        grafting: "adam", "adagrad", "rmsprop", "sgd" or "none" (raw Shampoo direction).
        grafting_beta2: second-moment decay of Adam/RMSprop grafting.
        grafting_epsilon: epsilon of the grafting optimizer.
        nesterov: use a Nesterov-style momentum in the direction.
        bias_correction: correct momentum, factors and Adam's second moment for their
            zero initialisation.
        root_iterations: iterations of the Newton solvers (per pass); None (default):
            as many as the damping needs, planned on the host from the spectrum bound
            relative damping gives (:func:`~lightning_dash.optim.roots.spectrum_floor`);
            see :func:`~lightning_dash.optim.roots.failure_residual` for when a root
            counts as failed.
        chebyshev_degree: degree of the Chebyshev interpolant.
        max_consecutive_root_failures: raise :class:`RootComputationError` once a
            block's root has failed this many times in a row (None: never raise).
        distributor: block ownership across data-parallel ranks (None: own every block).
        async_preconditioning: on CUDA, compute due roots on a side stream and use them
            from a later step (see :mod:`lightning_dash.optim.async_roots`); roots computed
            from the statistics of step ``t`` are used from step ``t + 1`` at the earliest
            and ``t + max_staleness`` at the latest. Off CUDA this is the synchronous path.
        max_staleness: the latest step (counted from the computation's step) at which new
            roots must be used; the main stream waits for them there.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        epsilon: float = DEFAULT_EPSILON,
        weight_decay: float = 0.0,
        block_size: int = 1024,
        precondition_frequency: int = 10,
        start_preconditioning_step: int = 1,
        inverse_root_method: str = "eigh",
        matrix_scaling: str = "power_iteration",
        matmul_dtype: torch.dtype | str = torch.float32,
        grafting: str = "adam",
        grafting_beta2: float = 0.95,
        grafting_epsilon: float = 1e-8,
        nesterov: bool = False,
        bias_correction: bool = True,
        root_iterations: Optional[int] = None,
        chebyshev_degree: int = 40,
        max_consecutive_root_failures: Optional[int] = 3,
        distributor: Optional[BlockDistributor] = None,
        async_preconditioning: bool = False,
        max_staleness: int = 1,
        relative_epsilon: bool = True,
    ) -> None:
        options = check_optimizer_options(dict(
            relative_epsilon=relative_epsilon,
            block_size=block_size,
            inverse_root_method=inverse_root_method,
            matrix_scaling=matrix_scaling,
            matmul_dtype=matmul_dtype,
            grafting=grafting,
            nesterov=nesterov,
            bias_correction=bias_correction,
            root_iterations=root_iterations,
            chebyshev_degree=chebyshev_degree,
            max_consecutive_root_failures=max_consecutive_root_failures,
        ))
        self.block_size: int = options["block_size"]
        self._grafting: str = options["grafting"]
        self.nesterov: bool = options["nesterov"]
        self.bias_correction: bool = options["bias_correction"]
        self.max_consecutive_root_failures: Optional[int] = options["max_consecutive_root_failures"]
        self.root_settings = RootSettings(
            method=options["inverse_root_method"],
            scaling=options["matrix_scaling"],
            matmul_dtype=options["matmul_dtype"],
            iterations=options["root_iterations"],
            chebyshev_degree=options["chebyshev_degree"],
            relative_epsilon=options["relative_epsilon"],
        )
        #: Blocks whose new roots were rejected (non-finite, or a residual above
        #: :func:`~lightning_dash.optim.roots.failure_residual`), over all ranks.
        self.root_failure_count = 0
        #: Steps skipped whole because some gradient was not finite.
        self.nonfinite_grad_skips = 0
        #: Steps skipped whole because some computed update was not finite.
        self.nonfinite_update_skips = 0
        #: Largest Newton residual of the roots computed in the latest step (None if none were).
        self.last_root_residual: Optional[Tensor] = None
        self._layout: Optional[_Layout] = None
        self._distributor = distributor
        self._consolidated: Optional[dict[int, dict[str, Tensor]]] = None
        #: When True (and blocks are sharded), :meth:`state_dict` is collective: every rank
        #: calls it, it consolidates by itself and rank 0 gets the complete state. This is
        #: how ``torch.distributed.checkpoint`` (Composer's checkpoints) calls it.
        self.collective_state_dict = False
        self.async_preconditioning: bool = check_async_preconditioning(async_preconditioning)
        self.max_staleness: int = check_max_staleness(max_staleness)
        self._pipeline = RootPipeline(self.max_staleness)
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            epsilon=epsilon,
            weight_decay=weight_decay,
            grafting_beta2=grafting_beta2,
            grafting_epsilon=grafting_epsilon,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            shampoo_blend=1.0,
        )
        super().__init__(params, defaults)

    @property
    def grafting(self) -> str:
        """The grafting type; may be changed during training (e.g. by a schedule callback)."""
        return self._grafting

    @grafting.setter
    def grafting(self, kind: str) -> None:
        self._grafting = check_choice("grafting", kind, GRAFTING_TYPES)

    @property
    def distributor(self) -> Optional[BlockDistributor]:
        """Block ownership across data-parallel ranks (None: this process owns every block)."""
        return self._distributor

    @distributor.setter
    def distributor(self, distributor: Optional[BlockDistributor]) -> None:
        self._retire_layout()
        self._distributor = distributor

    @property
    def ownership_balance(self) -> float:
        """max / mean of the per-rank cost of the block ownership (1.0 in one process)."""
        return 1.0 if self._distributor is None else self._distributor.balance

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **overrides: Any) -> "DASH":
        """DASH over ``optimizer``'s own parameter-group dictionaries.

        Learning rates, momenta, epsilons and weight decay map onto DASH and its
        grafting (Adam-family optimizers graft Adam, SGD grafts SGD, ...); schedulers
        attached to ``optimizer`` keep editing the same dictionaries. Keyword
        overrides set DASH options (``block_size``, ``inverse_root_method``, ...) or
        per-group values (``epsilon``, ``precondition_frequency``, ...) for all groups;
        ``factor_decay`` sets ``betas[1]``. A DASH optimizer is returned unchanged.
        A subclass that overrides its base class's ``step`` is refused (its update rule
        would be lost) unless ``allow_custom_step=True``.
        """
        if isinstance(optimizer, DASH):
            return optimizer
        factor_decay = overrides.pop("factor_decay", DEFAULT_FACTOR_DECAY)
        allow_custom_step = overrides.pop("allow_custom_step", False)
        group_settings, options = dash_group_settings(optimizer, factor_decay, allow_custom_step)
        per_group = {key: overrides.pop(key) for key in list(overrides) if key in _GROUP_KEYS}
        for group, settings in zip(optimizer.param_groups, group_settings):
            group.update(settings)
            group.update(per_group)
        return cls(optimizer.param_groups, **{**options, **overrides})

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (also after training started); its hyperparameters are checked."""
        self._retire_layout()
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    # ------------------------------------------------------------------ layout
    def _retire_layout(self) -> None:
        """Move stacked state back into ``self.state`` so the layout can be rebuilt."""
        self._settle_async(collective=False)
        layout = self.__dict__.get("_layout")
        if layout is None:
            return
        for index, entry in self._export(layout).items():
            self.state[layout.params[index]].update(entry)
        self._layout = None

    def _param_names(self) -> list[str]:
        names = []
        for group_index, group in enumerate(self.param_groups):
            given = group.get("param_names")
            for position, param in enumerate(group["params"]):
                if given is not None:
                    names.append(str(given[position]))
                else:
                    names.append(f"param_groups[{group_index}]['params'][{position}] {tuple(param.shape)}")
        return names

    def _flat_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _build_layout(self) -> _Layout:
        params = self._flat_params()
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        names = self._param_names()
        saved: dict[int, dict[str, Tensor]] = {}
        steps = []
        for index, param in enumerate(params):
            entry = self.state[param]
            entry["step"] = torch.as_tensor(entry.get("step", 0.0), dtype=torch.float32, device="cpu")
            steps.append(int(entry["step"].item()))
            saved[index] = entry
        want_momentum = any(group["betas"][0] > 0 for group in self.param_groups)
        want_second = uses_second_moment(self.grafting)

        regions = [
            region
            for index, param in enumerate(params) if param.dim() >= 2 and param.numel() > 0
            for region in param_regions(index, matrix_shape(param.shape), self.block_size)
        ]
        exchange = None
        if self._distributor is None:
            local_plans = _stacks_by_placement(regions, params)
        else:
            exchange = self._plan_exchange(regions, group_of)
            local_plans = exchange.plans[self._distributor.rank]

        stacks: list[_Stack] = []
        for plan in local_plans:
            if plan.regions:
                first = params[plan.regions[0].param_index]
                state = StackState.zeros(plan.num_blocks, plan.block_shape, first.device, _state_dtype(first))
                if want_momentum:
                    state.ensure(MOMENTUM)
                if want_second:
                    state.ensure(GRAFTING_RMS)
                import_stack(plan, state, params, self.block_size, saved, names)
                offset = 0 if exchange is None else exchange.offsets[self._distributor.rank][len(stacks)]
                stacks.append(_Stack(plan, state, offset))

        vectors: list[_VectorGroup] = []
        for group_index in range(len(self.param_groups)):
            members: dict[tuple[torch.device, torch.dtype], list[int]] = {}
            for index, param in enumerate(params):
                if group_of[index] == group_index and param.dim() < 2 and param.numel() > 0:
                    members.setdefault((param.device, _state_dtype(param)), []).append(index)
            for (device, dtype), indices in members.items():
                numels = [params[i].numel() for i in indices]
                offsets = [sum(numels[:k]) for k in range(len(numels))]
                total = sum(numels)
                momentum = torch.zeros(total, device=device, dtype=dtype)
                rms = torch.zeros(total, device=device, dtype=dtype)
                for index, offset, numel in zip(indices, offsets, numels):
                    for name, flat in ((MOMENTUM, momentum), (GRAFTING_RMS, rms)):
                        if name in saved[index]:
                            flat[offset : offset + numel].copy_(saved[index][name].reshape(-1))
                vectors.append(_VectorGroup(group_index, indices, offsets, numels, momentum, rms))

        for param in params:
            step = self.state[param]["step"]
            self.state[param].clear()
            self.state[param]["step"] = step
        return _Layout(params, group_of, names, steps, stacks, vectors, exchange)

    def _plan_exchange(self, regions: list[Region], group_of: list[int]) -> _Exchange:
        """Assign blocks to ranks and lay out every rank's stacks and update buffer.

        A region whose tiles all belong to one rank stays whole; otherwise it is
        split into one-tile regions. Every rank computes the same plan.
        """
        distributor = self._distributor
        tiles = [(region, tile) for region in regions for tile in region.single_tiles()]
        owners = distributor.assign_owners(
            keys=[(t.param_index, t.row_start, t.col_start) for _, t in tiles],
            shapes=[t.block_shape for _, t in tiles],
            frequencies=[self.param_groups[group_of[t.param_index]]["precondition_frequency"] for _, t in tiles],
        )
        owned: list[list[Region]] = [[] for _ in range(distributor.world_size)]
        position = 0
        for region in regions:
            region_owners = owners[position : position + region.num_blocks]
            if len(set(region_owners)) == 1:
                owned[region_owners[0]].append(region)
            else:
                for tile, owner in zip(region.single_tiles(), region_owners):
                    owned[owner].append(tile)
            position += region.num_blocks
        plans = [_stacks_by_placement(rank_regions, self._flat_params()) for rank_regions in owned]
        offsets = []
        for rank_plans in plans:
            sizes = [plan.num_blocks * plan.block_shape[0] * plan.block_shape[1] for plan in rank_plans]
            offsets.append([sum(sizes[:k]) for k in range(len(sizes) + 1)])
        return _Exchange(plans, [o[:-1] for o in offsets], max(o[-1] for o in offsets))

    def _current_layout(self) -> _Layout:
        if self._layout is None:
            self._layout = self._build_layout()
        return self._layout

    # ------------------------------------------------------------------ state dict
    def _export(self, layout: _Layout, include_vectors: bool = True) -> dict[int, dict[str, Tensor]]:
        """Per-parameter copies of this process's state (keyed by layout index).

        One-dimensional parameters are replicated on every rank; ``include_vectors``
        leaves them out so that only one rank contributes them when merging.
        """
        out: dict[int, dict[str, Tensor]] = {}
        for stack in layout.stacks:
            export_stack(stack.plan, stack.state, layout.params, self.block_size, out)
        for vector in layout.vectors if include_vectors else []:
            for index, offset, numel in zip(vector.param_indices, vector.offsets, vector.numels):
                shape = layout.params[index].shape
                out[index] = {
                    MOMENTUM: vector.momentum[offset : offset + numel].clone().view(shape),
                    GRAFTING_RMS: vector.rms[offset : offset + numel].clone().view(shape),
                }
        return out

    def _positions(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _local_state(self, include_vectors: bool = True) -> dict[int, dict[str, Tensor]]:
        """This process's statistics keyed by state-dict position (copies)."""
        layout, positions = self._layout, self._positions()
        if layout is None:
            return {}
        exported = self._export(layout, include_vectors)
        return {positions[id(layout.params[index])]: entry for index, entry in exported.items()}

    def _is_sharded(self) -> bool:
        return self._distributor is not None and self._distributor.world_size > 1

    def consolidate_state_dict(self) -> None:
        """Collect every rank's blocks on rank 0 so that its :meth:`state_dict` is complete.

        Collective: call it on every rank (Lightning's strategies do before saving).
        """
        self._settle_async(collective=True)
        if not self._is_sharded():
            return
        if self._layout is None and any(len(entry) > 1 for entry in self.state.values()):
            # Statistics sit in ``self.state`` (a retired layout, or a loaded checkpoint that
            # every rank holds whole): stack them first, so each rank reports only its blocks.
            self._current_layout()
        local = {
            key: {name: value.cpu() for name, value in entry.items()}
            for key, entry in self._local_state(include_vectors=self._distributor.rank == 0).items()
        }
        gathered = self._distributor.gather_to_first(local)
        if gathered is not None:
            self._consolidated = _merge_rank_states(gathered)

    def state_dict(self) -> dict[str, Any]:
        """Standard torch layout: ``state`` keyed by parameter index, plus ``param_groups``.

        Every statistic, root, momentum and step count is a per-parameter copy. With
        blocks owned by several ranks, :meth:`consolidate_state_dict` must run first
        (on every rank); the complete state is then returned on rank 0. With
        ``collective_state_dict`` set, this call consolidates by itself (every rank
        must call it) and the other ranks get only the step counts.
        """
        self._settle_async(collective=False)
        if self._is_sharded() and self.collective_state_dict:
            self.consolidate_state_dict()
            if self._distributor.rank != 0:
                return super().state_dict()
        packed = super().state_dict()
        if self._is_sharded():
            if self._consolidated is None:
                raise RuntimeError(
                    "DASH state is sharded across ranks: call consolidate_state_dict() on every rank "
                    "first, then state_dict() on rank 0"
                )
            local, self._consolidated = self._consolidated, None
        else:
            local = self._local_state()
        for key, entry in local.items():
            packed["state"][key] = {**packed["state"].get(key, {}), **entry}
        for key, entry in packed["state"].items():
            if isinstance(entry.get("step"), Tensor):  # a copy: the live counter keeps counting
                packed["state"][key] = {**entry, "step": entry["step"].clone()}
        packed["dash"] = {
            "root_failure_count": self.root_failure_count,
            "nonfinite_grad_skips": self.nonfinite_grad_skips,
            "nonfinite_update_skips": self.nonfinite_update_skips,
            "grafting": self.grafting,
        }
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`, onto the current parameters' devices.

        Tensors keep their saved dtype (statistics stay float32 for low-precision
        parameters); the stacks are rebuilt at the next step.
        """
        check_loadable(state_dict, self._flat_params(), self._param_names(), self.block_size)
        self._pipeline.discard()
        state_dict = dict(state_dict)
        saved_state = state_dict.pop("state")
        extra = state_dict.pop("dash", {})
        self._layout = None
        self._consolidated = None
        super().load_state_dict({**state_dict, "state": {}})
        # As torch's optimizers do: the saved groups' parameter keys (indices, or names
        # from torch.distributed.checkpoint) name the current parameters by position.
        saved_keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        params = dict(zip(saved_keys, (p for group in self.param_groups for p in group["params"])))
        self.state.clear()
        for key, entry in saved_state.items():
            param = params[key]
            self.state[param] = {
                name: value.to("cpu") if name == "step" else value.to(param.device)
                for name, value in upgrade_entry(entry).items()
            }
        # torch.distributed.checkpoint keeps only "state" and "param_groups": without the
        # "dash" entry the counters and grafting type stay as they are.
        self.root_failure_count = int(extra.get("root_failure_count", self.root_failure_count))
        self.nonfinite_grad_skips = int(extra.get("nonfinite_grad_skips", self.nonfinite_grad_skips))
        self.nonfinite_update_skips = int(extra.get("nonfinite_update_skips", self.nonfinite_update_skips))
        saved_grafting = extra.get("grafting", self.grafting)
        if saved_grafting != self.grafting:
            warnings.warn(
                f"DASH.load_state_dict: the checkpoint's grafting={saved_grafting!r} replaces "
                f"grafting={self.grafting!r} (the checkpoint wins, as after a GraftingSchedule switch)",
                stacklevel=2,
            )
        self.grafting = saved_grafting

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step; calls ``closure`` (with gradients enabled) first if given.

        The step is applied whole or not at all: every new statistic, root and update
        is computed first, then checked, then committed. A non-finite gradient
        anywhere skips the whole step (``nonfinite_grad_skips``); a non-finite update
        skips it too (``nonfinite_update_skips``); a root streak reaching
        ``max_consecutive_root_failures`` raises :class:`RootComputationError` before
        anything but the failure counters has changed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        layout = self._current_layout()
        self.last_root_residual = None
        active, all_finite, all_zero = self._active_params(layout)
        if not active or (all_zero and all(group["lr"] == 0 for group in self.param_groups)):
            # Nothing can move: torch.distributed.checkpoint materialises an empty
            # optimizer's state this way, and it must not advance any counter.
            return loss
        if not all_finite:
            self.nonfinite_grad_skips += 1
            return loss
        for index in active:
            layout.steps[index] += 1
        committed = False
        try:
            committed = self._step_whole(layout, active)
        finally:
            if not committed:
                for index in active:
                    layout.steps[index] -= 1
        return loss

    def _step_whole(self, layout: _Layout, active: set[int]) -> bool:
        """Compute every candidate, check it, and commit it (see :meth:`step`); returns
        whether the step was committed."""
        roots_due = self._roots_due_anywhere(layout, active)
        pipeline = self._pipeline if self._uses_pipeline(layout) else None
        # Asynchronous roots swap in before any statistics move (and before blocks are copied out).
        close = pipeline is not None and pipeline.begin_step(roots_due, self._install_roots)
        vectors = [work for vector in layout.vectors if (work := self._vector_work(layout, vector, active))]
        works = [work for stack in layout.stacks if (work := self._begin_stack(layout, stack, active))]
        if pipeline is None and roots_due:
            failures = self._compute_roots(works)
            self._check_failures(layout, [(w.plan, w.state.root_failures) for w in works], failures)
        elif close:
            self._check_failures(layout, _committed_streaks(layout), pipeline.take_failures())
        directions = [self._direction(work) for work in works]
        gathered = None
        if layout.exchange is not None:
            updates = self._exchange_buffer(layout)
            for work, direction in zip(works, directions):
                self._write_update(work, direction, updates)
            gathered = self._distributor.all_gather(updates)
            checked = list(gathered)
        else:
            checked = list(directions)
        checked.extend(work.update for work in vectors)
        if checked and not bool(torch.stack([torch.isfinite(t).all() for t in checked]).all()):
            self.nonfinite_update_skips += 1
            return False
        # Commit: nothing below can fail on bad numbers.
        if pipeline is not None and roots_due:
            job = self._root_job(works, whole_stacks=True)
            snapshots = [t for request in job.requests for t in (request.inputs, request.eps, request.scale)]
            pipeline.launch(job, snapshots, lambda: self._solve_roots(job), layout.params[0].device)
        torch._foreach_add_([self.state[layout.params[i]]["step"] for i in sorted(active)], 1.0)
        self._decay_weights(layout, active)
        for work in vectors:
            work.commit()
            torch._foreach_add_(work.params, work.update_views())
        for work, direction in zip(works, directions):
            work.commit()
            if gathered is None:
                self._apply(layout, work.plan, direction)
        if gathered is not None:
            self._apply_gathered(layout, gathered)
        return True

    # ------------------------------------------------------------------ asynchronous roots
    @property
    def async_roots_hidden(self) -> int:
        """Asynchronous root launches swapped in without the main stream waiting (this rank)."""
        return self._pipeline.hidden

    @property
    def async_roots_waited(self) -> int:
        """Asynchronous root launches the main stream had to wait for (this rank)."""
        return self._pipeline.waited

    @property
    def async_wait_ms(self) -> float:
        """Device milliseconds the main stream stalled waiting for side-stream roots
        (CUDA timing events around each wait; a stall counts once it has completed)."""
        return self._pipeline.wait_ms

    def _uses_pipeline(self, layout: _Layout) -> bool:
        """Asynchronous roots: the option is on and the parameters are on CUDA (the same
        answer on every rank, so collectives stay in step)."""
        return (self.async_preconditioning and bool(layout.params)
                and self._pipeline.handles(layout.params[0].device))

    def _settle_async(self, collective: bool) -> None:
        """Swap pending asynchronous roots in now (waiting if needed), so that saved or
        exported state holds them. ``collective``: every rank calls this together, so
        the launch is closed and its failures counted here (a collective when sharded);
        otherwise that happens at the launch's usual step."""
        pipeline = self.__dict__.get("_pipeline")
        if pipeline is None or not pipeline.pending:
            return
        if pipeline.settle(self._install_roots, close=collective or not self._is_sharded()):
            layout = self._current_layout()
            self._check_failures(layout, _committed_streaks(layout), pipeline.take_failures())

    def _roots_due_anywhere(self, layout: _Layout, active: set[int]) -> bool:
        """Whether any block of any rank recomputed its roots this step (known on every rank)."""
        return any(
            layout.params[index].dim() >= 2
            and _roots_due(layout.steps[index], self.param_groups[layout.group_of[index]])
            for index in active
        )

    # ------------------------------------------------------------------ step pieces
    def _active_params(self, layout: _Layout) -> tuple[set[int], bool, bool]:
        """Indices of parameters with a gradient (empty ones excepted), whether every
        gradient is finite, and whether every one is exactly zero; one host read-back."""
        candidates = [i for i, p in enumerate(layout.params) if p.grad is not None and p.numel() > 0]
        for index in candidates:
            if layout.params[index].grad.is_sparse:
                raise ValueError(f"params: DASH does not support sparse gradients ({layout.names[index]})")
        if not candidates:
            return set(), True, True
        grads = [layout.params[i].grad for i in candidates]
        device = grads[0].device
        peaks = torch.stack([peak.float().to(device) for peak in torch._foreach_norm(grads, float("inf"))]).tolist()
        return set(candidates), all(math.isfinite(peak) for peak in peaks), not any(peaks)

    def _decay_weights(self, layout: _Layout, active: set[int]) -> None:
        for group_index, group in enumerate(self.param_groups):
            factor = 1.0 - group["lr"] * group["weight_decay"]
            if factor != 1.0:
                decayed = [p for i, p in enumerate(layout.params) if i in active and layout.group_of[i] == group_index]
                if decayed:
                    torch._foreach_mul_(decayed, factor)

    def _momentum_terms(self, steps: list[int], counts: list[int], betas1: list[float],
                        device: torch.device) -> PerBlock:
        """``1 - beta1**t`` (``t + 1`` with Nesterov), per block."""
        if not self.bias_correction:
            return 1.0
        shift = 1 if self.nesterov else 0
        return _per_block([1.0 - b ** (t + shift) for b, t in zip(betas1, steps)], counts, device)

    def _next_momentum(self, momentum: Optional[Tensor], grad: Tensor, beta1: PerBlock
                       ) -> tuple[Optional[Tensor], Tensor]:
        """The next EMA of the gradient (a new tensor) and the momentum the step follows."""
        if momentum is None:
            return None, grad
        following = momentum.lerp(grad, 1.0 - beta1)
        return following, (grad.lerp(following, beta1) if self.nesterov else following)

    def _vector_work(self, layout: _Layout, vector: _VectorGroup, active: set[int]) -> Optional[_VectorWork]:
        """Candidate grafting-optimizer step of the one-dimensional parameters of one group."""
        members = [k for k, index in enumerate(vector.param_indices) if index in active]
        if not members:
            return None
        group = self.param_groups[vector.group_index]
        params = [layout.params[vector.param_indices[k]] for k in members]
        numels = [vector.numels[k] for k in members]
        device, dtype = vector.momentum.device, vector.momentum.dtype
        grad = torch.cat([p.grad.reshape(-1).to(dtype) for p in params])
        if len(members) == len(vector.param_indices):
            index, momentum, rms = None, vector.momentum, vector.rms
        else:
            index = torch.cat([
                torch.arange(vector.offsets[k], vector.offsets[k] + vector.numels[k]) for k in members
            ]).to(device)
            momentum, rms = vector.momentum[index], vector.rms[index]
        steps = [layout.steps[vector.param_indices[k]] for k in members]
        beta1, _ = group["betas"]
        kind = "adam" if self.grafting == "none" else self.grafting
        graft_beta2 = group["grafting_beta2"]
        if uses_second_moment(kind):
            rms = next_rms(rms, grad, kind, graft_beta2)
        momentum, followed = self._next_momentum(momentum if beta1 > 0 else None, grad, beta1)
        first_term = self._momentum_terms(steps, numels, [beta1] * len(steps), device)
        second_term = (
            _per_block([1.0 - graft_beta2**t for t in steps], numels, device) if self.bias_correction else 1.0
        )
        direction = grafting_direction(followed / first_term, rms, kind, group["grafting_epsilon"], second_term)
        update = direction.mul_(-group["lr"])
        return _VectorWork(vector, params, numels, index, momentum, rms, update)

    def _begin_stack(self, layout: _Layout, stack: _Stack, active: set[int]) -> Optional[_StackWork]:
        """Candidate factors, second moment and momentum of the moving blocks of one stack."""
        regions = [r for r in stack.plan.regions if r.param_index in active]
        if not regions:
            return None
        if len(regions) == len(stack.plan.regions):
            plan, index, state = stack.plan, None, stack.state.copy()
        else:
            plan, positions = stack.plan.subset({r.param_index for r in regions})
            index = torch.tensor(positions, device=stack.state.left_factor.device)
            state = stack.state.select(index)
        device, dtype = state.left_factor.device, state.left_factor.dtype
        grads = {
            r.param_index: layout.params[r.param_index].grad.reshape(matrix_shape(layout.params[r.param_index].shape))
            for r in plan.regions
        }
        grad = plan.gather(grads, dtype=dtype)
        counts = [r.num_blocks for r in plan.regions]
        groups = [self.param_groups[layout.group_of[r.param_index]] for r in plan.regions]
        steps = [layout.steps[r.param_index] for r in plan.regions]
        betas1 = [g["betas"][0] for g in groups]
        beta1 = _blockwise(_per_block(betas1, counts, device))
        beta2 = _per_block([g["betas"][1] for g in groups], counts, device)

        state.left_factor, state.right_factor, state.factor_scale = accumulate_factors(
            state.left_factor, state.right_factor, state.factor_scale, grad, beta2
        )
        if uses_second_moment(self.grafting):
            graft_beta2 = _blockwise(_per_block([g["grafting_beta2"] for g in groups], counts, device))
            state.grafting_rms = next_rms(state.ensure(GRAFTING_RMS), grad, self.grafting, graft_beta2)
        wants_momentum = any(b > 0 for b in betas1)
        state.momentum, followed = self._next_momentum(
            state.ensure(MOMENTUM) if wants_momentum else None, grad, beta1
        )
        first_term = _blockwise(self._momentum_terms(steps, counts, betas1, device))

        due_regions = [k for k, (t, g) in enumerate(zip(steps, groups)) if _roots_due(t, g)]
        due = None
        if due_regions and len(due_regions) < len(plan.regions):
            due = torch.cat([
                torch.arange(plan.regions[k].stack_offset, plan.regions[k].stack_offset + counts[k])
                for k in due_regions
            ]).to(device)
        return _StackWork(stack, plan, index, state, followed / first_term, steps, groups, due, due_regions)

    def _root_inputs(self, work: _StackWork) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Factors, scales (bias-corrected) and epsilon of the blocks whose roots are due."""
        counts = [work.plan.regions[k].num_blocks for k in work.due_regions]
        groups = [work.groups[k] for k in work.due_regions]
        device = work.state.left_factor.device
        left, right, scale = work.state.left_factor, work.state.right_factor, work.state.factor_scale
        if work.due is not None:
            left, right, scale = left[work.due], right[work.due], scale[work.due]
        if self.bias_correction:
            correction = _per_block(
                [1.0 - g["betas"][1] ** work.steps[k] if g["betas"][1] < 1 else 1.0
                 for k, g in zip(work.due_regions, groups)],
                counts, device,
            )
            scale = scale / (correction.double() if isinstance(correction, Tensor) else correction)
        eps = _per_block([g["epsilon"] for g in groups], counts, device)
        if not isinstance(eps, Tensor):
            eps = torch.full((left.shape[0],), eps, device=device)
        return left, right, scale, eps

    def _compute_roots(self, works: list[_StackWork]) -> list[Tensor]:
        """Recompute due roots into the works' candidate states, batching all factors
        of one size across stacks.

        Returns per-stack ``[failed blocks, longest failure streak]`` tensors (not yet
        read back), empty when no root was due.
        """
        job = self._root_job(works, whole_stacks=False)
        return self._install_roots(job, self._solve_roots(job))

    def _root_job(self, works: list[_StackWork], whole_stacks: bool) -> _RootJob:
        """The due factors of ``works`` (copies), one request per size and dtype.

        Results go to each work's own state (``whole_stacks=False``, this step) or to
        its stack's full state (``True``: installed at a later step, after the work's
        blocks have been committed).
        """
        targets: list[tuple[StackState, Optional[Tensor]]] = []
        sizes: dict[tuple[int, torch.dtype], tuple[list[Tensor], list[Tensor], list[Tensor], list[tuple[int, str]]]]
        sizes = {}
        smallest: dict[tuple[int, torch.dtype], float] = {}
        for work in works:
            if not work.due_regions:
                continue
            left, right, scale, eps = self._root_inputs(work)
            target = len(targets)
            targets.append((work.stack.state, _stack_positions(work)) if whole_stacks else (work.state, work.due))
            for side, factor in (("left", left), ("right", right)):
                key = (factor.shape[1], factor.dtype)
                factors, scales, epsilons, pieces = sizes.setdefault(key, ([], [], [], []))
                smallest[key] = min([smallest.get(key, math.inf)] + [work.groups[k]["epsilon"] for k in work.due_regions])
                factors.append(factor.clone() if whole_stacks else factor)
                scales.append(scale)
                epsilons.append(eps)
                pieces.append((target, side))
        requests = [
            _RootRequest(torch.cat(factors), torch.cat(epsilons), torch.cat(scales), smallest[key], pieces,
                         [f.shape[0] for f in factors])
            for key, (factors, scales, epsilons, pieces) in sizes.items()
        ]
        return _RootJob(targets, requests)

    def _solve_roots(self, job: _RootJob) -> list[RootResult]:
        """The inverse fourth roots of every request (on whichever stream is current)."""
        return [inverse_root(request.inputs, request.eps, 4, self.root_settings, request.scale, request.min_eps)
                for request in job.requests]

    def _install_roots(self, job: _RootJob, solved: list[RootResult]) -> list[Tensor]:
        """Accept solved roots into their targets; returns their failure tensors.

        A block's new roots are accepted when both are finite and, for the Newton
        solvers, both residuals are at most :func:`failure_residual`.
        """
        residuals = [result.residual.max() for result in solved if result.residual is not None]
        self.last_root_residual = torch.stack(residuals).max() if residuals else None
        limit = failure_residual(self.root_settings)
        pieces: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
        for request, result in zip(job.requests, solved):
            ok = torch.isfinite(result.root).all(dim=(1, 2))
            if result.residual is not None:
                ok = ok & (result.residual <= limit)
            pieces.update(zip(request.pieces, zip(result.root.split(request.counts), ok.split(request.counts))))
        return [
            self._accept_roots(state, due, *pieces[(target, "left")], *pieces[(target, "right")])
            for target, (state, due) in enumerate(job.targets)
        ]

    @staticmethod
    def _accept_roots(state: StackState, due: Optional[Tensor], left: Tensor, left_ok: Tensor,
                      right: Tensor, right_ok: Tensor) -> Tensor:
        """Keep new roots where both are acceptable, otherwise the previous ones. The
        state's root tensors are replaced, never written in place (they may be shared
        with the committed state until the step commits)."""
        ok = left_ok & right_ok
        select = ok[:, None, None]
        if due is None:
            state.left_root = torch.where(select, left, state.left_root)
            state.right_root = torch.where(select, right, state.right_root)
            state.root_valid = state.root_valid | ok
            state.root_failures = torch.where(ok, 0, state.root_failures + 1).to(torch.int32)
            streak = state.root_failures
        else:
            state.left_root = state.left_root.index_copy(0, due, torch.where(select, left, state.left_root[due]))
            state.right_root = state.right_root.index_copy(0, due, torch.where(select, right, state.right_root[due]))
            state.root_valid = state.root_valid.index_copy(0, due, state.root_valid[due] | ok)
            streak = torch.where(ok, 0, state.root_failures[due] + 1).to(torch.int32)
            state.root_failures = state.root_failures.index_copy(0, due, streak)
        return torch.stack([(~ok).sum(), streak.max()]).to(torch.int64)

    def _direction(self, work: _StackWork) -> Tensor:
        """The update (``-lr`` times the grafted direction) of the moving blocks of one stack."""
        state, plan = work.state, work.plan
        device = state.left_factor.device
        counts = [r.num_blocks for r in plan.regions]
        groups = work.groups
        second_term: PerBlock = 1.0
        if self.bias_correction:
            second_term = _blockwise(_per_block(
                [1.0 - g["grafting_beta2"] ** t for g, t in zip(groups, work.steps)], counts, device
            ))
        kind = "adam" if self.grafting == "none" else self.grafting
        epsilon = _blockwise(_per_block([g["grafting_epsilon"] for g in groups], counts, device))
        fallback = grafting_direction(work.momentum, state.grafting_rms, kind, epsilon, second_term)
        started = [t >= g["start_preconditioning_step"] for t, g in zip(work.steps, groups)]
        if any(started):
            shampoo = torch.bmm(torch.bmm(state.left_root, work.momentum), state.right_root)
            if self.grafting != "none":
                shampoo = graft_norm(shampoo, fallback)
            blend = _blockwise(_per_block([g["shampoo_blend"] for g in groups], counts, device))
            if isinstance(blend, Tensor) or blend != 1.0:
                shampoo = torch.lerp(fallback, shampoo, blend)
            use = state.root_valid
            if not all(started):
                use = use & _per_block([float(s) for s in started], counts, device).bool()
            direction = torch.where(use[:, None, None], shampoo, fallback)
        else:
            direction = fallback
        return direction.mul_(_blockwise(_per_block([-g["lr"] for g in groups], counts, device)))

    def _exchange_buffer(self, layout: _Layout) -> Tensor:
        """This rank's flat buffer of block updates (float64 when any stack is float64)."""
        wide = any(stack.state.left_factor.dtype == torch.float64 for stack in layout.stacks)
        dtype = torch.float64 if wide else torch.float32
        return torch.zeros(layout.exchange.size, device=layout.params[0].device, dtype=dtype)

    @staticmethod
    def _write_update(work: _StackWork, direction: Tensor, updates: Tensor) -> None:
        """Place one stack's block updates in this rank's exchange buffer."""
        full, offset = work.stack.plan, work.stack.update_offset
        rows, cols = full.block_shape
        window = updates[offset : offset + full.num_blocks * rows * cols].view(full.num_blocks, rows, cols)
        if work.index is None:
            window.copy_(direction)
        else:
            window.index_copy_(0, work.index, direction.to(window.dtype))

    @staticmethod
    def _apply(layout: _Layout, plan: StackPlan, update: Tensor) -> None:
        """Add each region's tiles of ``update`` to its parameter."""
        for region in plan.regions:
            param = layout.params[region.param_index]
            shape = matrix_shape(param.shape)
            if param.is_contiguous():
                region.window(param.view(shape)).add_(region.tiles(update))
            else:
                dense = torch.zeros(shape, dtype=update.dtype, device=update.device)
                region.window(dense).copy_(region.tiles(update))
                param.add_(dense.view(param.shape))

    def _apply_gathered(self, layout: _Layout, gathered: list[Tensor]) -> None:
        """Add every rank's block updates to the parameters, in the same order on all ranks."""
        for flat, plans, offsets in zip(gathered, layout.exchange.plans, layout.exchange.offsets):
            for plan, offset in zip(plans, offsets):
                rows, cols = plan.block_shape
                update = flat[offset : offset + plan.num_blocks * rows * cols].view(plan.num_blocks, rows, cols)
                self._apply(layout, plan, update)

    def _check_failures(self, layout: _Layout, streaks: list[tuple[StackPlan, Tensor]],
                        failures: list[Tensor]) -> None:
        """Count failed roots over all ranks; raise once a block's streak reaches the limit
        (naming the parameter when one of ``streaks`` — plans with their per-block
        failure streaks — holds the block).

        With several ranks this is collective, so every rank raises together. In a
        synchronous step the streaks are the step's candidates, so the error comes
        before anything but the counters has changed.
        """
        local = torch.stack(failures).float() if failures else torch.zeros(1, 2)
        summary = torch.stack([local[:, 0].sum(), local[:, 1].max()])
        if self._is_sharded():
            gathered = torch.stack(self._distributor.all_gather(summary.to(layout.params[0].device))).cpu()
            summary = torch.stack([gathered[:, 0].sum(), gathered[:, 1].max()])
        else:
            summary = summary.cpu()
        self.root_failure_count += int(summary[0])
        limit = self.max_consecutive_root_failures
        if limit is None or int(summary[1]) < limit:
            return
        for plan, streak in streaks:
            streak = streak.cpu()
            for region in plan.regions:
                block = region.stack_offset
                if int(streak[block : block + region.num_blocks].max()) >= limit:
                    raise RootComputationError(
                        f"inverse root of {layout.names[region.param_index]} failed {limit} times in a row "
                        f"(method={self.root_settings.method}); try a larger epsilon, a lower lr, or 'eigh'"
                    )
        raise RootComputationError(
            f"an inverse root owned by another rank failed {limit} times in a row "
            f"(method={self.root_settings.method}); that rank names the parameter"
        )


def _merge_rank_states(states: list[dict[int, dict[str, Tensor]]]) -> dict[int, dict[str, Tensor]]:
    """Combine per-rank exports: each block (and each element of the parameter-shaped
    buffers) is owned by exactly one rank, whose values are non-zero only there."""
    merged: dict[int, dict[str, Tensor]] = {}
    for state in states:
        for key, entry in state.items():
            target = merged.setdefault(key, {})
            for name, value in entry.items():
                if name not in target:
                    target[name] = value.clone()
                elif name == ROOT_VALID:
                    target[name] |= value
                elif name in (MOMENTUM, GRAFTING_RMS, ROOT_FAILURES):
                    target[name] += value
                else:
                    target[name] = value
    return merged
