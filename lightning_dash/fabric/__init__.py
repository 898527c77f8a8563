"""Lightning Fabric strategies: ``Fabric(strategy="dash")`` (DDP) and ``Fabric(strategy="dash_fsdp")`` (FSDP2).

Importing ``lightning_dash`` registers them, with their launcher variants, in Fabric's strategy registry of
every installed namespace (``lightning.fabric`` and the standalone ``lightning_fabric``; see
:mod:`lightning_dash.integration.namespaces`). ``DashFabricStrategy`` and ``DashFabricFSDPStrategy`` are the
``lightning.fabric`` classes, for options: ``Fabric(strategy=DashFabricFSDPStrategy(block_size=512))``.
"""

from importlib.util import find_spec

__all__: list[str] = []

if find_spec("lightning") is not None:
    from lightning_dash.fabric.fabric_ddp import DashFabricStrategy
    from lightning_dash.fabric.fabric_fsdp import DashFabricFSDPStrategy

    __all__ += ["DashFabricFSDPStrategy", "DashFabricStrategy"]
