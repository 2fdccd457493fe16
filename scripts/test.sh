#!/usr/bin/env bash
# Run the checks: set-up (idempotent), ruff, then the whole test suite (235 tests) in three
# phases, by pytest marker (pyproject.toml):
#   1. the tests that are neither `serial` nor `background`, two at a time (pytest-xdist):
#      they start their ranks with long collective timeouts, so a busy machine only slows them;
#   2. the `serial and heavy` tests (time bounds, short timeouts, servers that take most of the
#      memory), one at a time, alone on the machine;
#   3. the other `serial` tests, one at a time, with the `background` tests (outputs only, no
#      time bound, long or default timeouts) running beside them one at a time at nice 19: a
#      serial test takes about one core of the two (its processes start one after another),
#      and the background tests get what it leaves. A woken nice-0 thread preempts a nice-19
#      one at once, so the serial tests' timings are theirs.
# Extra arguments go to one plain pytest run instead, e.g. `bash scripts/test.sh -m "not slow"`
# or `bash scripts/test.sh tests/test_pacer.py`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
venv="${KEEPALIVE_VENV:-$repo/.venv}"
cd "$repo"
"$venv/bin/ruff" check keepalive_executor tests benchmarks
pytest=("$venv/bin/python" -m pytest -ra -p no:cacheprovider --durations=0)
if [ $# -gt 0 ]; then
  if [ -e "${1%%::*}" ]; then exec "${pytest[@]}" "$@"; fi
  exec "${pytest[@]}" tests "$@"
fi
start=$(date +%s)
status=0
"${pytest[@]}" -n 2 --dist loadgroup -m "not serial and not background" tests || status=$?
phase1=$(date +%s)
"${pytest[@]}" -m "serial and heavy" tests || status=$?
phase2=$(date +%s)
work="$(mktemp -d "${TMPDIR:-/tmp}/keepalive-tests.XXXXXX")"
background=""
# The background pytest runs in a session of its own: with Linux's autogroup scheduling every
# session competes at the niceness of its group, not of its processes, so it sets its group's
# to 19, and the sessions its tests start carry it on (tests/procs.py keep_niceness). If this
# script ends early it gets SIGINT and runs the teardowns that stop its servers (bash starts a
# background command with SIGINT ignored, and Python would then install no handler for it).
trap '[ -n "$background" ] && kill -INT "$background" 2>/dev/null; true' EXIT
nice -n 19 "$venv/bin/python" -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
os.setsid()
sys.path.insert(0, "tests")
from procs import keep_niceness
keep_niceness()
import pytest
sys.exit(pytest.main(sys.argv[1:]))' "${pytest[@]:3}" -m background \
  --basetemp "$work/background" tests > "$work/background.log" 2>&1 &
background=$!
"${pytest[@]}" -m "serial and not heavy" --basetemp "$work/serial" tests || status=$?
phase3=$(date +%s)
background_status=0
wait "$background" || background_status=$?
background=""
end=$(date +%s)
echo
echo "=== the background tests (nice 19, beside phase 3), ended $((end - phase3)) s after it ==="
cat "$work/background.log"
[ "$background_status" -eq 0 ] || status=$background_status
[ "$status" -ne 0 ] || rm -rf "$work"
echo "test.sh: phase 1 (two at a time) $((phase1 - start)) s, phase 2 (serial, heavy)" \
     "$((phase2 - phase1)) s, phase 3 (serial, background beside it) $((end - phase2)) s," \
     "in all $((end - start)) s; exit status $status"
exit "$status"
