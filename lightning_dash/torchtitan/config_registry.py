"""Run configurations of torchtitan with DASH, found by torchtitan's launcher by module path.

``--module lightning_dash.torchtitan --config llama3_debugmodel_dash`` runs torchtitan's Llama debug
model with DASH in place of AdamW; :func:`dash_optimizers` is the one line to put in a
configuration of your own.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from lightning_dash.torchtitan.container import DASH_NAME, DashOptimizersContainer

#: Parameters that stay on AdamW, as DASH's ``precondition="auto"`` routes a language model's: the token
#: embedding and the output layer (their rows are looked up or scored one at a time, not mixed).
ADAMW_PATTERN = r"^(tok_embeddings|lm_head)\."


def dash_optimizers(
    lr: float = 8e-4, adamw_pattern: str = ADAMW_PATTERN, **dash_options: Any
) -> DashOptimizersContainer.Config:
    """torchtitan's ``default_adamw(lr)`` recipe with DASH on every parameter but those ``adamw_pattern``
    matches (the embedding and the output layer by default), which keep AdamW. ``dash_options``: any
    DASH option (``block_size``, ``precondition_frequency``, ...), checked when the container is built."""
    recipe = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    return DashOptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=adamw_pattern, optimizer_name="AdamW", optimizer_kwargs=dict(recipe)),
            ParamGroupConfig(pattern=r".*", optimizer_name=DASH_NAME, optimizer_kwargs=dict(recipe)),
        ],
        optimizer_factory_kwargs_by_name={DASH_NAME: dash_options},
    )


def llama3_debugmodel_dash() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` with :func:`dash_optimizers` at its AdamW lr (8e-4)."""
    config = llama3_debugmodel()
    config.optimizer = dash_optimizers(lr=8e-4)
    return config
