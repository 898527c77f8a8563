"""Lightning strategies; ``register_strategies`` adds them to Lightning's registry."""

from lightning_dash.strategies.dash_ddp import DashStrategy


def register_strategies() -> None:
    """Make ``Trainer(strategy="dash")`` (and the spawn/fork variants) resolvable."""
    from lightning.pytorch.strategies import StrategyRegistry

    DashStrategy.register_strategies(StrategyRegistry)


__all__ = ["DashStrategy", "register_strategies"]
