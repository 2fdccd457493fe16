"""Async scheduling: rank 0's model outputs, resolved when first asked for, in step order.

With async scheduling on (``VLLM_KEEPALIVE_ASYNC_SCHEDULING=1``, GPUs only), vLLM's GPU model
runner returns an ``AsyncModelRunnerOutput`` (``AsyncGPUModelRunnerOutput``) from
``sample_tokens``: the sampled token ids are still being copied to the host on a side stream,
and ``get_output()`` waits for that copy. vLLM 0.32's executors differ in where that wait
happens (read in its source):

* ``UniProcExecutor`` runs the worker's call on the engine thread, then returns an
  ``AsyncOutputFuture`` whose ``result()`` calls ``get_output()`` when first asked, on the
  thread that asks (no thread pool in 0.32);
* ``MultiprocExecutor`` returns a ``FutureWrapper`` at once; its ``result()`` first drains
  every older future of the executor, in order, then reads the output rank's reply, which
  that worker resolved on its own thread (``WorkerAsyncOutputCopy``). Ranks that are not the
  output rank never call ``get_output()``: their outputs are dropped.

Here rank 0's part of a step runs on the driver's thread and returns as soon as rank 0 has
*launched* the step (as ``UniProcExecutor``'s call does); the future the engine gets
resolves lazily like ``AsyncOutputFuture``, and in order like ``FutureWrapper``: asking for
step N's output first resolves every older one. Two differences, both deliberate:

* ``get_output()`` runs on the driver's thread, not on the engine's: every CUDA call of rank
  0 is made on the one thread whose device is set (docs/design.md, "Threads, devices and
  streams");
* the wait is watched like a step (:meth:`keepalive_executor.steps.StepRunner.run_local`):
  it has the step timeout, and a failure elsewhere gives it up after the failure grace, so a
  GPU that never finishes the copy (a peer died inside the step's all-reduce) cannot hold the
  engine thread forever. Its lifecycle entry is local (not in flight): resolving is
  local, no collective.

An error raised by ``get_output()`` is that step's error, delivered through its future (the
other ranks finished the step: the ranks are in step, the executor stays usable), as
``UniProcExecutor`` does.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from keepalive_executor.outputs import is_async_output, settle

__all__ = ["DeferredOutput", "DeferredOutputs"]

#: ``run_local(name, fn)``: run ``fn`` as rank 0's local step and return its value
RunLocal = Callable[[str, Callable[[], Any]], Any]


class DeferredOutput(Future):
    """One step's async output; ``result()`` and ``exception()`` resolve it (and every older
    one) when first asked."""

    def __init__(self, owner: DeferredOutputs, name: str, output: Any) -> None:
        super().__init__()
        self.name = name
        self.output = output
        self._owner = owner

    def result(self, timeout: float | None = None) -> Any:
        """The output, resolved now if nobody asked for it yet."""
        self._owner.resolve_through(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error, resolving the output now if nobody asked for it yet."""
        self._owner.resolve_through(self)
        return super().exception(timeout)


class DeferredOutputs:
    """The not-yet-resolved async outputs of rank 0, oldest first.

    ``run_local(name, fn)`` runs ``fn`` as rank 0's local step (the driver's thread, watched
    by the lifecycle) and returns its value or raises.
    """

    def __init__(self, run_local: RunLocal) -> None:
        self._run_local = run_local
        self._lock = threading.Lock()
        self._pending: collections.deque[DeferredOutput] = collections.deque()

    @property
    def pending(self) -> int:
        """Outputs nobody has asked for yet."""
        return len(self._pending)

    def defer(self, name: str, value: Any) -> Future:
        """A future of ``value``: deferred if it is an async output, done otherwise."""
        if not is_async_output(value):
            done: Future = Future()
            done.set_result(value)
            return done
        future = DeferredOutput(self, name, value)
        with self._lock:
            self._pending.append(future)
        return future

    def resolve_through(self, future: DeferredOutput) -> None:
        """Resolve ``future`` and every older pending output, in order, on rank 0's thread.
        Returns at once if another caller already took them (its result follows)."""
        with self._lock:
            if future not in self._pending:
                return
            batch = []
            while True:
                oldest = self._pending.popleft()
                batch.append(oldest)
                if oldest is future:
                    break
        try:
            self._run_local(f"{future.name}'s output (rank 0's device-to-host copy)",
                            partial(_resolve_in_order, batch))
        except BaseException as e:
            for f in batch:
                settle(f, error=e)
            if not isinstance(e, Exception):
                raise  # the caller's own interrupt: its future has the same error


def _resolve_in_order(batch: list[DeferredOutput]) -> None:
    """On rank 0's thread: ``get_output()`` of each, oldest first; each future settles with
    its own outcome."""
    for f in batch:
        try:
            settle(f, value=f.output.get_output())
        except Exception as e:  # noqa: BLE001 - that step's error, through its future
            settle(f, error=e)
