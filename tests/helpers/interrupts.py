"""Ctrl-C and SIGTERM stop the whole test run, with pytest's summary, even inside a Trainer.

Lightning answers a KeyboardInterrupt inside ``fit`` with ``sys.exit(1)``, and a SIGTERM
with its own exception: pytest would record one failed test and start the next (each Ctrl-C
that lands in a fit costs one test, not the run), and a SIGTERM outside a fit would end
pytest without a summary. This plugin (loaded by ``tests/conftest.py``) turns both
signals back into the KeyboardInterrupt on which pytest stops and reports what ran.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Generator
from types import FrameType
from typing import Any

import pytest

_MAIN_PROCESS = os.getpid()
_terminated = False


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _terminated
    if os.getpid() != _MAIN_PROCESS:  # a forked rank inherited this handler: end as SIGTERM would
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _terminated = True
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)


def _interrupted(error: BaseException | None) -> bool:
    """Whether ``error`` or an exception it was raised while handling is a KeyboardInterrupt."""
    while error is not None:
        if isinstance(error, KeyboardInterrupt):
            return True
        error = error.__cause__ or error.__context__
    return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """Raise KeyboardInterrupt, on which pytest stops, where a test swallowed one (Lightning's
    ``sys.exit(1)`` after an interrupt) or a SIGTERM came."""
    try:
        result = yield
    except BaseException as error:
        if _interrupted(error) or _terminated:
            raise KeyboardInterrupt("the test run was interrupted") from error
        raise
    if _terminated:
        raise KeyboardInterrupt("the test run was interrupted")
    return result
