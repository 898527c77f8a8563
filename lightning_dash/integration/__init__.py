"""What the Lightning and Composer integrations share, trainer-independent.

:class:`ConversionOptions` resolves the DASH options a trainer integration is given
and converts the user's optimizer with them; :func:`dash_metrics` is what both DASH
monitors log. This package imports neither Lightning nor Composer.
"""

from lightning_dash.integration.metrics import dash_metrics, dash_settings
from lightning_dash.integration.options import ConversionOptions

__all__ = ["ConversionOptions", "dash_metrics", "dash_settings"]
