"""The pacer: when the driver is idle, send a no-op keepalive before the receivers time out.

State machine
=============

::

                begin_step()                      finish_step() of the last step
      +------+ ------------------> +------+ ------------------------------> +------+
      | IDLE |                     | BUSY |                                 | IDLE |
      +------+ <------------------ +------+ <------------------------------ +------+
         |  ^    finish_step()       |  ^  begin_step() / finish_step()
         |  |    (in_flight == 0)    |  |  of overlapping steps (in_flight > 0)
         |  +------------------------+  +--+
         |   keepalive sent when now - last_broadcast >= interval (IDLE only)
         |
         | stop()                     fail(error)
         v                            (from any state: a keepalive could not be sent)
     +----------+   thread exits   +---------+        +--------+
     | STOPPING | ---------------> | STOPPED |        | FAILED |
     +----------+                  +---------+        +--------+

* ``in_flight`` counts steps that began and have not finished. A non-blocking step stays in
  flight until its result has been taken, so the count may exceed one.
* ``last_broadcast`` is the time of the last frame of any kind. Every receiver entered its
  current wait after that frame arrived, so ``now - last_broadcast`` bounds how long any
  receiver has been waiting: measuring from it is conservative.

Guarantees (checked as invariants by tests/test_pacer.py):

1. No keepalive while a step is in flight (with NCCL a keepalive between two all-reduces of
   one step would deadlock or corrupt it). The decision and the send happen under one lock
   that ``begin_step`` also takes, so a step cannot begin between "decide" and "send".
2. While idle, the gap between consecutive broadcasts is at most ``interval`` plus the
   thread's wake-up latency (the *slack*: a timed ``Condition.wait`` returning late under
   load; tens of milliseconds on a loaded 2-core machine, far below the interval rule).
3. After ``stop()`` returns, the pacer sends nothing. The executor then sends SHUTDOWN, the
   last frame every receiver sees.

The decision logic lives in :class:`PacerCore`, a plain object with an injectable clock that
property tests drive without threads or sleeps; :class:`Pacer` wraps it in one thread.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["PacerState", "PacerCore", "Pacer", "PacerError"]

# Under the "vllm." namespace so that vLLM's logging configuration (format, level) applies.
logger = logging.getLogger("vllm." + __name__)

Clock = Callable[[], float]


class PacerError(RuntimeError):
    """Misuse of the pacer (finish without begin, begin after stop) or a failed keepalive."""


class PacerState(enum.Enum):
    """Named states of the pacer (see the module docstring)."""

    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class PacerCore:
    """The pure idle/busy decision: no threads, no I/O, time from the caller."""

    def __init__(self, interval: float, now: float) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        self.interval = float(interval)
        self.in_flight = 0
        self.last_broadcast = now
        self.state = PacerState.IDLE
        self.error: BaseException | None = None

    @property
    def accepting(self) -> bool:
        """Whether steps may begin (not stopping, stopped or failed)."""
        return self.state in (PacerState.IDLE, PacerState.BUSY)

    def begin_step(self) -> None:
        """A step (any broadcast followed by collective work) begins."""
        if not self.accepting:
            raise PacerError(f"cannot begin a step: pacer is {self.state.value}")
        self.in_flight += 1
        self.state = PacerState.BUSY

    def finish_step(self) -> None:
        """A step finished (for a non-blocking step: its result was taken)."""
        if self.in_flight <= 0:
            raise PacerError("finish_step() without a matching begin_step()")
        self.in_flight -= 1
        if self.in_flight == 0 and self.state is PacerState.BUSY:
            self.state = PacerState.IDLE

    def note_broadcast(self, now: float) -> None:
        """Any frame (work or keepalive) was broadcast at ``now``."""
        self.last_broadcast = max(self.last_broadcast, now)

    def keepalive_due_at(self) -> float | None:
        """When the next keepalive is due, or None if none may be sent in this state."""
        if self.state is not PacerState.IDLE:
            return None
        return self.last_broadcast + self.interval

    def should_send(self, now: float) -> bool:
        """The decision itself: idle and the last broadcast is ``interval`` old."""
        due = self.keepalive_due_at()
        return due is not None and now >= due

    def stop(self) -> None:
        """No more keepalives from now on."""
        if self.state is not PacerState.FAILED:
            self.state = PacerState.STOPPING

    def stopped(self) -> None:
        """The pacer's thread has exited."""
        if self.state is not PacerState.FAILED:
            self.state = PacerState.STOPPED

    def fail(self, error: BaseException) -> None:
        """A keepalive could not be sent: the channel is broken."""
        self.state = PacerState.FAILED
        self.error = error


class Pacer:
    """Runs a :class:`PacerCore` in a daemon thread named ``keepalive-pacer``.

    ``send_keepalive`` broadcasts one keepalive frame; it is called with the pacer's lock
    held, so no step can begin while it runs. ``send_lock`` (the channel's lock) is taken
    around it too, making every broadcast go through one lock.
    """

    def __init__(
        self,
        interval: float,
        send_keepalive: Callable[[], object],
        *,
        send_lock: threading.RLock | None = None,
        clock: Clock = time.monotonic,
        on_failure: Callable[[BaseException], None] | None = None,
        name: str = "keepalive-pacer",
    ) -> None:
        self._clock = clock
        self._core = PacerCore(interval, clock())
        self._send_keepalive = send_keepalive
        self._send_lock = send_lock or threading.RLock()
        self._on_failure = on_failure
        self._cond = threading.Condition(threading.Lock())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.keepalives_sent = 0

    # -- the engine's side -------------------------------------------------------
    @property
    def state(self) -> PacerState:
        """Current state."""
        return self._core.state

    @property
    def interval(self) -> float:
        """Seconds of idleness after which a keepalive is sent."""
        return self._core.interval

    @property
    def error(self) -> BaseException | None:
        """Why the pacer failed, if it did."""
        return self._core.error

    def start(self) -> None:
        """Start the thread (once)."""
        self._thread.start()

    def begin_step(self) -> None:
        """Mark a step as begun; blocks while a keepalive is being sent."""
        with self._cond:
            self._core.begin_step()

    def finish_step(self) -> None:
        """Mark a step as finished; wakes the thread so it can re-arm its timer."""
        with self._cond:
            self._core.finish_step()
            self._cond.notify_all()

    def note_broadcast(self) -> None:
        """Record that a work frame was just broadcast."""
        with self._cond:
            self._core.note_broadcast(self._clock())

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread; after this returns no keepalive is sent. Safe to call twice."""
        with self._cond:
            self._core.stop()
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._cond:
            self._core.stopped()

    # -- the thread ----------------------------------------------------------------
    def tick(self) -> float | None:
        """One pass of the thread's loop: send a keepalive if one is due.

        Returns the seconds until the next decision, or None when only a notification
        (a step finishing, stop) can change it. The thread calls this; property tests call
        it directly with a fake clock instead of running the thread.
        """
        with self._cond:
            return self._tick_locked()

    def _tick_locked(self) -> float | None:
        now = self._clock()
        if not self._core.should_send(now):
            due = self._core.keepalive_due_at()  # None unless idle
            return None if due is None else due - now
        try:
            with self._send_lock:
                self._send_keepalive()
        except BaseException as e:  # noqa: BLE001 - reported by the thread, then it ends
            self._core.fail(e)
            raise
        self.keepalives_sent += 1
        self._core.note_broadcast(self._clock())
        return self._core.interval

    def _run(self) -> None:
        failure: BaseException | None = None
        with self._cond:
            while self._core.accepting:
                try:
                    wait = self._tick_locked()
                except BaseException as e:  # noqa: BLE001
                    failure = e
                    break
                if self._core.accepting:
                    self._cond.wait(wait)
        if failure is not None:
            # Outside the lock: the callback may call back into the executor.
            logger.error("keepalive broadcast failed; the pacer stops: %s", failure)
            if self._on_failure is not None:
                self._on_failure(failure)
