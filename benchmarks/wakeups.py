"""Who wakes, how often, and what it costs: per process and per thread, keepalive beside mp.

    python benchmarks/wakeups.py steps [--tokens 64]     # per decode step, engine in-process
    python benchmarks/wakeups.py idle [--seconds 20]     # an idle `vllm serve` tree

``steps``: a TP=2 ``LLM`` with the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
8 sequences of ``--tokens`` greedy tokens after a warm-up; for every thread of this process and
of its children, the voluntary context switches (a thread that blocks and is woken again
counts one) and the CPU time, per decode step.

``idle``: a TP=2 ``vllm serve`` of the tiny model; one request, ``--settle`` seconds of rest
(5 s), then a ``--seconds`` window (20 s) with no request: every process's and every thread's
CPU time (% of one core) and wakeups per second (voluntary context switches), and the tree's
total.

Thread names: a Python thread's name (py-spy dump, or ``threading`` for this process), else
the kernel's (``/proc/PID/task/TID/comm``). CPU times come from ``/proc/.../stat`` (clock ticks,
10 ms each: per-thread CPU over a short window is coarse; the switch counts are exact). Both
backends run in one invocation, one after the other; results go to
``benchmarks/results/wakeups-MODE.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "scripts")]
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_counters(pid: int) -> dict[int, dict]:
    """Per thread of PID: kernel name, voluntary/involuntary switches, CPU seconds, minor
    page faults."""
    out: dict[int, dict] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in map(int, tids):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"{base}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{base}/comm") as f:
                comm = f.read().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[tid] = {"comm": comm,
                    "voluntary": int(status["voluntary_ctxt_switches"]),
                    "involuntary": int(status["nonvoluntary_ctxt_switches"]),
                    "cpu_s": (int(fields[11]) + int(fields[12])) * TICK_S,
                    "minflt": int(fields[7])}
    return out


def python_thread_names(pid: int, spy: Path | None = None) -> dict[int, str]:
    """tid -> Python thread name, from ``py-spy dump`` (``spy``: its path; default: beside
    this Python; empty if py-spy is not there)."""
    spy = spy or Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return {}
    try:
        dump = subprocess.run([str(spy), "dump", "--pid", str(pid)], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(tid, 0): name for tid, name in
            re.findall(r'^Thread (\S+) \([^)]*\): "([^"]*)"', dump, re.M)}


def snapshot(pids: list[int]) -> dict[tuple[int, int], dict]:
    return {(pid, tid): c for pid in pids for tid, c in thread_counters(pid).items()}


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")[0].decode(errors="replace")
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except FileNotFoundError:
        return "?"
    return cmd if cmd.startswith("VLLM::") else comm


def deltas(before: dict, after: dict, names: dict[int, dict[int, str]]) -> list[dict]:
    rows = []
    for key, a in after.items():
        b = before.get(key, {"voluntary": 0, "involuntary": 0, "cpu_s": 0.0})
        pid, tid = key
        rows.append({"pid": pid, "process": process_name(pid), "tid": tid,
                     "thread": names.get(pid, {}).get(tid) or a["comm"],
                     "voluntary": a["voluntary"] - b["voluntary"],
                     "involuntary": a["involuntary"] - b["involuntary"],
                     "cpu_s": a["cpu_s"] - b["cpu_s"]})
    return sorted(rows, key=lambda r: (-r["voluntary"], -r["cpu_s"]))


# ---------------------------------------------------------------- per step, in-process


def steps(backend: str, tokens: int) -> dict:
    """Run in a child interpreter (one engine per process): see main()."""
    import threading

    import psutil
    from tiny_model import build_tiny_model
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = LLM(str(build_tiny_model()), tensor_parallel_size=2, distributed_executor_backend=backend,
              enforce_eager=True, max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.2,
              seed=0)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = ["Hello, my name is"] * 8
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    me = psutil.Process()
    pids = [me.pid, *(c.pid for c in me.children(recursive=True))]
    before = snapshot(pids)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = snapshot(pids)
    names = {me.pid: {t.native_id: t.name for t in threading.enumerate()}}
    for pid in pids[1:]:
        names[pid] = python_thread_names(pid)
    return {"backend": backend, "steps": tokens, "wall_s": wall,
            "threads": deltas(before, after, names)}


# ---------------------------------------------------------------- idle serve tree


def idle(backend: str, settle_s: float, seconds: float) -> dict:
    from servers import Server
    from tiny_model import build_tiny_model

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    server = Server(str(build_tiny_model()), out / f"wakeups-idle-{backend}.log", backend=backend)
    try:
        server.wait_ready()
        server.client().completions.create(model="tiny", prompt="Hello", max_tokens=8)
        time.sleep(settle_s)
        pids = [p.pid for p in server.tree()]
        before = snapshot(pids)
        t0 = time.monotonic()
        time.sleep(seconds)
        after = snapshot(pids)
        window = time.monotonic() - t0
        names = {pid: python_thread_names(pid) for pid in pids}
        threads = deltas(before, after, names)  # while the processes still have names
    finally:
        server.stop()
    return {"backend": backend, "window_s": window, "threads": threads}


def print_steps(r: dict) -> None:
    n = r["steps"]
    print(f"\n{r['backend']}: {n} steps, {r['wall_s'] / n * 1e3:.2f} ms/step")
    print("  voluntary switches/step  CPU ms/step  process / thread")
    total = 0.0
    for t in r["threads"]:
        if t["voluntary"] == 0 and t["cpu_s"] == 0:
            continue
        total += t["voluntary"] / n
        print(f"  {t['voluntary'] / n:22.2f}  {t['cpu_s'] / n * 1e3:11.3f}  "
              f"{t['process']} / {t['thread']} ({t['tid']})")
    print(f"  {total:22.2f}  total voluntary switches per step")


def print_idle(r: dict) -> None:
    w = r["window_s"]
    print(f"\n{r['backend']}: idle window {w:.1f} s")
    print("  wakeups/s  CPU % of a core  process / thread")
    by_process: dict[str, list[float]] = {}
    for t in r["threads"]:
        agg = by_process.setdefault(f"{t['process']} ({t['pid']})", [0.0, 0.0])
        agg[0] += t["voluntary"] / w
        agg[1] += 100 * t["cpu_s"] / w
        if t["voluntary"] == 0 and t["cpu_s"] == 0:
            continue
        print(f"  {t['voluntary'] / w:9.1f}  {100 * t['cpu_s'] / w:15.2f}  "
              f"{t['process']} / {t['thread']} ({t['tid']})")
    print("  per process:")
    for name, (wk, cpu) in by_process.items():
        print(f"  {wk:9.1f}  {cpu:15.2f}  {name}")
    print(f"  {sum(v[0] for v in by_process.values()):9.1f}  "
          f"{sum(v[1] for v in by_process.values()):15.2f}  whole tree")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["steps", "idle", "_steps_child"])
    ap.add_argument("--backend", default="")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    if args.mode == "_steps_child":
        print("RESULT " + json.dumps(steps(args.backend, args.tokens)), flush=True)
        return
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  {os.uname().machine} "
          f"nproc={os.cpu_count()}  load average {os.getloadavg()[0]:.2f}  "
          f"command: python benchmarks/wakeups.py {' '.join(sys.argv[1:])}")
    results = []
    for backend in ("keepalive", "mp"):
        if args.mode == "steps":
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                       VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
            proc = subprocess.run([sys.executable, __file__, "_steps_child", "--backend",
                                   backend, "--tokens", str(args.tokens)], env=env,
                                  capture_output=True, text=True, timeout=900)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(proc.stdout[-3000:], proc.stderr[-5000:])
                raise SystemExit(f"{backend} failed")
            r = json.loads(lines[-1][7:])
            print_steps(r)
        else:
            r = idle(backend, args.settle, args.seconds)
            print_idle(r)
        results.append(r)
    path = HERE / "results" / f"wakeups-{args.mode}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nraw: {path.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
