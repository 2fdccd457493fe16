"""Faults against a real `vllm serve` with the keepalive backend: every case ends within a
stated bound, with a clear message, and leaves no process, shm entry or port behind.

The bounds are generous against what we observed (docs/reliability.md has the figures);
each assertion fails on a hang, which is what these tests exist to catch.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import openai
import psutil
import pytest
from procs import alive, left_after
from run_engine import HERE
from servers import Server, by_title

pytestmark = pytest.mark.slow

DETECT_BOUND_S = 15.0  # worker death -> server gone (vLLM's own shutdown after unhealthy)
# Worker SIGKILL while idle -> /health fails. Observed 0.16 s (the sentinel monitor fires at
# once); the bound leaves room for a loaded machine and fails on anything like a grace period
# or a health-check poll.
IDLE_DETECT_BOUND_S = 2.0
# Rank 1 raises inside a step -> the client's HTTP 500. Observed 1.23 s; the old fixed 5 s
# grace took 5.46 s, which this bound fails.
RAISE_BOUND_S = 4.0
CLIENT_BOUND_S = 30.0  # worker death mid-stream -> every client has an error or end of stream
# Worker SIGKILL with 8 streams -> every client has its error. The target is 1.5 s (measured
# in benchmarks/bench_faults.py); this bound leaves room for a loaded machine and still fails
# on the old fixed 5 s grace (5.2 s measured then).
KILL_REACTION_BOUND_S = 4.0
WORKER_EXIT_BOUND_S = 10.0  # engine process death -> every worker gone
SHUTDOWN_BOUND_S = 30.0  # SIGTERM/SIGINT -> server exited


def fault_server(tiny_model: str, tmp_path: Path, name: str, *, timeout: str = "30",
                 extra_args: list[str] | None = None, extra_env: dict | None = None) -> Server:
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir(parents=True, exist_ok=True)
    env = {"KEEPALIVE_FAULT_DIR": str(fault_dir),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.update(extra_env or {})
    server = Server(tiny_model, tmp_path / f"{name}.log",
                    extra_args=["--distributed-timeout-seconds", timeout, *(extra_args or [])],
                    extra_env=env)
    server.fault_dir = fault_dir
    server.wait_ready()
    return server


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


def test_worker_killed_while_idle(tiny_model, tmp_path):
    server = fault_server(tiny_model, tmp_path, "kill-idle")
    try:
        one_request(server)
        tree = server.tree()
        # security: nothing of the tree listens beyond loopback
        for p in tree:
            for conn in p.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    assert conn.laddr.ip in ("127.0.0.1", "::1"), (p.name(), conn)
        [worker] = by_title(server, "KeepaliveWorker_TP1")
        worker.kill()
        took = wait_until(lambda: unhealthy(server), IDLE_DETECT_BOUND_S)
        assert took is not None, f"server still healthy {IDLE_DETECT_BOUND_S}s after a " \
            "worker died"
        # vLLM's API server then shuts itself down (with exit code 0, as it does for mp)
        server.proc.wait(DETECT_BOUND_S)
        assert "worker rank 1" in server.log() and "died unexpectedly" in server.log()
    finally:
        server.stop()
    assert left_after(tree, 10) == []


def _stream_all(server: Server, n: int, results: dict) -> list[threading.Thread]:
    """``results[i]``: ("finished", the stream's last finish_reason, t) or ("error", the
    error, t). The front end merges tokens into fewer chunks, so chunk counts say nothing
    about completeness; the finish_reason does."""
    def run(i: int) -> None:
        try:
            finish = None
            for chunk in server.client().completions.create(
                    model="tiny", prompt="Hello", max_tokens=200, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].finish_reason is not None:
                    finish = chunk.choices[0].finish_reason
            results[i] = ("finished", finish, time.monotonic())
        except Exception as e:  # noqa: BLE001 - an error is the expected end under a fault
            results[i] = ("error", f"{type(e).__name__}: {e}", time.monotonic())

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_worker_killed_with_8_streams_in_flight(tiny_model, tmp_path):
    server = fault_server(tiny_model, tmp_path, "kill-busy")
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
def test_engine_process_killed_workers_exit(tiny_model, tmp_path, busy):
    server = fault_server(tiny_model, tmp_path, f"kill-engine-{busy}")
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
    """SIGTERM, as an orchestrator stops a server (uvicorn handles SIGINT the same way)."""
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


def test_worker_raises_inside_a_step(tiny_model, tmp_path):
    server = fault_server(tiny_model, tmp_path, "raise-in-step",
                          extra_args=["--worker-cls", "fault_injection.FaultyCPUWorker"])
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


STALL_TIMEOUT = "6"
STALL_S = "15"  # 2.5 times the collective timeout, in the engine loop, outside any step


def test_engine_loop_stall_outside_a_step_survives_and_negative_control_fails(tiny_model,
                                                                              tmp_path):
    """The engine loop stalls 2.5 collective timeouts outside any step (a slow scheduler):
    with the pacer the next request gets its answer; without it (negative control, the same
    scenario side by side) the workers' wait times out and the request fails."""
    args = ["--scheduler-cls", "fault_injection.StallingScheduler"]
    servers = {}
    try:
        # one after the other: a cold start beside another can starve a rank past the short
        # timeout inside vLLM's own start-up collectives, which is not the subject here
        for pacer in (True, False):
            env = {} if pacer else {"_KEEPALIVE_EXECUTOR_TEST_ONLY_DISABLE_PACER": "1"}
            servers[pacer] = fault_server(tiny_model, tmp_path / f"stall-{pacer}",
                                          f"stall-{pacer}", timeout=STALL_TIMEOUT,
                                          extra_args=args, extra_env=env)
        keep, control = servers[True], servers[False]
        first = one_request(keep)
        # (no warm-up request on the control: without the pacer its worker may time out first)
        for server in (keep, control):
            (server.fault_dir / "stall_schedule").write_text(STALL_S)
        answers: dict = {}

        def ask(name: str, server: Server) -> None:
            try:
                answers[name] = one_request(server)
            except Exception as e:  # noqa: BLE001 - the control's expected outcome
                answers[name] = e

        threads = [threading.Thread(target=ask, args=item) for item in
                   (("keepalive", keep), ("control", control))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert answers["keepalive"] == first  # arrived after the stall, same answer
        assert keep.health() == 200
        assert isinstance(answers["control"], Exception), answers
        assert "Timed out" in control.log()
    finally:
        for server in servers.values():
            server.stop()


def test_a_step_past_the_execute_timeout_fails_the_executor_clearly(tiny_model, tmp_path):
    """VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, as vLLM's mp honours it: rank 1 stalls 60 s inside
    a step, the timeout is 10 s; the executor fails naming the step and the setting, and the
    client gets an error long before the stall would have ended. (10 s, not 3: the first step
    of a cold server on a loaded 2-core machine once took longer than 3 s in CI.)"""
    server = fault_server(tiny_model, tmp_path, "step-timeout",
                          extra_args=["--worker-cls", "fault_injection.FaultyCPUWorker"],
                          extra_env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "10"})
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
    finally:
        server.stop()
    assert left_after(tree, 10) == []
