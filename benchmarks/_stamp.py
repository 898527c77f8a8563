"""The stamp every GPU record carries: the date, the commit and the device as torch names it.

The device machine receives a copy of the working tree without its git history, so the commit
comes from ``DASH_COMMIT`` when set (``benchmarks/device_checks.sh`` sets it from the file the
launcher writes), else from ``git rev-parse HEAD``, else it is null.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch


def commit() -> str | None:
    """The commit the benchmark ran at, or None where nothing says."""
    if os.environ.get("DASH_COMMIT"):
        return os.environ["DASH_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` on CUDA (``"NVIDIA H100 80GB HBM3"``), else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def stamp(device: torch.device) -> dict[str, str | None]:
    """``{"device", "date", "commit", "torch"}`` for one record."""
    return {
        "device": device_name(device),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "torch": torch.__version__,
    }
