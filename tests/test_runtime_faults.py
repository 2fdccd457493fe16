"""Run-time faults reaching the executor through vLLM's LLM API."""

import os

import pytest
from helpers import HERE, run_script

PYTHONPATH = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])


def test_oversize_and_unpicklable_arguments_fail_cleanly_and_channel_stays_in_sync(tiny_model):
    res = run_script("runtime_bad_input", model=tiny_model, extra_env={
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_KEEPALIVE_MAX_PAYLOAD_BYTES": str(1 << 20)})
    assert res["oversize"].startswith("PayloadTooLargeError")
    assert "exceeds the channel limit of 1048576 bytes; nothing was sent" in res["oversize"]
    assert res["unpicklable"].startswith("ChannelSerializationError")
    assert "cannot serialize" in res["unpicklable"]
    assert res["small"] == [1000, 1000]
    assert res["same_after"]


@pytest.mark.slow
def test_stall_inside_a_step_short_survives_long_fails_clearly(tiny_model):
    # 9 s: past the 6 s timeout of the group rank 1 waits on, and within the executor's
    # 5 s failure grace after rank 1 gives up, so the driver's call returns its own error
    res = run_script("step_stall", model=tiny_model, short_s=3.0, long_s=9.0, cpu_timeout_s=6)
    assert res["short"] == [0, 1]
    assert res["generate_after_short"] == 4
    # rank 1's reply gather times out after 6 s and rank 1 exits; the driver's gather then
    # fails at once, and the caller gets an error naming the failed collective
    assert res["long_error"] is not None
    assert res["long_elapsed_s"] < 30.0


def test_worker_slower_to_start_than_the_collective_timeout_still_starts(tiny_model):
    """Rank 1 takes 6 s to come up, the collective timeout is 3 s: the driver joins the
    rendezvous only once rank 1 said ALIVE, so the 3 s never run out before it arrives."""
    res = run_script("slow_start", model=tiny_model, timeout_s=3, extra_env={
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": PYTHONPATH,
        "KEEPALIVE_SLOW_CONSTRUCT_S": "6"})
    assert res["started"], res
    assert res["tokens"] == 4
    assert res["elapsed_s"] > 6


def test_negative_control_the_same_delay_inside_the_rendezvous_fails(tiny_model):
    """The same 6 s, spent after ALIVE (inside what the rendezvous waits for): the 3 s
    collective timeout runs out, so the protection above is what makes the difference."""
    res = run_script("slow_start", model=tiny_model, timeout_s=3, extra_env={
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": PYTHONPATH,
        "KEEPALIVE_SLOW_RENDEZVOUS_S": "6"})
    assert not res["started"], res
    assert "Wait timeout" in res["error"]  # gloo's rendezvous gave up, as in the CI failure
