"""Measurement: how long a mostly idle process waits for a CPU beside a busy vLLM server, with
Linux's autogroup scheduling on and off.

    python benchmarks/sched_starvation.py [--busy-s 60] [--modes off,on]

Why: an idle keepalive server with a 5 s collective timeout, beside a busy ``vllm serve -dp 2
-tp 2``, lost its ranks on this project's 2-core VM: its rank 0 ran no thread for 5.87 s, so no
keepalive went out (the one-node torchrun test's failure in CI, 2026-12-07). Autogroup
scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) makes each session a scheduling group
of its own, and every test server and every torchrun rank is a session. This shows the effect
without a keepalive server in the way: it needs root to switch the setting, and restores it.

Per mode, three probe processes start, each in a session of its own: one bound to CPU 0, one
to CPU 1, one unbound. Each sleeps 50 ms at a time in two threads and records the longest
gap over the 50 ms and how much run-queue wait (``/proc/self/task/*/schedstat``, the second
field) grew during it: a gap that is all run-queue wait is a runnable process the scheduler did
not run. Then a keepalive ``vllm serve -dp 2 -tp 2`` of the tiny model, its ranks bound to CPUs
0|1|0|1 as the tests bind them (tests/dp_scripts.py), answers back-to-back requests from four
clients for ``--busy-s`` seconds. The probes' figures are printed per mode, side by side.
It is a measurement, not a test: it asserts nothing about the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
PERIOD_S = 0.05

PROBE = r"""
import json, os, signal, sys, threading, time
cpu, PERIOD = sys.argv[1], float(sys.argv[2])
if cpu != "any":
    os.sched_setaffinity(0, {int(cpu)})
worst = {"gap_s": 0.0, "run_queue_wait_s": 0.0, "gaps_over_1s": 0}
lock = threading.Lock()

def run_delay():
    total = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                total += int(f.read().split()[1])
        except OSError:
            pass
    return total / 1e9

def watch():
    last, waited = time.monotonic(), run_delay()
    while True:
        time.sleep(PERIOD)
        now, w = time.monotonic(), run_delay()
        gap = now - last - PERIOD
        with lock:
            if gap > 1.0:
                worst["gaps_over_1s"] += 1
            if gap > worst["gap_s"]:
                worst["gap_s"], worst["run_queue_wait_s"] = gap, w - waited
        last, waited = now, w

def report(*_):
    with lock:
        print(json.dumps(worst), flush=True)
    os._exit(0)

signal.signal(signal.SIGTERM, report)
threading.Thread(target=watch, daemon=True).start()
watch()
"""


def set_autogroup(value: str) -> None:
    AUTOGROUP.write_text(value)


def measure(busy_s: float, work: Path, model: str) -> dict:
    """The probes' worst gaps while a DP=2 TP=2 keepalive server is kept busy for BUSY_S."""
    from dp_scripts import dp_server
    from procs import keep_niceness

    probes: dict[str, subprocess.Popen] = {}
    server = dp_server(model, work / "dp.log", "keepalive", 2, 2, work / "faults")
    served: list[str] = []
    try:
        server.wait_ready()
        stop = threading.Event()

        def client(replica: int) -> None:
            c = server.client()
            while not stop.is_set():
                try:
                    c.completions.create(
                        model="tiny", prompt="The quick brown fox", max_tokens=32,
                        temperature=0, extra_body={"ignore_eos": True},
                        extra_headers={"X-data-parallel-rank": str(replica)})
                    served.append("ok")
                except Exception as e:  # noqa: BLE001 - counted, not fatal to the figures
                    served.append(type(e).__name__)
                    time.sleep(0.5)

        # started once the server is up: its start-up is not what is measured
        probes = {cpu: subprocess.Popen([sys.executable, "-c", PROBE, cpu, str(PERIOD_S)],
                                        start_new_session=True, preexec_fn=keep_niceness,
                                        stdout=subprocess.PIPE, text=True)
                  for cpu in ("0", "1", "any")}
        threads = [threading.Thread(target=client, args=(r,), daemon=True) for r in (0, 1, 0, 1)]
        for t in threads:
            t.start()
        time.sleep(busy_s)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        figures = {}
        for cpu, p in probes.items():
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=10)
            figures[cpu] = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
        server.stop()
    return {"probes": figures, "requests": len(served),
            "failed_requests": sum(1 for s in served if s != "ok")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-s", type=float, default=60.0)
    parser.add_argument("--modes", default="off,on",
                        help="autogroup settings to measure, in order (off, on)")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in ("on", "off") for m in modes):
        parser.error(f"--modes takes on and off, got {args.modes!r}")
    if not AUTOGROUP.exists() or not os.access(AUTOGROUP, os.W_OK):
        sys.exit(f"sched_starvation: {AUTOGROUP} is missing or not writable (run as root)")
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]
    from tiny_model import build_tiny_model

    before = AUTOGROUP.read_text().strip()
    results = {}
    with tempfile.TemporaryDirectory(prefix="sched-starvation-") as tmp:
        model = str(build_tiny_model(Path(tmp) / "tiny-llama"))
        try:
            for mode in modes:
                set_autogroup("1" if mode == "on" else "0")
                work = Path(tmp) / mode
                work.mkdir()
                results[mode] = measure(args.busy_s, work, model)
                print(f"autogroup {mode}: {json.dumps(results[mode])}", flush=True)
        finally:
            set_autogroup(before)
    print(f"\n{args.busy_s:g} s of DP=2 TP=2 serving (ranks on CPUs 0|1|0|1); autogroup "
          f"restored to {before}")
    print(f"{'probe':<10}" + "".join(f"{'autogroup ' + m:>34}" for m in modes))
    for cpu in ("0", "1", "any"):
        cells = []
        for m in modes:
            f = results[m]["probes"][cpu]
            cells.append("no report" if f is None else
                         f"{f['gap_s']:.2f} s ({f['run_queue_wait_s']:.2f} queued), "
                         f"{f['gaps_over_1s']} >1 s")
        label = f"CPU {cpu}" if cpu != "any" else "unbound"
        print(f"{label:<10}" + "".join(f"{c:>34}" for c in cells))
    counts = [f"{results[m]['requests']} ({results[m]['failed_requests']} failed)" for m in modes]
    print(f"{'requests':<10}" + "".join(f"{c:>34}" for c in counts))


if __name__ == "__main__":
    main()
