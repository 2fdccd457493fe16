"""Where a serving step's time goes under load: keepalive and mp side by side (issue 29).

``python benchmarks/profile_serve.py [--rounds 2] [--model-shape wide] [--input-len 384]
[--output-len 64] [--num-prompts 64] [--max-concurrency 32] [--py-spy PATH]``

A benchmark, not a test: it prints figures and fails no assertion. For each round it serves
with keepalive, then mp (the same flags as ``bench_serve.py``'s servers plus
``--max-model-len 512 --max-num-seqs 32`` and vLLM's ``--worker-extension-cls`` set to
``step_timer.StepTimer``, which times ``Worker.execute_model``/``sample_tokens`` inside every
rank), runs vLLM's own client (``vllm bench serve``, random dataset, ``--ignore-eos``) once
to warm up and once measured, and samples every 0.1 s:

- each rank's model work so far (the step timer's running totals) and its step count;
- the CPU time (user + system) of every thread of every process in the server's tree and the
  client's.

The **busy window** runs from the last sample before rank 0's step count first grows to the
first sample after it last grew; every figure is a difference over that window, so the
client's start-up (it imports vLLM, about 10 s here) and the idle tail are left out. Printed
per run: steps, wall time per step, each rank's model work per step, rank 0's time outside its
model work per step, and the CPU each process and each of the engine process's threads used
(% of one core over the window). With ``--py-spy PATH`` (py-spy is not a dependency; install
it anywhere) the engine process's threads are named from a ``py-spy dump``, and a 10 s
``py-spy record --gil`` of the busy window gives each thread's share of the GIL.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO / "tests"), str(HERE)]

import psutil  # noqa: E402
from bench_serve import cpu_model, tiny_model, vllm_cmd  # noqa: E402
from servers import Server, env  # noqa: E402
from step_timer import read_totals  # noqa: E402
from wakeups import python_thread_names, snapshot  # noqa: E402

TICK_S = 0.1
SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "32",
               "--worker-extension-cls", "step_timer.StepTimer"]


def tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


class Sampler(threading.Thread):
    """Every TICK_S: (time, rank totals, per-thread CPU of the server's and client's trees)."""

    def __init__(self, server_pid: int, timer_dir: str) -> None:
        super().__init__(daemon=True)
        self.server_pid = server_pid
        self.timer_dir = timer_dir
        self.client_pid: int | None = None
        self.client_pids: set[int] = set()
        self.samples: list[tuple[float, dict, dict]] = []
        self.stop_event = threading.Event()
        self.first_step_at: float | None = None

    def run(self) -> None:
        while not self.stop_event.is_set():
            client = tree(self.client_pid) if self.client_pid else []
            self.client_pids.update(client)
            pids = tree(self.server_pid) + client
            totals = read_totals(self.timer_dir)
            now = time.monotonic()
            self.samples.append((now, totals, snapshot(pids)))
            if self.first_step_at is None and len(self.samples) > 1:
                if steps(self.samples[-1][1]) > steps(self.samples[0][1]):
                    self.first_step_at = now
            self.stop_event.wait(TICK_S)


def steps(totals: dict) -> int:
    return totals.get(0, {}).get("execute_model", (0.0, 0))[1]


def busy_window(samples: list) -> tuple[int, int]:
    counts = [steps(s[1]) for s in samples]
    changed = [i for i in range(1, len(counts)) if counts[i] != counts[i - 1]]
    if not changed:
        raise RuntimeError("no step ran while the client ran")
    return changed[0] - 1, changed[-1]


def gil_shares(raw: str) -> dict[str, float]:
    """Thread name -> share of the samples in which it held the GIL (py-spy --gil)."""
    per: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        m = re.match(r"(.*) (\d+)$", line)
        if m:
            per[m.group(1).split(";")[0]] += int(m.group(2))
    total = sum(per.values()) or 1
    return {k: v / total for k, v in per.most_common()}


def run_client(srv: Server, tok_dir: str, args: argparse.Namespace, n: int, log: Path,
               result_dir: str, sampler: Sampler | None = None) -> dict[str, Any]:
    cmd = [*vllm_cmd(), "bench", "serve", "--backend", "openai", "--base-url", srv.base_url,
           "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", tok_dir,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(n),
           "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", "0",
           "--save-result", "--result-dir", result_dir, "--result-filename", "r.json",
           "--disable-tqdm"]
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, env=env(), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        if sampler is not None:
            sampler.client_pid = proc.pid
        try:
            if proc.wait(900) != 0:
                raise RuntimeError(f"vllm bench serve failed; see {log}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return json.loads((Path(result_dir) / "r.json").read_text())


def label(pid: int, tid: int, name: str, roles: dict[int, str], names: dict[int, str]) -> str:
    role = roles.get(pid, name)
    if role == "engine process":
        return f"engine: {names.get(tid, 'main' if tid == pid else f'tid {tid}')}"
    return role


def profile_one(backend: str, rnd: int, model: str, args: argparse.Namespace,
                out_dir: Path) -> dict[str, Any]:
    timer_dir = tempfile.mkdtemp(prefix="profile-serve-")
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    log = out_dir / f"{backend}-{rnd}.log"
    srv = Server(model, log, tp=2, backend=backend, extra_args=SERVER_ARGS,
                 extra_env={"PYTHONPATH": pythonpath, "PROFILE_STEP_DIR": timer_dir,
                            "PROFILE_STEP_LOG": "1",
                            "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        srv.wait_ready(600)
        run_client(srv, model, args, 8, out_dir / f"{backend}-{rnd}-client.log",
                   tempfile.mkdtemp())
        time.sleep(1.0)
        server_pids = tree(srv.proc.pid)
        engine = next(p for p in server_pids if "EngineCor" in psutil.Process(p).name())
        roles = {srv.proc.pid: "API server", engine: "engine process"}
        for p in server_pids:
            n = psutil.Process(p).name()
            if "Worker" in n or "Keepalive" in n:
                roles[p] = f"worker {n.split('_')[-1]}"
        names = python_thread_names(engine, Path(args.py_spy)) if args.py_spy else {}
        sampler = Sampler(srv.proc.pid, timer_dir)
        sampler.start()
        spy_out = out_dir / f"{backend}-{rnd}-gil.txt"
        spy: subprocess.Popen | None = None
        spies: list[subprocess.Popen] = []
        result_dir = tempfile.mkdtemp()
        box: list[dict] = []
        client = threading.Thread(target=lambda: box.append(run_client(
            srv, model, args, args.num_prompts, out_dir / f"{backend}-{rnd}-client.log",
            result_dir, sampler)))
        client.start()
        while client.is_alive():
            if args.py_spy and spy is None and sampler.first_step_at is not None \
                    and time.monotonic() > sampler.first_step_at + 1.0:
                spy = subprocess.Popen([args.py_spy, "record", "--nonblocking", "--gil",
                                        "--threads", "-r", "200", "-d", "10", "-f", "raw",
                                        "-o", str(spy_out), "-p", str(engine)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if args.py_spy_ranks:  # where each rank's time goes, idle samples included
                    for pid, role in roles.items():
                        if role == "API server":
                            continue
                        spies.append(subprocess.Popen(
                            [args.py_spy, "record", "--nonblocking", "--idle", "--threads",
                             "-r", "100", "-d", "10", "-f", "raw", "-p", str(pid), "-o",
                             str(out_dir / f"{backend}-{rnd}-{role.replace(' ', '_')}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            client.join(0.1)
        sampler.stop_event.set()
        sampler.join()
        for p in [spy, *spies]:
            if p is not None:
                p.wait(60)
        if not box:
            raise RuntimeError(f"the client failed; see {out_dir}")
        bench = box[0]
    finally:
        srv.stop(timeout=30)
    first, last = busy_window(sampler.samples)
    (t0, tot0, cpu0), (t1, tot1, cpu1) = sampler.samples[first], sampler.samples[last]
    wall = t1 - t0
    n_steps = steps(tot1) - steps(tot0)
    ranks = {}
    for r in sorted(tot1):
        ranks[r] = {k: (tot1[r][k][0] - tot0.get(r, {}).get(k, (0.0, 0))[0]) for k in tot1[r]}
    cpu: dict[str, float] = collections.defaultdict(float)
    faults: dict[str, int] = collections.defaultdict(int)
    zero = {"cpu_s": 0.0, "minflt": 0}
    for key, counters in cpu1.items():
        before = cpu0.get(key, zero)
        pid, tid = key
        name = cpu1.get((pid, pid), counters)["comm"]  # the process's: its main thread's
        if pid in sampler.client_pids:
            who = "client (vllm bench serve)"
        elif pid in roles:
            who = label(pid, tid, name, roles, names)
        else:
            who = f"server: {name}"
        cpu[who] += counters["cpu_s"] - before["cpu_s"]
        faults[who] += counters["minflt"] - before["minflt"]
    gil = gil_shares(spy_out.read_text()) if args.py_spy and spy_out.exists() else {}
    kinds = step_kinds(timer_dir, t0, t1, args.max_concurrency)
    return {"backend": backend, "round": rnd, "window": [t0, t1], "kinds": kinds,
            "wall_s": wall, "steps": n_steps, "ranks": ranks, "cpu_s": dict(cpu),
            "minflt": dict(faults), "gil": gil,
            "output_throughput": bench.get("output_throughput"),
            "median_tpot_ms": bench.get("median_tpot_ms"),
            "median_ttft_ms": bench.get("median_ttft_ms")}


def read_calls(path: Path, t0: float, t1: float) -> list[tuple[str, float, float, int]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            name, start, end, tokens = line.split()
            if t0 <= float(start) <= t1:
                out.append((name, float(start), float(end), int(tokens)))
    return out


def step_kinds(timer_dir: str, t0: float, t1: float, max_seqs: int) -> dict[str, Any]:
    """Per step kind (decode: at most ``max_seqs`` tokens scheduled; prefill: more), from the
    ranks' call logs: count, median model ms per rank (execute_model + sample_tokens), rank
    1's start after rank 0's (median ms), and rank 0's median gap before the step (from the
    end of its previous call)."""
    calls = {r: read_calls(Path(timer_dir) / f"rank{r}.calls", t0, t1) for r in (0, 1)}
    steps_by_rank: dict[int, list[tuple[float, float, int]]] = {}
    for r, cs in calls.items():
        steps_: list[tuple[float, float, int]] = []
        for name, start, end, tokens in cs:
            if name == "execute_model":
                steps_.append((start, end, tokens))
            elif steps_:
                s0, _, tok = steps_[-1]
                steps_[-1] = (s0, end, tok)
        steps_by_rank[r] = steps_
    s0s, s1s = steps_by_rank[0], steps_by_rank[1]
    n = min(len(s0s), len(s1s))
    out: dict[str, Any] = {}
    for kind in ("decode", "prefill"):
        idx = [i for i in range(n) if (s0s[i][2] <= max_seqs) == (kind == "decode")]
        if not idx:
            continue

        def med(xs: list[float]) -> float:
            return statistics.median(xs) * 1000 if xs else float("nan")

        out[kind] = {
            "steps": len(idx),
            "tokens": sum(s0s[i][2] for i in idx),
            "rank0_ms": med([s0s[i][1] - s0s[i][0] for i in idx]),
            "rank1_ms": med([s1s[i][1] - s1s[i][0] for i in idx]),
            "rank0_total_s": sum(s0s[i][1] - s0s[i][0] for i in idx),
            "rank1_lag_ms": med([s1s[i][0] - s0s[i][0] for i in idx]),
            "rank0_gap_ms": med([s0s[i][0] - s0s[i - 1][1] for i in idx if i > 0]),
        }
    return out


def report(runs: list[dict[str, Any]]) -> None:
    print("\n| backend | round | output tok/s | median TPOT ms | busy s | steps | ms per step "
          "| rank 0 model ms/step | rank 1 model ms/step | rank 0 outside model ms/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        per = 1000.0 / max(r["steps"], 1)
        m0 = sum(r["ranks"].get(0, {}).values()) * per
        m1 = sum(r["ranks"].get(1, {}).values()) * per
        print(f"| {r['backend']} | {r['round']} | {r['output_throughput']:.1f} | "
              f"{r['median_tpot_ms']:.2f} | {r['wall_s']:.2f} | {r['steps']} | "
              f"{r['wall_s'] * per:.2f} | {m0:.2f} | {m1:.2f} | {r['wall_s'] * per - m0:.2f} |")
    print("\nBy step kind (decode: at most --max-concurrency tokens scheduled), medians; "
          "model = execute_model + sample_tokens inside the rank; lag = rank 1's start after "
          "rank 0's; gap = rank 0's time between the end of its previous step and this one's "
          "start:\n")
    print("| backend | round | kind | steps | tokens | rank 0 model ms | rank 1 model ms | "
          "rank 0 model s (all) | rank 1 lag ms | rank 0 gap ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        for kind, k in r["kinds"].items():
            print(f"| {r['backend']} | {r['round']} | {kind} | {k['steps']} | {k['tokens']} | "
                  f"{k['rank0_ms']:.2f} | {k['rank1_ms']:.2f} | {k['rank0_total_s']:.2f} | "
                  f"{k['rank1_lag_ms']:.2f} | {k['rank0_gap_ms']:.2f} |")
    print("\nCPU over the busy window, % of one core (200 = both cores):\n")
    whos = sorted({w for r in runs for w in r["cpu_s"]},
                  key=lambda w: -max(r["cpu_s"].get(w, 0.0) / r["wall_s"] for r in runs))
    print("| process / thread | " + " | ".join(f"{r['backend']} {r['round']}" for r in runs)
          + " |")
    print("|---|" + "---|" * len(runs))
    for w in whos:
        cells = [100 * r["cpu_s"].get(w, 0.0) / r["wall_s"] for r in runs]
        if max(cells) >= 0.5:
            print(f"| {w} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    print("\nMinor page faults per step over the busy window (a fault is a kernel entry and a "
          "page zeroed):\n")
    print("| process / thread | " + " | ".join(f"{r['backend']} {r['round']}" for r in runs)
          + " |")
    print("|---|" + "---|" * len(runs))
    for w in whos:
        cells = [r.get("minflt", {}).get(w, 0) / max(r["steps"], 1) for r in runs]
        if max(cells) >= 1:
            print(f"| {w} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    for r in runs:
        if r["gil"]:
            shares = ", ".join(f"{k}: {100 * v:.0f}%" for k, v in list(r["gil"].items())[:6])
            print(f"\nGIL holders, {r['backend']} {r['round']} (share of GIL-held samples): "
                  f"{shares}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model-shape", default="wide", choices=("tiny", "wide"))
    p.add_argument("--input-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--backends", default="keepalive,mp")
    p.add_argument("--py-spy", default=None, help="path of a py-spy executable")
    p.add_argument("--py-spy-ranks", action="store_true",
                   help="with --py-spy: also record every rank's process, idle included")
    p.add_argument("--out", type=Path, default=HERE / "results" / "profile_serve")
    p.add_argument("--json", type=Path, default=None, help="raw figures")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = tiny_model(args.model_shape)
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} | cpu: "
          f"{cpu_model()} | nproc: {os.cpu_count()} | python {platform.python_version()}")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    runs = []
    for rnd in range(1, args.rounds + 1):
        for backend in args.backends.split(","):
            print(f"{time.strftime('%H:%M:%S')} {backend} round {rnd}", flush=True)
            runs.append(profile_one(backend, rnd, model, args, args.out))
    report(runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
