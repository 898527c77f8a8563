"""The DASH optimizer and its pure numerical kernels, independent of any trainer."""

from lightning_dash.optim.config import DashConfig
from lightning_dash.optim.distributor import BlockDistributor, BlockUpdate, LocalDistributor
from lightning_dash.optim.optimizer import DASH
from lightning_dash.optim.step.failures import RootComputationError

__all__ = ["DASH", "BlockDistributor", "BlockUpdate", "DashConfig", "LocalDistributor", "RootComputationError"]
