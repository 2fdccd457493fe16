"""Run `bash scripts/test.sh` and say how much CPU each of its two phases used.

    python3 scripts/suite_cpu.py [arguments for test.sh]

It samples the machine's busy CPU time (/proc/stat, every core, every process: run it on an
otherwise idle machine) every second while the suite runs, then reads the phases' lengths
from test.sh's last line and prints, per phase, the wall time, the busy core-seconds and the
share of the machine's cores they kept busy. The sum of the busy core-seconds divided by the
number of cores is the shortest the suite could take here if nothing ever waited. Standard
library only: it runs before the set-up has made the virtual environment. Exits with
test.sh's status."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

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
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "test.sh"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
