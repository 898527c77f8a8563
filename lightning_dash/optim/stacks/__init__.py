"""Blocks, stacks and where their state lives: the parameters cut into Shampoo blocks, equal shapes
grouped into stacks, the per-stack state and its per-parameter (checkpoint) form.

This is the surface the data-parallel runtimes (:mod:`lightning_dash.distributed`) build on.
"""

from lightning_dash.optim.roots.common import working_dtype
from lightning_dash.optim.stacks.blocks import MatrixView, Region, StackPlan, add_stacks, param_regions
from lightning_dash.optim.stacks.layout import param_names, stacks_by_placement
from lightning_dash.optim.stacks.state import GRAFTING_RMS, MOMENTUM, ROOT_FAILURES, ROOT_VALID

__all__ = [
    "GRAFTING_RMS",
    "MOMENTUM",
    "ROOT_FAILURES",
    "ROOT_VALID",
    "MatrixView",
    "Region",
    "StackPlan",
    "add_stacks",
    "param_names",
    "param_regions",
    "stacks_by_placement",
    "working_dtype",
]
