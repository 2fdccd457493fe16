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
# The whole run also runs the no-engine tier on vLLM 0.33 and 0.34, each in a venv of its own
# (scripts/test_versions.sh; KEEPALIVE_SKIP_VERSIONS=1 skips it): the venvs' set-up beside
# phase 1, the tests beside phase 2's heavy tests and lanes as their guest, which runs only
# while no test there has the machine to itself (tests/lanes.py).
set -euo pipefail
only=""  # a marker expression the two phases are limited to
if [ "${1:-}" = "--fast" ]; then
  if [ $# -gt 1 ]; then echo "test.sh: --fast takes no other arguments" >&2; exit 2; fi
  only="fast and "
  shift
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
bash "$repo/scripts/setup_launchers.sh"  # the tests' Slurm, Open MPI and systemd-analyze (apt)
venv="${KEEPALIVE_VENV:-$repo/.venv}"
cd "$repo"
"$venv/bin/ruff" check keepalive_executor tests benchmarks
# Linux's autogroup scheduling gives every session a scheduling group of its own, and every
# test server is a session, as is every torchrun rank. A session that is mostly idle then
# waits for seconds behind a busy one on the CPU both are bound to: measured here, a process
# sleeping 50 ms at a time on CPU 0 went up to 26.5 s unscheduled while a DP=2 TP=2 server
# answered requests beside it, and 0.01 s at most with autogroups off
# (benchmarks/sched_starvation.py; docs/usage.md, "A shared CPU host"). The tests run idle
# servers with 5 s collective timeouts beside other tests, so the run turns autogroups off
# (plain per-thread fairness) and restores them at exit.
autogroup=/proc/sys/kernel/sched_autogroup_enabled
if [ "$(cat "$autogroup" 2>/dev/null || echo 0)" = 1 ]; then
  if (echo 0 >"$autogroup") 2>/dev/null; then
    trap 'echo 1 >"$autogroup"' EXIT
    echo "test.sh: autogroup scheduling off for this run ($autogroup; restored at exit)"
  else
    echo "test.sh: WARNING: autogroup scheduling is on and $autogroup is not writable here:" \
         "an idle test server may be starved for seconds by a busy one beside it, past its" \
         "5 s collective timeout (run as root, or set it to 0 first)" >&2
  fi
fi
pytest=("$venv/bin/python" -m pytest -ra -p no:cacheprovider --durations=0)
if [ $# -gt 0 ]; then
  # (not exec: the trap above restores the scheduler setting when pytest ends)
  [ -e "${1%%::*}" ] || set -- tests "$@"
  rc=0
  "${pytest[@]}" "$@" || rc=$?
  exit "$rc"
fi
status=0
start=$(date +%s)
# every test writes when it started, ended and failed (tests/conftest.py): if the run fails,
# scripts/test_events.py names what ran beside each failed test
own_events=""
if [ -z "${KEEPALIVE_TEST_EVENTS:-}" ]; then
  KEEPALIVE_TEST_EVENTS="$(mktemp)"
  own_events="$KEEPALIVE_TEST_EVENTS"
fi
export KEEPALIVE_TEST_EVENTS
# The no-engine tier's venvs are set up beside phase 1 (one release after the other): phase 1's
# tests assert no time bound, so more load only slows them.
tier=""
[ -n "$only" ] || [ -n "${KEEPALIVE_SKIP_VERSIONS:-}" ] || tier=1
if [ -n "$tier" ]; then
  tier_log="$(mktemp)"
  bash "$repo/scripts/test_versions.sh" --setup-only >"$tier_log" 2>&1 &
  tier_pid=$!
fi
"${pytest[@]}" -n 2 --dist loadgroup -m "${only}not serial" tests || status=$?
if [ -n "$tier" ]; then
  tier_status=0
  wait "$tier_pid" || tier_status=$?
  cat "$tier_log"
  echo "test.sh: the no-engine tier's venvs (vLLM 0.33 and 0.34), set up beside phase 1:" \
       "ready after $(($(date +%s) - start)) s; exit status $tier_status"
  if [ "$tier_status" -ne 0 ]; then status=$tier_status; tier=""; rm -f "$tier_log"; fi
fi
phase1=$(date +%s)
# (only the files that hold such tests: each of the four workers would otherwise import
# every test module, vLLM included, to collect them)
mapfile -t timer_files < <(grep -l "pytest.mark.timers" tests/test_*.py)
# (pytest's exit code 5: no test matched, as in a tier without such tests)
"${pytest[@]}" -n 4 -m "${only}serial and timers" "${timer_files[@]}" \
  || { rc=$?; [ "$rc" -eq 5 ] || status=$rc; }
# The rest shares one lock (tests/lanes.py). Its guest, the no-engine tier on vLLM 0.33 and
# 0.34 (one test at a time, the lock shared), runs whenever no test holds the machine.
lanes_lock="$(mktemp)"
export KEEPALIVE_SERIAL_LANES="$lanes_lock"
if [ -n "$tier" ]; then
  KEEPALIVE_LANES_GUEST=1 bash "$repo/scripts/test_versions.sh" --no-setup >"$tier_log" 2>&1 &
  tier_pid=$!
fi
# then those whose servers take most of the memory, alone but for their start-ups: one lane
mapfile -t heavy_files < <(grep -l "pytest.mark.heavy" tests/test_*.py)
"${pytest[@]}" -m "${only}serial and heavy and not timers" "${heavy_files[@]}" \
  || { rc=$?; [ "$rc" -eq 5 ] || status=$rc; }
# then the others in two lanes: two workers, one module at a time each; a worker has the
# machine to itself but in its regions (start-ups, idles, overlappable tests)
# (the fast tier has no such test today: one process collects in half the CPU of two)
lane_workers=2
[ -z "$only" ] || lane_workers=0
"${pytest[@]}" -n "$lane_workers" --dist loadfile \
  -m "${only}serial and not timers and not heavy" tests || { rc=$?; [ "$rc" -eq 5 ] || status=$rc; }
if [ -n "$tier" ]; then
  lanes_end=$(date +%s)
  tier_status=0
  wait "$tier_pid" || tier_status=$?
  cat "$tier_log"
  echo "test.sh: the no-engine tier on vLLM 0.33 and 0.34, the lanes' guest: ended" \
       "$(($(date +%s) - lanes_end)) s after the lanes; exit status $tier_status"
  [ "$tier_status" -eq 0 ] || status=$tier_status
  rm -f "$tier_log"
fi
unset KEEPALIVE_SERIAL_LANES
rm -f "$lanes_lock" "$lanes_lock.turnstile"
end=$(date +%s)
echo "test.sh: phase 1 (two at a time) $((phase1 - start)) s, phase 2 (serial)" \
     "$((end - phase1)) s, in all $((end - start)) s; exit status $status"
# Last, so that CI's excerpt of the log's end keeps them: what ran beside each failed test,
# then the failed tests' names (and a property test's reproduction blob). Nothing after it.
[ "$status" -eq 0 ] || python3 "$repo/scripts/test_events.py" "$KEEPALIVE_TEST_EVENTS" || true
[ -z "$own_events" ] || rm -f "$own_events"
exit "$status"
