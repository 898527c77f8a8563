"""lightning-dash: fast batched Shampoo (DASH) for plain PyTorch, Lightning and Composer."""

from lightning_dash.optim import DASH, RootComputationError

__all__ = ["DASH", "RootComputationError"]
__version__ = "0.1.0"
