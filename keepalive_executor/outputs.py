"""Step outputs: resolving vLLM's asynchronous ones, and under pipeline parallelism the last
stage's, back to rank 0.

Async scheduling hands back an ``AsyncModelRunnerOutput`` still being copied to the host;
:func:`resolve_output` waits for it wherever an output is returned (rank 0's deferred outputs,
a worker's reply, the output link below), and :func:`is_async_output` says whether there is
anything to wait for. Both sides use them, so they live here, below the driver and the
receive loop.

Under PP, rank 0 (the driver, first rank of the first stage) computes nothing the scheduler
needs: a step's output (sampled tokens, logprobs) is made by the last stage, on vLLM's
``output_rank``, ``(P - 1) * T``. It comes back without a second RPC system, over the same
torch.distributed world, and only for the steps that need it (``Replies.OUTPUT``)::

    rank 0 (engine thread)             other ranks                 output rank
    ------------------------           -----------                 -----------
    expect(step) -> a future
    broadcast the step ------------->  run their stage  --------> run the last stage
    run stage 0's part (ignored)       (send activations on)       send (length, reply) on the
    return the future                                              output group (gloo, 2 ranks)
    thread keepalive-output-recv:  <-------------------------------------------------+
      receive the next reply, resolve the oldest expected future (FIFO)

* The **output group** is a 2-rank gloo group ``[0, output_rank]`` that every rank creates at
  start-up, in the same order, right after the channel. Only the output rank sends on it and
  only rank 0 receives, so replies arrive in step order. Its timeout is
  ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``: an output that does not arrive in time fails the
  executor.
* Rank 0 posts a receive only while a step is expected, so an idle engine has no pending
  collective on the group to time out.
* Steps overlap: the engine keeps up to P batches in flight (``max_concurrent_batches``;
  P + 1 with async scheduling on vLLM's V2 model runner), the channel's broadcasts do not
  wait for a busy last stage (see :mod:`.channel`), and each step's future resolves when its
  output arrives. Every step is in flight (lifecycle.py) from its broadcast until its
  output arrived, so no keepalive is sent while any is in flight.
* Async scheduling: the output rank's output may still be on its way to the host. The link
  resolves it before it sends (only the output rank ever does: the other ranks drop theirs,
  as vLLM's mp does). Under async scheduling the output rank resolves and sends on a thread
  of its own, ``keepalive-output-send`` (:class:`OutputSender`, mp's ``WorkerAsyncOutputCopy``),
  so its receive loop takes the next step while its GPU finishes this one.
"""

from __future__ import annotations

import collections
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from keepalive_executor.lifecycle import ExecutorFailedError
from keepalive_executor.log import get_logger
from keepalive_executor.rpc import RpcReply, WorkerRpcError, serialize

__all__ = ["is_async_output", "resolve_output", "output_rank", "OutputLink", "OutputReceiver",
           "OutputSender", "open_output_link", "settle"]

logger = get_logger(__name__)
_LENGTH_TAG, _DATA_TAG = 1, 2


def is_async_output(value: Any) -> bool:
    """Whether ``value`` is vLLM's ``AsyncModelRunnerOutput`` or a subclass of it (the GPU
    runner's is ``AsyncGPUModelRunnerOutput``): an output still being copied to the host."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    return isinstance(value, AsyncModelRunnerOutput)


def resolve_output(value: Any) -> Any:
    """Wait for an asynchronous model output (async scheduling) and return it; any other
    value as it is (the same object). A plain tuple holding one (the fused step's pair of
    outputs) is resolved element by element."""
    if type(value) is tuple and any(is_async_output(v) for v in value):
        return tuple(resolve_output(v) for v in value)
    return value.get_output() if is_async_output(value) else value


def output_rank(parallel_config: Any) -> int:
    """vLLM's output rank: the first TP rank of the last PP stage."""
    return (parallel_config.world_size
            - parallel_config.tensor_parallel_size
            * getattr(parallel_config, "prefill_context_parallel_size", 1))


class OutputLink:
    """Point-to-point from the output rank to rank 0 on their 2-rank gloo group."""

    def __init__(self, group: Any, src: int, dst: int = 0,
                 timeout_s: float | None = None) -> None:
        self.group = group
        self.src = src
        self.dst = dst
        self.timeout = None if timeout_s is None else timedelta(seconds=timeout_s)

    def send(self, reply: RpcReply) -> None:
        """The output rank: one reply, its async output resolved first (blocks until rank 0
        receives it)."""
        try:
            if reply.ok:
                reply = RpcReply(rank=reply.rank, ok=True, value=resolve_output(reply.value))
            data = serialize(reply)
        except Exception as e:  # noqa: BLE001 - an unsendable output is the step's error
            data = pickle.dumps(RpcReply(rank=reply.rank, ok=False,
                                         error=f"step output cannot be sent: "
                                               f"{type(e).__name__}: {e}"))
        length = torch.tensor([len(data)], dtype=torch.int64)
        dist.send(length, dst=self.dst, group=self.group, tag=_LENGTH_TAG)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=self.dst,
                  group=self.group, tag=_DATA_TAG)

    def recv(self) -> RpcReply:
        """Rank 0: the next reply (raises on timeout or a lost peer)."""
        length = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.irecv(length, src=self.src, group=self.group, tag=_LENGTH_TAG))
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        self._wait(dist.irecv(data, src=self.src, group=self.group, tag=_DATA_TAG))
        return pickle.loads(data.numpy().tobytes())

    def _wait(self, work: Any) -> None:
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    def close(self, timeout_s: float = 0.0) -> None:
        """Nothing to flush: every send completed before it returned."""


class OutputSender:
    """The output rank under async scheduling: resolves and sends each step's output on the
    thread ``keepalive-output-send``, in step order, so the receive loop does not wait for
    the GPU's copy of this step before it takes the next (vLLM's mp resolves on its
    ``WorkerAsyncOutputCopy`` thread the same way).

    The receive loop owns it: :meth:`send` enqueues (and raises the sender's error, if a
    send failed: rank 0 is gone or gave up, so this rank stops), :meth:`close` sends what is
    queued and ends the thread. ``bind_thread`` runs first in the thread (sets the device:
    CUDA calls on a thread without it would create a context on device 0).
    """

    def __init__(self, link: OutputLink, bind_thread: Callable[[], None] = lambda: None,
                 ) -> None:
        self._link = link
        self._bind_thread = bind_thread
        self._queue: collections.deque[RpcReply | None] = collections.deque()
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="keepalive-output-send",
                                        daemon=True)
        self._thread.start()

    def send(self, reply: RpcReply) -> None:
        """Queue one reply (its output resolved and sent by the thread, in order)."""
        with self._cond:
            if self.error is not None:
                raise self.error
            self._queue.append(reply)
            self._cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (at most ``timeout_s``), then end the thread."""
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        self._bind_thread()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                reply = self._queue.popleft()
            if reply is None:
                return
            try:
                self._link.send(reply)
            except BaseException as e:  # noqa: BLE001 - the receive loop raises it
                logger.error("keepalive output rank: sending a step's output failed: %s", e)
                with self._cond:
                    self.error = e
                return


def open_output_link(parallel_config: Any, timeout_s: float) -> OutputLink | None:
    """Every rank, in the same order, right after the channel: the output group, or None
    without PP. Returns the link on rank 0 and the output rank, None elsewhere."""
    if parallel_config.pipeline_parallel_size <= 1:
        return None
    out = output_rank(parallel_config)
    group = dist.new_group([0, out], backend="gloo", timeout=timedelta(seconds=timeout_s))
    if dist.get_rank() not in (0, out):
        return None
    return OutputLink(group, src=out, timeout_s=timeout_s)


@dataclass
class _Expected:
    name: str
    future: Future


class OutputReceiver:
    """Thread ``keepalive-output-recv`` on rank 0: resolves expected steps in order.

    ``expect(name)`` returns a Future that resolves with the output rank's reply value.
    ``on_lost(reason)`` (the executor's fail) is called once, and the thread ends, if a reply
    cannot be received or if the output rank answers a step with an error: that step's
    future then raises :class:`WorkerRpcError` naming the step and the rank, and every later
    one fails. ``fail_all(error)`` fails every expected future (the executor failed).
    """

    def __init__(self, link: OutputLink, on_lost: Callable[[str], None]) -> None:
        self._link = link
        self._on_lost = on_lost
        self._cond = threading.Condition()
        self._expected: collections.deque[_Expected] = collections.deque()
        self._stopping = False
        self._failed: BaseException | None = None
        self.max_pending = 0  # the most steps ever in flight at once (overlap, for tests)
        self._thread = threading.Thread(target=self._run, name="keepalive-output-recv",
                                        daemon=True)

    def start(self) -> None:
        """Start the thread (once)."""
        self._thread.start()

    def expect(self, name: str) -> Future:
        """Register the next step whose output the output rank will send."""
        future: Future = Future()
        with self._cond:
            if self._failed is not None:
                future.set_exception(self._failed)
                return future
            self._expected.append(_Expected(name, future))
            self.max_pending = max(self.max_pending, len(self._expected))
            self._cond.notify_all()
        return future

    @property
    def pending(self) -> int:
        """Steps whose output has not arrived."""
        return len(self._expected)

    def fail_all(self, error: BaseException) -> None:
        """Fail every expected future, and every later one."""
        with self._cond:
            self._failed = error
            pending = list(self._expected)
            self._expected.clear()
            self._cond.notify_all()
        for e in pending:
            settle(e.future, error=error)

    def drain(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` until every expected output has arrived; the thread
        keeps receiving and the futures settle as usual. True if it drained; False on
        timeout, or if the receiver failed or was stopped first.

        Shutdown calls this before :meth:`fail_all`: an output rank whose output is never
        received stays blocked in its send and never reads the SHUTDOWN broadcast."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._expected and self._failed is None and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return not self._expected and self._failed is None

    def stop(self) -> None:
        """End the thread once it is not receiving (shutdown)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._expected and not self._stopping and self._failed is None:
                    self._cond.wait()
                if self._stopping or self._failed is not None:
                    return
                name = self._expected[0].name
            try:
                reply = self._link.recv()
            except Exception as e:  # noqa: BLE001 - a lost peer or a timeout: fatal
                if not self._stopping and self._failed is None:
                    reason = (f"the output of {name} from rank {self._link.src} (the "
                              f"last pipeline stage) did not arrive: {e}")
                    self._on_lost(reason)
                    self._fail_rest(reason)
                return
            with self._cond:
                if not self._expected:
                    continue  # failed meanwhile
                expected = self._expected.popleft()
                self._cond.notify_all()  # drain() waits for the queue to empty
            if reply.ok:
                settle(expected.future, value=reply.value)
                continue
            # The output rank failed this step, which every other stage ran (or raised in):
            # the pipeline is out of step, and a later reply would be paired with the wrong
            # step. Fatal: the executor fails before the engine sees this step's error, so
            # the engine's next call is refused rather than broadcast.
            reason = (f"{expected.name} failed on rank {reply.rank} (the output rank, last "
                      f"pipeline stage): {reply.error}; the pipeline is out of step")
            self._on_lost(reason)
            self._fail_rest(reason)
            settle(expected.future, error=WorkerRpcError(expected.name, reply))
            return

    def _fail_rest(self, reason: str) -> None:
        """Fail every later expected future, in case ``on_lost`` did not (it normally calls
        :meth:`fail_all` itself, with the executor's own error)."""
        with self._cond:
            failed = self._failed
        if failed is None:
            self.fail_all(ExecutorFailedError(f"keepalive executor failed: {reason}"))


def settle(future: Future, value: Any = None, error: BaseException | None = None) -> None:
    """Settle ``future`` with ``value`` or ``error`` unless it is settled already (a give-up,
    a failure and the normal path may race)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except InvalidStateError:
        pass
