"""Idle CPU of each process of a TP=2 `vllm serve` tree, keepalive then mp: where the tree's
idle CPU goes. One request, 2 s of rest, then a 20 s window (psutil user+system time).

    python benchmarks/idle_cpu_by_process.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from servers import Server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    from tiny_model import build_tiny_model

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, window {args.seconds:g} s,"
          " % of one core per process")
    for backend in ("keepalive", "mp"):
        s = Server(str(build_tiny_model()), out / f"idle-{backend}.log", backend=backend)
        try:
            s.wait_ready()
            s.client().completions.create(model="tiny", prompt="Hi", max_tokens=4)
            time.sleep(2)
            tree = s.tree()
            before = {p.pid: sum(p.cpu_times()[:2]) for p in tree}
            t0 = time.monotonic()
            time.sleep(args.seconds)
            dt = time.monotonic() - t0
            rows = []
            for p in tree:
                pct = 100 * (sum(p.cpu_times()[:2]) - before[p.pid]) / dt
                name = " ".join(p.cmdline())[:60] if p.name() == "python" else p.name()
                rows.append(f"{name}: {pct:.2f}")
            total = sum(float(r.rsplit(": ", 1)[1]) for r in rows)
            print(f"{backend:10s} total {total:.2f} | " + " | ".join(rows))
        finally:
            s.stop()


if __name__ == "__main__":
    main()
