"""AsyncLLMEngine embedding: concurrent streams, an abort mid-stream, idle past the
collective timeout, more requests, clean shutdown with no child process left."""

import pytest
from run_engine import run_script

# Not serial: its 5 s collective timeout bounds serving only (vLLM's start-up collectives
# run under the start-up timeout: startup_timeouts.py), and it asserts no time bound, so it
# runs beside another test; the keepalives' count during the idle holds under that load.

TIMEOUT_S = 5
IDLE_S = 10.0  # two 5 s timeouts: only the keepalive keeps the worker's wait alive


@pytest.mark.slow
@pytest.mark.parametrize("multiprocessing,transport", [
    ("1", "device"),
    pytest.param("0", "cpu", marks=pytest.mark.fast),  # in `scripts/test.sh --fast`
],
                         ids=["engine-core-process", "in-process-cpu-transport"])
def test_async_engine_streams_abort_idle_shutdown(tiny_model, multiprocessing, transport):
    """The second variant also runs the channel on the gloo CPU group
    (``VLLM_KEEPALIVE_TRANSPORT=cpu``), whose timeout is --cpu-distributed-timeout-seconds:
    the idle outlasts that one."""
    res = run_script("async_engine", model=tiny_model, idle_s=IDLE_S, timeout_s=TIMEOUT_S,
                     transport=transport,
                     extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing,
                                "VLLM_KEEPALIVE_TRANSPORT": transport})
    assert len(res["workers_running"]) == 1, res["workers_running"]  # rank 1's process
    assert all(len(t) == 16 for t in res["first"])
    assert 3 <= res["aborted_chunks"] < 200
    # the idle lasted 10 s at an interval of 1.25 s (timeout 5 s / 4): rank 1 received the
    # keepalives that kept its wait alive (without them it times out: test_serve's control)
    assert res["keepalives_during_idle"] >= IDLE_S / (TIMEOUT_S / 4) - 2, res
    # same greedy answers after the idle as before it
    assert res["second"] == res["first"]
    assert res["children_left"] == []
