"""One engine call, one :class:`Step`: built by the executor, run by :meth:`StepRunner.submit`.

Every engine call that puts work on the channel (``execute_model``, ``sample_tokens``,
``collective_rpc``, ...) is one :class:`Step` value: the request the other ranks run, what
rank 0 runs, and the **reply policy** (:class:`~keepalive_executor.rpc.Replies`), which says
what rank 0 waits for and what the others send back:

==========  ================================  ==========================================
policy      rank 0 waits for                  every other rank sends
==========  ================================  ==========================================
DRIVER      nothing: its own output is the    nothing (an error is fatal on that rank)
            step's output
ALL         the reply gather (CPU group)      its reply, or its error
STEP        the reply gather, then merges     its KV/EC connector outputs (connectors.py)
            the connector outputs
OUTPUT      the output rank's reply, later,   the output rank: its output on the output
            on the output link (outputs.py)   link; the others nothing
==========  ================================  ==========================================

(The other ranks' halves live in :mod:`keepalive_executor.worker_loop`.)

:meth:`StepRunner.submit` is the only way in, and its answer is always a Future, as mp's
``FutureWrapper`` is for mp: done at once for DRIVER, ALL and STEP; resolved by the output
link's thread for OUTPUT; resolved when first asked for if it is an async output
(:mod:`keepalive_executor.deferred`); and the sampled half of a fused step is a Future too,
waiting for the engine's ``sample_tokens``. ``submit`` returns once rank 0's part is done.

One step's life, top-down (:meth:`StepRunner.submit`)::

    engine thread (or a user's thread)         driver thread (keepalive-driver)
    ----------------------------------         --------------------------------
    encode the call (nothing held yet)
    take the channel owner lock
    enter the lifecycle (refused once failed;
      in flight: no keepalive from here)
    hand the step to the driver thread  ---->  QUEUED -> BEGUN
    wait for its outcome (a Future that        broadcast                      -> SENT
    a give-up can fail at any time)            rank 0's own part
                                               what the reply policy waits for -> SETTLED
    <------------------------------------------ outcome
    leave the lifecycle, release the lock (reverse order, by context managers)
    the step's answer, as a Future

1. the **channel owner lock** (re-entrant: whoever holds it owns the channel for a whole
   step, so a ``collective_rpc`` from another thread never lands inside a step);
2. the **lifecycle** entry (:class:`~keepalive_executor.lifecycle.Lifecycle`: refused once
   failed; records which step rank 0 is inside, with its deadline, and that a step is in
   flight, which is all the pacer reads of steps: no keepalive until it left flight; an
   OUTPUT step stays in flight until its output arrived). The step tells the pacer nothing;
3. the broadcast, rank 0's own part and the reply wait all run on the driver's thread, in one
   hand-over. The calling thread only ever waits on that hand-over's Future, so when the step
   is given up (a rank failed and the step cannot finish, see
   :mod:`keepalive_executor.lifecycle`), the caller is released at once, wherever rank 0 is
   blocked: in its model, in the reply gather, or in the channel's wait for a free frame.

Its states (:class:`StepState`)::

    QUEUED --(rank 0's thread takes it)--> BEGUN --(broadcast)--> SENT --(replies)--> SETTLED
      |                                      |
      | the caller left first                | ended before its broadcast
      v                                      v
    CANCELLED (never runs)                 UNSENT (nothing was sent)

If the caller leaves with an exception, the ranks may be out of step in BEGUN (rank 0's
thread may broadcast any moment) and SENT (the others run the step, rank 0 did not finish it):
the executor then fails. QUEUED becomes CANCELLED; UNSENT and SETTLED leave the ranks in step.

The fused step. When a batch has no structured-output request vLLM's grammar output is
``None`` by construction (``Scheduler.get_grammar_bitmask``), so every rank runs
``sample_tokens(None)`` right after ``execute_model``: the step costs one broadcast, and rank
0's driver thread samples straight after its forward pass, in the same hand-over, so nothing
can be broadcast between the two. The sampled half waits, as a Future, for the engine's
``sample_tokens`` (a sample step submitted while it waits takes it, nothing is broadcast);
without a pipeline that Future is done when the step ends, under a pipeline it resolves with
the output rank's reply. Nothing is held across the engine's two calls, so an engine that
never calls ``sample_tokens`` (an exception between the two, which vLLM's fault-tolerant
engine may survive) leaves the ranks in step and the executor usable: the next model step
discards the unclaimed half (with a warning if it held an output).

Async scheduling. A model step's output may still be on its way to the host when rank 0's
part returns; the step ends there, and the Future resolves the output when first asked
(:mod:`keepalive_executor.deferred`), in a *local step* (:meth:`StepRunner.run_local`): the
owner lock and a ``local`` lifecycle entry (the step timeout, the give-up; not in flight),
rank 0's thread, no broadcast.

Failure rules. A call that cannot be encoded or is too large fails before anything is sent:
the caller gets the error and the executor stays usable. Once the broadcast is out, the other
ranks are running the step; until every rank is known to be done with it (SETTLED), any
exception that leaves the step, ``BaseException`` included (a ``KeyboardInterrupt`` in the
user's process), fails the executor naming the call and the error: the ranks may be out of
step, and the next collective would pair with this one's. In detail:

* a broadcast that breaks, a gather that fails or times out: fail;
* rank 0 raises in a step without replies (a model step): fail (the others ran it);
* rank 0 raises in a ``collective_rpc``: the other ranks get ``failure_grace_s`` to reach the
  reply gather. If they all do, the ranks are in step: the caller gets rank 0's error and the
  executor stays usable. If not (the method itself runs collectives that rank 0 never
  entered, so the others wait in them), the executor fails naming the method and rank 0's
  error, and the caller gets that error at once, not after the collective's own timeout;
* another rank's error reply: the ranks are in step; the caller gets ``WorkerRpcError``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from vllm.v1.outputs import AsyncModelRunnerOutput
from vllm.v1.serial_utils import run_method

from keepalive_executor.channel import ChannelError, PayloadTooLargeError
from keepalive_executor.connectors import StepReply
from keepalive_executor.deferred import DeferredOutputs
from keepalive_executor.lifecycle import ExecutorFailedError, Lifecycle, StepInProgress
from keepalive_executor.log import get_logger
from keepalive_executor.metrics import NullMeter, StepMeter
from keepalive_executor.outputs import resolve_output, settle
from keepalive_executor.rpc import (
    Replies,
    RpcReply,
    RpcRequest,
    WorkerRpcError,
    encode_request,
)

__all__ = ["Step", "StepState", "StepRunner", "execute_and_sample", "execute_then_sample",
           "EXECUTE_TIMEOUT_SOURCE"]

logger = get_logger(__name__)
EXECUTE_TIMEOUT_SOURCE = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
_TIMER_SLACK_S = 0.05


def execute_and_sample(worker: Any, scheduler_output: Any) -> Any:
    """The other ranks' half of a fused step: forward pass, then sampling if it wants one."""
    out = worker.execute_model(scheduler_output)
    if out is None:
        out = worker.sample_tokens(None)
    return out


def execute_then_sample(worker: Any, scheduler_output: Any) -> tuple[Any, Any]:
    """Rank 0's half of a fused step, on the driver's thread (and the output rank's, under a
    pipeline): ``(execute_model's output, sample_tokens(None)'s output if execute_model
    returned None)``. Under async scheduling an output may still be on its way to the host:
    whoever needs it resolves it (deferred.py)."""
    out = worker.execute_model(scheduler_output)
    if out is not None:
        return out, None
    return None, worker.sample_tokens(None)


@dataclass(frozen=True)
class Step:
    """One engine call on the channel: what every rank runs and the reply policy. A plain
    value: the executor builds its model steps itself (its reply policy, the fused step),
    :meth:`Step.rpc` a ``collective_rpc``.

    ``request`` is what travels (its ``replies`` is the policy); ``local`` what rank 0 runs
    instead of ``request.method`` (a fused step's half that returns both outputs);
    ``model``: a model step (the step timeout; it discards an unclaimed sampled half);
    ``timeout_s``: a ``collective_rpc``'s own timeout; ``unique_reply_rank``: the one rank
    whose reply a ``collective_rpc`` returns; ``merge(output, replies)``: a STEP policy's
    merge of every rank's connector outputs into rank 0's output."""

    name: str
    request: RpcRequest
    local: Callable[..., Any] | str | None = None
    model: bool = False
    timeout_s: float | None = None
    unique_reply_rank: int | None = None
    merge: Callable[[Any, list[Any]], Any] | None = None

    @property
    def reply(self) -> Replies:
        """The reply policy (see the module docstring)."""
        return self.request.replies

    @property
    def fused(self) -> bool:
        """Whether rank 0's part returns ``(execute_model's output, the sampled one)``."""
        return self.local is execute_then_sample

    @classmethod
    def rpc(cls, method: str | Callable[..., Any], args: tuple = (),
            kwargs: dict | None = None, timeout: float | None = None,
            unique_reply_rank: int | None = None) -> Step:
        """A ``collective_rpc``: every rank's reply, gathered."""
        req = RpcRequest(method, tuple(args), kwargs or {}, Replies.ALL)
        return cls(req.name, req, timeout_s=timeout, unique_reply_rank=unique_reply_rank)


class StepState(enum.Enum):
    """Where one submitted step is (see the module docstring)."""

    QUEUED = "queued"  # handed to rank 0's thread, not taken yet
    CANCELLED = "cancelled"  # the caller left before rank 0's thread took it: never runs
    BEGUN = "begun"  # rank 0's thread took it: it may broadcast any moment
    UNSENT = "unsent"  # rank 0's thread ended it before the broadcast: nothing was sent
    SENT = "sent"  # the broadcast is out: the other ranks run it
    SETTLED = "settled"  # every rank is known to be done with it


class Channel(Protocol):
    """What a step needs of the channel."""

    def send(self, data: bytes) -> int: ...


class Driver(Protocol):
    """What a step needs of rank 0: a thread to hand work to, and the worker on it."""

    worker: Any

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


Gather = Callable[[RpcReply, "float | None"], list[RpcReply]]
#: ``expect(name)``: a Future of the output rank's reply to the step just broadcast
Expect = Callable[[str], Future]


class StepBroken(Exception):
    """Raised inside a step: the ranks are out of step. ``reason`` is the executor's failure
    reason; ``error`` what the caller gets."""

    def __init__(self, reason: str, error: BaseException) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class _Run:
    """One submitted step's state and its lifecycle entry. The state is written by the
    driver thread and read by the calling thread when it leaves the step, under ``lock``."""

    def __init__(self, step: Step, entry: StepInProgress, submitted: float) -> None:
        self.step = step
        self.entry = entry
        #: when the engine made the call (time.perf_counter), for the dispatch time
        self.submitted = submitted
        self.state = StepState.QUEUED
        self.lock = threading.Lock()

    def move(self, to: StepState, *, when: StepState | None = None) -> bool:
        """Enter ``to`` (only from ``when``, if given); False if it was not in ``when``."""
        with self.lock:
            if when is not None and self.state is not when:
                return False
            self.state = to
            return True

    def may_be_out_of_step(self) -> bool:
        """The caller leaves with an exception: can the ranks be out of step? A step not
        taken yet is cancelled (it never runs)."""
        with self.lock:
            if self.state is StepState.QUEUED:
                self.state = StepState.CANCELLED
            return self.state in (StepState.BEGUN, StepState.SENT)


@dataclass
class _Outcome:
    """What rank 0's part of a step produced."""

    value: Any = None
    error: Exception | None = None  # rank 0's own error, in a step that stayed in step
    replies: list[RpcReply] | None = None


class StepRunner:
    """Runs steps on the channel for the executor (see the module docstring).

    ``expect``: the output receiver's (pipeline only); ``fail(reason)``: the executor's
    failure."""

    def __init__(
        self,
        *,
        channel: Channel,
        driver: Driver,
        lifecycle: Lifecycle,
        gather: Gather,
        fail: Callable[[str], None],
        execute_timeout_s: float,
        error_window_s: float,
        expect: Expect | None = None,
        meter: StepMeter | None = None,
    ) -> None:
        self._channel = channel
        self._driver = driver
        self._life = lifecycle
        self._gather_fn = gather
        self._fail = fail
        self._execute_timeout_s = execute_timeout_s
        self._error_window_s = error_window_s
        self._expect = expect
        #: /metrics counters, bumped on the driver thread after each broadcast (metrics.py)
        self._meter = meter if meter is not None else NullMeter()
        self.owner = threading.RLock()
        self.deferred = DeferredOutputs(self.run_local)
        #: the sampled half of the last fused step, until sample_tokens takes it
        self._sampled: Future | None = None

    # ------------------------------------------------------------------ the way in
    def submit(self, step: Step) -> Future:
        """Run ``step``: broadcast, rank 0's part, what its reply policy waits for. Returns
        its answer as a Future once rank 0's part is done (an Exception goes into the
        Future; a ``BaseException`` such as ``KeyboardInterrupt`` propagates)."""
        submitted = time.perf_counter()
        try:
            if (self._sampled is not None and step.model
                    and step.request.method == "sample_tokens"):
                return self._take_sampled(step)
            data = encode_request(step.request)  # before anything is held or sent
            with self.owner, self._held(step, submitted) as run:
                if step.model:  # the engine moved on; a user's collective_rpc leaves it
                    self._drop_unclaimed(step.name)
                outcome = self._driver.run(self._on_rank0, run, data)
                if step.fused:
                    outcome.value, self._sampled = self._halves(step, outcome)
            return self._answer(step, outcome)
        except Exception as e:  # noqa: BLE001 - delivered through the future
            return _failed(e)

    # ------------------------------------------------------------------ what a step holds
    @contextmanager
    def _held(self, step: Step, submitted: float) -> Iterator[_Run]:
        """The step's lifecycle entry (refused once failed; the step watch's deadline; in
        flight, so the pacer sends no keepalive), and the out-of-step rule."""
        timeout_s, source = ((self._execute_timeout_s, EXECUTE_TIMEOUT_SOURCE) if step.model
                             else (step.timeout_s, "the call's timeout"))
        run = _Run(step, self._life.enter(step.name, timeout_s, source), submitted)
        try:
            yield run
        except StepBroken as broken:
            self._fail(broken.reason)
            raise self._first_failure(broken)  # noqa: B904 - its cause is already set
        except BaseException as e:
            if run.may_be_out_of_step():
                what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                self._fail(f"{step.name} was interrupted on rank 0 by {what} after the "
                           "other ranks had received it; the ranks are out of step")
            raise
        finally:
            self._life.exit()

    def _first_failure(self, broken: StepBroken) -> BaseException:
        """What the caller gets for a broken step: the step's own error, or, if the executor
        had already failed for another reason (a rank died, which broke this gather), an
        error that names that reason first."""
        failure = self._life.failure
        if failure is None or failure.reason == broken.reason:
            return broken.error
        why = (failure.reason if broken.reason in failure.reason
               else f"{failure.reason} (then: {broken.reason})")
        cause = (broken.error.__cause__ if isinstance(broken.error, ExecutorFailedError)
                 else None) or broken.error
        return _failed_error(why, cause)

    # ------------------------------------------------------------------ on the driver thread
    def _on_rank0(self, run: _Run, data: bytes) -> _Outcome:
        """Everything rank 0 does in a step, on the driver's thread, in order."""
        if not run.move(StepState.BEGUN, when=StepState.QUEUED):
            return _Outcome()  # the caller was interrupted before this began: nothing sent
        try:
            self._send(run, data)
            reply = run.step.reply
            if reply is Replies.ALL:
                outcome = self._rank0_then_gather(run)
            elif reply is Replies.OUTPUT:
                outcome = self._rank0_then_expect(run)
            else:
                outcome = _Outcome(self._rank0_part(run, resolve=reply is Replies.STEP))
                if reply is Replies.STEP:
                    outcome.replies = self._gather(run, RpcReply(rank=0, ok=True,
                                                                 value=StepReply(False)), None)
            run.move(StepState.SETTLED)
            return outcome
        finally:
            run.move(StepState.UNSENT, when=StepState.BEGUN)

    def _send(self, run: _Run, data: bytes) -> None:
        try:
            self._channel.send(data)
        except PayloadTooLargeError:
            raise  # nothing was sent: the caller's error, the channel is in sync
        except ChannelError as e:
            reason = f"broadcast of {run.step.name} failed: {e}"
            raise StepBroken(reason, _failed_error(reason, e)) from e
        step = run.step
        kind = ("rpc" if not step.model
                else "sample" if step.request.method == "sample_tokens" else "execute")
        self._meter.step_sent(kind, len(data), time.perf_counter() - run.submitted)
        run.move(StepState.SENT)

    def _invoke(self, run: _Run) -> Any:
        step = run.step
        method = step.request.method if step.local is None else step.local
        return run_method(self._driver.worker, method, step.request.args, step.request.kwargs)

    def _rank0_part(self, run: _Run, *, resolve: bool) -> Any:
        """Rank 0's part of a step whose error is fatal. ``resolve``: wait for an async
        output here (a connector's outputs are merged from resolved ones); otherwise whoever
        asks resolves it (deferred.py)."""
        try:
            out = self._invoke(run)
            return resolve_output(out) if resolve else out
        except ExecutorFailedError:
            raise
        except Exception as e:
            raise StepBroken(
                f"{run.step.name} raised on rank 0 after the other ranks had received it "
                f"({type(e).__name__}: {e}); the ranks are out of step", e) from e

    def _rank0_then_expect(self, run: _Run) -> _Outcome:
        """OUTPUT: the step's output is the output rank's, which arrives later."""
        # Registered right after the broadcast, under the owner lock: outputs arrive in
        # broadcast order. The step stays in flight (no keepalive) until its output arrived.
        assert self._expect is not None, "an OUTPUT step needs the output receiver"
        future = self._expect(run.step.name)
        self._life.hold(run.entry, until=future)
        self._rank0_part(run, resolve=False)  # stage 0's own result is not the step's
        return _Outcome(future)

    def _rank0_then_gather(self, run: _Run) -> _Outcome:
        """ALL: rank 0's part (its error is the caller's), then every rank's reply."""
        outcome = _Outcome()
        try:
            outcome.value = resolve_output(self._invoke(run))
        except ExecutorFailedError:
            raise
        except Exception as e:  # noqa: BLE001 - still owes the gather
            outcome.error = e
        mine = RpcReply(rank=0, ok=outcome.error is None, value=outcome.value,
                        error="" if outcome.error is None
                        else f"{type(outcome.error).__name__}: {outcome.error}")
        if outcome.error is None:
            outcome.replies = self._gather(run, mine, None)
            return outcome
        try:
            outcome.replies = self._gather(run, mine, self._error_window_s)
        except StepBroken:
            raise
        except Exception as e:
            reason = (f"collective_rpc({run.step.name!r}) raised on rank 0 "
                      f"({type(outcome.error).__name__}: {outcome.error}) and the other "
                      f"ranks did not reply within {self._error_window_s:g}s "
                      "(VLLM_KEEPALIVE_FAILURE_GRACE_S): they are still inside it, "
                      "presumably in a collective rank 0 never entered; the ranks are "
                      "out of step")
            raise StepBroken(reason, outcome.error) from e
        return outcome

    def _gather(self, run: _Run, mine: RpcReply, timeout_s: float | None) -> list[RpcReply]:
        """The reply gather, within the step's deadline and ``timeout_s``."""
        clock = self._life.clock
        entered = self._life.step
        deadline = None if entered is None else entered.deadline
        window_end = None if timeout_s is None else clock() + timeout_s
        end = min((t for t in (deadline, window_end) if t is not None), default=None)
        try:
            return self._gather_fn(mine, None if end is None else end - clock())
        except Exception as e:
            # gloo's own timer may fire a hair before ours: a failure that close to the end
            # is that end
            if end is not None and clock() >= end - _TIMER_SLACK_S:
                if end == window_end:
                    raise  # the caller knows what this window was for
                assert entered is not None
                reason = (f"{run.step.name} timed out after {entered.timeout_s:g}s "
                          f"({entered.timeout_source}) waiting for the other ranks' replies")
                error = TimeoutError(f"{reason}; the executor is now failed (ranks are out "
                                     "of step)")
                error.__cause__ = e
                raise StepBroken(reason, error) from e
            reason = f"gathering replies to {run.step.name} failed: {e}"
            raise StepBroken(reason, _failed_error(reason, e)) from e

    # ------------------------------------------------------------------ the answer
    def _halves(self, step: Step, outcome: _Outcome) -> tuple[Any, Future | None]:
        """A fused step's two outputs: execute_model's (a value, or a Future under OUTPUT)
        and the sampled half's Future, if sample_tokens may want it."""
        if step.reply is Replies.OUTPUT:
            return _split_pair(outcome.value)
        value, sampled = outcome.value
        if value is not None:
            return value, None
        if step.reply is Replies.STEP:  # the other ranks reply about the step's last output
            sampled = _merged(step, sampled, outcome.replies)
            outcome.replies = None
        return None, _done(sampled)

    def _answer(self, step: Step, outcome: _Outcome) -> Future:
        """The step's answer, as its reply policy makes it."""
        reply, value = step.reply, outcome.value
        if reply is Replies.ALL:
            return _done(self._rpc_result(step, outcome))
        if reply is Replies.OUTPUT:
            return value if isinstance(value, Future) else _done(value)
        if reply is Replies.STEP and outcome.replies is not None:
            value = _merged(step, value, outcome.replies)
        if isinstance(value, AsyncModelRunnerOutput):
            return self.deferred.defer(step.name, value)
        return _done(value)

    def _rpc_result(self, step: Step, outcome: _Outcome) -> Any:
        if outcome.error is not None:
            raise outcome.error
        assert outcome.replies is not None
        for r in outcome.replies[1:]:
            if not r.ok:
                raise WorkerRpcError(step.request.name, r)
        values = [r.value for r in outcome.replies]
        return values if step.unique_reply_rank is None else values[step.unique_reply_rank]

    def _take_sampled(self, step: Step) -> Future:
        """A sample step after a fused one: its sampled half, nothing broadcast."""
        self._life.check_usable()
        sampled, self._sampled = self._sampled, None
        assert sampled is not None
        if step.request.args[0] is not None:
            self._fail("sample_tokens got a grammar output after a step without "
                       "structured-output requests; the other ranks sampled without it")
            self._life.check_usable()
        if sampled.done() and isinstance(sampled.result(), AsyncModelRunnerOutput):
            return self.deferred.defer(step.name, sampled.result())
        return sampled

    def _drop_unclaimed(self, name: str) -> None:
        sampled, self._sampled = self._sampled, None
        if (sampled is not None and sampled.done() and sampled.exception() is None
                and sampled.result() is not None):
            logger.warning(
                "keepalive executor: %s began while the output sampled by the last fused "
                "execute_model was never taken by sample_tokens (the engine moved on, e.g. "
                "after an error between the two calls); that output is discarded. Every "
                "rank finished that step: the ranks are in step.", name)

    # ------------------------------------------------------------------ rank 0 alone
    def run_local(self, name: str, fn: Callable[[], Any]) -> Any:
        """Rank 0 alone, nothing broadcast: the wait for a deferred output (deferred.py).
        On the driver's thread like a step, and watched like one: the step timeout, and the
        give-up after a failure elsewhere (a peer that died inside the step's collectives
        leaves the GPU copy waiting forever). Not in flight: nothing collective runs, so
        the pacer may send keepalives meanwhile."""
        with self.owner:
            self._life.enter(name, self._execute_timeout_s, EXECUTE_TIMEOUT_SOURCE, local=True)
            try:
                return self._driver.run(fn)
            finally:
                self._life.exit()


def _merged(step: Step, value: Any, replies: list[RpcReply] | None) -> Any:
    assert step.merge is not None and replies is not None, "a STEP policy needs its merge"
    return step.merge(value, [r.value for r in replies])


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def _split_pair(both: Future) -> tuple[Future, Future]:
    """Two futures for the two halves of a future pair (or both failing with its error)."""
    first: Future = Future()
    second: Future = Future()

    def on_done(f: Future) -> None:
        error = f.exception()
        if error is not None:
            settle(first, error=error)
            settle(second, error=error)
        else:
            a, b = f.result()
            settle(first, value=a)
            settle(second, value=b)

    both.add_done_callback(on_done)
    return first, second


def _failed_error(reason: str, cause: BaseException) -> ExecutorFailedError:
    err = ExecutorFailedError(f"keepalive executor failed: {reason}")
    err.__cause__ = cause
    return err
