"""The lightning-dash package: fast batched Shampoo (DASH) for plain PyTorch, Lightning and Composer.

``from lightning_dash import DASH, DashConfig`` needs torch alone. Importing the package
registers ``strategy="dash"`` (and ``"dash_spawn"``, ``"dash_fork"``, ``"dash_notebook"``,
each also ``..._find_unused_parameters_true``/``_false``) in every installed Lightning
namespace (``lightning.pytorch`` and ``pytorch_lightning``), and ``strategy="dash_fsdp"``
(FSDP2, with ``"dash_fsdp_spawn"`` and ``"dash_fsdp_fork"``); the same names, for Fabric's launchers
(``"dash"``, ``"dash_spawn"``, ``"dash_fork"``, ``"dash_notebook"``,
``"dash_find_unused_parameters_true"``, ``"dash_fsdp"``, ``"dash_fsdp_spawn"``, ``"dash_fsdp_fork"``),
go in every installed Fabric namespace (``lightning.fabric`` and ``lightning_fabric``). With
``lightning`` installed it also exports ``DashStrategy`` and ``DashFSDPStrategy`` (Trainer) and
``DashFabricStrategy`` and ``DashFabricFSDPStrategy`` (Fabric).
The Composer integration lives in :mod:`lightning_dash.composer`.
"""

from importlib.util import find_spec

from lightning_dash.distributed.demo_optimizer import DeMo
from lightning_dash.integration.namespaces import register_strategies
from lightning_dash.optim import DASH, DashConfig, RootComputationError

__all__ = ["DASH", "DashConfig", "DeMo", "RootComputationError"]
__version__ = "0.5.0"

register_strategies()  # imports no Lightning namespace that is not installed
if find_spec("lightning") is not None:
    from lightning_dash.fabric import DashFabricFSDPStrategy, DashFabricStrategy
    from lightning_dash.strategies import DashFSDPStrategy, DashStrategy

    __all__ += ["DashFabricFSDPStrategy", "DashFabricStrategy", "DashFSDPStrategy", "DashStrategy"]
