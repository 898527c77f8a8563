"""The DASH optimizer and its pure numerical kernels, independent of any trainer."""

from lightning_dash.optim.dash import DASH, RootComputationError

__all__ = ["DASH", "RootComputationError"]
