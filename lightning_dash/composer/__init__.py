"""Composer integration: the ``Dash`` algorithm and the ``DashMonitor`` callback.

Importing this package needs ``mosaicml`` (``pip install "lightning-dash[composer]"``).
``Dash`` is also registered for llm-foundry under the ``llmfoundry_algorithms`` entry
point group as ``dash``, and ``DashMonitor`` under ``llmfoundry_callbacks`` as
``dash_monitor``.
"""

from lightning_dash.composer.dash import Dash
from lightning_dash.composer.monitor import DashMonitor

__all__ = ["Dash", "DashMonitor"]
