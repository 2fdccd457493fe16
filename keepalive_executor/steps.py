"""One step on the channel: broadcast a call, run it on rank 0, gather replies if wanted.

A *step* is every engine call that puts work on the channel. :class:`StepRunner` is the one
place that knows what a step holds and in which order:

1. the **channel owner lock** (a re-entrant lock: whoever holds it owns the channel for a
   whole step, so a ``collective_rpc`` from another thread never lands between the broadcast
   of a step and rank 0's part of it);
2. the **lifecycle** entry (:class:`~keepalive_executor.lifecycle.Lifecycle`: refused once
   failed; records which step rank 0 is inside, with its deadline);
3. the **pacer's step token** (no keepalive while it is held);
4. the broadcast, rank 0's own part, and, for ``Replies.ALL``, the reply gather.

They are released in the reverse order when the step ends, by context managers, never by a
promise in a docstring.

The fused step. When a batch has no structured-output request vLLM's grammar output is
``None`` by construction (``Scheduler.get_grammar_bitmask``), so every rank runs
``sample_tokens(None)`` right after ``execute_model``: the step costs one broadcast, and on
rank 0 one hand-over to the driver's thread, which samples straight after its forward pass, so
nothing can be broadcast between the two. ``execute_model`` returns rank 0's ``None`` as vLLM
expects, and the engine's ``sample_tokens`` then returns the output already sampled. Until that
call the step is **still held** (owner lock, lifecycle entry, pacer token are kept in an
``ExitStack`` popped out of the ``execute_model`` call), as the engine's contract says it is
one step.

Failure rules. A call that cannot be encoded or is too large fails before anything is sent:
the caller gets the error and the executor stays usable. A broadcast that breaks, a gather
that fails or times out, and an error raised on rank 0 inside a step *without* replies (the
other ranks already received it and may be waiting in its collectives) fail the executor,
naming the call and the error. An error inside a step *with* replies is reported after the
gather, so the ranks stay in step and the executor stays usable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol

from keepalive_executor.channel import ChannelError, PayloadTooLargeError
from keepalive_executor.driver import resolve_output
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


def execute_and_sample(worker: Any, scheduler_output: Any) -> Any:
    """The other ranks' half of a fused step: forward pass, then sampling if it wants one."""
    out = worker.execute_model(scheduler_output)
    if out is None:
        out = worker.sample_tokens(None)
    return out


def execute_then_sample(worker: Any, scheduler_output: Any) -> tuple[Any, Any]:
    """Rank 0's half of a fused step, on the driver's thread: ``(execute_model's output,
    sample_tokens(None)'s output if execute_model returned None)``."""
    out = resolve_output(worker.execute_model(scheduler_output))
    if out is not None:
        return out, None
    return None, resolve_output(worker.sample_tokens(None))


class Channel(Protocol):
    """What a step needs of the channel."""

    def send(self, data: bytes) -> int: ...


class Driver(Protocol):
    """What a step needs of rank 0."""

    def call(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> Any: ...


Gather = Callable[[RpcReply, "float | None"], list[RpcReply]]


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
        merge: Callable[[Any, list[Any]], Any] | None = None,
    ) -> None:
        self._channel = channel
        self._pacer = pacer
        self._driver = driver
        self._life = lifecycle
        self._gather_fn = gather
        self._fail = fail
        self._execute_timeout_s = execute_timeout_s
        self._merge = merge
        self.owner = threading.RLock()
        self._pending_sample: ExitStack | None = None
        self._pending_output: Any = None

    # ------------------------------------------------------------------ building blocks
    @contextmanager
    def _step(self, name: str, timeout_s: float | None, source: str) -> Iterator[None]:
        self._life.enter(name, timeout_s, source)
        try:
            try:
                self._pacer.begin_step()
            except PacerError as e:
                err = ExecutorFailedError(f"keepalive executor cannot begin {name}: {e}")
                raise (self._life.error() or err) from e
            try:
                yield
            finally:
                self._pacer.finish_step()
        finally:
            self._life.exit()

    def _refuse_while_sample_pending(self, name: str) -> None:
        if self._pending_sample is not None:
            raise RuntimeError(
                f"keepalive executor: {name} called while a fused execute_model step still "
                "awaits its sample_tokens (vLLM's engine calls sample_tokens right after "
                "execute_model): call sample_tokens first"
            )

    def _send(self, name: str, data: bytes) -> None:
        try:
            self._channel.send(data)
        except PayloadTooLargeError:
            raise  # nothing was sent: the caller's error, the channel is in sync
        except ChannelError as e:
            reason = f"broadcast of {name} failed: {e}"
            self._fail(reason)
            raise ExecutorFailedError(f"keepalive executor failed: {reason}") from e
        self._pacer.note_broadcast()

    def _local_model_step(self, name: str, method: Any, args: tuple) -> Any:
        """Rank 0's part of a step without replies: an error here leaves the other ranks
        with a step rank 0 did not finish, so the executor fails."""
        try:
            return self._driver.call(method, args, {})
        except ExecutorFailedError:
            raise
        except Exception as e:
            self._fail(
                f"{name} raised on rank 0 after the other ranks had received it "
                f"({type(e).__name__}: {e}); the ranks are out of step"
            )
            raise

    # ------------------------------------------------------------------ engine calls
    def call(
        self,
        req: RpcRequest,
        *,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        local_method: Any = None,
        model_step: bool = False,
    ) -> Any:
        """A blocking step. ``Replies.DRIVER``: rank 0's result; ``Replies.ALL``: every
        rank's result in rank order (or rank ``unique_reply_rank``'s alone)."""
        data = encode_request(req)  # before anything is held or sent
        timeout_s, source = (
            (self._execute_timeout_s, EXECUTE_TIMEOUT_SOURCE) if model_step
            else (timeout, "the call's timeout")
        )
        method = local_method if local_method is not None else req.method
        with self.owner:
            self._refuse_while_sample_pending(req.name)
            with self._step(req.name, timeout_s, source):
                self._send(req.name, data)
                if req.replies is Replies.DRIVER:
                    return self._local_model_step(req.name, method, req.args)
                if req.replies is Replies.STEP:
                    value = self._local_model_step(req.name, method, req.args)
                    return self._merged(req.name, value)
                error: Exception | None = None
                value: Any = None
                try:
                    value = self._driver.call(method, req.args, req.kwargs)
                except ExecutorFailedError:
                    raise
                except Exception as e:  # noqa: BLE001 - still owes the gather
                    error = e
                mine = RpcReply(rank=0, ok=error is None, value=value,
                                error="" if error is None else f"{type(error).__name__}: {error}")
                replies = self._gather(req.name, mine, timeout)
        if error is not None:
            raise error
        for r in replies[1:]:
            if not r.ok:
                raise WorkerRpcError(req.name, r)
        values = [r.value for r in replies]
        return values if unique_reply_rank is None else values[unique_reply_rank]

    def _gather(self, name: str, mine: RpcReply, timeout: float | None) -> list[RpcReply]:
        step = self._life.step
        deadline = None if step is None else step.deadline
        clock = self._life.clock
        try:
            return self._gather_fn(mine, None if deadline is None else deadline - clock())
        except Exception as e:
            if step is not None and deadline is not None and clock() >= deadline:
                reason = (f"{name} timed out after {step.timeout_s:g}s ({step.timeout_source}) "
                          "waiting for the other ranks' replies")
                self._fail(reason)
                raise TimeoutError(
                    f"{reason}; the executor is now failed (ranks are out of step)"
                ) from e
            reason = f"gathering replies to {name} failed: {e}"
            self._fail(reason)
            raise ExecutorFailedError(f"keepalive executor failed: {reason}") from e

    def _merged(self, name: str, value: Any) -> Any:
        """A ``Replies.STEP`` step: gather every rank's connector outputs, merge them."""
        from keepalive_executor.connectors import step_reply

        assert self._merge is not None, "Replies.STEP needs a merge function"
        mine = RpcReply(rank=0, ok=True, value=step_reply(value))
        replies = self._gather(name, mine, None)
        return self._merge(value, [r.value for r in replies])

    def execute_fused(self, scheduler_output: Any, replies: Replies = Replies.DRIVER) -> Any:
        """``execute_model`` as a fused step (see the module docstring). Returns rank 0's
        output; if that is None, the step stays held until :meth:`finish_fused`.
        ``replies``: DRIVER, or STEP while a connector's outputs must be merged."""
        req = RpcRequest(execute_and_sample, (scheduler_output,), {}, replies)
        data = encode_request(req)
        with ExitStack() as held:
            held.enter_context(self.owner)
            self._refuse_while_sample_pending("execute_model")
            held.enter_context(
                self._step("execute_model", self._execute_timeout_s, EXECUTE_TIMEOUT_SOURCE)
            )
            self._send("execute_model", data)
            value, sampled = self._local_model_step("execute_model", execute_then_sample,
                                                    (scheduler_output,))
            if replies is Replies.STEP:  # the other ranks reply about the step's last output
                if value is None:
                    sampled = self._merged("execute_model", sampled)
                else:
                    value = self._merged("execute_model", value)
            if value is None:
                self._pending_output = sampled
                self._pending_sample = held.pop_all()  # still held: owner, lifecycle, pacer
            return value

    @property
    def sample_pending(self) -> bool:
        """Whether a fused step awaits rank 0's sampling."""
        return self._pending_sample is not None

    def finish_fused(self, grammar_output: Any) -> Any:
        """The pending fused step's sampled output (rank 0 sampled right after its forward
        pass); then the step ends."""
        held, self._pending_sample = self._pending_sample, None
        output, self._pending_output = self._pending_output, None
        if held is None:
            raise RuntimeError("keepalive executor: no fused step awaits sample_tokens")
        with held:
            self._life.check_usable()
            if grammar_output is not None:
                self._fail("sample_tokens got a grammar output after a step without "
                           "structured-output requests; the other ranks sampled without it")
                self._life.check_usable()
            return output

    def release_pending(self) -> None:
        """Shutdown: end a fused step whose sample_tokens never came (best effort: the
        owner lock can only be released by the thread that holds it)."""
        held, self._pending_sample = self._pending_sample, None
        self._pending_output = None
        if held is not None:
            try:
                held.close()
            except RuntimeError:  # the owner lock belongs to another thread
                logger.debug("pending fused step released from another thread")

    def call_output(self, req: RpcRequest, expect: Callable[[str], Future],
                    local_method: Any = None) -> Future:
        """A pipeline step (``Replies.OUTPUT``): broadcast, run rank 0's stage, and return a
        Future of the output rank's result, which arrives later (outputs.py). The step stays
        on the pacer until then; rank 0's own result is not the step's."""
        data = encode_request(req)
        method = local_method if local_method is not None else req.method
        with self.owner:
            self._refuse_while_sample_pending(req.name)
            self._life.enter(req.name, self._execute_timeout_s, EXECUTE_TIMEOUT_SOURCE)
            try:
                try:
                    self._pacer.begin_step()
                except PacerError as e:
                    err = ExecutorFailedError(f"keepalive executor cannot begin {req.name}: {e}")
                    raise (self._life.error() or err) from e
                try:
                    self._send(req.name, data)
                except BaseException:
                    self._pacer.finish_step()
                    raise
                # Registered after the broadcast, under the owner lock: expected outputs are
                # in broadcast order, and the output rank's send waits for rank 0's receive.
                future = expect(req.name)
                future.add_done_callback(lambda _: self._pacer.finish_step())
                self._local_model_step(req.name, method, req.args)
            finally:
                self._life.exit()
        return future

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
