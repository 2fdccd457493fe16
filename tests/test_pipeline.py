"""Pipeline parallelism through `vllm serve`: streaming answers equal mp's, an idle period
several times the collective timeout, the last stage killed under load. (Offline PP, and
TP x PP on four ranks: tests/test_parity.py. torchrun with one stage per node:
tests/test_torchrun.py.)"""

from __future__ import annotations

import threading
import time

import pytest
from procs import left_after
from run_engine import PYTHONPATH
from servers import Server, by_title
from test_faults import KILL_REACTION_BOUND_S, _stream_all
from test_serve import ask, texts

pytestmark = pytest.mark.slow
TIMEOUT = "5"
IDLE_S = 16.0  # more than three times the timeout
# vLLM 0.32's mp cannot run PP in eager mode on CPU; mode 2 with the eager backend it can
MP_PP_ARGS = ["--no-enforce-eager", "--compilation-config", '{"mode": 2, "backend": "eager"}']


def _start(tiny_model, tmp_path, backend, extra_args, extra_env=None, name=None) -> Server:
    # mp gets vLLM's default collective timeout: its workers' rendezvous waits at most that
    # long, and a cold start beside another server takes more than 5 s here
    timeout = ["--distributed-timeout-seconds", TIMEOUT] if backend == "keepalive" else []
    name = name or backend
    faults = tmp_path / f"faults-{name}"
    faults.mkdir(exist_ok=True)
    server = Server(tiny_model, tmp_path / f"pp-{name}.log", tp=1, pp=2, backend=backend,
                    extra_args=["--dtype", "float32", "--worker-cls",
                                "fault_injection.FaultyCPUWorker", *timeout, *extra_args],
                    extra_env={"KEEPALIVE_FAULT_DIR": str(faults), "PYTHONPATH": PYTHONPATH,
                               **(extra_env or {})})
    server.fault_dir = faults
    return server


def test_pp_serve_answers_like_mp_survives_idle_and_fails_fast_when_the_last_stage_dies(
        tiny_model, tmp_path):
    """Also the negative control: a second keepalive server with the pacer disabled by the
    test-only switch idles side by side with the first, and its pipeline dies."""
    servers = {"keepalive": _start(tiny_model, tmp_path, "keepalive", []),
               "mp": _start(tiny_model, tmp_path, "mp", MP_PP_ARGS)}
    threads = [threading.Thread(target=s.wait_ready) for s in servers.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ka = servers["keepalive"]
    results: dict = {}
    try:
        answers = {b: ask(s.client()) for b, s in servers.items()}
        servers["mp"].stop()
        assert texts(answers["keepalive"]) == texts(answers["mp"])
        assert answers["keepalive"]["stream_chunks"] > 1
        tree = ka.tree()
        assert by_title(ka, "KeepaliveWorker_PP1_TP0"), [p.name() for p in tree]
        control = servers["control"] = _start(
            tiny_model, tmp_path, "keepalive", [], name="control",
            extra_env={"_KEEPALIVE_EXECUTOR_TEST_ONLY_DISABLE_PACER": "1"})
        try:
            control.wait_ready()
        except AssertionError:
            pass  # without the pacer the idle ranks may time out during start-up already
        tree += control.tree()
        time.sleep(IDLE_S)
        assert ka.health() == 200
        assert texts(ask(ka.client())) == texts(answers["keepalive"])
        control_failed = control.proc.poll() is not None or control.health() != 200
        if not control_failed:
            try:
                ask(control.client())
            except Exception:  # noqa: BLE001 - any failure of the request is the outcome
                control_failed = True
        assert control_failed and "Timed out" in control.log()
        control.stop()
        # the last stage (vLLM's output rank) dies inside a step while 8 streams run: rank 0
        # SIGKILLs it at its next execute_model (fault_injection's kill_pid)
        [last] = by_title(ka, "KeepaliveWorker_PP1_TP0")
        (ka.fault_dir / "kill_pid").write_text(str(last.pid))
        t0 = time.monotonic()
        threads = _stream_all(ka, 8, results)
        for t in threads:
            t.join(30)
        ends = [r[2] - t0 for r in results.values()]
        assert len(results) == 8 and max(ends) < KILL_REACTION_BOUND_S, (results, ends)
        assert all(r[0] == "error" or r[1] < 200 for r in results.values()), results
        assert not last.is_running() or last.status() == "zombie"
        # whichever noticed first names rank 1: its process sentinel, or the output link
        log = ka.log()
        assert "keepalive executor failed" in log
        assert ("worker rank 1" in log and "died unexpectedly" in log) or (
            "from rank 1 (the last pipeline stage) did not arrive" in log), log[-3000:]
    finally:
        for s in servers.values():
            s.stop()
    assert left_after(tree, 10) == []
