"""The reply gather (keepalive_executor/rpc.py) with real processes on a real gloo group."""

import pytest

# serial: a short collective timeout, alone on the machine (see pyproject.toml)
pytestmark = pytest.mark.serial


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
