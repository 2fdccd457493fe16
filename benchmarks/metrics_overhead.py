"""What keepalive's /metrics series cost a step: benchmarks/profile_step.py run for keepalive
with the series on and off (and mp beside them), in alternation, in one run.

    python benchmarks/metrics_overhead.py [--rounds 5] [--out FILE]

Each round runs the three backends once each, in a rotating order, each in a fresh process
(an in-process engine at TP=2, 8 sequences x 64 greedy tokens after a warm-up). Printed per
backend: the median over rounds of the wall time per decode step, of the executor's
``execute_model`` call (the engine's call: its dispatch, rank 0's share of the model, the
reply), and of the channel's broadcast, and the on/off ratios. The counters sit in the
step's path after its broadcast (metrics.StepMeter); the snapshot writer is a thread of its
own waking once a second.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BACKENDS = ("keepalive", "keepalive-nometrics", "mp")
_WALL = re.compile(r"\(([\d.]+) ms/step")
_CALL = re.compile(r"^\s+(execute_model|broadcast \(channel\.send\))\s+calls=\s*\d+\s+"
                   r"median=\s*([\d.]+) ms", re.M)


def run_once(backend: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, str(HERE / "profile_step.py"), backend],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{backend}: exit {out.returncode}\n{out.stderr[-3000:]}")
    text = out.stdout
    found = {"ms/step": float(_WALL.search(text).group(1))}
    for name, median in _CALL.findall(text):
        found[name] = float(median)
    return found


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {b: [] for b in BACKENDS}
    for r in range(args.rounds):
        order = BACKENDS[r % 3:] + BACKENDS[:r % 3]
        for backend in order:
            runs[backend].append(run_once(backend))
            print(f"round {r + 1} {backend}: {runs[backend][-1]}", flush=True)
    lines = [f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC  "
             f"{cpu_model()}  nproc={os.cpu_count()}  rounds={args.rounds}",
             f"# command: python benchmarks/metrics_overhead.py --rounds {args.rounds}",
             f"{'backend':22s} {'ms/step':>9s} {'execute_model':>14s} {'broadcast':>10s}"]
    med: dict[str, dict[str, float]] = {}
    for backend in BACKENDS:
        keys = ("ms/step", "execute_model", "broadcast (channel.send)")
        med[backend] = {k: statistics.median(x[k] for x in runs[backend] if k in x)
                        for k in keys if any(k in x for x in runs[backend])}
        m = med[backend]
        lines.append(f"{backend:22s} {m['ms/step']:9.3f} {m.get('execute_model', 0):14.3f} "
                     f"{m.get('broadcast (channel.send)', float('nan')):10.3f}")
    on, off = med["keepalive"], med["keepalive-nometrics"]
    lines.append(f"on/off: ms/step {on['ms/step'] / off['ms/step']:.3f}, execute_model "
                 f"{on['execute_model'] / off['execute_model']:.3f}; keepalive/mp ms/step "
                 f"{on['ms/step'] / med['mp']['ms/step']:.3f} (medians of the rounds)")
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
