# Two entry points: `make demo` runs the main job, `make test` runs the test suite.
# Each creates the virtual environment in .venv on first use.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/quick_demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/solvers.py

clean:
	rm -rf $(VENV) .pytest_cache
