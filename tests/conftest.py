import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Ctrl-C and SIGTERM end the run with its summary (helpers/interrupts.py says why this is needed).
pytest_plugins = ["helpers.interrupts"]

# The Composer tests run in their own environment (Composer pins an older torch); the
# README's test command runs them there with `pytest tests/with_composer`.
if importlib.util.find_spec("composer") is None:
    collect_ignore = ["with_composer"]
