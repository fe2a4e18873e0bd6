#!/usr/bin/env bash
# The DualPath vLLM connector on a GPU, one run, under 5 minutes: CUDA graphs on, TP 1 (and TP 2
# with two GPUs), the PE and DE read paths, SmolLM2-135M in bf16, tokens checked, GB/s per path.
# Everything is in benchmarks/gpu_check.py (its --help); this picks the interpreter and the
# time limit.
#
#   benchmarks/gpu_check.sh [--python PY] [--dry-run] [gpu_check.py options]
#
# PY: an interpreter with CUDA vLLM, torch and nixl and dualpath importable (default: the
# first of $DUALPATH_GPU_PYTHON, .venv-vllm/bin/python, python3). --dry-run runs on CPU: it
# checks the arguments, the model folder and that every step parses (make test runs it).
# Without a GPU and without --dry-run it fails at once, saying so (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."

py="${DUALPATH_GPU_PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x .venv-vllm/bin/python ]]; then py=.venv-vllm/bin/python; else py=python3; fi
fi
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) py="${2:?--python needs a path}"; shift 2 ;;
    --python=*) py="${1#--python=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
exec timeout --signal=TERM --kill-after=10 300 "$py" benchmarks/gpu_check.py --python "$py" "${args[@]}"
