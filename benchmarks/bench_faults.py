"""Fault scenarios against `vllm serve`, keepalive and mp side by side, with the times
measured: the figures of docs/reliability.md. (The pass/fail versions with bounds are
tests/test_faults.py; this script only measures.)

    python benchmarks/bench_faults.py [--backends keepalive mp] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "scripts"))

import psutil  # noqa: E402
from procs import alive, left_after  # noqa: E402
from run_engine import run_script  # noqa: E402
from servers import Server  # noqa: E402

WORKER_TITLE = {"keepalive": "KeepaliveWorker_TP1", "mp": "Worker_TP1"}


def start(model: str, backend: str, name: str, out: Path, extra: list[str] | None = None,
          extra_env: dict | None = None, wrapper: list[str] | None = None) -> Server:
    fault_dir = out / f"faults-{backend}-{name}"
    fault_dir.mkdir(parents=True, exist_ok=True)
    env = {"KEEPALIVE_FAULT_DIR": str(fault_dir),
           "PYTHONPATH": os.pathsep.join([str(HERE.parent / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    env.update(extra_env or {})
    s = Server(model, out / f"fault-{backend}-{name}.log", backend=backend,
               extra_args=["--distributed-timeout-seconds", "30", *(extra or [])],
               extra_env=env, wrapper=wrapper)
    s.fault_dir = fault_dir
    s.wait_ready()
    return s


def until(pred, bound: float = 60.0) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        if pred():
            return round(time.monotonic() - t0, 2)
        time.sleep(0.05)
    return None


def unhealthy(s: Server) -> bool:
    return s.proc.poll() is not None or s.health() != 200


def proc(s: Server, title: str) -> psutil.Process:
    return next(p for p in s.tree() if title in p.name())


def streams(s: Server, n: int, ends: dict) -> None:
    def run(i: int) -> None:
        try:
            for _ in s.client().completions.create(
                    model="tiny", prompt="Hello", max_tokens=200, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}):
                pass
            ends[i] = ("finished", time.monotonic())
        except Exception as e:  # noqa: BLE001
            ends[i] = (type(e).__name__, time.monotonic())

    for i in range(n):
        threading.Thread(target=run, args=(i,), daemon=True).start()


def finish(s: Server, tree: list[psutil.Process]) -> dict:
    exit_s = until(lambda: s.proc.poll() is not None, 60)
    code = s.proc.poll()
    s.stop()
    time.sleep(10)
    return {"server_exit_s": exit_s, "exit_code": code, "left_after_10s": len(alive(tree))}


def kill_worker(model: str, backend: str, out: Path, busy: bool) -> dict:
    s = start(model, backend, f"kill-worker-{'busy' if busy else 'idle'}", out)
    return kill_worker_of(s, backend, busy)


def kill_worker_of(s: Server, backend: str, busy: bool) -> dict:
    """SIGKILL rank 1's worker of the running server ``s`` (under 8 streams if ``busy``);
    how long until the server is unhealthy, the clients ended, it exited; what was left."""
    tree = s.tree()
    ends: dict = {}
    if busy:
        streams(s, 8, ends)
        time.sleep(1.5)
    t0 = time.monotonic()
    proc(s, WORKER_TITLE[backend]).kill()
    r: dict[str, Any] = {"unhealthy_s": until(lambda: unhealthy(s))}
    if busy:
        until(lambda: len(ends) == 8, 120)
        r["clients_ended_s"] = round(max(t for _, t in ends.values()) - t0, 2) if ends else None
        r["client_outcomes"] = sorted({k for k, _ in ends.values()})
    r.update(finish(s, tree))
    log = s.log()
    r["log_names_rank"] = "rank 1" in log or "Worker_TP1" in log
    return r


def kill_engine(model: str, backend: str, out: Path, busy: bool) -> dict:
    s = start(model, backend, f"kill-engine-{'busy' if busy else 'idle'}", out)
    tree = s.tree()
    if busy:
        streams(s, 8, {})
        time.sleep(1.5)
    workers = [p for p in tree if "Worker" in p.name()]
    proc(s, "EngineCore").kill()
    r = {"workers_gone_s": until(lambda: not alive(workers))}
    r.update(finish(s, tree))
    return r


def kill_api_server(model: str, backend: str, out: Path) -> dict:
    """SIGKILL of the API server (the OOM killer, `kill -9`), under a child subreaper
    (tests/subreaper.py, as systemd is one) that reaps whatever is left to it: how long
    until the engine process and the workers are gone (None: still there 30 s later), and
    the engine's exit status."""
    status = out / f"api-kill-{backend}.status"
    status.unlink(missing_ok=True)
    s = start(model, backend, "kill-api", out,
              wrapper=[sys.executable, str(HERE.parent / "tests" / "subreaper.py"),
                       str(status), "--"])
    [api] = psutil.Process(s.proc.pid).children()
    rest = api.children(recursive=True)
    engine = next(p for p in rest if "EngineCore" in p.name())
    t0 = time.time()
    api.kill()
    gone = until(lambda: not alive(rest), 30)
    r: dict[str, Any] = {"engine_and_workers_gone_s": gone,
                         "left_after_30s": len(alive(rest)) if gone is None else 0}
    r["left_after_30s_names"] = sorted(n.split(" ", 1)[1] for n in alive(rest))
    for p in rest:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    s.proc.wait(30)
    ended = {json.loads(x)["pid"]: json.loads(x) for x in status.read_text().splitlines()}
    e = ended.get(engine.pid, {})
    r["engine_exit"] = e.get("code") if e.get("signal") is None else -e["signal"]
    r["engine_exit_s"] = round(e["at"] - t0, 2) if e else None
    s.stop()
    return r


def sigterm(model: str, backend: str, out: Path, drain_s: int = 0) -> dict:
    shm = set(os.listdir("/dev/shm"))
    s = start(model, backend, f"sigterm-{drain_s}", out, ["--shutdown-timeout", str(drain_s)])
    s.client().completions.create(model="tiny", prompt="Hi", max_tokens=4)
    tree = s.tree()
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(120)
    r = {"exit_s": round(time.monotonic() - t0, 2), "exit_code": s.proc.returncode}
    s.stop()
    r["left_after_2s"] = len(left_after(tree, 2))  # multiprocessing's resource tracker lags
    r["new_shm_entries"] = sorted(set(os.listdir("/dev/shm")) - shm)
    return r


def armed_request(s: Server, fault: str, content: str = "1") -> dict[str, Any]:
    """Arm ``fault`` (fault_injection), send one request: its outcome and how long it took."""
    (s.fault_dir / fault).write_text(content)
    t0 = time.monotonic()
    try:
        s.client().completions.create(model="tiny", prompt="Hi", max_tokens=4)
        outcome = "answered"
    except Exception as e:  # noqa: BLE001
        outcome = type(e).__name__
    return {"client_error_s": round(time.monotonic() - t0, 2), "outcome": outcome}


def raise_in_step(model: str, backend: str, out: Path, rank: int = 1) -> dict:
    """Rank ``rank`` raises inside a step (rank 0: after the other ranks received it)."""
    s = start(model, backend, f"raise{rank}", out,
              ["--worker-cls", "fault_injection.FaultyCPUWorker"])
    tree = s.tree()
    r = armed_request(s, f"raise_rank{rank}")
    r["unhealthy_s"] = until(lambda: unhealthy(s))
    r.update(finish(s, tree))
    return r


def step_timeout(model: str, backend: str, out: Path) -> dict:
    """Rank 1 stalls 30 s inside a step; VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=3."""
    s = start(model, backend, "timeout", out, ["--worker-cls", "fault_injection.FaultyCPUWorker"],
              extra_env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3"})
    tree = s.tree()
    s.client().completions.create(model="tiny", prompt="Hi", max_tokens=4)
    r = armed_request(s, "stall_rank1", "30")
    r.update(finish(s, tree))
    r["log_names_timeout"] = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" in s.log()
    return r


def _script(name: str, backend: str, out: Path, **kw: Any) -> dict:
    fault_dir = out / f"faults-{backend}-{name}"
    fault_dir.mkdir(parents=True, exist_ok=True)
    for f in fault_dir.iterdir():
        f.unlink()
    t0 = time.monotonic()
    try:
        res = run_script(name, timeout=300, backend=backend, fault_dir=str(fault_dir), **kw,
                         extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                    "KEEPALIVE_FAULT_DIR": str(fault_dir),
                                    "PYTHONPATH": os.pathsep.join([str(HERE.parent / "tests"),
                                                                   os.environ.get("PYTHONPATH",
                                                                                  "")])})
    except Exception as e:  # noqa: BLE001 - a hang (timeout) or a crash is the figure
        first = str(e).splitlines()[0][:200] if str(e) else repr(e)
        return {"failed": first, "wall_s": round(time.monotonic() - t0, 1)}
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}


def inprocess_holes(model: str, backend: str, out: Path) -> dict:
    """In the user's process: an undecodable collective_rpc argument, collective_rpc from a
    second thread during generation, rank 0 raising in a step, shutdown after that."""
    return _script("inprocess_holes", backend, out, model=model)


def inprocess_kill(model: str, backend: str, out: Path) -> dict:
    """In the user's process: rank 1 SIGKILLed inside a step."""
    return _script("inprocess_rank_killed", backend, out, model=model)


def inprocess_rpc_errors(model: str, backend: str, out: Path) -> dict:
    """In the user's process: a __main__ function by collective_rpc, an error on every rank,
    rank 0 raising before a collective the others entered (issue 14 items 9 and 2)."""
    return _script("inprocess_rpc_errors", backend, out, model=model)


def startup_death(model: str, backend: str, out: Path) -> dict:
    """Rank 1 exits (code 3) after it was constructed, before the rendezvous (item 3)."""
    stamp = out / f"death-{backend}"
    t0 = time.monotonic()
    try:
        res = run_script("startup_death", timeout=300, backend=backend, model=model,
                         stamp=str(stamp), extra_env={
                             "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                             "KEEPALIVE_DIE_BEFORE_RENDEZVOUS": "3",
                             "KEEPALIVE_DEATH_STAMP": str(stamp),
                             "PYTHONPATH": os.pathsep.join([str(HERE.parent / "tests"),
                                                            os.environ.get("PYTHONPATH", "")])})
    except Exception as e:  # noqa: BLE001 - a hang (timeout) or a crash is the figure
        return {"failed": str(e).splitlines()[0][:200], "wall_s": round(time.monotonic() - t0, 1)}
    res["error"] = res.get("error", "")[:300]
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}


def torchrun_frozen_rank(model: str, backend: str, out: Path) -> dict:
    """torchrun mode (keepalive only): rank 1 SIGSTOPped, so no socket closes."""
    if backend != "keepalive":
        return {"n/a": "mp has no torchrun mode"}
    from servers import TorchrunServer

    s = TorchrunServer(model, out, log_prefix="fault-torchrun-frozen",
                       extra_args=["--distributed-timeout-seconds", "30"])
    try:
        s.wait_ready()
        s.client().completions.create(model="tiny", prompt="Hi", max_tokens=4)
        rank1 = proc(s, "KeepaliveWorker_TP1")
        t0 = time.monotonic()
        rank1.suspend()
        r: dict[str, Any] = {"unhealthy_s": until(lambda: s.health() != 200, 60)}
        r["clients_s"] = round(time.monotonic() - t0, 2)
        r["log_names_heartbeat"] = "sent no heartbeat" in s.log()
        rank1.kill()
    finally:
        code = s.stop()
    r["exit_code"] = code
    r["left"] = len(s.leftovers)
    return r


SCENARIOS = {
    "worker SIGKILL, idle": lambda m, b, o: kill_worker(m, b, o, False),
    "worker SIGKILL, 8 streams": lambda m, b, o: kill_worker(m, b, o, True),
    "engine SIGKILL, idle": lambda m, b, o: kill_engine(m, b, o, False),
    "engine SIGKILL, 8 streams": lambda m, b, o: kill_engine(m, b, o, True),
    "API server SIGKILL": kill_api_server,
    "API server SIGTERM": sigterm,
    "API server SIGTERM, drain 10 s": lambda m, b, o: sigterm(m, b, o, 10),
    "rank 1 raises in a step": raise_in_step,
    "rank 0 raises in a step": lambda m, b, o: raise_in_step(m, b, o, rank=0),
    "step past execute timeout 3 s": step_timeout,
    "in-process: 4 holes": inprocess_holes,
    "in-process: rank killed mid-step": inprocess_kill,
    "torchrun: rank 1 frozen": torchrun_frozen_rank,
    "in-process: rpc errors": inprocess_rpc_errors,
    "start-up: rank 1 dies": startup_death,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=["keepalive", "mp"])
    ap.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="run these scenarios")
    ap.add_argument("--json", default=str(HERE / "results" / "faults.json"))
    args = ap.parse_args()
    from tiny_model import build_tiny_model

    model = str(build_tiny_model())
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  {os.uname().machine} "
          f"nproc={os.cpu_count()}  command: python {' '.join(sys.argv)}")
    results: dict[str, dict[str, Any]] = {}
    for name, fn in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        for backend in args.backends:
            try:
                r = fn(model, backend, out)
            except Exception as e:  # noqa: BLE001 - report, go on
                r = {"error": repr(e)}
            results.setdefault(name, {})[backend] = r
            print(f"{name:28s} {backend:10s} {json.dumps(r)}", flush=True)
    Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
