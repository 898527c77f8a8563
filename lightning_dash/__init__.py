"""lightning-dash: fast batched Shampoo (DASH) for plain PyTorch, Lightning and Composer.

Importing the package registers ``strategy="dash"`` (and ``"dash_spawn"``,
``"dash_fork"``) with Lightning.
"""

from lightning_dash.optim import DASH, DashConfig, DeMo, RootComputationError
from lightning_dash.strategies import DashStrategy, register_strategies

register_strategies()

__all__ = ["DASH", "DashConfig", "DashStrategy", "DeMo", "RootComputationError"]
__version__ = "0.1.0"
