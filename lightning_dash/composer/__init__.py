"""Composer integration: the ``Dash`` algorithm and the ``DashComposerMonitor`` callback.

Importing this package needs ``mosaicml`` (``pip install ".[composer]"`` from a clone).
``Dash`` is also registered for llm-foundry under the ``llmfoundry_algorithms`` entry
point group as ``dash``, and ``DashComposerMonitor`` under ``llmfoundry_callbacks`` as
``dash_monitor``. ``DashMonitor`` is its deprecated former name.
"""

from lightning_dash.composer.dash import Dash
from lightning_dash.composer.monitor import DashComposerMonitor, DashMonitor

__all__ = ["Dash", "DashComposerMonitor", "DashMonitor"]
