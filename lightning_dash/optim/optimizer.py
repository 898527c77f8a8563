"""DASH: Shampoo with every equal-shaped block of every parameter processed as one stack."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dash.optim.checkpoint import DashStateDict
from lightning_dash.optim.config import AUTO, GROUP_OPTIONS, DashConfig, check_group, check_option
from lightning_dash.optim.conversion import converted_groups
from lightning_dash.optim.distributor import BlockDistributor, LocalDistributor
from lightning_dash.optim.param_routing import ParameterRouting
from lightning_dash.optim.roots import RootSettings
from lightning_dash.optim.roots.choice import choose_inverse_root_method, explain_choice
from lightning_dash.optim.routing import describe_model
from lightning_dash.optim.stacks.layout import Layout, export_layout, layout_bytes, owned_blocks, stack_state
from lightning_dash.optim.step.bookkeeping import StepBookkeeping
from lightning_dash.optim.step.device import step_on_device
from lightning_dash.optim.step.failures import failure_summary
from lightning_dash.optim.step.grafting import uses_second_moment
from lightning_dash.optim.step.refresh import RootRefresher
from lightning_dash.optim.step.update import UpdateRules, active_params, gradients_all_zero
from lightning_dash.optim.step.verdict import VerdictQueue

_log = logging.getLogger("lightning_dash")
#: Device types whose "auto" choice was logged (once per process).
_ANNOUNCED: set[str] = set()


class DASH(ParameterRouting, StepBookkeeping, DashStateDict):
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
        distributor: block ownership across data-parallel ranks (None: this process
            owns every block).
        model: the module the parameters belong to, for the parameters' names and roles
            (``precondition="hidden"`` needs it; see :meth:`attach_model`).
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
        self._counts = {"root_failure_count": 0, "nonfinite_grad_skips": 0, "nonfinite_update_skips": 0}
        self._verdicts = VerdictQueue()
        self._streak_at_limit: int | None = None  # a failure streak the next step raises on
        #: When True (and blocks are sharded), :meth:`state_dict` is collective: every rank
        #: calls it, it consolidates by itself and rank 0 gets the complete state. This is
        #: how ``torch.distributed.checkpoint`` (Composer's checkpoints) calls it.
        self.collective_state_dict = False
        #: The root computation: synchronous, or on a side CUDA stream ("auto" is resolved
        #: when the stacks are built, once the parameters' device is final).
        self.roots = RootRefresher(
            self._config.root_settings,
            self._config.bias_correction,
            self._config.async_preconditioning,
            self._config.max_staleness,
        )
        self._layout: Layout | None = None
        self._distributor: BlockDistributor = distributor or LocalDistributor()
        self._consolidated: dict[int, dict[str, Tensor]] | None = None
        self._model = describe_model(model) if model is not None else None
        defaults = self._config.group_defaults()
        super().__init__(params, defaults)

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
        return self._distributor

    @distributor.setter
    def distributor(self, distributor: BlockDistributor | None) -> None:
        self._retire_layout()
        self._distributor = distributor or LocalDistributor()

    @property
    def ownership_balance(self) -> float:
        """max / mean of the per-rank cost of the block ownership (1.0 in one process)."""
        return self._distributor.balance

    @property
    def owned_blocks(self) -> int:
        """Blocks whose statistics this process holds (0 before the first step)."""
        return owned_blocks(self._layout)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this process holds: the statistics, roots and buffers
        of its blocks and its part of the one-dimensional parameters' buffers (0 before
        the first step). With parameters sharded across N ranks each holds about 1/N."""
        return layout_bytes(self._layout)

    @property
    def preconditioned_blocks(self) -> int:
        """Blocks of this process whose Shampoo roots are in use (roots still being
        computed on a side stream are not counted); reads a count back from the device."""
        if self._layout is None:
            return 0
        return sum(int(stack.state.root_valid.sum()) for stack in self._layout.stacks)

    @property
    def last_root_residual(self) -> Tensor | None:
        """Largest Newton residual of the roots accepted in the latest step (None if none were)."""
        return self.roots.last_residual

    @property
    def async_roots_hidden(self) -> int:
        """Asynchronous root launches swapped in without the main stream waiting (this rank)."""
        return self.roots.pipeline.hidden

    @property
    def async_roots_waited(self) -> int:
        """Asynchronous root launches the main stream had to wait for (this rank)."""
        return self.roots.pipeline.waited

    @property
    def async_wait_ms(self) -> float:
        """Device milliseconds the main stream stalled waiting for side-stream roots."""
        return self.roots.pipeline.wait_ms

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, **overrides: Any) -> DASH:
        """DASH over ``optimizer``'s own parameter-group dictionaries.

        Learning rates, momenta, epsilons and weight decay map onto DASH and its
        grafting (Adam-family optimizers graft Adam, SGD grafts SGD, ...); schedulers
        attached to ``optimizer`` keep editing the same dictionaries. Keyword
        overrides set any :class:`~lightning_dash.optim.config.DashConfig` option
        (per-group ones in every group); ``factor_decay`` sets ``betas[1]``. A DASH
        optimizer is returned unchanged. A subclass that overrides its base class's
        ``step`` is refused (its update rule would be lost) unless ``allow_custom_step=True``.
        """
        if isinstance(optimizer, DASH):
            return optimizer
        groups, options = converted_groups(optimizer, overrides)
        return cls(groups, **options)

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
    def _current_layout(self) -> Layout:
        """The stacked state, built from ``self.state`` when there is none."""
        if self._layout is None:
            self._resolve_solver()
            self._layout = stack_state(
                self.param_groups,
                self.state,
                self._param_views(),
                self._distributor,
                self.block_size,
                want_second_moment=uses_second_moment(self.grafting),
            )
        return self._layout

    def _resolve_solver(self) -> None:
        """Point the root computation at the solver for the parameters' current device,
        saying once per device type what ``"auto"`` chose."""
        self.roots.settings = self.root_settings
        device = self._device()
        if self._config.inverse_root_method == AUTO and device.type not in _ANNOUNCED:
            _ANNOUNCED.add(device.type)
            _log.info("DASH inverse_root_method=%s", explain_choice(device, self.block_size))

    def _retire_layout(self) -> None:
        """Move stacked state back into ``self.state`` so the layout can be rebuilt."""
        if "roots" in self.__dict__:
            self._settle_roots(collective=False)
        layout = self.__dict__.get("_layout")
        if layout is None:
            return
        # Sharded parameters: per-tile entries, so no rank builds a whole parameter-shaped buffer.
        tiles = self._distributor.shards_parameters
        for index, entry in export_layout(layout, tiles=tiles).items():
            self.state[layout.params[index]].update(entry)
        self._layout = None

    def _settle_roots(self, collective: bool) -> None:
        """Collect the latest verdict and swap pending side-stream roots in, so saved or
        exported state holds them (reads values back: not for the step's hot path)."""
        self._verdicts.collect()
        layout = self._layout
        report = self.roots.settle(layout, collective or self._distributor.world_size == 1)
        if report is not None and layout is not None:
            device = layout.params[0].device if layout.params else torch.device("cpu")
            failed, longest = failure_summary(report, self._distributor, device).tolist()
            self._counts["root_failure_count"] += int(failed)
            self._note_streak(int(longest))

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
        self._verdicts.collect()
        layout = self._current_layout()
        self._raise_on_streak(layout)
        self.roots.last_residual = None
        active = active_params(layout)
        if not active or self._materialising(layout, active):
            return loss
        self._advance(layout, active, 1)
        try:
            rules = UpdateRules(self.grafting, self.nesterov, self.bias_correction, self._config.compile, self.lr_scale)
            verdict = step_on_device(layout, active, self.param_groups, rules, self.roots, self._distributor)
        except BaseException:
            self._advance(layout, active, -1)
            raise
        self._verdicts.post(verdict, lambda read: self._read_verdict(layout, active, read))
        return loss

    def _materialising(self, layout: Layout, active: set[int]) -> bool:
        """A step with every learning rate and gradient zero moves nothing and counts
        nothing: ``torch.distributed.checkpoint`` materialises an empty optimizer's state
        this way (reads one value back, only when every learning rate is zero)."""
        if any(group["lr"] != 0 for group in self.param_groups):
            return False
        return gradients_all_zero(layout, active, self._distributor.reduce_max)
