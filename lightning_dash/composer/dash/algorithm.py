"""The ``Dash`` Composer algorithm: swap the trainer's optimizer for DASH at ``Event.INIT``."""

from __future__ import annotations

import logging
from typing import Any

from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.utils import ensure_tuple
from typing_extensions import override

from lightning_dash.composer.dash.checkpoints import CheckpointForm
from lightning_dash.composer.dash.gradient_average import correct_gradient_average
from lightning_dash.composer.dash.sharding import check_composer_sharding, fsdp_version, refuse_fsdp1
from lightning_dash.integration.options import ConversionOptions, accepts_dash_options
from lightning_dash.integration.sharded_checkpoint import name_parameters
from lightning_dash.integration.trainer_options import refuse_unknown
from lightning_dash.optim import DASH, DashConfig

log = logging.getLogger(__name__)

__all__ = ["Dash"]


class Dash(Algorithm):
    """Train with DASH instead of the optimizer given to the Composer ``Trainer``.

    At ``Event.INIT`` (before Composer compiles its schedulers, wraps the model for
    DDP and loads a checkpoint) the single optimizer in ``state.optimizers`` —
    ``DecoupledAdamW``, ``DecoupledSGDW``, or a torch Adam/AdamW/SGD/Adagrad/RMSprop —
    is converted with :meth:`DASH.from_optimizer` over the same parameter groups,
    so learning rates, momenta and weight decay carry over and the schedulers bind
    to DASH. With several processes every rank owns a cost-balanced share of the
    blocks and one all-gather shares the updates (the same
    :class:`~lightning_dash.distributed.ProcessGroupDistributor` the Lightning
    strategy uses). Under Composer's FSDP2 (``FSDP2Config``) the parameters are row
    shards and a :class:`~lightning_dash.distributed.ShardedDistributor` sends each
    block's gradient rows to its owner and the update rows back, as the ``"dash_fsdp"``
    strategy does; FSDP1 is refused at INIT. Checkpoints go through Composer's own
    save/load (:mod:`lightning_dash.composer.dash.checkpoints` gives DASH's state the form
    it expects) and resume on any number of processes, under DDP or FSDP2.

    Options are plain keyword arguments so llm-foundry YAML can pass them
    (``algorithms: {dash: {block_size: 1024}}``), or a
    :class:`~lightning_dash.optim.DashConfig` from Python.

    Args:
        config: DASH options as a :class:`~lightning_dash.optim.DashConfig`; its fields that
            differ from the defaults override the values mapped from the original optimizer.
        **options: every :class:`~lightning_dash.optim.DashConfig` option by keyword (they
            appear in this signature, generated from DashConfig); one that is not None
            overrides ``config`` and the value mapped from the original optimizer, e.g. Adam
            grafting for ``DecoupledAdamW``
            (:mod:`lightning_dash.integration.options` states the rule), and the keyword arguments
            below.

    Keyword Args:
        factor_decay (float | None): decay of the Kronecker factors (``betas[1]`` of DASH).
        allow_custom_step (bool | None): convert a subclass of a supported optimizer that overrides
            ``step`` (its own update rule is then lost; refused by default).
        communication_dtype (torch.dtype | str): dtype of the all-gathered block updates across ranks.
        micro_group_mib (float | None): under FSDP2, the memory budget per rank, in MiB, for the whole
            blocks a step gathers at once (None: one round); refused under DDP.

    Example:
        >>> from composer import Trainer
        >>> from lightning_dash.composer import Dash
        >>> trainer = Trainer(model=model, algorithms=[Dash(block_size=1024)], ...)  # doctest: +SKIP
    """

    @accepts_dash_options
    def __init__(
        self,
        config: DashConfig | None = None,
        **options: Any,
    ) -> None:
        #: How the trainer's optimizer becomes DASH: the resolved overrides and conversion options.
        self.conversion = ConversionOptions.from_init(options, config)
        refuse_unknown(options, type(self))  # a name left over is none of Dash's
        #: The DASH optimizer this algorithm installed (None before ``Event.INIT``).
        self.optimizer: DASH | None = None
        #: How DASH's state meets Composer's checkpoints (None before ``Event.INIT``).
        self.checkpoint_form: CheckpointForm | None = None
        self._fsdp2 = False
        self._sharding_checked = False

    def __repr__(self) -> str:
        conversion = self.conversion
        shown = {**conversion.overrides, "communication_dtype": conversion.communication_dtype}
        if conversion.factor_decay is not None:
            shown["factor_decay"] = conversion.factor_decay
        if conversion.allow_custom_step:
            shown["allow_custom_step"] = True
        if conversion.micro_group_mib is not None:
            shown["micro_group_mib"] = conversion.micro_group_mib
        return f"Dash({', '.join(f'{key}={value!r}' for key, value in shown.items())})"

    @override
    def match(self, event: Event, state: State) -> bool:
        if event == Event.INIT:
            return True
        # FSDP2 replaces the parameters by DTensors after INIT, before BEFORE_LOAD.
        return self._fsdp2 and event in (Event.BEFORE_LOAD, Event.AFTER_LOAD)

    @override
    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            self._install(state)
            return
        assert self.optimizer is not None and self.checkpoint_form is not None
        if not self._sharding_checked:
            self._check_sharding(state)
        self.checkpoint_form.loading = event == Event.BEFORE_LOAD
        if event == Event.AFTER_LOAD:
            self.checkpoint_form.finish_loading()

    def _install(self, state: State) -> None:
        refuse_fsdp1(state)
        self._fsdp2 = fsdp_version(state) == 2
        if self._fsdp2 and state.fsdp_config.load_monolith_rank0_only:
            raise ValueError(
                "Dash under FSDP2 does not support load_monolith_rank0_only=True: Composer shards the "
                "model after such a load and clears the optimizer state it loaded"
            )
        optimizers = ensure_tuple(state.optimizers)
        if len(optimizers) != 1:
            raise ValueError(f"Dash needs exactly one optimizer in the trainer, found {len(optimizers)}")
        dash = self.conversion.convert(optimizers[0], sharded_parameters=self._fsdp2, model=state.model)
        if self._fsdp2:
            # Composer swaps the parameters for FSDP2's DTensors by name and keeps the other
            # group keys: named groups keep routing and checkpoints tied to the names.
            name_parameters(dash, state.model)
        sharded_files = self._fsdp2 and state.fsdp_config.state_dict_type == "sharded"
        self.checkpoint_form = CheckpointForm(dash, sharded_files=sharded_files)
        state.optimizers = dash
        self.optimizer = dash
        log.info(
            "Dash: replaced %s by DASH%s",
            type(optimizers[0]).__name__,
            "" if dash.distributor is None else f" (blocks owned across {dash.distributor.world_size} ranks)",
        )

    def _check_sharding(self, state: State) -> None:
        """Once FSDP2 has sharded the model: re-read the parameters' roles (DASH keys them
        by identity, and the parameters are new), check they are row shards, and make
        the backend's gradient reduction an average."""
        dash = self.optimizer
        assert dash is not None
        dash.attach_model(state.model)
        check_composer_sharding(dash)
        factor = correct_gradient_average(state, dash.param_groups[0]["params"][0])
        if factor != 1:
            log.warning(
                "Dash: this backend's reduce_scatter sums where FSDP2 asks for an average (gloo under "
                "torch 2.7); FSDP2's gradients are divided by %d",
                factor,
            )
        self._sharding_checked = True

    def state_dict(self) -> dict[str, Any]:
        """Composer stores this beside the optimizer. torch.distributed.checkpoint keeps
        only DASH's per-parameter state and groups, so DASH's optimizer-wide counters and
        grafting type travel here (Composer loads algorithms before optimizers)."""
        packed = super().state_dict()
        if self.optimizer is not None:
            packed["dash"] = {
                "root_failure_count": self.optimizer.root_failure_count,
                "nonfinite_grad_skips": self.optimizer.nonfinite_grad_skips,
                "nonfinite_update_skips": self.optimizer.nonfinite_update_skips,
                "grafting": self.optimizer.grafting,
            }
        if self.checkpoint_form is not None and self.checkpoint_form.saved_keys is not None:
            # What the whole file's optimizer state holds, for the template of a load under FSDP2.
            packed["optimizer_state_keys"] = self.checkpoint_form.saved_keys
        return packed

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("dash")
        if saved is None or self.optimizer is None:
            return
        form = self.checkpoint_form
        if self._fsdp2 and form is not None and not form.sharded_files:
            keys = state.get("optimizer_state_keys")
            if keys is None:
                raise ValueError(
                    "Dash under FSDP2 cannot load this single-file checkpoint: it does not record its "
                    "optimizer state's keys (written by lightning-dash 0.4 or earlier); resume it once "
                    "without FSDP and save it again"
                )
            form.expect_whole_file(keys)
        self.optimizer.root_failure_count = int(saved["root_failure_count"])
        self.optimizer.nonfinite_grad_skips = int(saved["nonfinite_grad_skips"])
        self.optimizer.nonfinite_update_skips = int(saved.get("nonfinite_update_skips", 0))
        self.optimizer.grafting = saved["grafting"]
