"""The reply gather (keepalive_executor/rpc.py) with real processes on a real gloo group."""

from types import SimpleNamespace

import pytest

from keepalive_executor import rpc, startup_timeouts


# serial: a short collective timeout, alone on the machine (see pyproject.toml)
@pytest.mark.serial
def test_a_reply_gather_whose_ranks_finish_further_apart_than_the_cpu_timeout_names_the_flag(
        ranks):
    """Every collective_rpc ends in a reply gather on the CPU group, bounded by that group's
    timeout (--cpu-distributed-timeout-seconds), not by the call's own: ranks that finish a
    call (loading, warm-up) further apart than it fail the call (issue 28, edge 7; the
    executor is then failed, docs/usage.md). The error must say which setting ran out and
    how to fix it. Control: the same ranks 0.2 s apart gather fine."""
    res = ranks("late_reply_gather", 3, timeout_s=1.0, wall_s=90, late_s=2.5)
    assert res[0]["error_type"] == "ReplyGatherError", res[0]
    assert "timed out" in res[0]["error"].lower(), res[0]["error"]
    assert "--cpu-distributed-timeout-seconds" in res[0]["error"], res[0]["error"]
    control = ranks("late_reply_gather", 3, timeout_s=1.0, wall_s=90, late_s=0.2)
    assert control[0]["values"] == [0, 1, 2], control
    # rank 0's own window (the call's timeout, steps.py) running out first is not the CPU
    # group's: raised as the transport's error, for the step to name the call's timeout
    window = ranks("late_reply_gather", 2, timeout_s=10.0, wall_s=90, late_s=2.0,
                   rpc_timeout_s=0.5)
    assert window[0]["error_type"] == "RuntimeError", window[0]
    assert "--cpu-distributed-timeout-seconds" not in window[0]["error"], window[0]


@pytest.fixture
def gloo_times_out(monkeypatch):
    """The gather's transport (tested with real processes above) fails as gloo's does when
    the group's timeout runs out."""
    def timed_out(*args, **kwargs):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                           "Timed out waiting 1000ms for recv operation to complete")

    monkeypatch.setattr(rpc, "_gather", timed_out)


def _gather_error() -> str:
    with pytest.raises(rpc.ReplyGatherError) as e:
        rpc.gather_replies(rpc.RpcReply(rank=1, ok=True), None, dst=0, world_size=2)
    return str(e.value)


@pytest.mark.fast
def test_a_start_up_gather_that_times_out_names_the_start_up_timeout(gloo_times_out):
    """Until the warm-up is over the CPU groups run under VLLM_KEEPALIVE_STARTUP_TIMEOUT_S
    where the user's --cpu-distributed-timeout-seconds is shorter (startup_timeouts.py): a
    gather that times out then ran out of the start-up timeout, and raising the CPU timeout
    would change nothing. After start-up (and when start-up raised nothing) it is the CPU
    timeout again."""
    config = SimpleNamespace(distributed_timeout_seconds=5, cpu_distributed_timeout_seconds=5)
    with startup_timeouts.during_startup(config, 600.0):
        pass  # vLLM's groups are created here; the gathers of loading, profiling, warm-up follow
    try:
        error = _gather_error()
        assert "VLLM_KEEPALIVE_STARTUP_TIMEOUT_S" in error, error
        assert "600" in error, error  # the value that ran out
        assert "raise --cpu-distributed-timeout-seconds" not in error, error
    finally:
        startup_timeouts._users.clear()  # as restore() does once the start-up is over
    error = _gather_error()
    assert "--cpu-distributed-timeout-seconds" in error, error
    assert "VLLM_KEEPALIVE_STARTUP_TIMEOUT_S" not in error, error
    # nothing raised (the user's CPU timeout is the longer): the user's setting from the start
    with startup_timeouts.during_startup(SimpleNamespace(distributed_timeout_seconds=5,
                                                         cpu_distributed_timeout_seconds=900),
                                         600.0):
        pass
    try:
        error = _gather_error()
        assert "--cpu-distributed-timeout-seconds" in error, error
        assert "VLLM_KEEPALIVE_STARTUP_TIMEOUT_S" not in error, error
    finally:
        startup_timeouts._users.clear()
