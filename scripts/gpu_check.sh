#!/usr/bin/env bash
# The GPU path checked beside vLLM's mp, in one command (not yet run on GPUs: README).
#
#   bash scripts/gpu_check.sh [--json PATH] [-- vllm serve flags]
#       on a machine with 2+ GPUs, in a Python environment with vLLM for CUDA or ROCm and
#       this repository (`pip install -e .[test,bench]`); PYTHON picks the interpreter
#       (default: python3), MODEL the model (default: the tiny local model, float16).
#   bash scripts/gpu_check.sh --cpu [--json PATH]
#       the short CPU (gloo) mode the test suite runs; needs `bash scripts/setup.sh` first.
#
# Prints each check and a table of figures; exits 1 if a check failed. What is checked:
# benchmarks/gpu_check.py.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = "--cpu" ]; then
  py="${KEEPALIVE_VENV:-$repo/.venv}/bin/python"
  if [ ! -x "$py" ]; then
    echo "gpu_check: no virtual environment at ${py%/bin/python}: run bash scripts/setup.sh" >&2
    exit 2
  fi
else
  py="${PYTHON:-python3}"
  gpus="$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
  if [ "$gpus" -lt 2 ]; then
    echo "gpu_check: $py sees $gpus GPU(s) (torch.cuda.device_count()); the GPU mode needs 2" \
         "or more and vLLM for CUDA/ROCm. Set PYTHON to such an interpreter, or run" \
         "the CPU mode: bash scripts/gpu_check.sh --cpu" >&2
    exit 2
  fi
fi
cd "$repo"
exec "$py" benchmarks/gpu_check.py "$@"
