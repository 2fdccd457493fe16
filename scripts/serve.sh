#!/usr/bin/env bash
# The main job: serve the tiny local model with the keepalive backend at TP=2 on this CPU.
# Does its own set-up first (idempotent). Extra arguments go to `vllm serve`.
#   PORT (default 8000)   MODEL (default: the tiny local model, built if missing)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
venv="${KEEPALIVE_VENV:-$repo/.venv}"
model="${MODEL:-$("$venv/bin/python" "$repo/scripts/tiny_model.py")}"
# One CPU per rank: rank 0 (the driver, inside the engine process) on CPU 0, rank 1 on CPU 1.
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0|1}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec "$venv/bin/vllm" serve "$model" \
  --host 127.0.0.1 --port "${PORT:-8000}" --served-model-name tiny \
  -tp 2 --distributed-executor-backend keepalive \
  --enforce-eager --max-model-len 256 --max-num-seqs 8 --gpu-memory-utilization 0.2 \
  "$@"
