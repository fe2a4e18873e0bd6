#!/usr/bin/env bash
# The DualPath vLLM connector on a GPU (docs/vllm/gpu.md). Four ways in:
#
#   gpu_check.sh stage [stage.py stage options]   here, with network: vLLM 0.26's CUDA wheel and
#       what the GPU image lacks, resolved, fetched, packed and split into parts that fit a
#       device transfer (.cache/dualpath/gpu-kit/parts), reassembled and installed here into a
#       temporary target as a check; prints the device calls (also in parts/calls.json)
#   gpu_check.sh receive PART                     GPU machine, one call per part: keep it
#   gpu_check.sh run [gpu_check.py options]       GPU machine: reassemble, check the hashes,
#       install into the kit folder, then the check: unit, bench and pd with two vLLM servers
#       on the GPU, CUDA graphs, FlashAttention, 16-token blocks, the kit's Llama-shaped model
#       with random weights (--load-format dummy); the JSON summary also goes to $OUT
#   gpu_check.sh [--python PY] [--dry-run] [gpu_check.py options]
#       the check with an interpreter that has CUDA vLLM, torch and nixl (default: the first
#       of $DUALPATH_GPU_PYTHON, .venv-vllm/bin/python, python3). --dry-run runs on CPU: it
#       checks the arguments, the model folder and that every step parses (make test runs it).
#       Without a GPU and without --dry-run it fails at once, saying so (exit 2).
#
# The kit folder on the GPU machine is $DUALPATH_GPU_KIT (default /tmp/dualpath-gpu-kit).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
cd "$repo"
export PYTHONPATH="$repo/src:$repo/benchmarks${PYTHONPATH:+:$PYTHONPATH}"

case "${1:-}" in
  stage)
    shift
    py=python3; [[ -x .venv/bin/python ]] && py=.venv/bin/python
    exec "$py" "$here/stage.py" stage "$@" ;;
  receive)
    shift
    exec python3 "$here/stage.py" receive "$@" ;;
  run)
    shift
    kit="${DUALPATH_GPU_KIT:-/tmp/dualpath-gpu-kit}"
    python3 "$here/stage.py" install --kit "$kit"
    export PYTHONPATH="$kit/site:$PYTHONPATH"
    out="${OUT:-$kit}"
    exec timeout --signal=TERM --kill-after=10 470 python3 "$here/gpu_check.py" \
      --python python3 --model "$kit/bundle/model" --load-format dummy --steps unit,bench,pd \
      --dtype float16 --turn1-tokens 512 --budget-s 420 --json-out "$out/gpu_check.json" "$@" ;;
esac

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
exec timeout --signal=TERM --kill-after=10 300 "$py" "$here/gpu_check.py" --python "$py" "${args[@]}"
