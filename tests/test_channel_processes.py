"""The channel and pacer with real processes on a real gloo group (3 ranks, loopback)."""

import pytest

pytestmark = pytest.mark.serial  # alone on the machine: see pyproject.toml

TIMEOUT_S = 2.0
IDLE_S = 10.0  # five times the collective timeout


WAITS = ["block", "poll"]


@pytest.fixture(scope="module")
def idle_runs(ranks) -> dict:
    """The four idle runs at once, each on its own 3-rank group: with the pacer and without
    (the negative control), for both waits. They sleep most of the time; the pacer's
    interval leaves 1.5 s of margin for a late wake-up."""
    from concurrent.futures import ThreadPoolExecutor

    configs = {(wait, pacer): dict(interval_s=TIMEOUT_S / 4 if pacer else None, wait=wait)
               for wait in WAITS for pacer in (True, False)}
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = {c: pool.submit(ranks, "idle_survival", 3, timeout_s=TIMEOUT_S, wall_s=90,
                                  idle_s=IDLE_S, **kw) for c, kw in configs.items()}
        return {c: f.result() for c, f in futures.items()}


@pytest.mark.parametrize("wait", WAITS)
def test_receivers_survive_idle_of_5x_timeout_with_pacer(idle_runs, wait):
    """``poll`` is the sleeping wait receivers use on a GPU; it is transport-agnostic, so
    gloo tests it here."""
    res = idle_runs[wait, True]
    assert set(res) == {0, 1, 2}
    assert "error" not in res[0], res[0]
    for r in (1, 2):
        assert "error" not in res[r], res[r]
        assert [p for _, p in res[r]["log"]] == ["before", "after"]
        # ~IDLE_S / interval keepalives were needed; every one reached every rank
        assert res[r]["keepalives"] == res[0]["keepalives_sent"] >= IDLE_S / TIMEOUT_S


@pytest.mark.parametrize("wait", WAITS)
def test_negative_control_without_pacer_receivers_time_out(idle_runs, wait):
    res = idle_runs[wait, False]
    for r in (1, 2):
        assert res[r]["log"] == [(1, "before")]
        assert res[r]["error_type"] == "ChannelTransportError"
        assert "timed out" in res[r]["error"].lower() or "timeout" in res[r]["error"].lower()
    # and the driver cannot deliver the next real message
    assert "error" in res[0]


def test_concurrent_senders_identical_sequences_no_interleaving(ranks):
    threads, per_thread = 4, 40
    res = ranks("concurrent_senders", 3, timeout_s=30, wall_s=120, threads=threads,
                per_thread=per_thread)
    sent = [(s, tuple(p)) for s, p in res[0]["sent"]]
    assert len(sent) == threads * per_thread
    for r in (1, 2):
        assert "error" not in res[r], res[r]
        got = [(s, tuple(p)) for s, p in res[r]["log"]]
        # same messages, same order, same sequence numbers as the driver assigned
        assert got == sent
        assert res[r]["keepalives"] == res[0]["keepalives_sent"]
        # every sequence number is a work frame, a keepalive, or the final shutdown
        assert res[r]["shutdown_seq"] == len(sent) + res[0]["keepalives_sent"] + 1


# Bound on noticing a dead peer. gloo sees the closed sockets at once (well under 1 s here);
# the bound allows for a loaded machine. The groups' timeout is 60 s, so a wait that merely
# timed out cannot pass, and the error must not be a timeout.
DEATH_BOUND_S = 3.0


def test_driver_death_ends_receivers_wait_within_bound(ranks):
    res = ranks("driver_dies", 3, timeout_s=60, wall_s=90, after_s=1.0)
    for r in (1, 2):
        assert res[r]["log"] == [(1, "hello")]
        assert res[r]["error_type"] == "ChannelTransportError"
        # the driver died 1 s after its first message; the wait ended within the bound of that
        assert res[r]["t_error"] - res[r]["t_first"] < 1.0 + DEATH_BOUND_S
        assert "timed out" not in res[r]["error"].lower(), res[r]["error"]


@pytest.mark.parametrize("world", [3])
def test_receiver_death_is_reported_to_the_driver_within_bound(ranks, world):
    res = ranks("receiver_dies", world, timeout_s=60, wall_s=120, victim=2)
    assert res[0]["error"], "driver kept sending to a dead rank for 60 s without an error"
    assert res[0]["error_type"] == "ChannelTransportError"
    assert res[0]["t_error"] - res[0]["t_victim_gone"] < DEATH_BOUND_S
    assert "timed out" not in res[0]["error"].lower(), res[0]["error"]
    assert res[1]["error_type"] == "ChannelTransportError"
