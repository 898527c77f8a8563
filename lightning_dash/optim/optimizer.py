"""DASH: Shampoo with every equal-shaped block of every parameter processed as one stack."""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dash.optim.checkpoint import Checkpointer, CheckpointMethods
from lightning_dash.optim.config import AUTO, GROUP_OPTIONS, DashConfig, check_group, check_option
from lightning_dash.optim.conversion import announced, converted_groups
from lightning_dash.optim.distributor import BlockDistributor, LocalDistributor, found_distributor
from lightning_dash.optim.layout_keeper import LayoutKeeper
from lightning_dash.optim.roots import RootSettings
from lightning_dash.optim.roots.choice import choose_inverse_root_method, explain_choice
from lightning_dash.optim.routing import ParameterRouting
from lightning_dash.optim.stacks.blocks import MatrixView
from lightning_dash.optim.stacks.layout import Layout, layout_bytes, owned_blocks, param_names, preconditioned_blocks
from lightning_dash.optim.step.bookkeeping import StepBookkeeping, advance_steps
from lightning_dash.optim.step.commit import active_params, gradients_all_zero
from lightning_dash.optim.step.device import step_on_device
from lightning_dash.optim.step.grafting import uses_second_moment
from lightning_dash.optim.step.refresh import RootRefresher
from lightning_dash.optim.step.rules import UpdateRules
from lightning_dash.optim.validation import check_iterable_params

_log = logging.getLogger("lightning_dash")
#: Device types whose "auto" choice was logged (once per process).
_ANNOUNCED: set[str] = set()


def _counter(name: str, doc: str) -> property:
    """A counter of DASH's step bookkeeping as a property (settable: a checkpoint restores it).
    Each step's verdict reaches the host one step later; reading a counter collects it first."""

    def read(self: DASH) -> int:
        return self._books.count(name)

    def write(self: DASH, value: int) -> None:
        self._books.set_count(name, value)

    return property(read, write, doc=doc)


def _reading(path: str, doc: str) -> property:
    """A read-only property that reads ``path`` (attributes from the optimizer, dotted) when asked."""
    return property(operator.attrgetter(path), doc=doc)


class DASH(CheckpointMethods, torch.optim.Optimizer):
    """Shampoo with batched block processing, batched inverse roots and grafting.

    Each parameter of two or more dimensions is viewed as a matrix, cut into
    ``block_size`` tiles, and every tile keeps Kronecker factors
    ``L <- b2 L + (1 - b2) G G^T`` and ``R <- b2 R + (1 - b2) G^T G``. Its update is
    ``L^(-1/p) M R^(-1/p)`` (M the gradient momentum, p = ``root_order``), rescaled per block to the
    norm of the grafting optimizer's update. One-dimensional parameters use the
    grafting optimizer alone (Adam when ``grafting="none"``), as do the parameters
    the ``precondition`` option routes there. All tiles of one shape, from every
    parameter and group, are updated together by batched matmuls.

    Args:
        params: parameters, named parameters or parameter groups, as for any torch optimizer.
        lr: learning rate (default: ``config.lr``).
        config: the options as a :class:`~lightning_dash.optim.config.DashConfig`.
        distributor: block ownership across data-parallel ranks (None: this process owns every
            block, or, for sharded parameters (DTensors: FSDP2, tensor parallelism, HSDP), a
            :class:`~lightning_dash.distributed.ShardedDistributor` over the default process group).
        model: the module of the parameters, for their names and roles (see :meth:`attach_model`).
        **options: any :class:`~lightning_dash.optim.config.DashConfig` option by
            keyword (``betas``, ``epsilon``, ``block_size``, ``inverse_root_method``,
            ...); they replace the values of ``config``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        *,
        config: DashConfig | None = None,
        distributor: BlockDistributor | None = None,
        model: nn.Module | None = None,
        **options: Any,
    ) -> None:
        if lr is not None:
            options["lr"] = lr
        self._config = DashConfig.build(config, **options)
        self._grafting = self._config.grafting
        #: When True (and blocks are sharded), :meth:`state_dict` is collective: every rank
        #: calls it, it consolidates by itself and rank 0 gets the complete state. This is
        #: how ``torch.distributed.checkpoint`` (Composer's checkpoints) calls it.
        self.collective_state_dict = False
        #: The root computation: synchronous, or on a side CUDA stream ("auto" is resolved
        #: when the stacks are built, once the parameters' device is final).
        self.roots = RootRefresher(
            self._config.root_settings,
            self._config.bias_correction and self._config.factor_bias_correction,
            self._config.async_preconditioning,
            self._config.max_staleness,
        )
        self._books = StepBookkeeping(self._config.max_consecutive_root_failures)
        self._routing = ParameterRouting(self._config.precondition, self._config.split_rows, model)
        self._keeper = LayoutKeeper(distributor or LocalDistributor(), self.block_size, self.roots, self._books)
        self._checkpointer = Checkpointer(self, self._keeper, self._routing, self._current_layout)
        super().__init__(check_iterable_params(params), self._config.group_defaults())
        if distributor is None:  # sharded parameters (DTensors) call for the sharded distributor
            found = found_distributor(
                [p for group in self.param_groups for p in group["params"]], self._parameter_names()
            )
            if found is not None:
                self._keeper.distributor = found

    # ------------------------------------------------------------------ options
    @property
    def config(self) -> DashConfig:
        """The optimizer's options (with the current grafting type)."""
        return dataclasses.replace(self._config, grafting=self._grafting)

    def __getattr__(self, name: str) -> Any:
        # Optimizer-wide options read as attributes (``opt.block_size``, ``opt.nesterov``, ...).
        config = self.__dict__.get("_config")
        if config is not None and name in DashConfig.__dataclass_fields__ and name not in GROUP_OPTIONS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def root_settings(self) -> RootSettings:
        """How the inverse roots are computed (from the options, with "auto" resolved)."""
        return dataclasses.replace(self._config.root_settings, method=self.inverse_root_method_in_use)

    @property
    def inverse_root_method_in_use(self) -> str:
        """The solver the roots are computed with: the option, or what ``"auto"`` picks for
        the parameters' device and the block size (:mod:`~lightning_dash.optim.roots.choice`)."""
        method = self._config.inverse_root_method
        if method != AUTO:
            return method
        return choose_inverse_root_method(self._device(), self.block_size)

    def _device(self) -> torch.device:
        first = next((p for group in self.param_groups for p in group["params"]), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def grafting(self) -> str:
        """The grafting type; may be changed during training (e.g. by a schedule callback)."""
        return self._grafting

    @grafting.setter
    def grafting(self, kind: str) -> None:
        self._grafting = check_option("grafting", kind)

    @property
    def distributor(self) -> BlockDistributor:
        """Block ownership across data-parallel ranks (a :class:`LocalDistributor` in one process)."""
        return self._keeper.distributor

    @distributor.setter
    def distributor(self, distributor: BlockDistributor | None) -> None:
        self._keeper.retire(self.state)
        self._keeper.distributor = distributor or LocalDistributor()

    ownership_balance = _reading(
        "_keeper.distributor.balance", "max / mean of the per-rank cost of the block ownership (1.0 in one process)."
    )
    last_root_residual = _reading(
        "roots.last_residual", "Largest Newton residual of the roots accepted in the latest step (None if none were)."
    )
    async_roots_hidden = _reading(
        "roots.pipeline.hidden", "Asynchronous root launches swapped in without the main stream waiting (this rank)."
    )
    async_roots_waited = _reading(
        "roots.pipeline.waited", "Asynchronous root launches the main stream had to wait for (this rank)."
    )
    async_wait_ms = _reading(
        "roots.pipeline.wait_ms", "Device milliseconds the main stream stalled waiting for side-stream roots."
    )

    @property
    def owned_blocks(self) -> int:
        """Blocks whose statistics this process holds (0 before the first step)."""
        return owned_blocks(self._keeper.layout)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this process holds: the statistics, roots and buffers
        of its blocks and its part of the one-dimensional parameters' buffers (0 before
        the first step). With parameters sharded across N ranks each holds about 1/N."""
        return layout_bytes(self._keeper.layout)

    @property
    def preconditioned_blocks(self) -> int:
        """Blocks of this process whose Shampoo roots are in use (roots still being
        computed on a side stream are not counted); reads a count back from the device."""
        return preconditioned_blocks(self._keeper.layout)

    @classmethod
    def from_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        *,
        model: nn.Module | None = None,
        distributor: BlockDistributor | None = None,
        **overrides: Any,
    ) -> DASH:
        """DASH over ``optimizer``'s own parameter-group dictionaries, so its schedulers keep working.

        Learning rates, momenta, epsilons and weight decay map onto DASH and its grafting (Adam-family
        optimizers graft Adam, SGD grafts SGD, ...). Keyword overrides set any
        :class:`~lightning_dash.optim.config.DashConfig` option; ``factor_decay`` sets ``betas[1]``;
        ``model`` routes the parameters as the strategies do (see ``DASH(..., model=)``), ``distributor``
        shares the blocks between ranks (see ``DASH(..., distributor=)``). A DASH optimizer is returned
        unchanged; a subclass overriding ``step`` is refused unless ``allow_custom_step=True``.
        What the recipe became is logged (INFO, ``lightning_dash``)."""
        if isinstance(optimizer, DASH):
            return optimizer
        groups, options = converted_groups(optimizer, overrides)
        return announced(cls(groups, model=model, distributor=distributor, **options), optimizer)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (also after training started); its hyperparameters are checked."""
        if "_keeper" in self.__dict__:  # (torch's constructor adds the first groups)
            self._keeper.retire(self.state)
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    # ------------------------------------------------------------------ model and layout
    def attach_model(self, model: nn.Module) -> None:
        """Tell DASH the model its parameters belong to: their names, and which are
        embeddings, the output layer or convolutions (``precondition="hidden"`` needs
        this; the Lightning strategies and the Composer algorithm call it)."""
        self._keeper.retire(self.state)
        self._routing.attach(model)

    def _parameter_names(self) -> list[str]:
        """Each parameter's name, where the groups or the model give one, else its group and position."""
        known, fallback = self._routing.names(self.param_groups), param_names(self.param_groups)
        return [name or other for name, other in zip(known, fallback)]

    def preconditioning(self) -> dict[str, MatrixView | None]:
        """How each parameter is updated, by name: its
        :class:`~lightning_dash.optim.stacks.blocks.MatrixView` when DASH preconditions it,
        None when the grafting optimizer alone updates it."""
        return dict(zip(self._parameter_names(), self._routing.views(self.param_groups)))

    def _current_layout(self) -> Layout:
        """The stacked state, built from ``self.state`` when there is none."""
        if self._keeper.layout is not None:
            return self._keeper.layout
        self._resolve_solver()
        views = self._routing.views(self.param_groups)
        return self._keeper.build(self.param_groups, self.state, views, uses_second_moment(self.grafting))

    def _resolve_solver(self) -> None:
        """Point the root computation at the solver for the parameters' current device,
        saying once per device type what ``"auto"`` chose."""
        self.roots.settings = self.root_settings
        device = self._device()
        if self._config.inverse_root_method == AUTO and device.type not in _ANNOUNCED:
            _ANNOUNCED.add(device.type)
            _log.info("DASH inverse_root_method=%s", explain_choice(device, self.block_size))

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; calls ``closure`` (with gradients enabled) first if given.

        The step is applied whole or not at all, decided on the device without a host
        wait: every new statistic, root and update is computed first, then checked, then
        committed. A non-finite gradient anywhere skips the whole step
        (``nonfinite_grad_skips``), a non-finite update too (``nonfinite_update_skips``).
        The host learns a step's verdict at the next step (or when a counter is read):
        a root streak that reached ``max_consecutive_root_failures`` raises
        :class:`RootComputationError` there, before that step changes anything.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._books.verdicts.collect()
        layout = self._current_layout()
        self._books.raise_on_streak(layout, lambda: self.inverse_root_method_in_use)
        self.roots.last_residual = None
        active = active_params(layout)
        if not active or self._materialising(layout, active):
            return loss
        advance_steps(self.state, layout, active, 1)
        try:
            rules = UpdateRules.of(self.config)
            verdict = step_on_device(layout, active, self.param_groups, rules, self.roots, self._keeper.distributor)
        except BaseException:
            advance_steps(self.state, layout, active, -1)
            raise
        self._books.post(verdict, self.state, layout, active)
        return loss

    def _materialising(self, layout: Layout, active: set[int]) -> bool:
        """A step with every learning rate and gradient zero moves nothing and counts
        nothing: ``torch.distributed.checkpoint`` materialises an empty optimizer's state
        this way (reads one value back, only when every learning rate is zero)."""
        if any(group["lr"] != 0 for group in self.param_groups):
            return False
        return gradients_all_zero(layout, active, self._keeper.distributor.reduce_max)

    root_failure_count = _counter(
        "root_failure_count",
        "Blocks whose new roots were rejected (non-finite, or a residual above "
        ":func:`~lightning_dash.optim.roots.failure_residual`), over all ranks.",
    )
    nonfinite_grad_skips = _counter("nonfinite_grad_skips", "Steps skipped whole because some gradient was not finite.")
    nonfinite_update_skips = _counter(
        "nonfinite_update_skips", "Steps skipped whole because some computed update was not finite."
    )
