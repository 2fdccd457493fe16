"""One step on the channel: broadcast a call, run it on rank 0, gather replies if wanted.

A *step* is every engine call that puts work on the channel. :class:`StepRunner` is the one
place that knows what a step holds and in which order; one step's life reads top-down in
:meth:`StepRunner.call` (and :meth:`StepRunner.call_output` for a pipeline step)::

    engine thread (or a user's thread)         driver thread (keepalive-driver)
    ----------------------------------         --------------------------------
    encode the call (nothing held yet)
    take the channel owner lock
    enter the lifecycle step (refused once failed)
    take the pacer's step token
    hand the step to the driver thread  ---->  broadcast            (step.sent)
    wait for its outcome (a Future that        rank 0's own part
    a give-up can fail at any time)            reply gather, if any (step.settled)
    <------------------------------------------ outcome
    release token, lifecycle, lock (reverse order, by context managers)

1. the **channel owner lock** (a re-entrant lock: whoever holds it owns the channel for a
   whole step, so a ``collective_rpc`` from another thread never lands inside a step);
2. the **lifecycle** entry (:class:`~keepalive_executor.lifecycle.Lifecycle`: refused once
   failed; records which step rank 0 is inside, with its deadline);
3. the **pacer's step token** (no keepalive while it is held);
4. the broadcast, rank 0's own part and the reply gather all run on the driver's thread, in one
   hand-over. The calling thread only ever waits on that hand-over's Future, so when the step
   is given up (a rank failed and the step cannot finish, see
   :mod:`keepalive_executor.lifecycle`), the caller is released at once, wherever rank 0 is
   blocked: in its model, in the reply gather, or in the channel's wait for a free frame.

The fused step. When a batch has no structured-output request vLLM's grammar output is
``None`` by construction (``Scheduler.get_grammar_bitmask``), so every rank runs
``sample_tokens(None)`` right after ``execute_model``: the step costs one broadcast, and rank
0's driver thread samples straight after its forward pass, in the same hand-over, so nothing
can be broadcast between the two. When the hand-over returns, every rank has finished the
whole step: the step ends there, and the sampled output waits on the side for the engine's
``sample_tokens``. Nothing is held across the engine's two calls, so an engine that never
calls ``sample_tokens`` (an exception between the two, which vLLM's fault-tolerant engine may
survive) leaves the ranks in step and the executor usable: the next step discards the
unclaimed output, with a warning.

Async scheduling. A model step's output may still be on its way to the host when rank 0's
part returns; the step ends there, and the engine's future resolves the output later
(:mod:`keepalive_executor.deferred`) in a *local step* (:meth:`StepRunner.run_local`): the
owner lock and a lifecycle entry (the step timeout, the give-up), rank 0's thread, no
broadcast and so no pacer token.

Failure rules. A call that cannot be encoded or is too large fails before anything is sent:
the caller gets the error and the executor stays usable. Once the broadcast is out, the other
ranks are running the step; until every rank is known to be done with it (``settled``), any
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

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from keepalive_executor.channel import ChannelError, PayloadTooLargeError
from keepalive_executor.connectors import StepReply
from keepalive_executor.lifecycle import ExecutorFailedError, Lifecycle
from keepalive_executor.log import get_logger
from keepalive_executor.pacer import Pacer, PacerError
from keepalive_executor.rpc import (
    Replies,
    RpcReply,
    RpcRequest,
    WorkerRpcError,
    encode_request,
)

__all__ = ["StepRunner", "execute_and_sample", "execute_then_sample", "EXECUTE_TIMEOUT_SOURCE"]

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
    """Rank 0's half of a fused step, on the driver's thread: ``(execute_model's output,
    sample_tokens(None)'s output if execute_model returned None)``. Under async scheduling
    an output may still be on its way to the host: whoever needs it resolves it
    (deferred.py)."""
    out = worker.execute_model(scheduler_output)
    if out is not None:
        return out, None
    return None, worker.sample_tokens(None)


class Channel(Protocol):
    """What a step needs of the channel."""

    def send(self, data: bytes) -> int: ...


class Driver(Protocol):
    """What a step needs of rank 0: a thread to hand work to, and the worker on it."""

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

    def invoke(self, method: Any, args: tuple = (), kwargs: dict | None = None, *,
               resolve: bool = True) -> Any: ...


Gather = Callable[[RpcReply, "float | None"], list[RpcReply]]


class StepBroken(Exception):
    """Raised inside a step: the ranks are out of step. ``reason`` is the executor's failure
    reason; ``error`` what the caller gets."""

    def __init__(self, reason: str, error: BaseException) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


@dataclass
class _Step:
    """One step's progress, as the failure rules read it. Written by the driver thread
    (``started``..``finished``), read by the calling thread when it leaves the step."""

    name: str
    started: bool = False  # the driver thread began the step's work
    sent: bool = False  # the broadcast is out: the other ranks run the step
    settled: bool = False  # every rank is known to be done with it
    finished: bool = False  # the driver thread is done with the step, either way
    cancelled: bool = False  # the caller left before the work began: it never will
    keep_pacer: bool = False  # the pacer token outlives the call (a pipeline step)
    pacer_released: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self) -> bool:
        """The driver thread's first act: False if the caller already left (do nothing)."""
        with self.lock:
            if self.cancelled:
                return False
            self.started = True
            return True

    def may_be_out_of_step(self) -> bool:
        """The caller leaves with an exception: can the ranks be out of step? Yes once the
        broadcast is out and not settled, and while the driver thread is still inside the
        step's work (it may broadcast any moment); a step whose work has not begun is
        cancelled (it never will)."""
        with self.lock:
            if self.settled:
                return False
            if self.sent:
                return True
            if self.finished or not self.started:
                self.cancelled = True
                return False
            return True

    def release_pacer(self, pacer: Pacer) -> None:
        """End the step's pacer token, once (the caller and an output's arrival may race
        after a give-up)."""
        with self.lock:
            if self.pacer_released:
                return
            self.pacer_released = True
        pacer.finish_step()


@dataclass
class _Outcome:
    """What rank 0's part of a step produced."""

    value: Any = None
    error: Exception | None = None  # rank 0's own error, in a step that stayed in step
    replies: list[RpcReply] | None = None


class StepRunner:
    """Runs steps on the channel for the executor (see the module docstring)."""

    def __init__(
        self,
        *,
        channel: Channel,
        pacer: Pacer,
        driver: Driver,
        lifecycle: Lifecycle,
        gather: Gather,
        fail: Callable[[str], None],
        execute_timeout_s: float,
        error_window_s: float,
        merge: Callable[[Any, list[Any]], Any] | None = None,
    ) -> None:
        self._channel = channel
        self._pacer = pacer
        self._driver = driver
        self._life = lifecycle
        self._gather_fn = gather
        self._fail = fail
        self._execute_timeout_s = execute_timeout_s
        self._error_window_s = error_window_s
        self._merge = merge
        self.owner = threading.RLock()
        self._unclaimed: tuple[str, Any] | None = None  # (step, sampled output) of a fused step

    # ------------------------------------------------------------------ what a step holds
    @contextmanager
    def _step(self, name: str, timeout_s: float | None, source: str) -> Iterator[_Step]:
        """Lifecycle entry and pacer token for one step, and the out-of-step rule."""
        self._life.enter(name, timeout_s, source)
        step = _Step(name)
        try:
            try:
                self._pacer.begin_step()
            except PacerError as e:
                err = ExecutorFailedError(f"keepalive executor cannot begin {name}: {e}")
                raise (self._life.error() or err) from e
            try:
                yield step
            except StepBroken as broken:
                self._fail(broken.reason)
                raise self._first_failure(broken)  # noqa: B904 - its cause is already set
            except BaseException as e:
                if step.may_be_out_of_step():
                    what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                    self._fail(f"{name} was interrupted on rank 0 by {what} after the other "
                               "ranks had received it; the ranks are out of step")
                raise
            finally:
                if not step.keep_pacer:
                    step.release_pacer(self._pacer)
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
    def _send(self, step: _Step, data: bytes) -> None:
        try:
            self._channel.send(data)
        except PayloadTooLargeError:
            raise  # nothing was sent: the caller's error, the channel is in sync
        except ChannelError as e:
            reason = f"broadcast of {step.name} failed: {e}"
            raise StepBroken(reason, _failed_error(reason, e)) from e
        step.sent = True
        self._pacer.note_broadcast()

    def _rank0_part(self, step: _Step, method: Any, req: RpcRequest) -> Any:
        try:
            # A connector's outputs are merged from resolved outputs; a model step's output
            # is resolved when the engine asks for it (deferred.py); a pipeline stage's is
            # not the step's output.
            return self._driver.invoke(method, req.args, req.kwargs,
                                       resolve=req.replies is Replies.STEP)
        except ExecutorFailedError:
            raise
        except Exception as e:
            raise StepBroken(
                f"{step.name} raised on rank 0 after the other ranks had received it "
                f"({type(e).__name__}: {e}); the ranks are out of step", e) from e

    def _gather(self, step: _Step, mine: RpcReply, timeout_s: float | None) -> list[RpcReply]:
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
                reason = (f"{step.name} timed out after {entered.timeout_s:g}s "
                          f"({entered.timeout_source}) waiting for the other ranks' replies")
                error = TimeoutError(f"{reason}; the executor is now failed (ranks are out "
                                     "of step)")
                error.__cause__ = e
                raise StepBroken(reason, error) from e
            reason = f"gathering replies to {step.name} failed: {e}"
            raise StepBroken(reason, _failed_error(reason, e)) from e

    def _run_step(self, step: _Step, req: RpcRequest, data: bytes, method: Any,
                  expect: Callable[[str], Future] | None = None) -> _Outcome:
        """Everything rank 0 does in a step, on the driver's thread, in order."""
        if not step.begin():
            return _Outcome()  # the caller was interrupted before this began: nothing sent
        try:
            return self._run_begun_step(step, req, data, method, expect)
        finally:
            with step.lock:
                step.finished = True

    def _run_begun_step(self, step: _Step, req: RpcRequest, data: bytes, method: Any,
                        expect: Callable[[str], Future] | None) -> _Outcome:
        self._send(step, data)
        if req.replies is Replies.ALL:
            return self._rank0_with_replies(step, req, method)
        outcome = _Outcome()
        if expect is not None:
            # Registered right after the broadcast, under the owner lock: outputs arrive in
            # broadcast order. From here the output's arrival ends the pacer token.
            outcome.value = future = expect(step.name)
            step.keep_pacer = True
            future.add_done_callback(lambda _: step.release_pacer(self._pacer))
            self._rank0_part(step, method, req)  # stage 0's own result is not the step's
        else:
            outcome.value = self._rank0_part(step, method, req)
        if req.replies is Replies.STEP:
            outcome.replies = self._gather(step, RpcReply(rank=0, ok=True,
                                                          value=StepReply(False)), None)
        step.settled = True
        return outcome

    def _rank0_with_replies(self, step: _Step, req: RpcRequest, method: Any) -> _Outcome:
        outcome = _Outcome()
        try:
            outcome.value = self._driver.invoke(method, req.args, req.kwargs)
        except ExecutorFailedError:
            raise
        except Exception as e:  # noqa: BLE001 - still owes the gather
            outcome.error = e
        mine = RpcReply(rank=0, ok=outcome.error is None, value=outcome.value,
                        error="" if outcome.error is None
                        else f"{type(outcome.error).__name__}: {outcome.error}")
        if outcome.error is None:
            outcome.replies = self._gather(step, mine, None)
        else:
            try:
                outcome.replies = self._gather(step, mine, self._error_window_s)
            except StepBroken:
                raise
            except Exception as e:
                reason = (f"collective_rpc({step.name!r}) raised on rank 0 "
                          f"({type(outcome.error).__name__}: {outcome.error}) and the other "
                          f"ranks did not reply within {self._error_window_s:g}s "
                          "(VLLM_KEEPALIVE_FAILURE_GRACE_S): they are still inside it, "
                          "presumably in a collective rank 0 never entered; the ranks are "
                          "out of step")
                raise StepBroken(reason, outcome.error) from e
        step.settled = True
        return outcome

    # ------------------------------------------------------------------ engine calls
    def call(
        self,
        req: RpcRequest,
        *,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        local_method: Any = None,
        model_step: bool = False,
        name: str | None = None,
    ) -> Any:
        """A blocking step (``name``: the engine call's, if not the request's).
        ``Replies.DRIVER``: rank 0's result; ``Replies.STEP``: rank 0's result and every
        rank's connector replies; ``Replies.ALL``: every rank's result in rank order (or
        rank ``unique_reply_rank``'s alone)."""
        outcome = self._call(req, timeout=timeout, local_method=local_method,
                             model_step=model_step, name=name)
        if req.replies is Replies.DRIVER:
            return outcome.value
        assert outcome.replies is not None
        if req.replies is Replies.STEP:
            return outcome.value, outcome.replies
        if outcome.error is not None:
            raise outcome.error
        for r in outcome.replies[1:]:
            if not r.ok:
                raise WorkerRpcError(req.name, r)
        values = [r.value for r in outcome.replies]
        return values if unique_reply_rank is None else values[unique_reply_rank]

    def _call(self, req: RpcRequest, *, timeout: float | None, local_method: Any,
              model_step: bool, expect: Callable[[str], Future] | None = None,
              name: str | None = None) -> _Outcome:
        data = encode_request(req)  # before anything is held or sent
        timeout_s, source = (
            (self._execute_timeout_s, EXECUTE_TIMEOUT_SOURCE) if model_step
            else (timeout, "the call's timeout")
        )
        method = local_method if local_method is not None else req.method
        name = req.name if name is None else name
        with self.owner, self._step(name, timeout_s, source) as step:
            if model_step:  # the engine moved on; a user's collective_rpc leaves it
                self._drop_unclaimed(name)
            return self._driver.run(self._run_step, step, req, data, method, expect)

    def execute_fused(self, scheduler_output: Any, replies: Replies = Replies.DRIVER) -> Any:
        """``execute_model`` as a fused step (see the module docstring). Returns rank 0's
        output; if that is None, the sampled output waits for :meth:`take_sampled`.
        ``replies``: DRIVER, or STEP while a connector's outputs must be merged."""
        req = RpcRequest(execute_and_sample, (scheduler_output,), {}, replies)
        result = self.call(req, local_method=execute_then_sample, model_step=True,
                           name="execute_model")
        (value, sampled), step_replies = result if replies is Replies.STEP else (result, None)
        if step_replies is not None:  # the other ranks reply about the step's last output
            if value is None:
                sampled = self._merged(sampled, step_replies)
            else:
                value = self._merged(value, step_replies)
        if value is None:
            self._unclaimed = ("execute_model", sampled)
        return value

    def model_step(self, req: RpcRequest) -> Any:
        """A model step that is not fused (``Replies.DRIVER`` or ``Replies.STEP``)."""
        result = self.call(req, model_step=True)
        if req.replies is Replies.STEP:
            value, step_replies = result
            return self._merged(value, step_replies)
        return result

    def _merged(self, value: Any, replies: list[RpcReply]) -> Any:
        assert self._merge is not None, "Replies.STEP needs a merge function"
        return self._merge(value, [r.value for r in replies])

    @property
    def sample_pending(self) -> bool:
        """Whether a fused step's sampled output awaits the engine's ``sample_tokens``."""
        return self._unclaimed is not None

    def take_sampled(self, grammar_output: Any) -> Any:
        """The fused step's sampled output (rank 0 sampled right after its forward pass)."""
        self._life.check_usable()
        unclaimed, self._unclaimed = self._unclaimed, None
        if unclaimed is None:
            raise RuntimeError("keepalive executor: no fused step awaits sample_tokens")
        if grammar_output is not None:
            self._fail("sample_tokens got a grammar output after a step without "
                       "structured-output requests; the other ranks sampled without it")
            self._life.check_usable()
        return unclaimed[1]

    def _drop_unclaimed(self, name: str) -> None:
        if self._unclaimed is not None:
            logger.warning(
                "keepalive executor: %s began while the output sampled by the last fused "
                "execute_model was never taken by sample_tokens (the engine moved on, e.g. "
                "after an error between the two calls); that output is discarded. Every "
                "rank finished that step: the ranks are in step.", name)
            self._unclaimed = None

    def call_output(self, req: RpcRequest, expect: Callable[[str], Future],
                    local_method: Any = None) -> Future:
        """A pipeline step (``Replies.OUTPUT``): broadcast, run rank 0's stage, and return a
        Future of the output rank's result, which arrives later (outputs.py). The step stays
        on the pacer until then; rank 0's own result is not the step's."""
        outcome = self._call(req, timeout=None, local_method=local_method, model_step=True,
                             expect=expect)
        return outcome.value

    def run_local(self, name: str, fn: Callable[[], Any]) -> Any:
        """Rank 0 alone, nothing broadcast: the wait for a deferred output (deferred.py).
        On the driver's thread like a step, and watched like one: the step timeout, and the
        give-up after a failure elsewhere (a peer that died inside the step's collectives
        leaves the GPU copy waiting forever). No pacer token: nothing collective runs."""
        with self.owner:
            self._life.enter(name, self._execute_timeout_s, EXECUTE_TIMEOUT_SOURCE)
            try:
                return self._driver.run(fn)
            finally:
                self._life.exit()

    def send_shutdown(self, channel_shutdown: Callable[[], Any], timeout_s: float) -> bool:
        """Broadcast SHUTDOWN once no step holds the channel; bounded by ``timeout_s``."""
        if not self.owner.acquire(timeout=timeout_s):
            logger.warning("keepalive: a step still holds the channel; SHUTDOWN not sent")
            return False
        try:
            outcome: list[BaseException | None] = []

            def send() -> None:
                try:
                    channel_shutdown()
                    outcome.append(None)
                except BaseException as e:  # noqa: BLE001 - workers are then stopped by signal
                    outcome.append(e)

            sender = threading.Thread(target=send, name="keepalive-send-shutdown", daemon=True)
            sender.start()
            sender.join(timeout_s)
        finally:
            self.owner.release()
        if not outcome or outcome[0] is not None:
            logger.warning("could not broadcast SHUTDOWN to the other ranks: %s",
                           outcome[0] if outcome else f"still sending after {timeout_s:g}s")
            return False
        return True


def _failed_error(reason: str, cause: BaseException) -> ExecutorFailedError:
    err = ExecutorFailedError(f"keepalive executor failed: {reason}")
    err.__cause__ = cause
    return err
