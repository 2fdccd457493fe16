"""torchrun mode's death detection: the pure decision, then heartbeats on a real TCPStore."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keepalive_executor.torchrun.liveness import Heartbeat, LivenessCore, LivenessMonitor

TIMEOUT = 1.5


@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.floats(0.0, 3.0)), max_size=40))
def test_a_rank_is_lost_exactly_when_its_counter_has_not_moved_for_the_timeout(beats):
    core = LivenessCore([1, 2], TIMEOUT, now=0.0)
    now, counters, moved = 0.0, {1: 0, 2: 0}, {1: 0.0, 2: 0.0}
    for rank in (1, 2):  # the first reading is the baseline
        core.observe(rank, 0, now)
    for rank, dt in beats:
        now += dt
        counters[rank] += 1
        core.observe(rank, counters[rank], now)
        moved[rank] = now
        core.observe(3 - rank, counters[3 - rank], now)  # unchanged value: no news
        expected = sorted(r for r in (1, 2) if now - moved[r] > TIMEOUT)
        assert [r for r, _ in core.lost(now)] == expected


def key(name: str) -> str:
    return f"keepalive_executor/test/0/{name}"


@pytest.mark.parametrize("beating", [False, True], ids=["silent", "negative-control"])
def test_monitor_reports_a_silent_rank_within_2s_and_not_a_beating_one(tcp_store, beating):
    _, _, client = tcp_store
    beat = Heartbeat(client(), key, rank=1, timeout_s=TIMEOUT)
    beat.start()
    lost: list[tuple[str, float]] = []
    got = threading.Event()

    def on_lost(reason: str) -> None:
        lost.append((reason, time.monotonic()))
        got.set()

    monitor = LivenessMonitor(client(), key, [1], TIMEOUT, on_lost)
    monitor.start()
    time.sleep(1.0)
    t_silent = time.monotonic()
    if not beating:
        beat.stop()  # what a SIGKILLed rank or a lost node does
        assert got.wait(10)
        reason, when = lost[0]
        assert "rank 1 sent no heartbeat" in reason
        assert TIMEOUT - 0.3 <= when - t_silent < 2.0 + 0.5  # the target is 2 s; 0.5 s slack
    else:
        assert not got.wait(3 * TIMEOUT), lost
    monitor.stop()
    beat.stop()
