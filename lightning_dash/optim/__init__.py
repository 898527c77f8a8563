"""The DASH optimizer and its pure numerical kernels, independent of any trainer."""

from lightning_dash.optim.config import DashConfig
from lightning_dash.optim.dash import DASH, RootComputationError
from lightning_dash.optim.demo_sign import DeMo

__all__ = ["DASH", "DashConfig", "DeMo", "RootComputationError"]
