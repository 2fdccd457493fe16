"""torchrun mode's death detection: heartbeats on torchrun's store, not on the channel.

The executor cannot watch torchrun's processes (they are not its children, and may be on
other nodes), and a failing channel send is not a death signal it can rely on: with NCCL a
small broadcast can complete on the root without the receiver, and a step's collectives have
no timeout of their own. So every follower beats on the agent's store, a TCP service that
does not depend on the transport::

    follower (thread keepalive-heartbeat)      driver (threads keepalive-liveness[-reader])
    every timeout/6: add(alive/<rank>, 1)      reader, every timeout/6: read alive/<rank> of
    (a failed add is retried at the next       each rank; decision, every timeout/6: a
     beat, not fatal)                          counter that has not moved for `timeout`, or
                                               a store that has not answered for `timeout`
                                               (driver's own clock: no clock skew between
                                               nodes matters) -> lost

A lost process, a lost node and a partition all stop the counter, so any of them is noticed
within ``timeout`` plus two polls (one to see the last beat, one to see the counter still):
``VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S``, default 1.5 s on one node and 5 s across nodes, see
:func:`keepalive_executor.config.default_liveness_timeout_s`.

**Transient errors are tolerated, silence is not.** One exception from a store call (a reset
connection, a timeout under load) says nothing about whether a rank is alive, so neither side
acts on it: the follower keeps beating, and the driver counts a store as lost only once *no*
read has answered for the timeout. The decision runs in its own thread because a TCPStore
call can block indefinitely (seen here: ``add`` on a SIGSTOPped server never returns), and a
blocked reader must still be noticed. The decision is the pure :class:`LivenessCore` with an
injectable clock.

**The monitor's own stalls are not evidence.** The decision thread runs every timeout/6; a
much longer gap between two of its decisions means this process could not run its threads:
C calls that hold the GIL (vLLM's engine start-up: the warm-up, then a full garbage
collection, ``freeze_gc_heap``), or a CPU starved for that long. Seen in the engine process
of a one-node torchrun run on 2 loaded cores: gaps of 1.06 s and 0.44 s during the warm-up
and 0.36 s just after it; in two loaded test runs before this rule, 1.85 s and 1.98 s in
the 2 s after vLLM logged the end of its start-up, read as a silent store (1.5 s timeout),
which failed the server. No read could be made or recorded meanwhile, so that time counts
neither as the store's silence nor as a rank's stillness (:meth:`LivenessCore.tick`); a
verdict needs the timeout's worth of time in which the monitor was running. A store call
that blocks does not stall the monitor (TCPStore's calls release the GIL: another thread
ticked every 50 ms while ``add`` on a SIGSTOPped server blocked), so a store that stops
answering is still noticed on time.

**A follower's own stalls: a start-up window.** The heartbeat is a Python thread too, so a C
call holding a follower's GIL stops its beats; vLLM's GPU worker ends its warm-up
(``compile_or_warm_up_model``) with ``freeze_gc_heap``, a full collection, on every rank, and
the same call stalled rank 0's process for up to 1.98 s (above). While it lasts, that stall
and a frozen rank look the same to the driver: a still counter. A late beat could say how
late it was, but only after the stall ends, and the driver must decide before that. So the
monitor has two phases, named by ``LivenessCore.starting``::

    starting --(end_startup: every rank answered its warm-up)--> running
    a rank is lost when still for             a rank is lost when still for `timeout`,
    STARTUP_TIMEOUT_FACTOR x timeout          counted from the end of start-up at the earliest

The executor ends the start-up once every rank answered its warm-up, so every follower's
``freeze_gc_heap`` is over by then. A frozen rank is noticed within the start-up timeout
during start-up (where its silence also holds up the start-up's collective calls), and within
the timeout afterwards. The store's silence is judged by the timeout in both phases (the
follower's stalls do not touch it). End of start-up logs any rank that was still for more
than the timeout meanwhile: the same stall later would be a loss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from keepalive_executor import exit_codes
from keepalive_executor.log import get_logger
from keepalive_executor.supervision import ProcessWatch
from keepalive_executor.torchrun.env import pid_space

__all__ = ["LivenessCore", "Heartbeat", "LivenessMonitor", "BEATS_PER_TIMEOUT", "STALL_PERIODS",
           "STARTUP_TIMEOUT_FACTOR"]

logger = get_logger(__name__)
BEATS_PER_TIMEOUT = 6
#: A gap between two decisions longer than this many periods is the monitor's own stall.
STALL_PERIODS = 2
#: During the engine's start-up a rank may be still for this many timeouts (15 s on one node):
#: its start-up holds its GIL in long C calls (1.85-1.98 s seen for the full collection).
STARTUP_TIMEOUT_FACTOR = 10
#: At most one warning per this many seconds for repeated store errors (a flaky link would
#: otherwise log six lines per timeout, forever).
ERROR_LOG_INTERVAL_S = 10.0
ENV_LIVENESS = "VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S"


class LivenessCore:
    """Which ranks are lost, and whether the store is, from observations and a clock.

    Every argument ``now`` is the observer's clock; nothing here reads a clock itself. A rank
    is lost on evidence only: a read that *answered* showed its counter still for more than
    the timeout. While reads fail or block, a rank's counter is unknown, not still: that is
    the store's silence, reported as such once no read of some rank has answered for the
    timeout (a store that answers again within it costs nothing). Until
    :meth:`end_startup`, a rank's stillness is judged by ``startup_timeout_s`` instead.
    """

    def __init__(self, ranks: Iterable[int], timeout_s: float, now: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        #: how often the monitor decides; a gap over STALL_PERIODS of these is a stall
        self.period_s = timeout_s / BEATS_PER_TIMEOUT
        #: how long a rank may be still while ``starting``
        self.startup_timeout_s = STARTUP_TIMEOUT_FACTOR * timeout_s
        #: the engine's start-up is not over (see :meth:`end_startup`)
        self.starting = True
        self._last_tick = now
        # rank -> (last value read, when it was first read, when it was last read)
        self._seen: dict[int, tuple[int | None, float, float]] = {
            r: (None, now, now) for r in ranks}
        # rank -> the longest stillness seen while starting
        self._longest_still = dict.fromkeys(self._seen, 0.0)

    def tick(self, now: float) -> float:
        """A decision is about to be made at ``now``; returns the seconds excused.

        Decisions come every ``period_s``. If more than ``STALL_PERIODS`` periods passed
        since the last one, the monitor itself was stalled for all but one period of the
        gap: every mark (first and last read of each rank) moves forward by that much, never
        past ``now``, so the stall counts neither as silence nor as stillness.
        """
        gap, self._last_tick = now - self._last_tick, now
        if gap <= STALL_PERIODS * self.period_s:
            return 0.0
        excused = gap - self.period_s
        self._seen = {
            r: (value, min(since + excused, now), min(read + excused, now))
            for r, (value, since, read) in self._seen.items()
        }
        return excused

    def observe(self, rank: int, value: int, now: float) -> None:
        """A read of rank ``rank``'s counter answered ``value`` at ``now``."""
        last, since, read = self._seen[rank]
        since, read = (now if value != last else since), max(read, now)
        self._seen[rank] = (value, since, read)
        if self.starting:
            self._longest_still[rank] = max(self._longest_still[rank], read - since)

    def end_startup(self, now: float) -> dict[int, float]:
        """The engine's start-up ended at ``now``: from then on a rank is lost when still for
        ``timeout_s``, counted from ``now`` at the earliest (a follower whose late beat is not
        read yet is not lost at once). Returns, the first time only, each rank that was
        still for more than ``timeout_s`` during the start-up, with the longest stillness."""
        if not self.starting:
            return {}
        self.starting = False
        self._seen = {r: (value, now, read) for r, (value, _, read) in self._seen.items()}
        return {r: s for r, s in self._longest_still.items() if s > self.timeout_s}

    def lost(self, now: float) -> list[tuple[int, float]]:
        """``(rank, seconds its counter was seen still)`` for each rank whose last answered
        read found it unmoved for more than the timeout (the start-up timeout while
        ``starting``)."""
        limit = self.startup_timeout_s if self.starting else self.timeout_s
        return sorted(
            (r, read - since) for r, (_, since, read) in self._seen.items()
            if read - since > limit
        )

    def still_for(self, now: float) -> dict[int, float]:
        """Each rank's seconds since its counter was last seen to move (its first read, if
        it never moved): the heartbeat's age, as far as the reads can tell."""
        return {r: max(0.0, now - since) for r, (_, since, _) in self._seen.items()}

    def store_silent(self, now: float) -> float | None:
        """Seconds since some rank's counter was last read, if past the timeout, else None."""
        if not self._seen:
            return None
        silent = now - min(read for _, _, read in self._seen.values())
        return silent if silent > self.timeout_s else None


class _RateLimited:
    """Log a repeated failure once, then at most every ERROR_LOG_INTERVAL_S with a count."""

    def __init__(self, what: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._what = what
        self._clock = clock
        self._next = float("-inf")
        self._suppressed = 0

    def failed(self, error: BaseException) -> None:
        now = self._clock()
        if now < self._next:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last warning)" if self._suppressed else ""
        logger.warning("%s failed, retrying: %s%s", self._what, error, more)
        self._suppressed = 0
        self._next = now + ERROR_LOG_INTERVAL_S


def _key(key_of: Callable[[str], str], rank: int) -> str:
    return key_of(f"alive/{rank}")


class _Periodic:
    """A daemon thread running ``self._tick()`` every ``period`` until stop()."""

    def __init__(self, period: float, name: str) -> None:
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (once)."""
        self._thread.start()

    def stop(self) -> None:
        """No tick begins after this returns (one may still be inside a store call)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._tick():
                return
            self._stop.wait(self._period)

    def _tick(self) -> bool:
        raise NotImplementedError


class Heartbeat(_Periodic):
    """A follower's heartbeat thread (``keepalive-heartbeat``).

    A failed ``add`` is logged (rate-limited) and the next beat tries again: only a counter
    that stays still for the whole timeout makes the driver declare this rank lost.
    """

    def __init__(self, store: Any, key_of: Callable[[str], str], rank: int,
                 timeout_s: float) -> None:
        super().__init__(timeout_s / BEATS_PER_TIMEOUT, "keepalive-heartbeat")
        self._store = store
        self._key = _key(key_of, rank)
        self._errors = _RateLimited(f"rank {rank}'s heartbeat to torchrun's store")

    def _tick(self) -> bool:
        try:
            self._store.add(self._key, 1)
        except Exception as e:  # noqa: BLE001 - transient until the driver sees silence
            self._errors.failed(e)
        return True


class LivenessMonitor(_Periodic):
    """The driver's watch over followers' heartbeats.

    Two threads: ``keepalive-liveness-reader`` reads the counters (its store calls may fail,
    which it retries, or block), and ``keepalive-liveness`` decides from what was read and
    the clock. ``on_lost(reason)`` is called once, for the first rank lost or for a store
    that has not answered for the timeout; both threads then end. stop() ends them too.
    It starts in the engine's start-up phase; its owner calls :meth:`end_startup`.
    """

    def __init__(self, store: Any, key_of: Callable[[str], str], ranks: Iterable[int],
                 timeout_s: float, on_lost: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(timeout_s / BEATS_PER_TIMEOUT, "keepalive-liveness")
        self._store = store
        self._key_of = key_of
        self._ranks = list(ranks)
        self._clock = clock
        self._lock = threading.Lock()
        self._core = LivenessCore(self._ranks, timeout_s, clock())
        self._on_lost = on_lost
        self._errors = _RateLimited("reading heartbeats from torchrun's store", clock)
        self._last_error: BaseException | None = None
        self._reader = threading.Thread(target=self._read_loop, name="keepalive-liveness-reader",
                                        daemon=True)
        #: the rank declared lost, once one is (a store's silence declares none)
        self.lost_rank: int | None = None

    def start(self) -> None:
        """Start the reader and the decision thread (once)."""
        self._reader.start()
        super().start()

    def end_startup(self) -> None:
        """The engine's start-up is over (every rank answered its warm-up): from now on a
        rank still for the timeout is lost. Logs each rank that was still for longer during
        the start-up (a stall of its own process, excused there, a loss from now on)."""
        with self._lock:
            stalls = self._core.end_startup(self._clock())
        for rank, still in sorted(stalls.items()):
            logger.warning(
                "keepalive liveness: rank %d sent no heartbeat for %.2fs during the engine's "
                "start-up (a C call holding its GIL, e.g. vLLM's full garbage collection after "
                "the warm-up); allowed there, but from now on a rank still for %s=%gs is "
                "lost: raise it if that rank can stall so long while serving",
                rank, still, ENV_LIVENESS, self._core.timeout_s)

    def heartbeat_ages(self) -> dict[int, float]:
        """Each watched rank's heartbeat age now (see :meth:`LivenessCore.still_for`)."""
        with self._lock:
            return self._core.still_for(self._clock())

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            for r in self._ranks:
                try:
                    value = int(self._store.add(_key(self._key_of, r), 0))
                except Exception as e:  # noqa: BLE001 - not a loss by itself; silence is
                    self._last_error = e
                    self._errors.failed(e)
                    continue
                self._last_error = None  # the error to name is the one in a silence
                with self._lock:
                    self._core.observe(r, value, self._clock())
            # decide at once from fresh reads (no wait for the decision thread's next tick)
            if not self._tick():
                return
            self._stop.wait(self._period)

    def _tick(self) -> bool:
        """Decide; called by both threads, so the first verdict is the only one."""
        with self._lock:
            if self._stop.is_set():
                return False
            now = self._clock()
            excused = self._core.tick(now)
            silent = self._core.store_silent(now)
            lost = self._core.lost(now)
            starting = self._core.starting
            if silent is not None or lost:
                self._stop.set()  # both threads end; on_lost runs once, below
            if lost and silent is None:
                self.lost_rank = lost[0][0]
        if excused >= self._core.timeout_s / 2:
            logger.warning(
                "keepalive liveness: this process ran no heartbeat check for %.2fs (a C call "
                "holding the GIL, e.g. a full garbage collection, or a starved CPU, e.g. "
                "autogroup scheduling beside a busy process: docs/usage.md, 'A shared CPU "
                "host'); that time is not counted against torchrun's store or any rank, but "
                "the same stall of another rank would be", excused)
        if silent is not None:
            cause = f"; last error: {self._last_error}" if self._last_error else \
                " (calls blocked)"
            self._on_lost(
                f"torchrun's store has not answered for {silent:.2f}s ({ENV_LIVENESS}="
                f"{self._core.timeout_s:g}s){cause}: node 0's agent, or the network to it, "
                "is lost"
            )
            return False
        if lost:
            rank, since = lost[0]
            limit = (f"the engine's start-up allows {STARTUP_TIMEOUT_FACTOR} x "
                     if starting else "")
            self._on_lost(
                f"rank {rank} sent no heartbeat for {since:.2f}s (torchrun mode, {limit}"
                f"{ENV_LIVENESS}={self._core.timeout_s:g}s): its process or node is lost"
            )
            return False
        return True


#: A follower whose driver's process is gone (and that has not ended by itself meanwhile)
#: ends this long after: a clean shutdown's own clean-up normally ends it first.
DRIVER_GONE_EXIT_S = 3.0


class DriverWatch(ProcessWatch):
    """Thread ``keepalive-driver-watch`` in a follower on rank 0's node: ends the follower
    ``DRIVER_GONE_EXIT_S`` after rank 0's engine process (the driver) is gone.

    Its channel tells a follower that waits on it: the driver's end of the group closes.
    A follower inside a step's collective learns nothing from it: on CPU, vLLM's one-node
    all-reduce (shared memory) spins on a peer that will never arrive, holding the follower
    until torchrun's SIGKILL 30 s after its SIGTERM (which the follower defers while it
    follows: the driver's shutdown still has to reach it). Seen in a chaos run: a follower
    frozen past the liveness timeout, thawed after rank 0 ended. On another node the driver
    cannot be watched by pid; there the step's gloo collectives fail with the peer's
    connection, and NCCL's are bounded by the collective timeout.
    Exit code ``OK`` once a stop was requested (torchrun's SIGTERM), else ``FAILED``."""

    thread_name = "keepalive-driver-watch"

    def __init__(self, pid: int, stop_requested: threading.Event, **kwargs: Any) -> None:
        kwargs.setdefault("exit_after_s", DRIVER_GONE_EXIT_S)
        super().__init__(pid, **kwargs)
        self._stop_requested = stop_requested

    def reason(self) -> str:
        return (f"the driver (rank 0's engine process, pid {self.pid}) is gone; this rank "
                f"ends {self._exit_after_s:g}s from now unless it has ended by then")

    def exit_code(self) -> int:
        return exit_codes.OK if self._stop_requested.is_set() else exit_codes.FAILED

    @classmethod
    def for_driver(cls, driver: dict[str, Any] | None, stop_requested: threading.Event,
                   **kwargs: Any) -> DriverWatch | None:
        """A started watch over the driver that the bootstrap names (``driver``: its pid
        and :func:`pid_space`), if it lives in this process's pid space; else None."""
        if not driver or not driver.get("pid") or driver.get("pid_space") != pid_space():
            return None
        watch = cls(int(driver["pid"]), stop_requested, **kwargs)
        watch.start()
        return watch
