"""DASH's view of the model: which parameters it preconditions, and as which matrices."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_dash.optim.config import DashConfig
from lightning_dash.optim.routing import ModelParameters, describe_model, matrix_views
from lightning_dash.optim.stacks.blocks import MatrixView
from lightning_dash.optim.stacks.layout import param_names


class ParameterRouting:
    """The ``precondition`` and ``split_rows`` options applied to the optimizer's parameters."""

    param_groups: list[dict[str, Any]]
    _config: DashConfig
    _model: ModelParameters | None

    def _retire_layout(self) -> None:
        raise NotImplementedError

    def attach_model(self, model: nn.Module) -> None:
        """Tell DASH the model its parameters belong to: their names, and which are
        embeddings, the output layer or convolutions (``precondition="hidden"`` needs
        this; the Lightning strategies and the Composer algorithm call it)."""
        self._retire_layout()
        self._model = describe_model(model)

    def _param_names_known(self) -> list[str | None]:
        given = [group.get("param_names") for group in self.param_groups]
        names: list[str | None] = []
        for group, group_names in zip(self.param_groups, given):
            for position, param in enumerate(group["params"]):
                if group_names is not None:
                    names.append(str(group_names[position]))
                else:
                    names.append(self._model.name(param) if self._model is not None else None)
        return names

    def _param_views(self) -> list[MatrixView | None]:
        params = [p for group in self.param_groups for p in group["params"]]
        return matrix_views(
            params, self._param_names_known(), self._model, self._config.precondition, self._config.split_rows
        )

    def preconditioning(self) -> dict[str, MatrixView | None]:
        """How each parameter is updated, by name: its :class:`~lightning_dash.optim.stacks.blocks.MatrixView` when
        DASH preconditions it, None when the grafting optimizer alone updates it."""
        known = self._param_names_known()
        fallback = param_names(self.param_groups)
        return {known[i] or fallback[i]: view for i, view in enumerate(self._param_views())}
