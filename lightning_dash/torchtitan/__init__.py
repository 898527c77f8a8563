"""DASH in torchtitan: an optimizers container whose param groups may name ``"DASH"``.

Needs torchtitan (``pip install ".[torchtitan]"``); ``import lightning_dash`` never imports it.
"""

from lightning_dash.torchtitan.container import DASH_NAME, DashOptimizersContainer

__all__ = ["DASH_NAME", "DashOptimizersContainer"]
