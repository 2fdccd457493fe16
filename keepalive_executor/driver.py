"""Rank 0: the driver's own vLLM worker, which lives in the engine process, on its own thread.

Every call to rank 0's worker, from its construction on, runs on one thread the driver owns,
``keepalive-driver``; the caller (vLLM's engine thread, or a user's thread calling
``collective_rpc``) hands the call over and waits for its outcome. So thread-local state (the
CUDA device, the CPU binding, per-thread streams) is the same for every call, and a call can be
**given up**: when a rank fails while rank 0 is inside a step whose collectives wait for that
rank forever (the CPU shared-memory all-reduce and an NCCL kernel have no timeout),
:meth:`DriverRank.abandon` fails the waiting call and every later one. The engine thread then
returns with the failure, and vLLM's own error path takes over (the request or utility call
fails, the engine reports itself dead to its clients), in vLLM's ``EngineCore`` process and in
the user's own process alike. The executor never ends a process: ending vLLM's engine process
abruptly leaves vLLM's synchronous client waiting forever (it fails pending calls only when the
engine says it is dead), and the user's process is not the executor's to end. The given-up
thread stays blocked (a daemon) until the process exits.

A step is one hand-over: its broadcast, rank 0's part and its reply gather all run on this
thread (see :mod:`keepalive_executor.steps`), so the engine thread only ever waits on a
Future that a give-up can fail. The hand-over costs one thread switch per step, about 60 us
on the 2-core machine here.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from keepalive_executor.binding import bind_threads, share_binding
from keepalive_executor.log import get_logger

__all__ = ["DriverRank"]

logger = get_logger(__name__)


class DriverRank:
    """Rank 0's worker and the thread its calls run on (see the module docstring)."""

    def __init__(self, *, name: str = "keepalive-driver") -> None:
        self.worker: Any = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._abandoned: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ running calls
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the driver's thread; return or raise its outcome."""
        return self.run_within(None, fn, *args, **kwargs)

    def run_within(self, timeout_s: float | None, fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
        """:meth:`run`, waiting at most ``timeout_s`` (``TimeoutError`` after it). A call
        whose wait ends early (a timeout, a ``KeyboardInterrupt``) before it began is
        cancelled: it never runs."""
        future: Future = Future()
        with self._lock:
            if self._abandoned is not None:
                raise self._abandoned
            self._pending.add(future)
        self._queue.put((fn, args, kwargs, future))
        try:
            return future.result(timeout_s)
        except BaseException:
            future.cancel()  # no effect once it runs
            raise
        finally:
            with self._lock:
                self._pending.discard(future)

    def abandon(self, error: BaseException) -> bool:
        """Fail the call waiting on the driver's thread and every later one with ``error``."""
        with self._lock:
            self._abandoned = error
            pending = list(self._pending)
        for future in pending:
            try:
                future.set_exception(error)
            except InvalidStateError:
                pass
        return True

    def close(self, timeout: float = 5.0) -> None:
        """End the driver's thread (after the worker has been shut down)."""
        if self._thread.is_alive():
            self._queue.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, kwargs, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - delivered to the waiting caller
                try:
                    future.set_exception(e)
                except InvalidStateError:
                    pass  # given up meanwhile: the caller already has its error
            else:
                try:
                    future.set_result(result)
                except InvalidStateError:
                    pass

    # ------------------------------------------------------------------ the worker
    def create(
        self,
        vllm_config: Any,
        *,
        local_rank: int,
        distributed_init_method: str,
        shared_worker_lock: Any,
        before_init_device: Callable[[], None] = lambda: None,
    ) -> None:
        """Build rank 0's worker, bind its CPUs and join the process groups (every rank
        must be joining them too)."""
        cpus = self.run(self._create, vllm_config, local_rank, distributed_init_method,
                        shared_worker_lock, before_init_device)
        share_binding(cpus)

    def _create(self, vllm_config: Any, local_rank: int, init_method: str, lock: Any,
                before_init_device: Callable[[], None]) -> set[int] | None:
        from vllm.v1.executor.vllm_net_devices import set_worker_net_device
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        set_worker_net_device(local_rank, vllm_config)  # NIC selection, as mp's workers do
        wrapper = WorkerWrapperBase(rpc_rank=0, global_rank=0)
        all_kwargs: list[dict] = [{} for _ in range(vllm_config.parallel_config.world_size)]
        all_kwargs[0] = dict(
            vllm_config=vllm_config,
            local_rank=local_rank,
            rank=0,
            distributed_init_method=init_method,
            is_driver_worker=True,
            shared_worker_lock=lock,
        )
        wrapper.init_worker(all_kwargs)
        self.worker = wrapper
        # On CPU, rank 0 takes its CPUs here, as mp's worker 0 would in its own process;
        # threads created by this one (OpenMP's) inherit the binding.
        bind_threads(vllm_config, local_rank)
        before_init_device()
        wrapper.init_device()  # joins the process groups with every other rank
        return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

    def shutdown_worker(self, timeout_s: float) -> None:
        """vLLM's worker shutdown (best effort; at most ``timeout_s``: the thread may be
        stuck in a step that was interrupted or given up)."""
        if self.worker is not None and getattr(self.worker, "worker", None) is not None:
            try:
                self.run_within(timeout_s, self.worker.shutdown)
            except Exception:  # noqa: BLE001
                logger.debug("driver worker shutdown failed", exc_info=True)
