"""How a trainer integration takes DASH options and converts the user's optimizer with them.

The Lightning strategy and the Composer algorithm both accept ``config`` (a
:class:`~lightning_dash.optim.DashConfig`), every DASH option by keyword, and the
conversion options ``factor_decay``, ``allow_custom_step`` and
``communication_dtype``. :meth:`ConversionOptions.build` resolves them once, for
both, into the *overrides* passed to :meth:`DASH.from_optimizer
<lightning_dash.optim.DASH.from_optimizer>`:

1. the fields of ``config`` that differ from DashConfig's defaults, then
2. every keyword option that is not None (a keyword wins over ``config``).

Every other option keeps the value mapped from the user's optimizer (AdamW's
momentum, ``eps`` and weight decay, SGD's grafting, ...) or DASH's default. So a
``config`` field left at (or set to) its default never overrides the mapped value,
and a keyword cannot set an option to None (None means "not set"): pass
``config=DashConfig(max_consecutive_root_failures=None)`` for that.
"""

from __future__ import annotations

import inspect
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_dash.distributed import shard_across_ranks
from lightning_dash.distributed.micro_groups import check_micro_group_mib
from lightning_dash.integration.trainer_options import check_data_parallel_options
from lightning_dash.optim import DASH, DashConfig
from lightning_dash.optim.config import OPTION_NAMES, check_option, check_option_names
from lightning_dash.optim.conversion import DEFAULT_FACTOR_DECAY, check_conversion_options
from lightning_dash.optim.distributor import BlockDistributor
from lightning_dash.optim.validation import check_communication_dtype


@dataclass(frozen=True)
class ConversionOptions:
    """The options a trainer integration converts the user's optimizer to DASH with.

    Checked when built, so a bad value fails when the strategy or algorithm is
    constructed, naming the option, rather than when training starts.

    Attributes:
        overrides: DASH options (:class:`~lightning_dash.optim.DashConfig` names, checked
            and normalised, read-only) that replace the values mapped from the user's
            optimizer: per-group ones in every parameter group, the others optimizer-wide.
        factor_decay: ``betas[1]`` of every group (None: DASH's default); conflicts with
            overriding ``betas``, which sets it too.
        allow_custom_step: convert a subclass of a supported optimizer that overrides
            ``step`` (its own update rule is then lost; refused by default).
        communication_dtype: dtype of the block updates all-gathered across ranks.
        micro_group_mib: where parameters are sharded (FSDP2, tensor parallelism), the memory
            budget per rank, in MiB, for the whole blocks a step gathers at once: blocks are
            exchanged and computed in micro-groups that fit it (None: all in one round).
    """

    overrides: Mapping[str, Any] = field(default_factory=dict)
    factor_decay: float | None = None
    allow_custom_step: bool = False
    communication_dtype: torch.dtype = torch.float32
    micro_group_mib: float | None = None

    def __post_init__(self) -> None:
        check_option_names(self.overrides)
        overrides = {name: check_option(name, value) for name, value in self.overrides.items()}
        object.__setattr__(self, "overrides", MappingProxyType(overrides))
        if self.factor_decay is not None and "betas" in overrides:
            raise ValueError("factor_decay and betas both set betas[1]: give only one of them")
        decay, _ = check_conversion_options(
            DEFAULT_FACTOR_DECAY if self.factor_decay is None else self.factor_decay, self.allow_custom_step
        )
        object.__setattr__(self, "factor_decay", None if self.factor_decay is None else decay)
        object.__setattr__(self, "communication_dtype", check_communication_dtype(self.communication_dtype))
        object.__setattr__(self, "micro_group_mib", check_micro_group_mib(self.micro_group_mib))

    def __reduce__(self) -> tuple[Any, ...]:
        # Spawned ranks receive the strategy pickled; a mappingproxy does not pickle.
        fields = (self.factor_decay, self.allow_custom_step, self.communication_dtype, self.micro_group_mib)
        return type(self), (dict(self.overrides), *fields)

    @classmethod
    def build(
        cls,
        config: DashConfig | None = None,
        *,
        factor_decay: float | None = None,
        allow_custom_step: bool | None = None,
        communication_dtype: torch.dtype | str = torch.float32,
        micro_group_mib: float | None = None,
        **options: Any,
    ) -> ConversionOptions:
        """Resolve a trainer integration's arguments (see the module docstring for the rule).

        ``options`` are DASH options by name, None meaning "not set"; an unknown name
        raises ``TypeError`` listing the known ones, a bad value ``ValueError`` or
        ``TypeError`` naming the option.
        """
        if config is not None and not isinstance(config, DashConfig):
            raise TypeError(f"config must be a DashConfig, got {type(config).__name__}")
        check_option_names(options)
        given = {name: value for name, value in options.items() if value is not None}
        overrides = {**(config.changed() if config is not None else {}), **given}
        custom = False if allow_custom_step is None else allow_custom_step
        return cls(overrides, factor_decay, custom, communication_dtype, micro_group_mib)

    @classmethod
    def from_init(cls, keywords: dict[str, Any], config: DashConfig | None = None) -> ConversionOptions:
        """What every front-end's constructor does first: take ``config``, the conversion arguments
        (:data:`CONVERSION_ARGUMENTS`) and the DASH options out of its ``keywords`` (in place, so that
        the rest can go to the trainer's base class) and resolve them (:meth:`build`)."""
        config = keywords.pop("config", config)
        conversion = {name: keywords.pop(name, default) for name, (_, default) in CONVERSION_ARGUMENTS.items()}
        options = {name: keywords.pop(name) for name in list(keywords) if name in OPTION_NAMES}
        return cls.build(config, **conversion, **options)

    @classmethod
    def for_data_parallel(
        cls,
        keywords: dict[str, Any],
        strategy: type,
        takes: tuple[Callable[..., Any], ...],
        sharded: tuple[Callable[..., Any], ...],
        use_instead: str,
    ) -> ConversionOptions:
        """:meth:`from_init` for a data-parallel front-end (Lightning's or Fabric's DDP strategy), which
        then refuses ``micro_group_mib``, a sharding keyword (pointing to ``use_instead``), a keyword that
        none of ``takes`` accepts and a wrong ``start_method`` (see
        :func:`~lightning_dash.integration.trainer_options.check_data_parallel_options`)."""
        conversion = cls.from_init(keywords)
        conversion.check_sharding(sharded_parameters=False)
        check_data_parallel_options(keywords, strategy, takes, sharded, use_instead)
        return conversion

    def sharded_distributor(self, optimizer: Optimizer) -> BlockDistributor:
        """The :class:`~lightning_dash.distributed.ShardedDistributor` these options configure, for the
        parameters of ``optimizer`` (FSDP2 row shards, DTensors)."""
        # Imported here: it needs torch.distributed.tensor, which `import lightning_dash` does not load.
        from lightning_dash.distributed.sharded import ShardedDistributor

        config = optimizer.config if isinstance(optimizer, DASH) else DashConfig.build(**self.overrides)
        return ShardedDistributor(
            communication_dtype=self.communication_dtype,
            root_iterations=config.root_iterations or 10,
            micro_group_mib=self.micro_group_mib,
        )

    def check_sharding(self, sharded_parameters: bool) -> None:
        """Refuse ``micro_group_mib`` for a front-end whose parameters are whole on every rank."""
        if self.micro_group_mib is not None and not sharded_parameters:
            raise ValueError(
                "micro_group_mib applies where parameters are sharded (strategy 'dash_fsdp', or Composer "
                "under FSDP2): under DDP every rank holds whole parameters and gathers no blocks"
            )

    def convert(
        self, optimizer: Optimizer, *, sharded_parameters: bool = False, model: nn.Module | None = None
    ) -> DASH:
        """``optimizer`` as DASH over its own parameter groups (so its schedulers keep
        working), with these options, and its blocks owned across the ranks of the
        default process group when several are running. ``sharded_parameters``: the
        parameters are FSDP2 row shards (DTensors), exchanged by a
        :class:`~lightning_dash.distributed.ShardedDistributor` (also in one process).
        ``model``: the module being trained, whose embeddings and output layer the
        ``precondition`` option recognises (:meth:`DASH.attach_model`).

        A DASH optimizer is kept as it is: the overrides are not applied to it (a
        warning names them).
        """
        sharded = self.sharded_distributor(optimizer) if sharded_parameters else None
        if isinstance(optimizer, DASH):
            ignored = sorted(self.overrides)
            if self.factor_decay is not None:
                ignored.append("factor_decay")
            if ignored:
                warnings.warn(
                    f"the optimizer already is DASH: the options {ignored} are not applied to it",
                    UserWarning,
                    stacklevel=2,
                )
            dash = optimizer
            if sharded is not None:
                dash.distributor = sharded
        else:
            conversion = {"factor_decay": self.factor_decay} if self.factor_decay is not None else {}
            dash = DASH.from_optimizer(
                optimizer,
                **self.overrides,
                **conversion,
                allow_custom_step=self.allow_custom_step,
                distributor=sharded,
            )
        if model is not None:
            dash.attach_model(model)
        if not sharded_parameters:
            self.check_sharding(sharded_parameters=False)
            shard_across_ranks(dash, self.communication_dtype)
        return dash


#: The conversion arguments every front-end takes beside ``config`` and the DASH options, with their types
#: and defaults (documented on :class:`ConversionOptions` and on each front-end).
CONVERSION_ARGUMENTS: Mapping[str, tuple[Any, Any]] = MappingProxyType(
    {
        "factor_decay": (float | None, None),
        "allow_custom_step": (bool | None, None),
        "communication_dtype": (torch.dtype | str, torch.float32),
        "micro_group_mib": (float | None, None),
    }
)

_Init = typing.TypeVar("_Init", bound=Callable[..., None])


def accepts_dash_options(init: _Init) -> _Init:
    """Give an ``__init__`` that takes ``**kwargs`` the keyword-only parameters ``config``, the
    :data:`CONVERSION_ARGUMENTS` and every DASH option (default None, read from :class:`DashConfig`) in
    its signature, so that introspection (LightningCLI's ``class_path``/``init_args``, llm-foundry, IDEs)
    sees them without the list being written again in each front-end. The call itself is unchanged: they
    arrive in ``**kwargs`` (:meth:`ConversionOptions.from_init` takes them out); a front-end may declare
    ``config`` itself (the Composer algorithm takes it by position).
    """
    signature = inspect.signature(init)
    hints = typing.get_type_hints(DashConfig)
    given = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    rest = [p for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    keyword = inspect.Parameter.KEYWORD_ONLY
    generated = (
        []
        if "config" in signature.parameters
        else [inspect.Parameter("config", keyword, default=None, annotation=DashConfig | None)]
    )
    generated += [
        inspect.Parameter(name, keyword, default=default, annotation=annotation)
        for name, (annotation, default) in CONVERSION_ARGUMENTS.items()
    ]
    generated += [
        inspect.Parameter(name, keyword, default=None, annotation=hints[name] | None) for name in OPTION_NAMES
    ]
    init.__signature__ = signature.replace(parameters=given + generated + rest)  # type: ignore[attr-defined]
    return init
