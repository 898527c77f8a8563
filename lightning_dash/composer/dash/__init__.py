"""DASH, a batched Shampoo, as a Composer algorithm (see README.md in this folder)."""

from lightning_dash.composer.dash.algorithm import Dash

__all__ = ["Dash"]
