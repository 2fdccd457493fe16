"""The executor's failure model: its named states, and the watch over the step rank 0 is in.

States
======

::

                   fail(reason)                     shutdown()
     +---------+ ---------------> +--------+ ----------------------> +---------+
     | RUNNING |                  | FAILED |                         | STOPPED |
     +---------+ ----------------------------------------------------> +---------+
                                shutdown()

States only move forward. ``FAILED`` is entered once, with the first reason (a rank died, a
collective broke or timed out, a step raised on rank 0 after the other ranks had received it);
every later call raises :class:`ExecutorFailedError` naming that reason at once. ``is_failed``
is what vLLM's fault-tolerance sentinel reads on ``MultiprocExecutor``.

Which step is rank 0 in
=======================

:class:`Lifecycle` also records the step rank 0's thread is inside (its name, when it began,
its deadline). "Is a step running" and "has a rank failed" are one decision under one lock:
:meth:`Lifecycle.enter` refuses to begin a step once failed, and :meth:`Lifecycle.fail`
captures the step in progress at the moment of failure. A step that is still inside after a
failure is one whose collectives may wait for the failed rank forever (the CPU shared-memory
all-reduce and an NCCL kernel have no timeout of their own).

:class:`StepWatch` (thread ``keepalive-step-watch``) acts on two deadlines, decided by the pure
function :func:`decide` with an injectable clock:

* **step timeout**: a step still inside after its deadline (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``
  for model steps, the caller's ``timeout`` for ``collective_rpc``) fails the executor;
* **give up**: a step still inside ``failure_grace`` seconds after a failure cannot finish;
  the executor then gives it up: the pending call fails with the reason, wherever rank 0 is
  blocked, since the whole step runs on rank 0's own thread and the caller only waits for it
  (see :mod:`keepalive_executor.steps`). Start-up is watched the same way: rank 0's wait in
  the rendezvous is a step, so a rank that dies there fails start-up within the grace.

A rank that dies during a step makes that step's collectives impossible, so the grace only
has to cover a step that had already passed its last collective when the rank died.

Steps in flight
===============

The lifecycle is also the one place that knows whether a step is *in flight*, which is all
the pacer (:mod:`keepalive_executor.pacer`) needs to know of steps: no keepalive may be
broadcast between a step's broadcast and the end of its collective work. A step is in flight
from :meth:`Lifecycle.enter` until :meth:`Lifecycle.exit`, or, if :meth:`Lifecycle.hold` was
called inside it (a pipeline step, whose output reaches rank 0 later), until that output's
future is done. An entry with ``local=True`` (rank 0 alone, nothing broadcast: the wait for
an async output) is watched but not in flight. Each entry leaves flight once, whichever of
``exit`` and the output's arrival comes last, so the count never goes below zero however a
give-up interleaves them. The pacer's thread reads :attr:`Lifecycle.in_flight` when it
wakes; nothing on a step's path calls the pacer.

Steps do not wake the watch. It sleeps until the deadline it knows of, or for its *horizon*
(the model steps' timeout) when it knows of none, and :meth:`Lifecycle.enter` wakes it only for
a step whose deadline falls before the watch would look anyway (a ``collective_rpc`` with a
short ``timeout``); a model step's deadline never does. Leaving a step wakes nothing: the watch
finds the step gone when it looks. A failure and a stop wake it at once. So a model step costs
the watch no thread switch.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from keepalive_executor.log import get_logger

__all__ = [
    "ExecutorState",
    "ExecutorFailedError",
    "StepInProgress",
    "Failure",
    "Lifecycle",
    "WatchAction",
    "decide",
    "StepWatch",
]

logger = get_logger(__name__)
Clock = Callable[[], float]


class ExecutorState(enum.Enum):
    """Named states of the executor (see the module docstring)."""

    RUNNING = "running"
    FAILED = "failed"
    STOPPED = "stopped"


class ExecutorFailedError(RuntimeError):
    """The executor is failed or stopped; the message says why."""


@dataclass(frozen=True, eq=False)
class StepInProgress:
    """The step rank 0's thread is inside (each entry is its own: compared by identity)."""

    name: str
    since: float
    deadline: float | None = None
    timeout_s: float | None = None
    timeout_source: str = ""
    thread: int = 0


@dataclass(frozen=True)
class Failure:
    """Why the executor failed, when, and the step rank 0 was inside at that moment."""

    reason: str
    at: float
    stuck: StepInProgress | None


class Lifecycle:
    """The state, the failure, the current step and the steps in flight, under one
    condition."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self.cond = threading.Condition(threading.Lock())
        self._state = ExecutorState.RUNNING
        self._failure: Failure | None = None
        self._step: StepInProgress | None = None
        #: entries no keepalive may land inside (see "Steps in flight"), and those of them
        #: that stay in flight after rank 0 left them, until their output arrived
        self._in_flight: set[StepInProgress] = set()
        self._held: set[StepInProgress] = set()
        #: when the step watch looks next (it sleeps until then); None: it waits to be woken
        #: (or there is no watch). Written by the watch, read by enter(), under ``cond``.
        self.watch_looks_at: float | None = None

    @property
    def state(self) -> ExecutorState:
        """The current state."""
        return self._state

    @property
    def failure(self) -> Failure | None:
        """The failure, once failed."""
        return self._failure

    @property
    def step(self) -> StepInProgress | None:
        """The step rank 0 is inside, if any."""
        return self._step

    @property
    def in_flight(self) -> int:
        """Steps in flight: entered (not ``local``) and not yet out of flight."""
        return len(self._in_flight)

    @property
    def is_failed(self) -> bool:
        """True once failed (stays True after a later shutdown)."""
        return self._failure is not None

    def error(self) -> ExecutorFailedError | None:
        """The error every call raises now, or None while running."""
        if self._state is ExecutorState.RUNNING:
            return None
        if self._failure is not None:
            return ExecutorFailedError(f"keepalive executor failed: {self._failure.reason}")
        return ExecutorFailedError("keepalive executor is shut down")

    def check_usable(self) -> None:
        """Raise ExecutorFailedError unless running."""
        err = self.error()
        if err is not None:
            raise err

    def enter(
        self, name: str, timeout_s: float | None = None, timeout_source: str = "",
        *, local: bool = False,
    ) -> StepInProgress:
        """Rank 0 begins a step; refused (ExecutorFailedError) unless running. The step is
        in flight from now on, unless ``local`` (rank 0 alone: nothing is broadcast)."""
        with self.cond:
            self.check_usable()
            if self._step is not None:
                raise RuntimeError(
                    f"keepalive executor: {name} began while rank 0 is inside {self._step.name}"
                )
            now = self.clock()
            deadline = None if timeout_s is None else now + timeout_s
            self._step = StepInProgress(
                name, now, deadline, timeout_s, timeout_source, threading.get_ident(),
            )
            if not local:
                self._in_flight.add(self._step)
            if deadline is not None and (self.watch_looks_at is None
                                         or deadline < self.watch_looks_at):
                self.cond.notify_all()  # the watch would look too late
            return self._step

    def exit(self) -> None:
        """Rank 0 left its step (returned or raised); the step leaves flight too unless it
        is held. Wakes nothing (see the module docstring)."""
        with self.cond:
            step, self._step = self._step, None
            if step is not None and step not in self._held:
                self._in_flight.discard(step)

    def hold(self, step: StepInProgress, until: Future) -> None:
        """Keep ``step`` in flight after rank 0 leaves it, until ``until`` is done (a
        pipeline step: until the last stage's output reached rank 0). Nothing if the step
        already left flight (its caller left first, after a give-up)."""
        with self.cond:
            if step not in self._in_flight:
                return
            self._held.add(step)
        until.add_done_callback(lambda _: self._land(step))

    def _land(self, step: StepInProgress) -> None:
        with self.cond:
            self._held.discard(step)
            if step is not self._step:
                self._in_flight.discard(step)

    def fail(self, reason: str) -> Failure | None:
        """Enter FAILED (once); return the failure, or None if not running any more.

        ``Failure.stuck`` is the step rank 0 is inside, unless the failure is reported by
        that step's own thread (it is on its way out of the step, not stuck in it)."""
        with self.cond:
            if self._state is not ExecutorState.RUNNING:
                return None
            self._state = ExecutorState.FAILED
            step = self._step
            if step is not None and step.thread == threading.get_ident():
                step = None
            self._failure = Failure(reason, self.clock(), step)
            self.cond.notify_all()
            return self._failure

    def stop(self) -> ExecutorState:
        """Enter STOPPED; return the state it left."""
        with self.cond:
            previous = self._state
            self._state = ExecutorState.STOPPED
            self.cond.notify_all()
            return previous


class WatchAction(enum.Enum):
    """What the step watch does now."""

    NONE = "none"
    TIMEOUT = "timeout"
    GIVE_UP = "give-up"


def decide(
    now: float,
    state: ExecutorState,
    step: StepInProgress | None,
    failure: Failure | None,
    grace_s: float,
) -> tuple[WatchAction, float | None]:
    """The watch's decision: an action, and when to look again (None: on a change only)."""
    if step is None:
        return WatchAction.NONE, None
    if state is ExecutorState.RUNNING:
        if step.deadline is None:
            return WatchAction.NONE, None
        if now >= step.deadline:
            return WatchAction.TIMEOUT, None
        return WatchAction.NONE, step.deadline
    if state is ExecutorState.FAILED and failure is not None:
        give_up_at = failure.at + grace_s
        if now >= give_up_at:
            return WatchAction.GIVE_UP, None
        return WatchAction.NONE, give_up_at
    return WatchAction.NONE, None  # stopped: nothing more to watch


class StepWatch:
    """Thread ``keepalive-step-watch``: applies :func:`decide` to a :class:`Lifecycle`.

    ``on_timeout(step)`` is called (outside the lock) when a step passes its deadline;
    ``on_give_up(failure, step)`` once, when a step outlives the failure grace. The thread
    ends after a give-up or when the lifecycle is stopped; the executor owns it. Tests drive
    the same decisions without the thread through :meth:`check`, on the lifecycle's clock.
    ``horizon_s``: how long the thread sleeps when it knows of no deadline (the model steps'
    timeout: a model step entered meanwhile then never needs to wake it).
    """

    def __init__(
        self,
        lifecycle: Lifecycle,
        grace_s: float,
        on_timeout: Callable[[StepInProgress], None],
        on_give_up: Callable[[Failure, StepInProgress], None],
        horizon_s: float = 300.0,
    ) -> None:
        self._life = lifecycle
        self._grace_s = grace_s
        self._horizon_s = horizon_s
        self._on_timeout = on_timeout
        self._on_give_up = on_give_up
        self._timed_out: StepInProgress | None = None  # reported: wait for the failure
        self._gave_up = False
        self._thread = threading.Thread(target=self._run, name="keepalive-step-watch",
                                        daemon=True)

    def start(self) -> None:
        """Start the thread (once)."""
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after the lifecycle is stopped)."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def check(self) -> WatchAction:
        """One decision at the lifecycle's clock, and its action; returns the action."""
        with self._life.cond:
            action, _, step, failure = self._decide()
        self._act(action, step, failure)
        return action

    def _decide(self) -> tuple[WatchAction, float | None, StepInProgress | None,
                               Failure | None]:
        life = self._life
        if self._gave_up:
            return WatchAction.NONE, None, None, None
        action, wake = decide(life.clock(), life.state, life.step, life.failure,
                              self._grace_s)
        if action is WatchAction.TIMEOUT and life.step is self._timed_out:
            action = WatchAction.NONE  # already reported: wait for the failure
        return action, wake, life.step, life.failure

    def _act(self, action: WatchAction, step: StepInProgress | None,
             failure: Failure | None) -> None:
        if action is WatchAction.TIMEOUT:
            assert step is not None
            self._timed_out = step
            self._on_timeout(step)
        elif action is WatchAction.GIVE_UP:
            assert step is not None and failure is not None
            self._gave_up = True
            self._on_give_up(failure, step)

    def _run(self) -> None:
        life = self._life
        while True:
            with life.cond:
                if life.state is ExecutorState.STOPPED or self._gave_up:
                    return
                action, wake, step, failure = self._decide()
                if action is WatchAction.NONE:
                    now = life.clock()
                    life.watch_looks_at = now + self._horizon_s if wake is None else wake
                    life.cond.wait(max(0.0, life.watch_looks_at - now))
                    life.watch_looks_at = None
                    continue
            self._act(action, step, failure)
