"""The pacer: when the driver is idle, send a no-op keepalive before the receivers time out.

State machine
=============

::

                a step in flight                   no step in flight any more
      +------+ ------------------> +------+ ------------------------------> +------+
      | IDLE |                     | BUSY |                                 | IDLE |
      +------+ <------------------ +------+ <------------------------------ +------+
         |     (as the thread sees them when it looks: it is told nothing)
         |
         |   keepalive sent when now - last_broadcast >= interval (IDLE only)
         |
         | stop()                     fail(error)
         v                            (from any state: a keepalive could not be sent)
     +----------+   thread exits   +---------+        +--------+
     | STOPPING | ---------------> | STOPPED |        | FAILED |
     +----------+                  +---------+        +--------+

The pacer owns no step bookkeeping. It reads two things when it wakes, each from its one
owner:

* ``busy()``: whether a step is in flight, from :class:`~keepalive_executor.lifecycle.Lifecycle`
  (a step is in flight from its lifecycle entry until rank 0 left it, or, under pipeline
  parallelism, until its output reached rank 0; several may be in flight at once);
* ``last_frame()``: when the channel sent its last frame of any kind (the channel stamps
  every frame; the pacer also remembers its own keepalives). Every receiver entered its
  current wait after that frame arrived, so ``now - last_broadcast`` bounds how long any
  receiver has been waiting: measuring from it is conservative.

Guarantees (checked as invariants by tests/test_pacer.py):

1. No keepalive while a step is in flight (with NCCL a keepalive between two all-reduces of
   one step would deadlock or corrupt it). The thread takes the channel's send lock, then
   reads ``busy()`` and decides ("idle and due?") and sends while still holding it. A step
   enters the lifecycle before its broadcast, which takes the same lock: a step that enters
   after the decision broadcasts after the keepalive, so the keepalive precedes the whole
   step; a step that entered before it makes the decision "busy". The pacer's own condition
   is never held across a send, and a step never waits for the pacer (it does not call it),
   so nothing on a step's path waits for a broadcast that may block (on a GPU a copy can wait
   for the previous broadcast), and ``stop`` does not either.
2. No receiver waits on the channel longer than ``interval`` plus the thread's wake-up
   latency (the *slack*: a timed ``Condition.wait`` returning late under load; tens of
   milliseconds on a loaded 2-core machine, far below the interval rule). A receiver waits
   from the end of its last step (or the last frame, if that came later); the next frame
   is due ``interval`` after the last one, and comes at the latest ``interval`` after the
   last step finished: the thread looks every ``interval`` while steps run, so a step that
   outlasted the interval is followed by a keepalive within one interval of its end.
   "The end of the step" is rank 0's: under pipeline parallelism a step stays in flight
   until the last stage's output reached rank 0 (:mod:`.outputs`), and a stage-0 receiver
   finished its part long before. Its wait is bounded by the time the steps stay in flight
   after its part ended, plus ``interval`` plus the slack; not by the interval. A step
   stays in flight at most ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (the output's receive
   fails the executor then), and while serving a new step is broadcast every step, so such
   waits last about a step; a pipeline step in flight longer than the collective timeout
   minus the interval would time out stage-0 receivers (the default step timeout, 300 s,
   comes first with the default collective timeouts).
3. After ``stop()`` or ``request_stop()`` returns, no keepalive begins. ``stop(timeout)``
   joins the thread for at most ``timeout`` seconds whatever the channel does (a thread stuck
   in a send is a daemon and is left behind). The executor then sends SHUTDOWN, the last frame
   every receiver sees.

Nothing on a step's path wakes the thread, or calls the pacer at all: the thread wakes on its
own clock (when a keepalive is due while idle, every ``interval`` while busy) and on
``stop``/``request_stop``; so a step costs no thread switch here, and a busy pacer wakes once
per interval instead of once per step.

The decision logic lives in :class:`PacerCore`, a plain object with an injectable clock that
property tests drive without threads or sleeps (``busy`` is its input); :class:`Pacer` wraps
it in one thread.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

from keepalive_executor.log import get_logger

__all__ = ["PacerState", "PacerCore", "Pacer"]

logger = get_logger(__name__)

Clock = Callable[[], float]


class PacerState(enum.Enum):
    """Named states of the pacer (see the module docstring)."""

    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class PacerCore:
    """The pure idle/busy decision: no threads, no I/O; time and ``busy`` (a step in flight)
    from the caller."""

    def __init__(self, interval: float, now: float) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        self.interval = float(interval)
        self.last_broadcast = now
        self.stop_state: PacerState | None = None  # STOPPING, STOPPED or FAILED, else None
        self.error: BaseException | None = None

    @property
    def running(self) -> bool:
        """Whether keepalives may still be sent (not stopping, stopped or failed)."""
        return self.stop_state is None

    def state(self, busy: bool) -> PacerState:
        """The named state, given whether a step is in flight."""
        if self.stop_state is not None:
            return self.stop_state
        return PacerState.BUSY if busy else PacerState.IDLE

    def note_broadcast(self, now: float) -> None:
        """A frame (work or keepalive) was broadcast at ``now``."""
        self.last_broadcast = max(self.last_broadcast, now)

    def keepalive_due_at(self, busy: bool) -> float | None:
        """When the next keepalive is due, or None if none may be sent in this state."""
        if self.state(busy) is not PacerState.IDLE:
            return None
        return self.last_broadcast + self.interval

    def next_look(self, now: float, busy: bool) -> float | None:
        """When the thread should look again, if nothing but the clock changes: when the
        next keepalive is due while idle, one interval from now while busy (a step that ends
        meanwhile is not announced), never once stopping or failed."""
        due = self.keepalive_due_at(busy)
        if due is not None:
            return due
        if self.running:
            return now + self.interval
        return None

    def should_send(self, now: float, busy: bool) -> bool:
        """The decision itself: idle and the last broadcast is ``interval`` old."""
        due = self.keepalive_due_at(busy)
        return due is not None and now >= due

    def stop(self) -> None:
        """No more keepalives from now on."""
        if self.stop_state is not PacerState.FAILED:
            self.stop_state = PacerState.STOPPING

    def stopped(self) -> None:
        """The pacer's thread has exited."""
        if self.stop_state is not PacerState.FAILED:
            self.stop_state = PacerState.STOPPED

    def fail(self, error: BaseException) -> None:
        """A keepalive could not be sent: the channel is broken."""
        self.stop_state = PacerState.FAILED
        self.error = error


class Pacer:
    """Runs a :class:`PacerCore` in a daemon thread named ``keepalive-pacer``.

    ``send_keepalive`` broadcasts one keepalive frame; the thread calls it holding
    ``send_lock`` (the channel's lock, which every broadcast takes) and not the pacer's own
    condition. ``busy()`` says whether a step is in flight (the lifecycle's count) and
    ``last_frame()`` when the channel last sent a frame; the thread reads both under the
    send lock, when it wakes (without them: never busy, and only its own keepalives count).
    ``on_thread_start`` runs first in the thread (the channel binds its device there).
    """

    def __init__(
        self,
        interval: float,
        send_keepalive: Callable[[], object],
        *,
        send_lock: threading.RLock | None = None,
        busy: Callable[[], bool] = lambda: False,
        last_frame: Callable[[], float] | None = None,
        clock: Clock = time.monotonic,
        on_failure: Callable[[BaseException], None] | None = None,
        on_thread_start: Callable[[], None] | None = None,
        name: str = "keepalive-pacer",
    ) -> None:
        self._clock = clock
        self._core = PacerCore(interval, clock())
        self._send_keepalive = send_keepalive
        self._send_lock = send_lock or threading.RLock()
        self._busy = busy
        self._last_frame = last_frame
        self._on_failure = on_failure
        self._on_thread_start = on_thread_start
        self._cond = threading.Condition(threading.Lock())
        self._changes = 0  # bumped on every stop request, so the thread never misses one
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.keepalives_sent = 0

    @property
    def state(self) -> PacerState:
        """Current state (idle or busy as a look now would see it)."""
        return self._core.state(self._busy())

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

    def request_stop(self) -> None:
        """No keepalive begins after this returns; does not wait for the thread."""
        with self._cond:
            self._core.stop()
            self._changes += 1
            self._cond.notify_all()

    def stop(self, timeout: float | None = 5.0) -> bool:
        """Stop, and join the thread for at most ``timeout`` seconds; True if it exited.
        Safe to call twice, and from any thread."""
        self.request_stop()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        exited = not self._thread.is_alive()
        if exited or not self._thread.ident:
            with self._cond:
                self._core.stopped()
        else:
            logger.warning(
                "keepalive pacer thread still inside a send %ss after stop; leaving it "
                "(daemon): it sends nothing more", timeout,
            )
        return exited

    # -- the thread ----------------------------------------------------------------
    def tick(self) -> float | None:
        """One pass of the thread's loop: send a keepalive if one is due.

        Returns the seconds until the thread should look again, or None when only a stop
        request can change anything. The thread calls this; property tests call it directly
        with a fake clock instead of running the thread.
        """
        with self._send_lock:
            busy = self._busy()
            with self._cond:
                if self._last_frame is not None:
                    self._core.note_broadcast(self._last_frame())
                now = self._clock()
                if not self._core.should_send(now, busy):
                    look = self._core.next_look(now, busy)
                    return None if look is None else look - now
            # Holding only the send lock: a step that enters now broadcasts after us.
            try:
                self._send_keepalive()
            except BaseException as e:  # noqa: BLE001 - reported by the thread, then it ends
                with self._cond:
                    self._core.fail(e)
                raise
            with self._cond:
                self.keepalives_sent += 1
                self._core.note_broadcast(self._clock())
                return self._core.interval

    def _run(self) -> None:
        failure: BaseException | None = None
        if self._on_thread_start is not None:
            self._on_thread_start()
        while True:
            with self._cond:
                if not self._core.running:
                    break
                seen = self._changes
            try:
                wait = self.tick()
            except BaseException as e:  # noqa: BLE001
                failure = e
                break
            with self._cond:
                if self._core.running and self._changes == seen:
                    self._cond.wait(wait)
        if failure is not None:
            # Outside the lock: the callback may call back into the executor.
            logger.error("keepalive broadcast failed; the pacer stops: %s", failure)
            if self._on_failure is not None:
                self._on_failure(failure)
