"""lightning-dash: fast batched Shampoo (DASH) for plain PyTorch, Lightning and Composer.

``from lightning_dash import DASH, DashConfig`` needs torch alone. When Lightning is
installed, importing the package also registers ``strategy="dash"`` (and
``"dash_spawn"``, ``"dash_fork"``, ``"dash_notebook"``) and exports ``DashStrategy``.
The Composer integration lives in :mod:`lightning_dash.composer`.
"""

from importlib.util import find_spec

from lightning_dash.distributed.demo_optimizer import DeMo
from lightning_dash.optim import DASH, DashConfig, RootComputationError

__all__ = ["DASH", "DashConfig", "DeMo", "RootComputationError"]
__version__ = "0.3.0"

if find_spec("lightning") is not None:
    from lightning_dash.strategies import DashStrategy, register_strategies

    register_strategies()
    __all__ += ["DashStrategy"]
