"""Data parallelism through `vllm serve -dp N -tp M`: what the DP tests do to a server, and
the same as a reference scenario (vLLM's ``mp`` at the same -dp/-tp, cached in
tests/references/ by scripts/make_references.py, see run_engine.Reference).

``python dp_scripts.py NAME JSON_KWARGS`` prints ``RESULT <json>``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve_scripts import LOAD_ARGS, run_wave, workload  # noqa: E402
from servers import Server  # noqa: E402
from tiny_moe import build_tiny_moe  # noqa: E402

#: the requests of one wave: the first 48 of serve_scripts.workload() that are not aborted
WAVE = 48
#: streams sent when a rank of replica 1 is killed, and their length
KILLED_STREAMS = 8
STREAM_TOKENS = 200
#: how long the server may take to go after that kill before the scenario calls it alive.
#: mp's answer is a cached reference, and a wait it outlives would be cached as "alive" (every
#: later comparison on that CPU then fails): mp took 2 s on an AVX2 EPYC, 12 s on an AVX-512
#: EPYC and 12-18 s on an Intel Xeon with AMX (its shared-memory all-reduce spins), alone or
#: beside the 0.34 tier and server start-ups; keepalive about 6 s there (its own bound is
#: test_data_parallel.EXIT_BOUND_S). The wait ends when the server does.
EXIT_WAIT_S = 60.0


def dp_server(model: str, log_path: Path, backend: str, dp: int, tp: int, fault_dir: Path,
              extra_args: list[str] | None = None, extra_env: dict | None = None,
              moe: bool = False) -> Server:
    """`vllm serve -dp DP -tp TP` of the tiny model (float32, LOAD_ARGS), one CPU entry per
    rank of every replica (vLLM gives replica i the entries i*TP .. i*TP+TP-1). One API
    server (vLLM's default is one per replica; with several, streams reach the client in
    late bursts on 2 CPUs). Every rank runs fault_injection.FaultyCPUWorker with FAULT_DIR
    (see :func:`kill_replica_rank`).

    MOE: the tiny Mixtral (tests/tiny_moe.py, built beside MODEL) instead, whose replicas vLLM
    runs in one torch world with collectives between them, and tests/cpu_moe_dp on the
    PYTHONPATH: the gather/scatter vLLM 0.32's CPU communicator lacks for it."""
    bind = "|".join(("0", "1")[r % 2] for r in range(dp * tp))
    args = ["-dp", str(dp), "--api-server-count", "1", *LOAD_ARGS,
            "--worker-cls", "fault_injection.FaultyCPUWorker", *(extra_args or [])]
    fault_dir.mkdir(parents=True, exist_ok=True)
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "KEEPALIVE_FAULT_DIR": str(fault_dir),
           "PYTHONPATH": os.pathsep.join([*([str(HERE / "cpu_moe_dp")] if moe else []),
                                         str(HERE), os.environ.get("PYTHONPATH", "")]),
           **(extra_env or {})}
    if tp == 1:  # Server passes the backend only when a replica has several ranks
        args += ["--distributed-executor-backend", backend]
    if moe:
        model = str(build_tiny_moe(Path(model).parent / "tiny-mixtral", tokenizer_from=model))
    return Server(model, log_path, tp=tp, backend=backend, extra_args=args, extra_env=env)


def wave_requests(n: int = WAVE) -> list[dict]:
    return [r for r in workload() if not r["abort"]][:n]


def wave(server: Server, n: int = WAVE) -> dict[str, str]:
    """The texts of the first N non-aborted workload requests, streamed 32 at a time."""
    done = asyncio.run(run_wave(server.base_url, wave_requests(n)))
    return {str(i): text for i, text in sorted(done.items())}


def requests_per_engine(server: Server) -> dict[str, float]:
    """``vllm:request_success_total`` summed per engine label, from /metrics (every API
    server reports every engine's counts)."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="([^"]*)"', line)
            if engine:
                counts[engine.group(1)] = counts.get(engine.group(1), 0.0) + float(
                    line.rsplit(" ", 1)[1])
    return counts


def replica_rank(server: Server, replica: int, title: str) -> Any:
    """The process titled TITLE whose parent is replica REPLICA's engine core."""
    found = []
    for p in server.tree():
        try:
            if title in p.name() and f"EngineCore_DP{replica}" in p.parent().name():
                found.append(p)
        except Exception:  # noqa: BLE001 - a process that went meanwhile
            pass
    assert len(found) == 1, (replica, title, [p.name() for p in server.tree()])
    return found[0]


def stream_all(server: Server, n: int, results: dict,
               replica: int | None = None) -> list[threading.Thread]:
    """N streams of STREAM_TOKENS tokens (to replica REPLICA if given: vLLM's
    X-data-parallel-rank header); ``results[i]``: ("finished", the stream's last
    finish_reason, t) or ("error", the error, t). The front end merges tokens into fewer
    chunks, so chunk counts say nothing about completeness; the finish_reason does. (Also
    tests/test_faults.py's and test_pipeline.py's.)"""
    headers = {} if replica is None else {"X-data-parallel-rank": str(replica)}

    def run(i: int) -> None:
        try:
            finish = None
            for chunk in server.client().completions.create(
                    model="tiny", prompt="Hello", max_tokens=STREAM_TOKENS, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}, extra_headers=headers):
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    finish = chunk.choices[0].finish_reason
            results[i] = ("finished", finish, time.monotonic())
        except Exception as e:  # noqa: BLE001 - an error is the expected end under a fault
            results[i] = ("error", f"{type(e).__name__}: {e}", time.monotonic())

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def kill_replica_rank(server: Server, title: str, fault_dir: Path, replica: int = 1) -> dict:
    """Replica REPLICA's rank titled TITLE SIGKILLed inside the first step of KILLED_STREAMS
    streams sent to that replica (its rank 0 kills it: fault_injection's kill_pid, armed
    before the streams start, so the kill cannot miss them); what followed: how each client's
    stream ended, whether the server exited (within EXIT_WAIT_S) and its exit code, and the
    seconds from the streams' start to the last client's end and to the exit. (Streams on
    the other replica would be a race: under mp they may finish before the server ends.)"""
    victim = replica_rank(server, replica, title)
    (fault_dir / "kill_pid").write_text(str(victim.pid))
    results: dict = {}
    t0 = time.monotonic()
    threads = stream_all(server, KILLED_STREAMS, results, replica)
    for t in threads:
        t.join(EXIT_WAIT_S)
    try:
        server.proc.wait(EXIT_WAIT_S)
    except Exception:  # noqa: BLE001 - still running: recorded below
        pass
    exited_at = time.monotonic() if server.proc.poll() is not None else None
    assert not (fault_dir / "kill_pid").exists(), "the kill never fired"
    return {
        "clients": sorted({r[0] for r in results.values()}) if len(results) == KILLED_STREAMS
        else ["some client never ended"],
        "server_exited": server.proc.poll() is not None,
        "exit_code": server.proc.poll(),
        "last_client_s": max((r[2] for r in results.values()), default=t0) - t0,
        "exit_s": None if exited_at is None else exited_at - t0,
    }


#: the rank-1 process of a replica, by backend (mp names it as for DP=1: vLLM runs the
#: replicas of a dense model as independent engines)
RANK1_TITLE = {"mp": "Worker_TP1", "keepalive": "KeepaliveWorker_TP1"}


def dp_serve(model: str, backend: str, workdir: str, dp: int = 2, tp: int = 2,
             moe: bool = False) -> dict:
    """The reference scenario: a wave's answers, which engines served it, and (TP > 1, a
    dense model) what killing replica 1's rank 1 under load does to the server.
    Deterministic parts only: the timings are returned under "timings" and not compared."""
    work = Path(workdir)
    server = dp_server(model, work / f"dp{dp}-tp{tp}-{backend}{'-moe' * moe}.log", backend,
                       dp, tp, work / "dp-faults", moe=moe)
    try:
        server.wait_ready()
        out: dict = {"answers": wave(server),
                     "engines_served": sorted(e for e, n in requests_per_engine(server).items()
                                              if n > 0)}
        if tp > 1 and not moe:
            killed = kill_replica_rank(server, RANK1_TITLE[backend], work / "dp-faults")
            out["timings"] = {k: killed.pop(k) for k in ("last_client_s", "exit_s")}
            out["kill_replica1_rank1"] = killed
    finally:
        server.stop()
    assert not server.leftovers, f"left {server.leftovers}"
    return out


if __name__ == "__main__":
    name, kwargs = sys.argv[1], json.loads(sys.argv[2])
    out = globals()[name](**kwargs)
    print("RESULT " + json.dumps(out), flush=True)
