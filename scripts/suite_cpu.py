"""Run `bash scripts/test.sh` and say how much CPU each of its two phases used.

    python3 scripts/suite_cpu.py [arguments for test.sh]

It samples the machine's busy CPU time (/proc/stat, every core, every process: run it on an
otherwise idle machine) every second while the suite runs, then reads the phases' lengths
from test.sh's last line and prints, per phase, the wall time, the busy core-seconds and the
share of the machine's cores they kept busy. The sum of the busy core-seconds divided by the
number of cores is the shortest the suite could take here if nothing ever waited.

It also has every test write when it started and ended (tests/conftest.py, the
KEEPALIVE_TEST_EVENTS file), shares out each second's busy CPU among the tests running in it
(evenly: the tests side by side in phase 1 get equal shares, whatever each really used), and
prints the tests and the test files that took the most. Standard library only: it runs before
the set-up has made the virtual environment. Exits with test.sh's status."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import test_events

REPO = Path(__file__).resolve().parent.parent
PHASES = re.compile(r"^test\.sh: phase 1 .*? (\d+) s, phase 2 .*? (\d+) s, in all ")
TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """The machine's busy CPU time since boot, in core-seconds (all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


def at(samples: list[tuple[float, float]], when: float) -> float:
    """The busy time of the sample nearest to ``when``."""
    return min(samples, key=lambda s: abs(s[0] - when))[1]


def main(argv: list[str]) -> int:
    samples: list[tuple[float, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.time(), busy_seconds()))
            done.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    events = Path(tempfile.mkstemp(prefix="keepalive-test-events-")[1])
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "test.sh"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "KEEPALIVE_TEST_EVENTS": str(events)})
    phases = None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        m = PHASES.match(line)
        if m:
            phases = (time.time(), *(int(g) for g in m.groups()))
    status = proc.wait()
    done.set()
    sampler.join()
    try:
        by_test(samples, events.read_text())
    finally:
        events.unlink()
    if phases is None:
        print("suite_cpu: test.sh printed no phase times (a run with arguments has one phase)")
        return status
    end, first, second = phases
    cores = os.cpu_count() or 1
    total = 0.0
    for name, start, stop in (("phase 1", end - first - second, end - second),
                              ("phase 2", end - second, end)):
        busy = at(samples, stop) - at(samples, start)
        total += busy
        print(f"suite_cpu: {name}: {stop - start:.0f} s wall, {busy:.0f} busy core-seconds, "
              f"{100 * busy / (stop - start) / cores:.0f}% of {cores} cores")
    print(f"suite_cpu: both phases: {total:.0f} busy core-seconds, {total / cores:.0f} s on "
          f"{cores} cores kept busy all the time")
    return status


def by_test(samples: list[tuple[float, float]], events: str, top: int = 25) -> None:
    """Print the tests and the test files that took the most busy CPU (see the docstring)."""
    parsed = test_events.parse(events)
    spans, held = parsed.spans, parsed.held
    if not spans:
        return
    cpu: dict[str, float] = {}
    outside = 0.0
    for (t0, b0), (t1, b1) in zip(samples, samples[1:], strict=False):
        mid = (t0 + t1) / 2
        running = [name for start, end, name in spans if start <= mid < end]
        for name in running:
            cpu[name] = cpu.get(name, 0.0) + (b1 - b0) / len(running)
        if not running:
            outside += b1 - b0
    files: dict[str, float] = {}
    for name, c in cpu.items():
        file = name.split("::")[0]
        files[file] = files.get(file, 0.0) + c
    print(f"suite_cpu: the {top} tests that took the most busy core-seconds (their set-up "
          "and teardown included: a shared fixture counts for the test that started it):")
    for name, c in sorted(cpu.items(), key=lambda kv: -kv[1])[:top]:
        print(f"suite_cpu: {c:7.0f}  {name}")
    print("suite_cpu: per test file:")
    for file, c in sorted(files.items(), key=lambda kv: -kv[1]):
        print(f"suite_cpu: {c:7.0f}  {file}")
    print(f"suite_cpu: {outside:7.0f}  outside any test (set-up, ruff, collection, start-up)")
    if held:
        # the lanes (tests/lanes.py): what held the machine to itself is the serial part
        ex, sh, wait = (sum(f[i] for f in held.values()) for i in range(3))
        print(f"suite_cpu: the lanes' lock, in all: held exclusively {ex:.0f} s, shared "
              f"{sh:.0f} s, waited for {wait:.0f} s; the tests that held it exclusively longest "
              "(exclusive / shared / waited, s):")
        for name, f in sorted(held.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"suite_cpu: {f[0]:6.0f} {f[1]:6.0f} {f[2]:6.0f}  {name}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
