"""AsyncLLMEngine embedding: concurrent streams, an abort mid-stream, idle past the
collective timeout, more requests, clean shutdown with no child process left."""

import pytest
from run_engine import run_script

TIMEOUT_S = 5
IDLE_S = 12.0  # well past the 5 s timeout: only the keepalive keeps the worker's wait alive


@pytest.mark.slow
@pytest.mark.parametrize("multiprocessing", ["1", "0"], ids=["engine-core-process", "in-process"])
def test_async_engine_streams_abort_idle_shutdown(tiny_model, multiprocessing):
    res = run_script("async_engine", model=tiny_model, idle_s=IDLE_S, timeout_s=TIMEOUT_S,
                     extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing})
    assert res["children_running"] >= 1  # the worker (and the engine core, when separate)
    assert all(len(t) == 16 for t in res["first"])
    assert 3 <= res["aborted_chunks"] < 200
    assert res["idle_s"] >= IDLE_S
    # same greedy answers after the idle as before it
    assert res["second"] == res["first"]
    assert res["children_left"] == []
