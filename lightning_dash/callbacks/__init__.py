"""Lightning callbacks that schedule and monitor the DASH optimizer."""

from lightning_dash.callbacks.grafting_schedule import GraftingSchedule
from lightning_dash.callbacks.monitor import DashMonitor
from lightning_dash.callbacks.preconditioner_schedule import PreconditionerSchedule

__all__ = ["DashMonitor", "GraftingSchedule", "PreconditionerSchedule"]
