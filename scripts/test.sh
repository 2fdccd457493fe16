#!/usr/bin/env bash
# Run the checks: set-up (idempotent), ruff, then the whole test suite in two phases:
#   1. every test not marked `serial`, two at a time (pytest-xdist): they compare outputs and
#      start their ranks with long collective timeouts, so a busy machine only slows them;
#   2. the `serial` tests (time bounds, short collective timeouts) with nothing else running:
#      first those also marked `timers` (bounds on threads that mostly sleep) four at a time,
#      then those marked `heavy` (servers that take most of the memory) alone, then the others
#      in two lanes: one test at a time, but for the waits for a server's start-up, the idle
#      periods and the tests marked `overlappable` outside their measured windows, which the
#      two lanes may run side by side (tests/lanes.py).
# Extra arguments go to one plain pytest run instead, e.g. `bash scripts/test.sh -m "not slow"`
# or `bash scripts/test.sh tests/test_pacer.py`.
# `bash scripts/test.sh --fast`: the everyday tier, the same two phases over the tests marked
# `fast` only (pure and property tests, a few in-process engine runs; at most 5 minutes).
# The whole run also runs the no-engine tier on vLLM 0.33 and 0.34, each in a venv of its own,
# beside phase 1 (scripts/test_versions.sh; KEEPALIVE_SKIP_VERSIONS=1 skips it).
set -euo pipefail
only=""  # a marker expression the two phases are limited to
if [ "${1:-}" = "--fast" ]; then
  if [ $# -gt 1 ]; then echo "test.sh: --fast takes no other arguments" >&2; exit 2; fi
  only="fast and "
  shift
fi
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
status=0
start=$(date +%s)
# The no-engine tier runs beside phase 1 (one pytest worker per release, one release after the
# other): phase 1's tests assert no time bound, so more load only slows them, and the tier's
# tests are phase-1 tests themselves (the same modules run there on 0.32).
tier_pid=""
if [ -z "$only" ] && [ -z "${KEEPALIVE_SKIP_VERSIONS:-}" ]; then
  tier_log="$(mktemp)"
  KEEPALIVE_VERSIONS_WORKERS=1 bash "$repo/scripts/test_versions.sh" >"$tier_log" 2>&1 &
  tier_pid=$!
fi
"${pytest[@]}" -n 2 --dist loadgroup -m "${only}not serial" tests || status=$?
if [ -n "$tier_pid" ]; then
  tier_status=0
  wait "$tier_pid" || tier_status=$?
  cat "$tier_log"
  rm -f "$tier_log"
  echo "test.sh: the no-engine tier on vLLM 0.33 and 0.34 (set-up included), beside phase 1:" \
       "ended after $(($(date +%s) - start)) s; exit status $tier_status"
  [ "$tier_status" -eq 0 ] || status=$tier_status
fi
phase1=$(date +%s)
# (only the files that hold such tests: each of the four workers would otherwise import
# every test module, vLLM included, to collect them)
mapfile -t timer_files < <(grep -l "pytest.mark.timers" tests/test_*.py)
# (pytest's exit code 5: no test matched, as in a tier without such tests)
"${pytest[@]}" -n 4 -m "${only}serial and timers" "${timer_files[@]}" \
  || { rc=$?; [ "$rc" -eq 5 ] || status=$rc; }
# then those whose servers take most of the memory, alone
mapfile -t heavy_files < <(grep -l "pytest.mark.heavy" tests/test_*.py)
"${pytest[@]}" -m "${only}serial and heavy and not timers" "${heavy_files[@]}" \
  || { rc=$?; [ "$rc" -eq 5 ] || status=$rc; }
# then the others in two lanes (tests/lanes.py): two workers, one module at a time each; a
# worker has the machine to itself but in its regions (start-ups, idles, overlappable tests)
# (the fast tier has no such test today: one process collects in half the CPU of two)
lane_workers=2
[ -z "$only" ] || lane_workers=0
lanes_lock="$(mktemp)"
KEEPALIVE_SERIAL_LANES="$lanes_lock" "${pytest[@]}" -n "$lane_workers" --dist loadfile \
  -m "${only}serial and not timers and not heavy" tests || { rc=$?; [ "$rc" -eq 5 ] || status=$rc; }
rm -f "$lanes_lock"
end=$(date +%s)
echo "test.sh: phase 1 (two at a time) $((phase1 - start)) s, phase 2 (serial)" \
     "$((end - phase1)) s, in all $((end - start)) s; exit status $status"
exit "$status"
