# Entry points: `make demo` runs the main job (`make demo-quick`: a one-minute version), `make test` runs
# the test suite, `make lint` runs ruff, `make docs` builds the documentation.
# Each creates its virtual environments on first use: .venv (newest torch, Lightning)
# and, for the Composer tests, .venv-composer (Composer pins torch < 2.7.1); for the torchtitan tests,
# .venv-torchtitan (torchtitan brings datasets, tensorboard, wandb and triton, about 2.5 GB).
PYTHON ?= python3
VENV ?= .venv
COMPOSER_VENV ?= .venv-composer
TITAN_VENV ?= .venv-torchtitan
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
CPY := $(COMPOSER_VENV)/bin/python
TPY := $(TITAN_VENV)/bin/python

# Peer optimizers that are not on the package registry (benchmarks only; see ../shared/peers/README.md).
PEER_TARBALL := $(lastword $(sort $(wildcard ../shared/peers/torch-shampoo-*.tar.gz)))

.PHONY: demo demo-quick docs package test test-fast test-lightning test-composer test-torchtitan lint bench bench-step bench-peers bench-families clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[lightning,dev,bench,examples,docs]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/train_char_gpt.py

demo-quick: $(VENV)/.installed
	$(PY) examples/train_char_gpt.py --quick

$(COMPOSER_VENV)/.installed: pyproject.toml
	test -x $(CPY) || $(PYTHON) -m venv $(COMPOSER_VENV)
	$(CPY) -m pip install --quiet --upgrade pip
	$(CPY) -m pip install --quiet -e ".[composer,lightning,dev]"
	touch $@

$(TITAN_VENV)/.installed: pyproject.toml
	test -x $(TPY) || $(PYTHON) -m venv $(TITAN_VENV)
	$(TPY) -m pip install --quiet --upgrade pip
	$(TPY) -m pip install --quiet "$(TORCH_SPEC)"
	$(TPY) -m pip install --quiet -e ".[torchtitan,dev]"
	touch $@

test: test-lightning test-composer test-torchtitan

# Tests run in parallel worker processes (pytest-xdist), one per CPU up to TEST_WORKERS: most tests use
# one core, and the multi-process ones pin their ranks to one thread each. TEST_WORKERS=0 runs them in one.
TEST_WORKERS ?= 4
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n auto --maxprocesses $(TEST_WORKERS))

# The peer is installed when ../shared/peers has it, so that the tests of the peers benchmark run.
test-lightning: $(VENV)/.installed $(if $(PEER_TARBALL),$(VENV)/.peers-installed)
	$(PY) -m pytest -q $(XDIST)

# The fast lane: every test that starts no other Python process (no gloo ranks, no scripts), in .venv.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) -m "not multiprocess"

# The option refusals of Composer's Dash live with every entry point's (tests/trainers); the main lane skips them.
# By file: one worker runs a module's tests, so a module-scoped fixture (a two-rank run) runs once.
test-composer: $(COMPOSER_VENV)/.installed
	$(CPY) -m pytest -q $(XDIST) $(if $(XDIST),--dist loadfile) tests/with_composer
	$(CPY) -m pytest -q tests/trainers/test_option_refusals.py -k composer

# DASH in torchtitan's optimizers container, on its own FSDP2 and tensor-parallel Llama (4 gloo ranks).
test-torchtitan: $(TITAN_VENV)/.installed
	$(TPY) -m pytest -q $(XDIST) $(if $(XDIST),--dist loadfile) tests/with_torchtitan

# The documentation (MkDocs Material + mkdocstrings) into site/; --strict fails on a broken link or reference.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# A wheel and an sdist into dist/, the wheel installed into a new environment that has torch alone, and
# DASH imported and stepped from it: packaging cannot break unnoticed (CI runs this).
WHEEL_VENV ?= .venv-wheel
package: $(VENV)/.installed
	rm -rf dist $(WHEEL_VENV)
	$(PY) -m build --quiet --outdir dist . > /dev/null
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)" dist/*.whl
	cd dist && ../$(WHEEL_VENV)/bin/python ../tests/wheel_smoke.py

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(VENV)/.installed
	$(PY) benchmarks/speed/solvers.py

# Meta's Distributed Shampoo into $(VENV), for benchmarks/speed/step_time.py --suite peers. Its metadata asks
# for Python >= 3.12 but it runs on 3.11; it imports numpy without declaring it.
$(VENV)/.peers-installed: $(PEER_TARBALL) $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python $(PEER_TARBALL)
	$(PY) -m pip install --quiet numpy
	touch $@

# DASH against Meta's Distributed Shampoo (skipped by the script when the peer is not installed);
# about 8 minutes on 2 CPU cores. On a shared machine: flock /tmp/cpu_heavy.lock make bench-step
bench-step: $(VENV)/.installed $(if $(PEER_TARBALL),$(VENV)/.peers-installed)
	$(PY) benchmarks/speed/step_time.py --suite peers

# The convergence race (benchmarks/races/peers.py): AdamW, Muon, heavyball's SOAP and PSGD-Kron, Meta's
# Distributed Shampoo and DASH on the main job's model; about 55 minutes on 2 CPU cores. heavyball comes
# with the bench extra (pip leaves torch as it is: heavyball 3.2.1 asks for torch >= 2.2, < 3, numpy >=
# 2.3.4 and opt-einsum); Meta's Shampoo from ../shared/peers when it is there (else that contender is
# recorded as unavailable). On a shared machine: flock /tmp/cpu_heavy.lock make bench-peers
bench-peers: $(VENV)/.installed $(if $(PEER_TARBALL),$(VENV)/.peers-installed)
	$(PY) benchmarks/races/peers.py

# The model-family suite (benchmarks/races/families.py): nine unchanged LightningModules with their AdamW recipes,
# AdamW's lr tuned per family, then strategy="dash" at it, 2 seeds; about 40 minutes on 2 idle CPU cores.
bench-families: $(VENV)/.installed
	$(PY) benchmarks/races/families.py --timing 1

clean:
	rm -rf $(VENV) $(COMPOSER_VENV) $(TITAN_VENV) .pytest_cache site
