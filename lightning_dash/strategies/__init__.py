"""Lightning Trainer strategies: ``Trainer(strategy="dash")`` (DDP) and ``Trainer(strategy="dash_fsdp")`` (FSDP2).

``register_strategies`` adds them to every installed Lightning namespace's registry
(:mod:`lightning_dash.integration.namespaces`). ``DashStrategy`` is the ``lightning.pytorch`` one.
"""

from importlib.util import find_spec

from lightning_dash.integration.namespaces import register_strategies

__all__ = ["register_strategies"]

if find_spec("lightning") is not None:
    from lightning_dash.strategies.dash_ddp import DashStrategy
    from lightning_dash.strategies.dash_fsdp import DashFSDPStrategy

    __all__ += ["DashFSDPStrategy", "DashStrategy"]
