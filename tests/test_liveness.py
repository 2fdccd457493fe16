"""torchrun mode's death detection: the pure decision, then heartbeats on a real TCPStore.

The "survives" tests put a fault below the tolerance; each has a negative control that puts
the same fault past it and sees the loss reported, so none of them can pass by not watching.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keepalive_executor.config import (
    DEFAULT_LIVENESS_TIMEOUT_MULTI_NODE_S,
    DEFAULT_LIVENESS_TIMEOUT_S,
    KeepaliveConfigError,
    settings_from_vllm_config,
)
from keepalive_executor.torchrun.env import ENV_TORCHRUN_LOCAL_WORLD_SIZE, TorchrunEnv
from keepalive_executor.torchrun.liveness import Heartbeat, LivenessCore, LivenessMonitor

# The tests on a real TCPStore (below) are marked ``serial``, and those whose threads all
# live in the test's own process also ``timers``: time bounds of a few tenths of a second, on
# threads that mostly sleep. scripts/test.sh runs those first in the serial phase, four at a
# time with nothing else beside them; the pure decisions above them run anywhere.

# What docs/torchrun.md promises for one node, written here rather than imported from the
# implementation, so that a change of its constants fails these tests instead of moving
# them along: a 1.5 s timeout, a heartbeat and a decision every timeout/6, a gap of up to two
# periods between decisions counted in full, and a tolerance of the timeout minus two beats
# (1.0 s: a stall of either side's thread, or 4 failed heartbeats in a row).
TIMEOUT = 1.5
BEAT = 0.25
STALL_PERIODS = 2
TOLERATED_STALL_S = TIMEOUT - 2 * BEAT
TOLERATED_FAILED_BEATS = round(TOLERATED_STALL_S / BEAT)


@pytest.mark.fast  # in `scripts/test.sh --fast`: the pure decisions (no sleeps)
@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.floats(0.0, 3.0)), max_size=40))
def test_a_rank_is_lost_exactly_when_its_counter_has_not_moved_for_the_timeout(beats):
    core = LivenessCore([1, 2], TIMEOUT, now=0.0)
    core.end_startup(0.0)  # serving (the start-up's longer limit: further down)
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


# One step of the driver's reader: at time dt later, the read of rank 1 either fails (the
# store raised) or answers with the counter, which moved or not.
_step = st.tuples(st.floats(0.0, 2.0), st.sampled_from(["raise", "same", "moved"]))


@pytest.mark.fast
@given(st.lists(_step, max_size=60))
def test_the_store_is_lost_exactly_when_no_read_answered_for_the_timeout(steps):
    """Failed reads are not a loss by themselves: only silence past the timeout is, and a
    rank whose counter moved after a run of failed reads is not lost."""
    core = LivenessCore([1], TIMEOUT, now=0.0)
    core.end_startup(0.0)
    now, counter, answered, moved = 0.0, 0, 0.0, 0.0
    core.observe(1, counter, now)
    for dt, outcome in steps:
        now += dt
        if outcome != "raise":
            if outcome == "moved":
                counter += 1
                moved = now
            core.observe(1, counter, now)
            answered = now
        silent = core.store_silent(now)
        assert (silent is not None) == (now - answered > TIMEOUT)
        if silent is not None:
            assert silent == pytest.approx(now - answered)
        # lost on evidence: the last read that answered saw the counter still past the
        # timeout; a silent store does not make the rank lost by itself
        assert bool(core.lost(now)) == (answered - moved > TIMEOUT)


@pytest.mark.fast
@given(st.lists(_step, max_size=60))
def test_the_monitors_own_stalls_count_as_one_period_and_nothing_else_changes(steps):
    """The same steps, each a decision (tick) first: a gap of up to two periods counts in
    full, a longer one (the monitor could not run) counts as one period. In that time the
    verdicts are exactly those of the rule above. Gaps here reach 2 s, past the timeout."""
    core = LivenessCore([1], TIMEOUT, now=0.0)
    core.end_startup(0.0)
    clock = monitored = answered = moved = 0.0
    counter = 0
    core.observe(1, counter, clock)
    for dt, outcome in steps:
        before, clock = clock, clock + dt
        # the gap as the monitor sees it, between two readings of its clock: in floating
        # point 0.5 after 1.95 may be 0.5000000000000002, past two periods (hypothesis found
        # such a case once)
        dt = clock - before
        excused = core.tick(clock)
        stalled = dt > STALL_PERIODS * BEAT
        assert excused == (pytest.approx(dt - BEAT) if stalled else 0.0)
        monitored += BEAT if stalled else dt
        if outcome != "raise":
            if outcome == "moved":
                counter += 1
                moved = monitored
            core.observe(1, counter, clock)
            answered = monitored
        silent = core.store_silent(clock)
        assert (silent is not None) == (monitored - answered > TIMEOUT + 1e-9)
        assert bool(core.lost(clock)) == (answered - moved > TIMEOUT + 1e-9)


@pytest.mark.fast
def test_a_stall_of_the_monitor_is_excused_whichever_thread_runs_first_after_it():
    """vLLM's full GC at the end of its start-up held the engine's GIL ~2 s (timeout 1.5 s).
    Without tick() that read as a silent store (the first assertion, the old verdict); after
    it, no verdict, whether the reader's read (rank 1's counter unchanged: its beat is late
    too) or the decision comes first. A frozen rank is still lost, one timeout of monitored
    time after its last move."""
    for reader_first in (False, True):
        core = LivenessCore([1], TIMEOUT, now=0.0)
        core.end_startup(0.0)
        for i in range(1, 5):  # beats and decisions every period until t = 1.0
            core.tick(i * BEAT)
            core.observe(1, i, i * BEAT)
        now = 3.0  # the stall: nothing ran for 2 s
        assert core.store_silent(now) == pytest.approx(2.0)  # what the old rule saw
        if reader_first:
            core.observe(1, 4, now)
        assert core.tick(now) == pytest.approx(2.0 - BEAT)
        assert core.store_silent(now) is None and core.lost(now) == []
        # rank 1 is frozen from t = 1.0: monitored time since then is BEAT (the stall) plus
        # the time after it, so it is lost once that passes the timeout
        t = now
        while t < now + TIMEOUT:
            t += BEAT / 2
            core.tick(t)
            core.observe(1, 4, t)
            assert bool(core.lost(t)) == (BEAT + (t - now) > TIMEOUT + 1e-9), t
        assert core.lost(t)


@pytest.mark.fast
def test_a_blocked_store_is_silent_without_any_call_returning_and_no_rank_is_lost():
    core = LivenessCore([1, 2], TIMEOUT, now=10.0)
    core.end_startup(10.0)
    core.observe(1, 0, 10.0)
    core.observe(2, 0, 10.0)
    assert core.store_silent(10.0 + TIMEOUT) is None  # exactly the timeout: not yet
    assert core.store_silent(10.0 + TIMEOUT + 0.01) == pytest.approx(TIMEOUT + 0.01)
    assert core.lost(10.0 + 5 * TIMEOUT) == []  # nothing read: no evidence against a rank
    core.observe(1, 0, 12.0)  # rank 1 read again, unmoved: lost; rank 2 still unread
    assert core.lost(12.0) == [(1, pytest.approx(2.0))]
    assert core.store_silent(12.0) is not None  # rank 2's reads have not answered
    core.observe(2, 1, 12.0)
    assert core.store_silent(12.0 + TIMEOUT) is None



# ---------------------------------------------------------------- the engine's start-up
# A follower's heartbeat is a Python thread: a C call of its process that holds the GIL (vLLM's
# GPU worker ends its warm-up with a full garbage collection, freeze_gc_heap) stops it. Such a
# stall and a frozen rank look the same to the driver, so until the engine's start-up ends
# (every rank answered its warm-up) a rank may be still for STARTUP_TIMEOUT, and from then on
# for the timeout, counted from the end of the start-up at the earliest (torchrun.md).
STARTUP_TIMEOUT = 10 * TIMEOUT


@pytest.mark.fast
def test_a_followers_gil_stall_in_start_up_is_no_loss_and_a_frozen_rank_still_is():
    """Rank 1 beats until t = 1.0, then its process holds the GIL for 2 s while the driver
    reads on: no verdict (the rule without a start-up window: lost after 1.5 s). A rank that
    never beats again is lost once still for more than the start-up timeout."""
    core = LivenessCore([1], TIMEOUT, now=0.0)
    for i in range(1, 5):
        core.tick(i * BEAT)
        core.observe(1, i, i * BEAT)
    t = 1.0
    while t < 3.0:
        t += BEAT
        core.tick(t)
        core.observe(1, 4, t)
    assert core.lost(t) == []
    while t < 1.0 + STARTUP_TIMEOUT + 2 * BEAT:
        t += BEAT
        core.tick(t)
        core.observe(1, 4, t)
        assert bool(core.lost(t)) == (t - 1.0 > STARTUP_TIMEOUT), t
    assert core.lost(t) == [(1, pytest.approx(t - 1.0))]


@pytest.mark.fast
def test_after_start_up_a_rank_is_lost_after_the_timeout_counted_from_its_end():
    """Rank 2's warm-up held its GIL from t = 0; start-up ends at t = 2.0 (its answer came)
    before its late beat was read. No verdict at the switch, the stall is reported; if rank 2
    never beats again (frozen right after its answer), it is lost one timeout after the end
    of the start-up, and rank 1, beating, never is."""
    core = LivenessCore([1, 2], TIMEOUT, now=0.0)
    t, beats = 0.0, 0
    for rank in (1, 2):
        core.observe(rank, 0, t)
    while t < 2.0:
        t += BEAT
        beats += 1
        core.tick(t)
        core.observe(1, beats, t)
        core.observe(2, 0, t)
    assert core.end_startup(t) == {2: pytest.approx(2.0)}
    assert core.lost(t) == []
    assert core.end_startup(t) == {}  # once
    end = t
    while t < end + TIMEOUT + 2 * BEAT:
        t += BEAT
        beats += 1
        core.tick(t)
        core.observe(1, beats, t)
        core.observe(2, 0, t)
        assert [r for r, _ in core.lost(t)] == ([2] if t - end > TIMEOUT else []), t


# One step of the driver's reader, or the end of the engine's start-up.
_phase_step = st.tuples(st.floats(0.0, 4.0),
                        st.sampled_from(["raise", "same", "moved", "end-start-up"]))


@pytest.mark.fast
@given(st.lists(_phase_step, max_size=60))
def test_a_rank_is_lost_exactly_when_still_past_the_limit_of_its_phase(steps):
    """Before the end of the start-up: still for more than the start-up timeout; after it:
    for more than the timeout, counted from the end at the earliest. The end reports the
    longest stillness past the timeout seen in the start-up, once."""
    core = LivenessCore([1], TIMEOUT, now=0.0)
    now = answered = moved = longest = 0.0
    counter, ended = 0, None
    core.observe(1, counter, now)
    for dt, what in steps:
        now += dt
        if what == "end-start-up":
            reported = core.end_startup(now)
            if ended is None:
                ended = now
                assert reported == ({1: pytest.approx(longest)} if longest > TIMEOUT else {})
            else:
                assert reported == {}
        elif what != "raise":
            if what == "moved":
                counter += 1
                moved = now
            core.observe(1, counter, now)
            answered = now
            if ended is None:
                longest = max(longest, answered - moved)
        if ended is None:
            expected = answered - moved > STARTUP_TIMEOUT
        else:
            expected = answered - max(moved, ended) > TIMEOUT
        assert bool(core.lost(now)) == expected


# ---------------------------------------------------------------- the default timeout


class _Parallel:
    tensor_parallel_size = 2
    pipeline_parallel_size = 1
    world_size = 2
    distributed_timeout_seconds = 10
    cpu_distributed_timeout_seconds = None


class _Config:
    parallel_config = _Parallel()
    additional_config: dict = {}


def _liveness(env: dict[str, str]) -> float:
    return settings_from_vllm_config(_Config(), env=env, dist_backend="gloo").liveness_timeout_s


@pytest.mark.fast
def test_default_is_low_on_one_node_higher_across_nodes_and_the_setting_wins():
    assert _liveness({}) == DEFAULT_LIVENESS_TIMEOUT_S == 1.5  # spawned mode, or no torchrun
    assert _liveness({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}) == 1.5
    across = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    assert _liveness(across) == DEFAULT_LIVENESS_TIMEOUT_MULTI_NODE_S == 5.0
    assert _liveness({**across, "VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S": "0.7"}) == 0.7
    with pytest.raises(KeepaliveConfigError,
                       match=r"VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S='0' must be positive.*"
                             r"default 5\b"):
        _liveness({**across, "VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S": "0"})


@pytest.mark.fast
def test_across_nodes_survives_vllm_rewriting_local_world_size():
    """vLLM's CPU platform sets LOCAL_WORLD_SIZE to the TP size in the engine's process, so
    TP=2 over two one-rank nodes read as one node (1.5 s: seen failing a two-node start-up
    under load in CI). torchrun's own value, saved by the CLI before vLLM runs, decides."""
    rewritten = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}  # what vLLM leaves
    assert _liveness({**rewritten, ENV_TORCHRUN_LOCAL_WORLD_SIZE: "1"}) == 5.0
    assert _liveness({**rewritten, ENV_TORCHRUN_LOCAL_WORLD_SIZE: "2"}) == 1.5
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert not TorchrunEnv.from_environ(
        {**torchrun, **rewritten, ENV_TORCHRUN_LOCAL_WORLD_SIZE: "1"}).one_node
    assert TorchrunEnv.from_environ({**torchrun, **rewritten}).one_node


# ---------------------------------------------------------------- on a real TCPStore


def key(name: str) -> str:
    return f"keepalive_executor/test/0/{name}"


class FlakyStore:
    """A real TCPStore client whose ``add`` raises, or first sleeps, on chosen calls.

    ``fault(n)`` is called with the 0-based index of each ``add`` and returns None (pass
    through), ``"raise"``, or a number of seconds to block before passing through.
    """

    def __init__(self, inner, fault: Callable[[int], object]) -> None:
        self._inner = inner
        self._fault = fault
        self._n = 0
        self.raised = 0

    def add(self, k: str, v: int) -> int:
        n, self._n = self._n, self._n + 1
        what = self._fault(n)
        if what == "raise":
            self.raised += 1
            raise RuntimeError(f"injected store error on call {n}")
        if what:
            time.sleep(float(what))
        return self._inner.add(k, v)


class Watch:
    """Run a Heartbeat for rank 1 and a LivenessMonitor over it, past the engine's start-up;
    record what is reported."""

    def __init__(self, beat_store, monitor_store) -> None:
        self.lost: list[tuple[str, float]] = []
        self.got = threading.Event()
        self.beat = Heartbeat(beat_store, key, rank=1, timeout_s=TIMEOUT)
        self.monitor = LivenessMonitor(monitor_store, key, [1], TIMEOUT, self._on_lost)

    def _on_lost(self, reason: str) -> None:
        self.lost.append((reason, time.monotonic()))
        self.got.set()

    def __enter__(self) -> Watch:
        self.beat.start()
        self.monitor.start()
        self.monitor.end_startup()
        return self

    def __exit__(self, *exc) -> None:
        self.monitor.stop()
        self.beat.stop()


@pytest.mark.serial
@pytest.mark.timers
@pytest.mark.fast  # in `scripts/test.sh --fast`: one heartbeat run, and its control
@pytest.mark.parametrize("beating", [False, True], ids=["silent", "negative-control"])
def test_monitor_reports_a_silent_rank_within_2s_and_not_a_beating_one(tcp_store, beating):
    _, _, client = tcp_store
    with Watch(client(), client()) as w:
        time.sleep(1.0)
        t_silent = time.monotonic()
        if not beating:
            w.beat.stop()  # what a SIGKILLed rank or a lost node does
            assert w.got.wait(10)
            reason, when = w.lost[0]
            assert "rank 1 sent no heartbeat" in reason
            # claimed: after timeout - one beat, within timeout + two beats (one poll to see
            # the last beat, one to see the counter still); 0.5 s slack for a loaded machine
            assert TIMEOUT - BEAT - 0.1 <= when - t_silent < TIMEOUT + 2 * BEAT + 0.5
        else:
            assert not w.got.wait(3 * TIMEOUT), w.lost


def _burst(start: int, count: int) -> Callable[[int], object]:
    return lambda n: "raise" if start <= n < start + count else None


# A follower's adds fail: as many in a row as torchrun.md says are tolerated (4: 1.0 s
# without a beat), then one in three for the rest of the run. Control: every add fails from
# call 4 on.
_FOLLOWER_FLAKY = [
    pytest.param(lambda n: "raise" if 4 <= n < 4 + TOLERATED_FAILED_BEATS
                 or (n > 5 + TOLERATED_FAILED_BEATS and n % 3 == 0) else None,
                 False, id="transient-errors-survive"),
    pytest.param(_burst(4, 10_000), True, id="negative-control-errors-past-timeout"),
]


@pytest.mark.serial
@pytest.mark.timers
@pytest.mark.parametrize("fault, fails", _FOLLOWER_FLAKY)
def test_a_follower_whose_store_raises_sometimes_keeps_beating(tcp_store, fault, fails):
    _, _, client = tcp_store
    beat_store = FlakyStore(client(), fault)
    with Watch(beat_store, client()) as w:
        got = w.got.wait(4 * TIMEOUT)
    if fails:
        assert got and "rank 1 sent no heartbeat" in w.lost[0][0], w.lost
    else:
        assert not got, w.lost
    assert beat_store.raised >= 3  # the fault was really injected


# The driver's reads fail: a burst of 4 (1 s, the tolerance), then every other one.
# Control: every read fails from call 4 on, which is a store that stopped answering.
_MONITOR_FLAKY = [
    pytest.param(lambda n: "raise" if 4 <= n < 4 + TOLERATED_FAILED_BEATS
                 or (n > 8 + TOLERATED_FAILED_BEATS and n % 2 == 0) else None,
                 False, id="transient-errors-survive"),
    pytest.param(_burst(4, 10_000), True, id="negative-control-errors-past-timeout"),
]


@pytest.mark.serial
@pytest.mark.timers
@pytest.mark.parametrize("fault, fails", _MONITOR_FLAKY)
def test_a_monitor_whose_store_raises_sometimes_does_not_fail(tcp_store, fault, fails):
    _, _, client = tcp_store
    monitor_store = FlakyStore(client(), fault)
    with Watch(client(), monitor_store) as w:
        got = w.got.wait(4 * TIMEOUT)
    if fails:
        assert got, "a store that never answers went unnoticed"
        reason = w.lost[0][0]
        assert "torchrun's store has not answered for" in reason
        assert "injected store error" in reason  # names the last error
    else:
        assert not got, w.lost
    assert monitor_store.raised >= 3  # the fault was really injected


# One call blocks (a thread starved of CPU, a throttled pod, a retransmission) for the
# tolerance torchrun.md states (1.0 s); the control blocks for 2.5 s, past the timeout.
_STALL = [pytest.param(TOLERATED_STALL_S, False, id="stall-of-the-tolerance-survives"),
          pytest.param(2.5, True, id="negative-control-stall-past-timeout")]


@pytest.mark.serial
@pytest.mark.timers
@pytest.mark.parametrize("stall, fails", _STALL)
def test_a_follower_heartbeat_that_stalls_below_the_timeout_is_not_lost(tcp_store, stall,
                                                                        fails):
    _, _, client = tcp_store
    beat_store = FlakyStore(client(), lambda n: stall if n == 4 else None)
    with Watch(beat_store, client()) as w:
        got = w.got.wait(4 * TIMEOUT)
    if fails:
        assert got and "rank 1 sent no heartbeat" in w.lost[0][0], w.lost
    else:
        assert not got, w.lost


@pytest.mark.serial
@pytest.mark.timers
@pytest.mark.parametrize("stall, fails", _STALL)
def test_a_monitor_read_that_blocks_is_noticed_only_past_the_timeout(tcp_store, stall,
                                                                     fails):
    """TCPStore calls can block indefinitely (``add`` on a SIGSTOPped server does): the
    decision thread still sees the silence while the reader is stuck."""
    _, _, client = tcp_store
    monitor_store = FlakyStore(client(), lambda n: stall if n == 4 else None)
    with Watch(client(), monitor_store) as w:
        got = w.got.wait(4 * TIMEOUT)
    if fails:
        assert got and "torchrun's store has not answered" in w.lost[0][0], w.lost
        assert "(calls blocked)" in w.lost[0][0]
    else:
        assert not got, w.lost


# This process holds the GIL for 2.5 s (past the 1.5 s timeout): what vLLM's full garbage
# collection at the end of the engine's start-up does to the monitor in the engine process.
# The driver's reads are held back from 0.15 s before the stall to 0.15 s after it, so that
# no read can answer first when the GIL comes back (the control would otherwise depend on
# which thread takes the GIL first). Control: the same without LivenessCore.tick (the rule
# before it): 2.5 s without an answer, a false verdict. With it: ~0.8 s of monitored time.
_GIL_HELD = [pytest.param(False, id="monitor-stall-excused"),
             pytest.param(True, id="negative-control-stall-counted")]


class HeldStore:
    """A real TCPStore client whose ``add`` waits (GIL released) while ``held`` is set."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.held = threading.Event()

    def add(self, k: str, v: int) -> int:
        while self.held.is_set():
            time.sleep(0.01)
        return self._inner.add(k, v)


@pytest.mark.serial
@pytest.mark.timers
@pytest.mark.parametrize("control", _GIL_HELD)
def test_the_monitors_process_holding_the_gil_past_the_timeout_is_no_loss(tcp_store,
                                                                        monkeypatch, control):
    if control:
        monkeypatch.setattr(LivenessCore, "tick", lambda self, now: 0.0)
    _, _, client = tcp_store
    usleep = ctypes.PyDLL(None).usleep  # a PyDLL call keeps the GIL for its whole length
    reads = HeldStore(client())
    ticks: list[float] = []

    def ticker() -> None:
        for _ in range(200):
            ticks.append(time.monotonic())
            time.sleep(0.02)

    with Watch(client(), reads) as w:
        time.sleep(1.0)
        t = threading.Thread(target=ticker)
        t.start()
        reads.held.set()
        time.sleep(0.15)
        held_from = time.monotonic()
        usleep(2_500_000)
        held_to = time.monotonic()
        time.sleep(0.15)
        reads.held.clear()
        got = w.got.wait(3 * TIMEOUT)
        t.join()
    # the scenario really happened: no Python thread ran while the GIL was held
    assert held_to - held_from >= 2.5
    assert not [x for x in ticks if held_from + 0.1 < x < held_to - 0.1]
    if control:
        assert got, "the control did not fail: the stall was not past the timeout"
        assert "torchrun's store has not answered" in w.lost[0][0], w.lost
    else:
        assert not got, w.lost


# A follower's process holds its GIL for 3 s (twice the timeout), in a real process of its
# own: what vLLM's GPU worker does at the end of its warm-up (freeze_gc_heap), which stops the
# follower's heartbeat thread while the driver reads on. In start-up it is no loss; the
# control is the same stall after the end of the start-up, where it is a frozen rank's
# silence: the loss is reported (the rank is healthy, which is why a stall must be tolerated
# only where one is expected).
FOLLOWER_STALL_S = 3.0

_FOLLOWER = r"""
import ctypes, datetime, sys, time
from torch.distributed import TCPStore
from keepalive_executor.torchrun.liveness import Heartbeat

port, timeout_s, stall_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
key = lambda name: f"keepalive_executor/test/0/{name}"

def client():
    return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))

beats = []

class Timed:
    def __init__(self, inner):
        self.inner = inner

    def add(self, k, v):
        beats.append(time.monotonic())
        return self.inner.add(k, v)

Heartbeat(Timed(client()), key, rank=1, timeout_s=timeout_s).start()
store = client()
store.wait([key("stall")])  # TCPStore calls release the GIL: the heartbeat runs meanwhile
usleep = ctypes.PyDLL(None).usleep  # a PyDLL call keeps the GIL for its whole length
held_from = time.monotonic()
usleep(int(stall_s * 1e6))
held_to = time.monotonic()
store.set(key("stalled"), "1")
store.wait([key("done")])
# the first beat after the stall closes the gap; the test may say "done" before the
# heartbeat thread ran again (its control reports the loss at once)
until = time.monotonic() + 30
while beats[-1] <= held_to and time.monotonic() < until:
    time.sleep(0.01)
gap = max(b - a for a, b in zip(beats, beats[1:]) if b > held_from)
print(f"held {held_to - held_from:.3f} longest-beat-gap {gap:.3f}", flush=True)
"""


@pytest.mark.parametrize("after_startup", [False, True],
                         ids=["stall-in-start-up-survives", "negative-control-after-start-up"])
@pytest.mark.serial  # not `timers`: its follower process imports torch beside the other
# tests (seconds of CPU), and its positive case failed here with both cores kept busy by
# two spinning processes, four at a time and alone alike; it runs with nothing beside it
def test_a_followers_process_holding_its_gil_past_the_timeout_in_start_up_is_no_loss(
        tcp_store, after_startup):
    import datetime
    import subprocess
    import sys

    _, port, client = tcp_store
    follower = subprocess.Popen(
        [sys.executable, "-c", _FOLLOWER, str(port), str(TIMEOUT), str(FOLLOWER_STALL_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = client()
    lost: list[str] = []
    got = threading.Event()

    def on_lost(reason: str) -> None:
        lost.append(reason)
        got.set()

    monitor = LivenessMonitor(client(), key, [1], TIMEOUT, on_lost)
    try:
        store.wait([key("alive/1")], datetime.timedelta(seconds=120))  # it beats
        monitor.start()
        time.sleep(1.0)
        if after_startup:
            monitor.end_startup()
        store.set(key("stall"), "1")
        store.wait([key("stalled")], datetime.timedelta(seconds=60))
        if not after_startup:
            monitor.end_startup()  # what the executor does once the warm-up's answers came
        got.wait(3 * TIMEOUT)
        store.set(key("done"), "1")
        out, err = follower.communicate(timeout=60)
    finally:
        monitor.stop()
        follower.kill()
    # the scenario really happened: the follower's heartbeat did not run during the stall
    held, gap = (float(x) for x in out.split()[1::2])
    assert held >= FOLLOWER_STALL_S and gap >= FOLLOWER_STALL_S, (out, err)
    if after_startup:
        assert lost and "rank 1 sent no heartbeat" in lost[0], lost
    else:
        assert not lost, lost


# ----------------------------------------------------------------- the driver's process

FOLLOWER = """
import signal, sys, threading, time
from keepalive_executor.torchrun.env import pid_space
from keepalive_executor.torchrun.liveness import DriverWatch
driver_pid, where = int(sys.argv[1]), sys.argv[2]
stop_requested = threading.Event()
def on_term(signum, frame):  # as a following rank: note it, keep following
    stop_requested.set()
signal.signal(signal.SIGTERM, on_term)
space = pid_space() if where == "same" else "another-node/1"
DriverWatch.for_driver({"pid": driver_pid, "pid_space": space}, stop_requested)
print("following", flush=True)
while True:  # a step's collective that never ends (vLLM's shared-memory all-reduce)
    time.sleep(0.05)
"""


@pytest.mark.fast
@pytest.mark.parametrize("where,term", [("same", False), ("same", True), ("other", False)],
                         ids=["driver-dies", "sigterm-then-driver-dies",
                              "other-pid-space-control"])
def test_a_follower_stuck_in_a_step_ends_soon_after_its_drivers_process(where, term):
    """A follower that defers SIGTERM and sits in a collective that never returns ends
    DRIVER_GONE_EXIT_S after the driver's process is gone: exit 1, or 0 if it was asked to
    stop. The control names the driver in another pid space (another node: no pid watch):
    the same follower is still there well after."""
    import subprocess
    import sys

    from keepalive_executor import exit_codes
    from keepalive_executor.torchrun.liveness import DRIVER_GONE_EXIT_S

    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, str(driver.pid), where],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert follower.stdout.readline().strip() == "following"
        if term:
            follower.terminate()
            time.sleep(0.5)
            assert follower.poll() is None  # deferred, as a following rank does
        driver.kill()
        driver.wait()
        t0 = time.monotonic()
        if where == "other":
            time.sleep(DRIVER_GONE_EXIT_S + 3)
            assert follower.poll() is None
            return
        code = follower.wait(DRIVER_GONE_EXIT_S + 10)
        assert code == (exit_codes.OK if term else exit_codes.FAILED)
        assert time.monotonic() - t0 >= DRIVER_GONE_EXIT_S - 0.1
    finally:
        for p in (driver, follower):
            if p.poll() is None:
                p.kill()
                p.wait()
