"""Environment records: what a benchmark's JSON says about the machine and the software it ran on."""

from __future__ import annotations

import importlib.util
import os
import platform
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from _stamp import commit

#: Optional peers a record names the version of when installed: module -> distribution.
PEER_DISTRIBUTIONS = (("heavyball", "heavyball"), ("distributed_shampoo", "torch-shampoo"))


def cpu_name(fallback: str) -> str:
    """The CPU model from /proc/cpuinfo where there is one, else ``fallback``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return fallback


def peer_versions() -> dict[str, str]:
    """torch's and Python's versions, and those of the installed peers (:data:`PEER_DISTRIBUTIONS`)."""
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for module, distribution in PEER_DISTRIBUTIONS:
        if importlib.util.find_spec(module) is not None:
            versions[distribution] = version(distribution)
    return versions


def race_environment() -> dict[str, str | int]:
    """A race run's environment (``peers.py``): :func:`peer_versions`, torch's threads and the CPU."""
    return peer_versions() | {"threads": torch.get_num_threads(), "cpu": cpu_name(platform.machine())}


def suite_environment() -> dict[str, Any]:
    """A suite run's environment (``families.py``): versions, the machine, its load, the date and the commit."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": commit(),
    }
