"""DASH: Shampoo with every equal-shaped block of every parameter processed as one stack."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor

from lightning_dash.optim.async_roots import RootPipeline
from lightning_dash.optim.blocks import Region, StackPlan, matrix_shape, param_regions, stack_regions
from lightning_dash.optim.conversion import DEFAULT_FACTOR_DECAY, dash_group_settings
from lightning_dash.optim.distributor import BlockDistributor
from lightning_dash.optim.grafting import (
    GRAFTING_TYPES,
    graft_norm,
    grafting_direction,
    update_second_moment,
    uses_second_moment,
)
from lightning_dash.optim.roots import RootResult, RootSettings, inverse_root
from lightning_dash.optim.state import (
    MOMENTUM,
    ROOT_FAILURES,
    ROOT_VALID,
    SECOND_MOMENT,
    StackState,
    export_stack,
    import_stack,
)
from lightning_dash.optim.validation import (
    check_async_preconditioning,
    check_choice,
    check_group,
    check_max_staleness,
    check_optimizer_options,
)

PerBlock = Union[float, Tensor]


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
    second_moment: Tensor


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


@dataclass
class _RootRequest:
    """One batched solver call: every due factor of one size (a fresh, bias-corrected copy)."""

    inputs: Tensor
    eps: Tensor
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


def _accumulate(factor: Tensor, left: Tensor, right: Tensor, decay: PerBlock) -> None:
    """``factor <- decay * factor + (1 - decay) * left @ right`` in place."""
    if isinstance(decay, Tensor):
        factor.mul_(decay).add_(torch.bmm(left, right).mul_(1.0 - decay))
    else:
        factor.baddbmm_(left, right, beta=decay, alpha=1.0 - decay)


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
        epsilon: damping added to the (bias-corrected) factors before the roots.
        weight_decay: decoupled weight decay, ``W <- W (1 - lr wd)``.
        block_size: largest tile side; remainders form smaller tiles.
        precondition_frequency: recompute the roots every this many steps.
        start_preconditioning_step: first step that uses the Shampoo direction;
            earlier steps follow the grafting direction.
        inverse_root_method: "eigh", "coupled_newton", "newton_db" or "chebyshev".
        matrix_scaling: "frobenius" or "power_iteration" (Newton and Chebyshev solvers).
        matmul_dtype: float32, bfloat16 or float16 for the solver matmuls.
        grafting: "adam", "adagrad", "rmsprop", "sgd" or "none" (raw Shampoo direction).
        grafting_beta2: second-moment decay of Adam/RMSprop grafting.
        grafting_epsilon: epsilon of the grafting optimizer.
        nesterov: use a Nesterov-style momentum in the direction.
        bias_correction: correct momentum, factors and Adam's second moment for their
            zero initialisation.
        root_iterations: iterations of the Newton solvers (per pass).
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
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        block_size: int = 1024,
        precondition_frequency: int = 10,
        start_preconditioning_step: int = 1,
        inverse_root_method: str = "newton_db",
        matrix_scaling: str = "power_iteration",
        matmul_dtype: torch.dtype | str = torch.float32,
        grafting: str = "adam",
        grafting_beta2: float = 0.95,
        grafting_epsilon: float = 1e-8,
        nesterov: bool = False,
        bias_correction: bool = True,
        root_iterations: int = 10,
        chebyshev_degree: int = 40,
        max_consecutive_root_failures: Optional[int] = 3,
        distributor: Optional[BlockDistributor] = None,
        async_preconditioning: bool = False,
        max_staleness: int = 1,
    ) -> None:
        options = check_optimizer_options(dict(
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
        )
        self.root_failure_count = 0
        self.nonfinite_grad_skips = 0
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
        """
        if isinstance(optimizer, DASH):
            return optimizer
        factor_decay = overrides.pop("factor_decay", DEFAULT_FACTOR_DECAY)
        group_settings, options = dash_group_settings(optimizer, factor_decay)
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

    def _build_layout(self) -> _Layout:
        params = [p for group in self.param_groups for p in group["params"]]
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
            for index, param in enumerate(params) if param.dim() >= 2
            for region in param_regions(index, matrix_shape(param.shape), self.block_size)
        ]
        exchange = None
        if self._distributor is None:
            devices = dict.fromkeys(params[r.param_index].device for r in regions)
            local_plans = [plan for device in devices
                           for plan in stack_regions([r for r in regions if params[r.param_index].device == device])]
        else:
            exchange = self._plan_exchange(regions, group_of)
            local_plans = exchange.plans[self._distributor.rank]

        stacks: list[_Stack] = []
        for plan in local_plans:
            if plan.regions:
                device = params[plan.regions[0].param_index].device
                state = StackState.zeros(plan.num_blocks, plan.block_shape, device)
                if want_momentum:
                    state.ensure(MOMENTUM)
                if want_second:
                    state.ensure(SECOND_MOMENT)
                import_stack(plan, state, params, self.block_size, saved, names)
                offset = 0 if exchange is None else exchange.offsets[self._distributor.rank][len(stacks)]
                stacks.append(_Stack(plan, state, offset))

        vectors: list[_VectorGroup] = []
        for group_index in range(len(self.param_groups)):
            members: dict[torch.device, list[int]] = {}
            for index, param in enumerate(params):
                if group_of[index] == group_index and param.dim() < 2:
                    members.setdefault(param.device, []).append(index)
            for device, indices in members.items():
                numels = [params[i].numel() for i in indices]
                offsets = [sum(numels[:k]) for k in range(len(numels))]
                total = sum(numels)
                momentum = torch.zeros(total, device=device)
                second = torch.zeros(total, device=device)
                for index, offset, numel in zip(indices, offsets, numels):
                    for name, flat in ((MOMENTUM, momentum), (SECOND_MOMENT, second)):
                        if name in saved[index]:
                            flat[offset : offset + numel].copy_(saved[index][name].reshape(-1))
                vectors.append(_VectorGroup(group_index, indices, offsets, numels, momentum, second))

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
        plans = [stack_regions(rank_regions) for rank_regions in owned]
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
                    SECOND_MOMENT: vector.second_moment[offset : offset + numel].clone().view(shape),
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
            "grafting": self.grafting,
        }
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict`, onto the current parameters' devices.

        Tensors keep their saved dtype (statistics stay float32 for low-precision
        parameters); the stacks are rebuilt at the next step.
        """
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
                for name, value in entry.items()
            }
        # torch.distributed.checkpoint keeps only "state" and "param_groups": without the
        # "dash" entry the counters and grafting type stay as they are.
        self.root_failure_count = int(extra.get("root_failure_count", self.root_failure_count))
        self.nonfinite_grad_skips = int(extra.get("nonfinite_grad_skips", self.nonfinite_grad_skips))
        self.grafting = extra.get("grafting", self.grafting)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step; calls ``closure`` (with gradients enabled) first if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        layout = self._current_layout()
        self.last_root_residual = None
        active, all_zero = self._active_params(layout)
        if not active or (all_zero and all(group["lr"] == 0 for group in self.param_groups)):
            # Nothing can move: torch.distributed.checkpoint materialises an empty
            # optimizer's state this way, and it must not advance any counter.
            return loss
        for index in active:
            layout.steps[index] += 1
        torch._foreach_add_([self.state[layout.params[i]]["step"] for i in sorted(active)], 1.0)
        self._decay_weights(layout, active)
        for vector in layout.vectors:
            self._step_vectors(layout, vector, active)
        roots_due = self._roots_due_anywhere(layout, active)
        pipeline = self._pipeline if self._uses_pipeline(layout) else None
        # Asynchronous roots swap in before any statistics move (and before blocks are copied out).
        close = pipeline is not None and pipeline.begin_step(roots_due, self._install_roots)
        works = [work for stack in layout.stacks if (work := self._begin_stack(layout, stack, active))]
        failures: list[Tensor] = []
        if pipeline is None:
            failures = self._compute_roots(works)
        elif roots_due:
            job = self._root_job(works, whole_stacks=True)
            snapshots = [t for request in job.requests for t in (request.inputs, request.eps)]
            pipeline.launch(job, snapshots, lambda: self._solve_roots(job), layout.params[0].device)
        updates = None
        if layout.exchange is not None:
            device = layout.params[0].device
            updates = torch.zeros(layout.exchange.size, device=device)
        for work in works:
            self._finish_stack(layout, work, updates)
        if updates is not None:
            self._apply_gathered(layout, self._distributor.all_gather(updates))
        if pipeline is None and roots_due:
            self._check_failures(layout, [work.stack for work in works], failures)
        elif close:
            self._check_failures(layout, layout.stacks, pipeline.take_failures())
        return loss

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
            self._check_failures(layout, layout.stacks, pipeline.take_failures())

    def _roots_due_anywhere(self, layout: _Layout, active: set[int]) -> bool:
        """Whether any block of any rank recomputed its roots this step (known on every rank)."""
        return any(
            layout.params[index].dim() >= 2
            and _roots_due(layout.steps[index], self.param_groups[layout.group_of[index]])
            for index in active
        )

    def _apply_gathered(self, layout: _Layout, gathered: list[Tensor]) -> None:
        """Add every rank's block updates to the parameters, in the same order on all ranks."""
        for flat, plans, offsets in zip(gathered, layout.exchange.plans, layout.exchange.offsets):
            for plan, offset in zip(plans, offsets):
                rows, cols = plan.block_shape
                update = flat[offset : offset + plan.num_blocks * rows * cols].view(plan.num_blocks, rows, cols)
                self._apply(layout, plan, update)

    def _active_params(self, layout: _Layout) -> tuple[set[int], bool]:
        """Indices of parameters with finite gradients (non-finite ones are skipped and
        counted), and whether every gradient is exactly zero; one host read-back."""
        candidates = [i for i, p in enumerate(layout.params) if p.grad is not None]
        for index in candidates:
            if layout.params[index].grad.is_sparse:
                raise ValueError(f"params: DASH does not support sparse gradients ({layout.names[index]})")
        if not candidates:
            return set(), True
        grads = [layout.params[i].grad for i in candidates]
        device = grads[0].device
        peaks = torch.stack([peak.float().to(device) for peak in torch._foreach_norm(grads, float("inf"))]).tolist()
        finite = [math.isfinite(peak) for peak in peaks]
        self.nonfinite_grad_skips += finite.count(False)
        return {index for index, ok in zip(candidates, finite) if ok}, not any(peaks)

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

    def _update_momentum(self, momentum: Optional[Tensor], grad: Tensor, beta1: PerBlock) -> Tensor:
        """Advance the EMA of the gradient and return the momentum the step follows."""
        if momentum is None:
            return grad
        momentum.lerp_(grad, 1.0 - beta1)
        return grad.lerp(momentum, beta1) if self.nesterov else momentum

    def _step_vectors(self, layout: _Layout, vector: _VectorGroup, active: set[int]) -> None:
        """Grafting-optimizer step for the one-dimensional parameters of one group."""
        members = [k for k, index in enumerate(vector.param_indices) if index in active]
        if not members:
            return
        group = self.param_groups[vector.group_index]
        params = [layout.params[vector.param_indices[k]] for k in members]
        numels = [vector.numels[k] for k in members]
        device = vector.momentum.device
        grad = torch.cat([p.grad.reshape(-1).float() for p in params])
        if len(members) == len(vector.param_indices):
            index, momentum, second = None, vector.momentum, vector.second_moment
        else:
            index = torch.cat([
                torch.arange(vector.offsets[k], vector.offsets[k] + vector.numels[k]) for k in members
            ]).to(device)
            momentum, second = vector.momentum[index], vector.second_moment[index]
        steps = [layout.steps[vector.param_indices[k]] for k in members]
        beta1, _ = group["betas"]
        kind = "adam" if self.grafting == "none" else self.grafting
        graft_beta2 = group["grafting_beta2"]
        if uses_second_moment(kind):
            update_second_moment(second, grad, kind, graft_beta2)
        followed = self._update_momentum(momentum if beta1 > 0 else None, grad, beta1)
        first_term = self._momentum_terms(steps, numels, [beta1] * len(steps), device)
        second_term = (
            _per_block([1.0 - graft_beta2**t for t in steps], numels, device) if self.bias_correction else 1.0
        )
        direction = grafting_direction(followed / first_term, second, kind, group["grafting_epsilon"], second_term)
        update = direction.mul_(-group["lr"]).split(numels)
        torch._foreach_add_(params, [u.view(p.shape) for u, p in zip(update, params)])
        if index is not None:
            vector.momentum[index] = momentum
            vector.second_moment[index] = second

    def _begin_stack(self, layout: _Layout, stack: _Stack, active: set[int]) -> Optional[_StackWork]:
        """Update factors, second moment and momentum of the moving blocks of one stack."""
        regions = [r for r in stack.plan.regions if r.param_index in active]
        if not regions:
            return None
        if len(regions) == len(stack.plan.regions):
            plan, index, state = stack.plan, None, stack.state
        else:
            plan, positions = stack.plan.subset({r.param_index for r in regions})
            index = torch.tensor(positions, device=stack.state.left_factor.device)
            state = stack.state.select(index)
        device = state.left_factor.device
        grads = {
            r.param_index: layout.params[r.param_index].grad.reshape(matrix_shape(layout.params[r.param_index].shape))
            for r in plan.regions
        }
        grad = plan.gather(grads)
        counts = [r.num_blocks for r in plan.regions]
        groups = [self.param_groups[layout.group_of[r.param_index]] for r in plan.regions]
        steps = [layout.steps[r.param_index] for r in plan.regions]
        betas1 = [g["betas"][0] for g in groups]
        beta1 = _blockwise(_per_block(betas1, counts, device))
        beta2 = _blockwise(_per_block([g["betas"][1] for g in groups], counts, device))

        _accumulate(state.left_factor, grad, grad.transpose(1, 2), beta2)
        _accumulate(state.right_factor, grad.transpose(1, 2), grad, beta2)
        if uses_second_moment(self.grafting):
            graft_beta2 = _blockwise(_per_block([g["grafting_beta2"] for g in groups], counts, device))
            update_second_moment(state.ensure(SECOND_MOMENT), grad, self.grafting, graft_beta2)
        wants_momentum = any(b > 0 for b in betas1)
        followed = self._update_momentum(state.ensure(MOMENTUM) if wants_momentum else None, grad, beta1)
        first_term = _blockwise(self._momentum_terms(steps, counts, betas1, device))

        due_regions = [k for k, (t, g) in enumerate(zip(steps, groups)) if _roots_due(t, g)]
        due = None
        if due_regions and len(due_regions) < len(plan.regions):
            due = torch.cat([
                torch.arange(plan.regions[k].stack_offset, plan.regions[k].stack_offset + counts[k])
                for k in due_regions
            ]).to(device)
        return _StackWork(stack, plan, index, state, followed / first_term, steps, groups, due, due_regions)

    def _root_inputs(self, work: _StackWork) -> tuple[Tensor, Tensor, Tensor]:
        """Bias-corrected factors and epsilon of the blocks whose roots are due."""
        counts = [work.plan.regions[k].num_blocks for k in work.due_regions]
        groups = [work.groups[k] for k in work.due_regions]
        device = work.state.left_factor.device
        left, right = work.state.left_factor, work.state.right_factor
        if work.due is not None:
            left, right = left[work.due], right[work.due]
        if self.bias_correction:
            correction = _blockwise(_per_block(
                [1.0 - g["betas"][1] ** work.steps[k] if g["betas"][1] < 1 else 1.0
                 for k, g in zip(work.due_regions, groups)],
                counts, device,
            ))
            left, right = left / correction, right / correction
        eps = _per_block([g["epsilon"] for g in groups], counts, device)
        if not isinstance(eps, Tensor):
            eps = torch.full((left.shape[0],), eps, device=device)
        return left, right, eps

    def _compute_roots(self, works: list[_StackWork]) -> list[Tensor]:
        """Recompute due roots, batching all factors of one size across stacks.

        Returns per-stack ``[failed blocks, longest failure streak]`` tensors (not yet
        read back), empty when no root was due.
        """
        job = self._root_job(works, whole_stacks=False)
        return self._install_roots(job, self._solve_roots(job))

    def _root_job(self, works: list[_StackWork], whole_stacks: bool) -> _RootJob:
        """The due factors of ``works`` (bias-corrected copies), one request per size.

        Results go to each work's own state (``whole_stacks=False``, this step) or to
        its stack's full state (``True``: installed at a later step, after the work's
        blocks have been written back).
        """
        targets: list[tuple[StackState, Optional[Tensor]]] = []
        sizes: dict[int, tuple[list[Tensor], list[Tensor], list[tuple[int, str]]]] = {}
        for work in works:
            if not work.due_regions:
                continue
            left, right, eps = self._root_inputs(work)
            target = len(targets)
            targets.append((work.stack.state, _stack_positions(work)) if whole_stacks else (work.state, work.due))
            for side, factor in (("left", left), ("right", right)):
                factors, epsilons, pieces = sizes.setdefault(factor.shape[1], ([], [], []))
                factors.append(factor)
                epsilons.append(eps)
                pieces.append((target, side))
        requests = [
            _RootRequest(torch.cat(factors), torch.cat(epsilons), pieces, [f.shape[0] for f in factors])
            for factors, epsilons, pieces in sizes.values()
        ]
        return _RootJob(targets, requests)

    def _solve_roots(self, job: _RootJob) -> list[RootResult]:
        """The inverse fourth roots of every request (on whichever stream is current)."""
        return [inverse_root(request.inputs, request.eps, 4, self.root_settings) for request in job.requests]

    def _install_roots(self, job: _RootJob, solved: list[RootResult]) -> list[Tensor]:
        """Accept solved roots into their targets; returns their failure tensors."""
        residuals = [result.residual.max() for result in solved if result.residual is not None]
        self.last_root_residual = torch.stack(residuals).max() if residuals else None
        pieces: dict[tuple[int, str], Tensor] = {}
        for request, result in zip(job.requests, solved):
            pieces.update(zip(request.pieces, result.root.split(request.counts)))
        return [
            self._accept_roots(state, due, pieces[(target, "left")], pieces[(target, "right")])
            for target, (state, due) in enumerate(job.targets)
        ]

    @staticmethod
    def _accept_roots(state: StackState, due: Optional[Tensor], left: Tensor, right: Tensor) -> Tensor:
        """Keep new roots where both factors are finite; otherwise keep the previous ones."""
        ok = torch.isfinite(left).all(dim=(1, 2)) & torch.isfinite(right).all(dim=(1, 2))
        select = ok[:, None, None]
        if due is None:
            state.left_root.copy_(torch.where(select, left, state.left_root))
            state.right_root.copy_(torch.where(select, right, state.right_root))
            state.root_valid.logical_or_(ok)
            state.root_failures.copy_(torch.where(ok, 0, state.root_failures + 1))
            streak = state.root_failures
        else:
            state.left_root.index_copy_(0, due, torch.where(select, left, state.left_root[due]))
            state.right_root.index_copy_(0, due, torch.where(select, right, state.right_root[due]))
            state.root_valid.index_copy_(0, due, state.root_valid[due] | ok)
            streak = torch.where(ok, 0, state.root_failures[due] + 1)
            state.root_failures.index_copy_(0, due, streak)
        return torch.stack([(~ok).sum(), streak.max()]).to(torch.int64)

    def _finish_stack(self, layout: _Layout, work: _StackWork, updates: Optional[Tensor]) -> None:
        """Precondition and graft the moving blocks of one stack; apply their update, or
        write it into this rank's ``updates`` buffer when blocks are shared across ranks."""
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
        fallback = grafting_direction(work.momentum, state.grafting_second_moment, kind, epsilon, second_term)
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
        direction.mul_(_blockwise(_per_block([-g["lr"] for g in groups], counts, device)))
        if updates is None:
            self._apply(layout, plan, direction)
        else:
            full, offset = work.stack.plan, work.stack.update_offset
            rows, cols = full.block_shape
            window = updates[offset : offset + full.num_blocks * rows * cols].view(full.num_blocks, rows, cols)
            if work.index is None:
                window.copy_(direction)
            else:
                window.index_copy_(0, work.index, direction)
        if work.index is not None:
            work.stack.state.commit(work.index, state)

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

    def _check_failures(self, layout: _Layout, stacks: list[_Stack], failures: list[Tensor]) -> None:
        """Count failed roots over all ranks; raise once a block's streak reaches the limit
        (naming the parameter when one of ``stacks`` holds the block).

        With several ranks this is collective, so every rank raises together.
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
        for stack in stacks:
            streaks = stack.state.root_failures.cpu()
            for region in stack.plan.regions:
                block = region.stack_offset
                if int(streaks[block : block + region.num_blocks].max()) >= limit:
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
                elif name in (MOMENTUM, SECOND_MOMENT, ROOT_FAILURES):
                    target[name] += value
                else:
                    target[name] = value
    return merged
