#!/usr/bin/env bash
# Run the checks: set-up (idempotent), ruff, then the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` locally.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
venv="${KEEPALIVE_VENV:-$repo/.venv}"
cd "$repo"
"$venv/bin/ruff" check keepalive_executor tests benchmarks
exec "$venv/bin/python" -m pytest -ra -p no:cacheprovider --durations=0 tests "$@"
