"""Which parameters DASH preconditions, and as which matrices.

A routing rule (the ``precondition`` option) sends each parameter either to the
Shampoo blocks or to the grafting optimizer alone:

* ``"all_matrices"``: every parameter of two or more dimensions is preconditioned;
* ``"hidden"``: as Muon's recipe, the embeddings, the output layer (and a weight tied
  to either) go to the grafting optimizer, with the one-dimensional parameters;
* a set of parameter names: exactly these are preconditioned;
* a callable ``(name, param) -> bool``.

One-dimensional and empty parameters always go to the grafting optimizer. A
preconditioned parameter is seen as a :class:`~lightning_dash.optim.stacks.blocks.MatrixView`: a 3-D
parameter that is not a convolution's weight is a stack of expert matrices
``(experts, out, in)``, one matrix per expert; other parameters are
``(shape[0], rest)``. ``split_rows`` cuts a fused projection (``{"qkv": 3}``) into
equal row parts, each its own matrix.

Roles (embedding, output layer, convolution) come from the model's modules
(:func:`describe_model`), never from shapes: the Lightning strategies and the
Composer algorithm describe the model they train; in plain PyTorch, pass
``model=`` to :class:`~lightning_dash.optim.DASH`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lightning_dash.optim.stacks.blocks import MatrixView

ALL_MATRICES = "all_matrices"
HIDDEN = "hidden"
#: ``hidden`` when DASH knows the model and it has no recurrent layer, else ``all_matrices`` (the default).
AUTO = "auto"
PRECONDITION_RULES = (AUTO, ALL_MATRICES, HIDDEN)

EMBEDDING = "embedding"
OUTPUT = "output"
CONVOLUTION = "convolution"

#: A routing rule: one of :data:`PRECONDITION_RULES`, a set of names or a callable.
PreconditionRule = str | frozenset[str] | Callable[[str, Tensor], bool]

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
#: Names of parameters that a module holds itself (not through a layer such as ``nn.Embedding``) and that
#: are embeddings all the same: learned position tables (``position``, ``pos_embed``, ``wpe``, ...) and
#: class, register or mask tokens. Each row or token is added to the activations, never multiplied into
#: them, as an embedding's rows are; matched against the attribute's own name, case-insensitively.
TABLE_NAMES = re.compile(
    r"(pos|position|positional|absolute_pos)(_?(emb|embed|embeds|embedding|embeddings|encoding|encodings|table))?"
    r"|wpe|cls_token|class_token|reg_token|register_tokens|dist_token|mask_token",
    re.IGNORECASE,
)
#: Recurrent layers (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``): a model with one is routed ``all_matrices`` by ``auto``.
_RECURRENT = (nn.RNNBase, nn.RNNCellBase)


@dataclass(frozen=True)
class ModelParameters:
    """What a model's modules say about its parameters, keyed by ``id(parameter)``:
    each one's name and roles (``embedding``, ``output``, ``convolution``), and whether
    the model has a recurrent layer."""

    names: dict[int, str] = field(default_factory=dict)
    roles: dict[int, frozenset[str]] = field(default_factory=dict)
    recurrent: bool = False

    def name(self, param: Tensor) -> str | None:
        return self.names.get(id(param))

    def roles_of(self, param: Tensor) -> frozenset[str]:
        return self.roles.get(id(param), frozenset())


def describe_model(model: nn.Module) -> ModelParameters:
    """Names and roles of ``model``'s parameters: ``nn.Embedding``/``nn.EmbeddingBag``
    weights are embeddings, and so are the tables a module holds as bare parameters under a
    position-table or token name (:data:`TABLE_NAMES`); convolution weights are convolutions, and
    the weight of the last ``nn.Linear`` in registration order is the output layer (a weight shared
    with an embedding has both roles); an ``nn.RNN``/``nn.GRU``/``nn.LSTM`` (or one of their
    cells) makes the model recurrent."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the nn.Module being trained (or None), got {type(model).__name__}")
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    roles: dict[int, set[str]] = {}
    last_linear: nn.Linear | None = None
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            roles.setdefault(id(module.weight), set()).add(EMBEDDING)
        elif isinstance(module, _CONVOLUTIONS):
            roles.setdefault(id(module.weight), set()).add(CONVOLUTION)
        elif isinstance(module, nn.Linear):
            last_linear = module
        else:
            for attribute, param in module.named_parameters(recurse=False):
                if TABLE_NAMES.fullmatch(attribute):
                    roles.setdefault(id(param), set()).add(EMBEDDING)
    if last_linear is not None:
        roles.setdefault(id(last_linear.weight), set()).add(OUTPUT)
    recurrent = any(isinstance(module, _RECURRENT) for module in model.modules())
    return ModelParameters(names, {key: frozenset(value) for key, value in roles.items()}, recurrent)


def resolve_auto(model: ModelParameters | None) -> str:
    """What ``precondition="auto"`` stands for: ``hidden`` for a known model without a recurrent
    layer, ``all_matrices`` for a recurrent one or an unknown model.

    Why recurrent models keep their embeddings and output layer preconditioned: an output layer
    trained by Adam turns nearly rank one within a few dozen steps, so the error it sends back,
    summed over every time step by the recurrence, gives the recurrent weights' factors one
    dominant direction and a deep tail (median eigenvalue 1e-4 to 1e-6 of the largest). Damped
    relative to the factor's norm, most of that tail is held still, the grafted step goes into the
    few directions left, and the recurrence tips into exploding gradients (a byte-level GRU at a
    high lr failed on 4 of 6 seeds). A preconditioned output layer keeps several directions and the
    tail fills in (0 of 6)."""
    return HIDDEN if model is not None and not model.recurrent else ALL_MATRICES


def check_precondition(name: str, value: Any) -> PreconditionRule:
    """The ``precondition`` option: a rule name, a callable, or a collection of names
    (returned as a frozenset)."""
    if value in PRECONDITION_RULES or (callable(value) and not isinstance(value, str)):
        return value
    names = isinstance(value, Collection) and not isinstance(value, (str, Mapping))
    if names and all(isinstance(item, str) for item in value):
        return frozenset(value)
    raise ValueError(
        f"{name} must be one of {PRECONDITION_RULES}, a set of parameter names or a callable (name, param) -> bool, "
        f"got {value!r}"
    )


def check_split_rows(name: str, value: Any) -> tuple[tuple[str, int], ...]:
    """The ``split_rows`` option: a mapping (or pairs) of name part -> number of equal
    row parts, returned as sorted pairs."""
    try:
        pairs = sorted((key, parts) for key, parts in (value.items() if isinstance(value, Mapping) else value))
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or not all(_row_parts(key, parts) for key, parts in pairs):
        raise ValueError(f"{name} must map parameter names to a number of row parts >= 1, got {value!r}")
    return tuple(pairs)


def _row_parts(key: Any, parts: Any) -> bool:
    return isinstance(key, str) and bool(key) and isinstance(parts, int) and not isinstance(parts, bool) and parts >= 1


def _matches(key: str, name: str) -> bool:
    """Whether ``key`` is a run of whole dotted components of ``name``."""
    return f".{key}." in f".{name}."


def matrix_views(
    params: list[Tensor],
    names: list[str | None],
    model: ModelParameters | None,
    precondition: PreconditionRule,
    split_rows: tuple[tuple[str, int], ...] = (),
) -> list[MatrixView | None]:
    """Each parameter's matrix view, or None when the grafting optimizer updates it alone.

    ``names`` are the parameters' names where known (None elsewhere); ``model`` the
    roles from :func:`describe_model`, if a model was described. Raises ``ValueError``
    when the rule needs names or roles that are unknown, or names a parameter (or a
    ``split_rows`` key) that is not there.
    """
    if precondition == AUTO:
        precondition = resolve_auto(model)
    if precondition == HIDDEN and model is None:
        raise ValueError(
            "precondition='hidden' needs to know the model's embeddings and output layer: pass model=... to "
            "DASH (the Lightning strategies and the Composer algorithm pass it themselves)"
        )
    needs_names = not isinstance(precondition, str) or bool(split_rows)
    if needs_names and any(name is None for name in names):
        raise ValueError(
            "precondition as names or a callable, and split_rows, need parameter names: pass "
            "model.named_parameters() or model=... to DASH"
        )
    if isinstance(precondition, frozenset):
        unknown = sorted(precondition - set(names))
        if unknown:
            raise ValueError(f"precondition names parameters this optimizer does not have: {unknown}")
    unused = [key for key, _ in split_rows if not any(name is not None and _matches(key, name) for name in names)]
    if unused:
        raise ValueError(f"split_rows names parameters this optimizer does not have: {unused}")
    return [
        _view(param, name, model.roles_of(param) if model else frozenset(), precondition, split_rows)
        for param, name in zip(params, names)
    ]


def _preconditioned(param: Tensor, name: str | None, roles: frozenset[str], rule: PreconditionRule) -> bool:
    if rule == ALL_MATRICES:
        return True
    if rule == HIDDEN:
        return not roles & {EMBEDDING, OUTPUT}
    if isinstance(rule, frozenset):
        return name in rule
    return bool(rule(name, param))  # type: ignore[operator,arg-type]


def _view(
    param: Tensor,
    name: str | None,
    roles: frozenset[str],
    rule: PreconditionRule,
    split_rows: tuple[tuple[str, int], ...],
) -> MatrixView | None:
    if param.dim() < 2 or param.numel() == 0:
        if isinstance(rule, frozenset) and name in rule and param.numel() > 0:
            raise ValueError(
                f"precondition names {name!r}, which has {param.dim()} dimension(s): only parameters "
                "of two or more dimensions can be preconditioned"
            )
        return None
    if not _preconditioned(param, name, roles, rule):
        return None
    shape = tuple(param.shape)
    if len(shape) == 3 and CONVOLUTION not in roles:
        view = MatrixView(shape[1], shape[2], shape[0])  # one matrix per expert
    else:
        view = MatrixView.of(shape)
    for key, parts in split_rows:
        if name is not None and _matches(key, name):
            if view.part_rows % parts:
                raise ValueError(
                    f"split_rows[{key!r}] = {parts} does not divide the {view.part_rows} rows of {name} "
                    f"{shape} into equal parts"
                )
            view = MatrixView(view.part_rows // parts, view.cols, view.parts * parts)
    return view


class ParameterRouting:
    """An optimizer's routing: its ``precondition`` and ``split_rows`` options and what it knows of
    the model, applied to its parameter groups (names from the groups' ``param_names`` or the model)."""

    def __init__(
        self,
        precondition: PreconditionRule,
        split_rows: tuple[tuple[str, int], ...],
        model: nn.Module | None = None,
    ) -> None:
        self.precondition = precondition
        self.split_rows = split_rows
        self.model = describe_model(model) if model is not None else None

    def attach(self, model: nn.Module) -> None:
        """Take the names and roles of ``model``'s parameters."""
        self.model = describe_model(model)

    def names(self, param_groups: list[dict[str, Any]]) -> list[str | None]:
        """Each parameter's name, where the groups or the model give one."""
        names: list[str | None] = []
        for group in param_groups:
            given = group.get("param_names")
            for position, param in enumerate(group["params"]):
                if given is not None:
                    names.append(str(given[position]))
                else:
                    names.append(self.model.name(param) if self.model is not None else None)
        return names

    def views(self, param_groups: list[dict[str, Any]]) -> list[MatrixView | None]:
        """Each parameter's matrix view, or None where the grafting optimizer alone updates it."""
        params = [p for group in param_groups for p in group["params"]]
        return matrix_views(params, self.names(param_groups), self.model, self.precondition, self.split_rows)
