"""Faults against a real `vllm serve` with the keepalive backend: every case ends within a
stated bound, with a clear message, and leaves no process, shm entry or port behind.

The bounds are generous against what we observed (docs/reliability.md has the figures);
each assertion fails on a hang, which is what these tests exist to catch.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from dp_scripts import stream_all as _stream_all
from procs import alive, left_after
from run_engine import HERE
from servers import Server, by_title

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.heavy]

DETECT_BOUND_S = 15.0  # worker death -> server gone (vLLM's own shutdown after unhealthy)
# Rank 1 raises inside a step -> the client's HTTP 500: README's 1.5 s. Observed 1.23 s, and
# 1.27 s with the machine's load at 16 (rank 1's own clean-up, then vLLM's error path); the
# old fixed 5 s grace took 5.46 s.
RAISE_BOUND_S = 1.5
CLIENT_BOUND_S = 30.0  # worker death mid-stream -> every client has an error or end of stream
# Worker SIGKILL with 8 streams -> every client has its error: README's 1.5 s (this module
# runs alone, marked serial). Observed 0.76 s (benchmarks/bench_faults.py); the old fixed 5 s
# grace took 5.2 s.
KILL_REACTION_BOUND_S = 1.5
WORKER_EXIT_BOUND_S = 10.0  # engine process death -> every worker gone
SHUTDOWN_BOUND_S = 30.0  # SIGTERM/SIGINT -> server exited


#: every server of this module runs with the fault-injecting worker and a 10 s step timeout
#: (which only the step-timeout test reaches: a step here takes milliseconds)
FAULT_ARGS = ["--worker-cls", "fault_injection.FaultyCPUWorker"]
FAULT_ENV = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "10"}
#: the servers of the pool below, one per test that ends its server
POOLED = ["kill-busy", "kill-engine-idle", "kill-engine-busy", "raise-in-step", "step-timeout"]
POOL_STARTS_AT_ONCE = 3


def fault_server(tiny_model: str, tmp_path: Path, name: str, *, timeout: str = "30",
                 extra_args: list[str] | None = None, extra_env: dict | None = None,
                 wait: bool = True) -> Server:
    fault_dir = tmp_path / f"faults-{name}"
    fault_dir.mkdir(parents=True, exist_ok=True)
    env = {"KEEPALIVE_FAULT_DIR": str(fault_dir),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           **FAULT_ENV}
    env.update(extra_env or {})
    server = Server(tiny_model, tmp_path / f"{name}.log",
                    extra_args=["--distributed-timeout-seconds", timeout, *FAULT_ARGS,
                                *(extra_args or [])],
                    extra_env=env)
    server.fault_dir = fault_dir
    if wait:
        server.wait_ready()
    return server


@pytest.fixture(scope="module")
def pool(tiny_model, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """The servers of the tests that end theirs, started before the first of them, a few at
    a time: a start-up measures nothing here and its collective timeout is 30 s, so starting
    them side by side only shares the CPU. Until its test they idle (each test then runs
    alone, its measured window on an otherwise quiet machine but for idle servers). Each
    test takes its own; whatever is left is stopped at the end."""
    from concurrent.futures import ThreadPoolExecutor

    tmp_path = tmp_path_factory.mktemp("faults")
    servers: dict[str, Server] = {}

    def start(name: str) -> None:
        servers[name] = fault_server(tiny_model, tmp_path, name, wait=False)
        servers[name].wait_ready()

    try:
        with ThreadPoolExecutor(POOL_STARTS_AT_ONCE) as starting:
            for f in [starting.submit(start, name) for name in POOLED]:
                f.result()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def wait_until(pred, bound: float, step: float = 0.05) -> float | None:
    """Seconds until ``pred()`` held, or None if it did not within ``bound``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def unhealthy(server: Server) -> bool:
    return server.proc.poll() is not None or server.health() != 200


def one_request(server: Server, max_tokens: int = 8) -> str:
    c = server.client()
    return c.completions.create(model="tiny", prompt="Hello, my name is",
                                max_tokens=max_tokens, temperature=0).choices[0].text


def test_worker_killed_with_8_streams_in_flight(pool):
    server = pool["kill-busy"]
    results: dict = {}
    try:
        tree = server.tree()
        threads = _stream_all(server, 8, results)
        time.sleep(1.5)
        assert not results, "streams ended before the fault"
        [worker] = by_title(server, "KeepaliveWorker_TP1")
        t_kill = time.monotonic()
        worker.kill()
        for t in threads:
            t.join(CLIENT_BOUND_S)
        assert len(results) == 8, f"clients still hanging: {8 - len(results)}"
        ends = [r[2] - t_kill for r in results.values()]
        assert max(ends) < KILL_REACTION_BOUND_S, ends
        # every client learns of the fault: an error, never a stream that just ends
        assert all(r[0] == "error" for r in results.values()), results
        server.proc.wait(DETECT_BOUND_S)
        assert "worker rank 1" in server.log()
    finally:
        server.stop()
    assert left_after(tree, 10) == []


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_engine_process_killed_workers_exit(pool, busy):
    server = pool["kill-engine-busy" if busy else "kill-engine-idle"]
    results: dict = {}
    try:
        [engine] = by_title(server, "EngineCore")
        [worker] = by_title(server, "KeepaliveWorker_TP1")
        if busy:
            _stream_all(server, 8, results)
            time.sleep(1.5)
        engine.kill()
        took = wait_until(lambda: not alive([worker]), WORKER_EXIT_BOUND_S)
        assert took is not None, "worker outlived the engine process"
        # it left by one of the two ways the docs name: its death pipe closed (exit code 2,
        # ORPHANED), or its broadcast wait saw the closed sockets first (code 1)
        assert wait_until(lambda: "parent process exited; exiting" in server.log()
                          or "keepalive worker rank 1 stops" in server.log(), 5), \
            server.log()[-3000:]
    finally:
        server.stop()


def test_api_server_sigterm_graceful_shutdown(tiny_model, tmp_path):
    """SIGTERM, as an orchestrator stops a server (uvicorn handles SIGINT the same way). Not
    from the pool: the shared-memory check compares /dev/shm before its start and after its
    end."""
    sig = signal.SIGTERM
    shm_before = set(os.listdir("/dev/shm"))
    # vLLM's default --shutdown-timeout 0 SIGKILLs the engine and its children at once (for
    # mp too), which leaves the CPU all-reduce's /dev/shm segments behind; a graceful
    # shutdown is the drain mode.
    server = fault_server(tiny_model, tmp_path, f"signal-{sig.name}",
                          extra_args=["--shutdown-timeout", "10"])
    one_request(server)
    tree = server.tree()
    port = server.port
    t0 = time.monotonic()
    server.proc.send_signal(sig)
    code = server.proc.wait(SHUTDOWN_BOUND_S)
    took = time.monotonic() - t0
    assert code == 0 and took < SHUTDOWN_BOUND_S
    # the resource tracker may take a moment after the server to notice its parent is gone
    assert left_after(tree, 10) == []
    server.stop()
    assert set(os.listdir("/dev/shm")) - shm_before == set()
    with socket.socket() as s:
        # the port is free again for a new server (SO_REUSEADDR, as uvicorn binds: the
        # closed client connections may sit in TIME_WAIT, which is not a leak)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    assert "keepalive executor shut down; worker exit codes {1: 0}" in server.log()


def test_worker_raises_inside_a_step(pool):
    server = pool["raise-in-step"]
    try:
        tree = server.tree()
        assert one_request(server)
        (server.fault_dir / "raise_rank1").write_text("1")
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError):  # HTTP 500: the engine is dead
            one_request(server)
        assert time.monotonic() - t0 < RAISE_BOUND_S
        assert wait_until(lambda: unhealthy(server), DETECT_BOUND_S) is not None
        log = server.log()
        assert "injected step failure on rank 1" in log and "worker rank 1" in log
    finally:
        server.stop()
    assert left_after(tree, 10) == []


def test_a_step_past_the_execute_timeout_fails_the_executor_clearly(pool):
    """VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, as vLLM's mp honours it: rank 1 stalls 60 s inside
    a step, the timeout is 10 s; the executor fails naming the step and the setting, and the
    client gets an error long before the stall would have ended. (10 s, not 3: the first step
    of a cold server on a loaded 2-core machine once took longer than 3 s in CI.)"""
    server = pool["step-timeout"]
    try:
        tree = server.tree()
        assert one_request(server)
        (server.fault_dir / "stall_rank1").write_text("60")
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError):  # HTTP 500: the engine is dead
            one_request(server)
        took = time.monotonic() - t0
        # the timeout plus the grace and vLLM's error path (0.54 s over at 3 s in
        # bench_faults); the stall itself is 60 s
        assert 10 <= took < 13, took
        log = server.log()
        assert ("execute_model did not return within 10s (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)"
                in log), log[-3000:]
        # every rank's stacks are in the log: rank 1's shows where it is stuck (the stall's
        # sleep in the fault injection), rank 0's where it waits (its collective)
        assert "outlived its timeout; every rank's Python stacks follow" in log
        assert f'fault_injection.py", line {_line_of("time.sleep(float(seconds))")} in ' \
               "execute_model" in log, log[-6000:]
        assert f'fault_injection.py", line {_line_of("out = super().execute_model(")} in ' \
               "execute_model" in log, log[-6000:]
    finally:
        server.stop()
    assert left_after(tree, 10) == []


def _line_of(code: str) -> int:
    """The (first) line of tests/fault_injection.py holding ``code``."""
    lines = (Path(__file__).parent / "fault_injection.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if code in line)
