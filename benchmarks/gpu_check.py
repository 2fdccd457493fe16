"""The GPU path, checked side by side with vLLM's ``mp`` in one command (``scripts/gpu_check.sh``).

**GPU mode** (the default; a machine with two or more GPUs and vLLM for CUDA or ROCm, this
repository installed with ``pip install -e .[test,bench]``): for ``mp``, keepalive on the
gloo CPU group (the GPU default) and keepalive on the device group (NCCL/RCCL), each with
async scheduling off and on (``--no-async-scheduling`` / vLLM's default for mp;
``VLLM_KEEPALIVE_ASYNC_SCHEDULING`` for keepalive), one ``vllm serve`` at TP=2 that:

1. answers greedy questions (a completion, a chat, a stream): equal to ``mp``'s (async off);
2. serves ``vllm bench serve`` (random dataset): output throughput and median TPOT;
3. rests ``--idle-s``: each GPU's utilization (``nvidia-smi`` or ``rocm-smi``) and the CPU of
   every process of the tree (every rank);

then keepalive on each transport with a short collective timeout (``--idle-timeout-s``) is
left idle for three times that timeout and must answer the same after; and rank 1's worker
is killed under load (8 streams), keepalive and mp: time until the server reports unhealthy
and every client ended, the server's exit, and what was left running.

**CPU mode** (``--cpu``; what the test suite runs, tests/test_gpu_check.py): the same checks
where a CPU can make them, within two engine start-ups: keepalive at TP=2 on the device group
(gloo here) answers like mp, survives three times a 5 s timeout idle, is benchmarked briefly,
rests for the CPU of its ranks and loses rank 1 under load; keepalive on the CPU group,
started while the first idles, answers like mp. mp's answers come from the serving tests'
cached reference (serve_tp2 in tests/reference_calls.py, the project's reference mechanism:
tests/run_engine.py), run live when its key does not match.
Async scheduling is skipped (vLLM turns it off on CPU for every backend), and so is GPU
utilization.

Output: a report on stdout, the figures in ``--json``; exit code 1 if a check failed. Logs go
to ``--out`` (default benchmarks/results/gpu_check/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "scripts"))
sys.path.insert(0, str(HERE))

from bench_faults import kill_worker_of  # noqa: E402
from bench_serve import idle_by_process, run_bench  # noqa: E402
from serve_scripts import LOAD_ARGS, ask, texts  # noqa: E402
from servers import Server  # noqa: E402

#: how long after a worker's SIGKILL the server must report unhealthy and every client end
REACTION_BOUND_S = 30.0


class Checks:
    """The checks made so far (name, ok, detail) and the figures, for the report."""

    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"[{'ok' if ok else 'FAILED'}] {name}" + (f": {detail}" if detail else ""),
              flush=True)
        return bool(ok)

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)


def gpu_utilization() -> list[float] | None:
    """Each GPU's utilization in percent, or None without nvidia-smi/rocm-smi."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True)
        return [float(x) for x in out.stdout.split()] if out.returncode == 0 else None
    if shutil.which("rocm-smi"):
        out = subprocess.run(["rocm-smi", "--showuse", "--json"], capture_output=True, text=True)
        if out.returncode != 0:
            return None
        cards = json.loads(out.stdout)
        return [float(v.get("GPU use (%)", "nan")) for v in cards.values()]
    return None


def idle_figures(server: Server, seconds: float) -> dict[str, Any]:
    """The server at rest: each GPU's mean utilization (sampled once a second) and the CPU
    of every process of its tree, over ``seconds``."""
    samples: list[list[float]] = []
    if gpu_utilization() is None:
        by_process = idle_by_process(server, seconds)
    else:
        import threading

        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(1.0):
                u = gpu_utilization()
                if u is not None:
                    samples.append(u)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        by_process = idle_by_process(server, seconds)
        stop.set()
        t.join(5)
    gpu = ([round(sum(col) / len(col), 1) for col in zip(*samples, strict=True)]
           if samples else None)
    return {"gpu_util_pct": gpu, "cpu_pct_by_process": by_process}


def bench(server: Server, model: str, name: str, out: Path, args: argparse.Namespace
          ) -> dict[str, Any]:
    """``vllm bench serve`` (bench_serve.run_bench): output tok/s and median TPOT."""
    ns = argparse.Namespace(input_len=args.input_len, output_len=args.output_len,
                            max_concurrency=8, bench_timeout=600)
    data = run_bench(server, model, model, name, args.num_prompts, ns,
                     out / f"{name}-bench.log", out)
    return {"output_tok_s": round(data["output_throughput"], 1),
            "median_tpot_ms": round(data["median_tpot_ms"], 2)}


def start(model: str, out: Path, name: str, backend: str, args: argparse.Namespace,
          extra_args: list[str] = (), extra_env: dict[str, str] | None = None,
          wait: bool = True) -> Server:
    """``vllm serve`` at TP=2 with ``--serve-args``; ready unless ``wait`` is false."""
    print(f"... starting {name}", flush=True)
    server = Server(model, out / f"{name}.log", backend=backend,
                    extra_args=[*args.serve_args, *extra_args], extra_env=extra_env)
    if wait:
        server.wait_ready(args.ready_timeout_s)
    return server


def stopped(server: Server, checks: Checks, name: str) -> None:
    code = server.stop()
    checks.check(f"{name} stops cleanly", code == 0 and not server.leftovers,
                 f"exit code {code}, left {server.leftovers}")


def kill_under_load(server: Server, backend: str, checks: Checks, name: str) -> dict:
    r = kill_worker_of(server, backend, busy=True)
    unhealthy, ended = r.get("unhealthy_s"), r.get("clients_ended_s")
    checks.check(f"{name}: rank 1 killed under load, the server reports it and ends every "
                 f"stream within {REACTION_BOUND_S:g} s, nothing left",
                 unhealthy is not None and unhealthy < REACTION_BOUND_S
                 and ended is not None and ended < REACTION_BOUND_S
                 and r.get("left_after_10s") == 0, r)
    return r


# ---------------------------------------------------------------------------- mp's answers
def mp_reference(model: str, out: Path, args: argparse.Namespace) -> tuple[dict, str]:
    """mp's answers in CPU mode: the serving tests' cached reference ``serve_tp2``
    (tests/reference_calls.py: ``vllm serve -tp 2`` under mp with serve_scripts.LOAD_ARGS, the
    CPU mode's own flags), run live and rewritten when its key does not match this machine
    (tests/run_engine.py). ``--refresh-reference`` reruns it."""
    from reference_calls import REFERENCES
    from run_engine import Reference, reference_call

    if args.serve_args != LOAD_ARGS:
        raise SystemExit(f"the CPU mode compares with mp's cached answers for {LOAD_ARGS}; "
                         f"extra vllm serve flags {args.serve_args[len(LOAD_ARGS):]} would "
                         "change them")
    ref = Reference.look_up("serve_tp2", reference_call(REFERENCES["serve_tp2"], model,
                                                        out / "mp-reference"), model)
    if args.refresh_reference:
        ref.cached = None
    how = ref.message()
    return ref.result(), how


# ---------------------------------------------------------------------------- the two modes
def run_cpu(model: str, out: Path, args: argparse.Namespace, checks: Checks) -> None:
    mp_answers, how = mp_reference(model, out, args)
    checks.figures["mp_reference"] = how
    timeout = args.idle_timeout_s
    name = "keepalive TP=2, transport device (gloo)"
    server = start(model, out, "keepalive-device", "keepalive", args,
                   ["--distributed-timeout-seconds", f"{timeout:g}"])
    second: Server | None = None
    try:
        before = texts(ask(server.client()))
        checks.check(f"{name}: greedy answers equal mp's", before == mp_answers,
                     {"keepalive": before, "mp": mp_answers})
        # The CPU-group server starts while this one is idle (its start-up is not measured,
        # and its collective timeout is vLLM's default): an idle server beside a start-up is
        # what every keepalive deployment meets, and this one must survive it as well.
        second = start(model, out, "keepalive-cpu", "keepalive", args,
                       extra_env={"VLLM_KEEPALIVE_TRANSPORT": "cpu"}, wait=False)
        time.sleep(3 * timeout)
        after = texts(ask(server.client()))
        checks.check(f"{name}: idle for 3x the {timeout:g} s collective timeout, then the "
                     "same answers", after == before and server.health() == 200)
        second.wait_ready(args.ready_timeout_s)  # the figures below on a quiet machine
        checks.figures[name] = {"idle": idle_figures(server, args.idle_s),
                                "bench": bench(server, model, "keepalive-device", out, args)}
        checks.figures[name]["kill"] = kill_under_load(server, "keepalive", checks, name)
    except BaseException:
        if second is not None:
            second.stop()
        raise
    finally:
        server.stop()
    name = "keepalive TP=2, transport cpu"
    try:
        got = texts(ask(second.client()))
        checks.check(f"{name}: greedy answers equal mp's", got == mp_answers,
                     {"keepalive": got, "mp": mp_answers})
    finally:
        stopped(second, checks, name)
    checks.figures["skipped"] = ("async scheduling on/off (vLLM turns it off on CPU for every "
                                 "backend), GPU utilization (no GPU), mp's throughput and "
                                 "reaction (two start-ups at most in CPU mode)")


GPU_CONFIGS = [
    # name, backend, environment, extra vllm serve flags
    ("mp, async off", "mp", {}, ["--no-async-scheduling"]),
    ("mp, async on", "mp", {}, []),
    ("keepalive cpu group, async off", "keepalive", {}, []),
    ("keepalive cpu group, async on", "keepalive", {"VLLM_KEEPALIVE_ASYNC_SCHEDULING": "1"}, []),
    ("keepalive device group, async off", "keepalive", {"VLLM_KEEPALIVE_TRANSPORT": "device"},
     []),
    ("keepalive device group, async on", "keepalive",
     {"VLLM_KEEPALIVE_TRANSPORT": "device", "VLLM_KEEPALIVE_ASYNC_SCHEDULING": "1"}, []),
]


def run_gpu(model: str, out: Path, args: argparse.Namespace, checks: Checks) -> None:
    answers: dict[str, dict] = {}
    for name, backend, env, extra in GPU_CONFIGS:
        slug = name.replace(", ", "-").replace(" ", "-")
        server = start(model, out, slug, backend, args, extra, env)
        try:
            answers[name] = texts(ask(server.client()))
            if backend == "keepalive":
                on = "VLLM_KEEPALIVE_ASYNC_SCHEDULING" in env
                checks.check(f"{name}: the start-up line says async scheduling is "
                             f"{'on' if on else 'off'}",
                             f"async scheduling={'on' if on else 'off'}" in server.log())
            checks.figures[name] = {"bench": bench(server, model, slug, out, args),
                                    "idle": idle_figures(server, args.idle_s)}
        finally:
            stopped(server, checks, name)
        checks.check(f"{name}: greedy answers equal mp's (async off)",
                     answers[name] == answers["mp, async off"],
                     {"got": answers[name], "mp": answers["mp, async off"]})
    timeout = args.idle_timeout_s
    for transport, flag in (("device", "--distributed-timeout-seconds"),
                            ("cpu", "--cpu-distributed-timeout-seconds")):
        name = f"keepalive {transport} group, {timeout:g} s timeout"
        server = start(model, out, f"idle-{transport}", "keepalive", args, [flag, f"{timeout:g}"],
                       {"VLLM_KEEPALIVE_TRANSPORT": transport})
        try:
            before = texts(ask(server.client()))
            time.sleep(3 * timeout)
            after = texts(ask(server.client()))
            checks.check(f"{name}: idle for 3x the timeout, then the same answers",
                         after == before == answers["mp, async off"])
        finally:
            stopped(server, checks, name)
    for backend in ("keepalive", "mp"):
        server = start(model, out, f"kill-{backend}", backend, args)
        try:
            checks.figures[f"{backend}: rank 1 killed under load"] = kill_under_load(
                server, backend, checks, backend)
        finally:
            server.stop()


def report(checks: Checks, args: argparse.Namespace) -> str:
    lines = [f"# gpu_check ({'CPU' if args.cpu else 'GPU'} mode), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| configuration | output tok/s | median TPOT ms | idle GPU util % | "
             "idle CPU % by process |", "|---|---|---|---|---|"]
    for name, fig in checks.figures.items():
        if not isinstance(fig, dict) or "bench" not in fig:
            continue
        idle = fig.get("idle", {})
        cpu = ", ".join(f"{k} {v:g}" for k, v in idle.get("cpu_pct_by_process", {}).items())
        lines.append(f"| {name} | {fig['bench']['output_tok_s']} | "
                     f"{fig['bench']['median_tpot_ms']} | {idle.get('gpu_util_pct') or 'n/a'} "
                     f"| {cpu} |")
    failed = [c["check"] for c in checks.checks if not c["ok"]]
    lines += ["", f"{len(checks.checks) - len(failed)} of {len(checks.checks)} checks passed"
              + (": FAILED " + "; ".join(failed) if failed else "")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="the short CPU (gloo) mode")
    p.add_argument("--model", default=os.environ.get("MODEL"),
                   help="model to serve (default: the tiny local model)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "gpu_check")
    p.add_argument("--json", type=Path, help="write the checks and figures here")
    p.add_argument("--idle-timeout-s", type=float, default=None,
                   help="the short collective timeout of the idle check (CPU 5, GPU 30)")
    p.add_argument("--idle-s", type=float, default=None, help="rest window (CPU 3, GPU 20)")
    p.add_argument("--num-prompts", type=int, default=None, help="CPU 16, GPU 200")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=None, help="CPU 16, GPU 128")
    p.add_argument("--ready-timeout-s", type=float, default=600)
    p.add_argument("--refresh-reference", action="store_true",
                   help="CPU mode: run mp live and rewrite its cached answers")
    p.add_argument("serve_args", nargs="*", help="more vllm serve flags (after --)")
    args = p.parse_args(argv)
    cpu = args.cpu
    args.idle_timeout_s = args.idle_timeout_s or (5.0 if cpu else 30.0)
    args.idle_s = args.idle_s or (3.0 if cpu else 20.0)
    args.num_prompts = args.num_prompts or (16 if cpu else 200)
    args.output_len = args.output_len or (16 if cpu else 128)
    if not cpu:
        # CUDA graphs on, as users run (tests/servers.py starts eager servers)
        args.serve_args = ["--no-enforce-eager", "--dtype", "float16", *args.serve_args]
    else:  # the flags of the serving tests, whose cached mp answers the CPU mode compares with
        args.serve_args = [*LOAD_ARGS, *args.serve_args]
    if args.model is None:
        from tiny_model import build_tiny_model

        args.model = str(build_tiny_model())
    args.out.mkdir(parents=True, exist_ok=True)
    checks = Checks()
    try:
        (run_cpu if cpu else run_gpu)(args.model, args.out, args, checks)
    except Exception as e:  # noqa: BLE001 - reported as the failed check it is
        checks.check("the run completed", False, f"{type(e).__name__}: {e}")
    print(report(checks, args), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"checks": checks.checks, "figures": checks.figures},
                                        indent=1, default=str))
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
