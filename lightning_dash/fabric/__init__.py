"""Lightning Fabric strategies: ``Fabric(strategy="dash")`` (DDP).

Importing ``lightning_dash`` registers them, with their launcher variants, in Fabric's strategy registry of
every installed namespace (``lightning.fabric`` and the standalone ``lightning_fabric``; see
:mod:`lightning_dash.strategies.namespaces`). ``DashFabricStrategy`` is the ``lightning.fabric`` class,
for options: ``Fabric(strategy=DashFabricStrategy(block_size=512))``.
"""

from importlib.util import find_spec

__all__: list[str] = []

if find_spec("lightning") is not None:
    from lightning_dash.fabric.fabric_ddp import DashFabricStrategy

    __all__ += ["DashFabricStrategy"]
