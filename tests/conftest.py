import importlib.util
import os
import sys
from pathlib import Path

# One intra-op thread in every test process and in the processes it starts. The multi-process
# tests fork their ranks (helpers/spawning.py), and a rank forked from a process that has run a
# parallel OpenMP region of two or more threads waits forever at its own first one (GNU OpenMP's
# thread pool does not survive a fork). The variable is set before torch is imported, and it also
# keeps Lightning's launchers from raising the thread count: with one device they set it to the
# number of cores unless OMP_NUM_THREADS is set. The test workers run side by side, one per core, so
# more threads would only oversubscribe the machine.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread_after_each_test():
    """Fail the test that leaves torch's thread count raised, before a later test forks ranks that hang."""
    yield
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert threads == 1, f"the test left torch.get_num_threads() at {threads}: forked ranks would hang"


@pytest.fixture(autouse=True)
def no_process_group_after_each_test():
    """End the default process group a test leaves in this process: Fabric keeps the one its
    strategies start (one process, world size 1), and the ranks of a later test, forked from this
    process, would inherit it and fail to start their own ("initialize the default process group
    twice")."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


sys.path.insert(0, str(Path(__file__).parent))

# Ctrl-C and SIGTERM end the run with its summary (helpers/interrupts.py says why this is needed).
pytest_plugins = ["helpers.interrupts"]

# The Composer tests run in their own environment (Composer pins an older torch); the
# README's test command runs them there with `pytest tests/with_composer`.
# The same for torchtitan (`make test-torchtitan`, in .venv-torchtitan).
collect_ignore = [
    lane
    for lane, package in (("with_composer", "composer"), ("with_torchtitan", "torchtitan"))
    if importlib.util.find_spec(package) is None
]
