"""Ctrl-C or SIGTERM during ``make test`` stops the run and prints pytest's summary.

A real pytest run in a child process, with the suite's interrupt plugin, is signalled while
a test's ``Trainer.fit`` steps; the test after it must not start.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

INNER = """
import time

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel


class Slow(BoringModel):
    def training_step(self, batch, batch_idx):
        print("STEPPING", flush=True)
        time.sleep(0.2)
        return super().training_step(batch, batch_idx)


def test_a_fit_that_is_interrupted():
    settings = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    pl.Trainer(max_steps=10_000, **settings).fit(Slow())


def test_the_next_one():
    print("THE NEXT TEST STARTED", flush=True)
"""


def _as_from_a_terminal() -> None:
    """Ctrl-C's default disposition in the child: a suite started in the background by a shell
    without job control (``make test &``, CI runners) inherits SIGINT ignored, and Python keeps it
    ignored, so no Ctrl-C could reach the child at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_a_fit_stops_the_run_with_its_summary(tmp_path, signum):
    (tmp_path / "test_inner.py").write_text(INNER)
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "helpers.interrupts", "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONWARNINGS": "ignore"}
    run = subprocess.Popen(
        [*command, "test_inner.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    assert run.stdout is not None
    seen = ""
    while "STEPPING" not in seen:
        line = run.stdout.readline()
        assert line, seen
        seen += line
    run.send_signal(signum)
    output = seen + run.communicate(timeout=120)[0]
    assert run.returncode == 2, output  # pytest's code for an interrupted run
    assert "KeyboardInterrupt" in output and "THE NEXT TEST STARTED" not in output, output
    assert re.search(r"in \d+\.\d+s", output.strip().splitlines()[-1]), output
