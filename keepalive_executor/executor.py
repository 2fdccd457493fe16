"""KeepaliveExecutor: vLLM's executor contract on one side, the channel and pacer on the other.

The driver (rank 0) lives in the engine process and runs its share of the model in-process,
as vLLM's ``UniProcExecutor`` does. Ranks 1..N-1 wait indefinitely in
:func:`keepalive_executor.worker_loop.receive_loop`; they are either worker processes started
here (see :mod:`keepalive_executor.launcher`) or, in torchrun mode, torchrun's own processes
that receive their configuration from the driver (see :mod:`keepalive_executor.torchrun`).
Every engine call is one broadcast on the channel; calls that need every rank's result
gather them over the world CPU group.
While the engine is idle, the pacer broadcasts a no-op keepalive every ``interval``.

States of the executor (``self.state``): ``running`` -> ``failed`` (a worker died, a
collective failed or timed out; every later call raises at once naming the cause) and
``running``/``failed`` -> ``stopped`` (``shutdown``; idempotent).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from vllm.v1.executor.abstract import Executor, FailureCallback

from keepalive_executor import torchrun
from keepalive_executor.channel import BroadcastChannel, ChannelError
from keepalive_executor.config import (
    KeepaliveSettings,
    check_parallel_layout,
    settings_from_vllm_config,
)
from keepalive_executor.launcher import (
    WorkerHandle,
    WorkerMonitor,
    spawn_worker,
    stop_workers,
    wait_for_ready,
)
from keepalive_executor.pacer import Pacer
from keepalive_executor.rpc import RpcReply, RpcRequest, WorkerRpcError, gather_replies
from keepalive_executor.worker_loop import bind_threads, make_channel

__all__ = ["KeepaliveExecutor", "ExecutorFailedError"]

logger = logging.getLogger("vllm." + __name__)

#: Test-only: start without the pacer so tests can show that idle receivers then die.
#: Deliberately not a documented option; it logs a warning whenever it is honoured.
_TEST_DISABLE_PACER_ENV = "_KEEPALIVE_EXECUTOR_TEST_ONLY_DISABLE_PACER"
SHUTDOWN_GRACE_S = 5.0
EXIT_STUCK_STEP = 70
#: After a rank fails, how long the engine thread may stay inside a step before the engine
#: process is ended (see _watch_stuck_step).
FAILURE_GRACE_S = float(os.environ.get("VLLM_KEEPALIVE_FAILURE_GRACE_S", "5"))


class ExecutorFailedError(RuntimeError):
    """The executor is in its failed state; the message says why."""


def _execute_and_sample(worker: Any, scheduler_output: Any) -> Any:
    """Workers' fused step: forward pass, then sampling if the step wants it."""
    out = worker.execute_model(scheduler_output)
    if out is None:
        out = worker.sample_tokens(None)
    return out


def _load_model(worker: Any) -> None:
    """Run on every rank: load weights, then let the platform fix the block size."""
    from vllm.platforms import current_platform

    worker.load_model()
    current_platform.update_block_size_for_backend(worker.vllm_config)


class _StepFuture(Future):
    """A finished-in-process step whose pacer token is released when its result is taken."""

    def __init__(self, resolve: Callable[[], Any], release: Callable[[], None]):
        super().__init__()
        self._resolve: Callable[[], Any] | None = resolve
        self._release = release
        self._lock = threading.Lock()

    def _settle(self) -> None:
        with self._lock:
            if self._resolve is None:
                return
            resolve, self._resolve = self._resolve, None
            try:
                self.set_result(resolve())
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                self.set_exception(e)
            finally:
                self._release()

    def result(self, timeout: float | None = None) -> Any:
        self._settle()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._settle()
        return super().exception(timeout)

    def done(self) -> bool:
        return self._resolve is None and super().done()


class KeepaliveExecutor(Executor):
    """Driver in-process, receivers in worker processes, one broadcast channel between."""

    uses_ray: bool = False
    supports_pp: bool = False

    # ------------------------------------------------------------------ start-up
    @staticmethod
    def validate(vllm_config: Any) -> KeepaliveSettings:
        """All start-up checks, cheap enough for the front end: raises KeepaliveConfigError."""
        check_parallel_layout(vllm_config.parallel_config)
        if torchrun.in_torchrun_mode():
            torchrun.check_world_size(vllm_config.parallel_config)
        return settings_from_vllm_config(vllm_config)

    def _init_executor(self) -> None:
        self._torchrun: torchrun.TorchrunEnv | None = None
        self._store: Any = None
        if torchrun.in_torchrun_mode():
            self._torchrun = torchrun.TorchrunEnv.from_environ()
            self._store = torchrun.connect_store(self._torchrun)
            # torchrun signals rank 0's whole process group. Leave it, so that this engine
            # process gets one SIGTERM, from vLLM's front end, as under `vllm serve`: a
            # second one would kill it in vLLM's teardown before SHUTDOWN reaches the
            # other ranks. It still dies with its parent.
            try:
                os.setpgid(0, 0)
            except OSError as e:  # e.g. already a session leader: keep vLLM's behaviour
                logger.warning("keepalive: could not leave rank 0's process group: %s", e)
            torchrun.set_parent_death_signal(signal.SIGKILL)
        try:
            self.settings = self.validate(self.vllm_config)
        except Exception as e:
            self._tell_followers_error(f"{type(e).__name__}: {e}")
            raise
        logger.info("%s", self.settings.describe())
        self.state = "running"
        self._sample_pending = False
        self._inside: str | None = None  # name of the call the engine thread is inside
        self._failure: str | None = None
        self._failure_callback: FailureCallback | None = None
        self._rpc_lock = threading.RLock()
        self._state_lock = threading.Lock()
        self.workers: list[WorkerHandle] = []
        self._monitor: WorkerMonitor | None = None
        self._pacer: Pacer | None = None
        self._channel: BroadcastChannel | None = None
        self.driver_worker: Any = None
        self._finalizer = weakref.finalize(self, KeepaliveExecutor._last_resort_stop, self.workers)

        self.world_size = self.parallel_config.world_size
        if self._torchrun is not None:
            # Ranks are torchrun's; the process groups meet on torchrun's store.
            self._init_method = self._torchrun.group_label()
            self._local_rank = self._torchrun.local_rank
        else:
            # Keep gloo's sockets on loopback: there is only one node in this mode.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            from vllm.utils.network_utils import get_file_store_init_method

            self._init_method = get_file_store_init_method()
            self._local_rank = 0
        try:
            self._start()
        except BaseException as e:
            self._tell_followers_error(f"rank 0's executor failed to start: {e!r}")
            self.shutdown()
            raise

    def _tell_followers_error(self, message: str) -> None:
        """torchrun mode: make the waiting ranks exit with rank 0's start-up error."""
        if self._torchrun is None or self._store is None:
            return
        try:
            torchrun.post_error(self._store, self._torchrun, message)
        except Exception:  # noqa: BLE001 - they still time out or are stopped by torchrun
            logger.warning("could not post the start-up error to torchrun's store", exc_info=True)

    def _post_bootstrap(self) -> None:
        """torchrun mode: give every other rank the configuration it must follow."""
        assert self._torchrun is not None
        settings = dict(
            init_method=self._init_method,
            transport=self.settings.transport,
            inline_bytes=self.settings.inline_bytes,
            max_payload_bytes=self.settings.max_payload_bytes,
        )
        if not torchrun.post_bootstrap(
            self._store, self._torchrun, {"vllm_config": self.vllm_config, "settings": settings}
        ):
            raise RuntimeError(
                "torchrun's store already holds a bootstrap for this run and attempt "
                f"({self._torchrun.key('bootstrap')}); is another rank 0 running?"
            )
        logger.info(
            "keepalive torchrun mode: configuration published for ranks 1..%d; joining "
            "the process groups at %s", self.world_size - 1, self._init_method,
        )

    def _start(self) -> None:
        from vllm.utils.system_utils import get_mp_context
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        lock = get_mp_context().Lock()
        common = dict(
            distributed_init_method=self._init_method,
            transport=self.settings.transport,
            inline_bytes=self.settings.inline_bytes,
            max_payload_bytes=self.settings.max_payload_bytes,
            shared_worker_lock=lock,
        )
        if self._torchrun is None:
            for rank in range(1, self.world_size):
                self.workers.append(spawn_worker(self.vllm_config, rank, common))
            # Rendezvous only once every worker is up: the process-group rendezvous waits
            # at most the collective timeout, shorter than a cold start can take.
            wait_for_ready(self.workers, torchrun.STARTUP_TIMEOUT_S, status="ALIVE")
        else:
            self._post_bootstrap()

        self.driver_worker = WorkerWrapperBase(rpc_rank=0, global_rank=0)
        all_kwargs: list[dict] = [{} for _ in range(self.world_size)]
        all_kwargs[0] = dict(
            vllm_config=self.vllm_config,
            local_rank=self._local_rank,
            rank=0,
            distributed_init_method=self._init_method,
            is_driver_worker=True,
            shared_worker_lock=lock,
        )
        self.driver_worker.init_worker(all_kwargs)
        # On CPU, the in-process driver takes rank 0's CPUs, as mp gives its worker 0.
        bind_threads(self.vllm_config, self._local_rank)
        if self._torchrun is not None:
            torchrun.init_world_process_group(self._torchrun, self.vllm_config)
        self.driver_worker.init_device()  # joins the process groups with every worker
        self._channel, self._reply_group = make_channel(
            self.settings.transport, self.settings.inline_bytes, self.settings.max_payload_bytes
        )
        wait_for_ready(self.workers, torchrun.STARTUP_TIMEOUT_S)

        if self.workers:  # torchrun mode has no processes of its own to watch
            self._monitor = WorkerMonitor(self.workers, self._on_worker_death)
            self._monitor.start()
        channel = self._channel
        self._pacer = Pacer(
            self.settings.interval_s,
            channel.send_keepalive,
            send_lock=channel.send_lock,
            on_failure=lambda e: self._fail(f"keepalive broadcast failed: {e}"),
        )
        if os.environ.get(_TEST_DISABLE_PACER_ENV) == "1":
            logger.warning("TEST ONLY: keepalive pacer disabled; idle workers will time out")
        else:
            self._pacer.start()
        self.collective_rpc(_load_model)

    # ------------------------------------------------------------------ failure
    def _fail(self, reason: str) -> None:
        with self._state_lock:
            if self.state != "running":
                return
            self.state = "failed"
            self._failure = reason
            callback, self._failure_callback = self._failure_callback, None
        logger.error("keepalive executor failed: %s", reason)
        torchrun.record_failure(reason)
        if self._inside is not None:
            threading.Thread(
                target=self._watch_stuck_step, args=(reason,), name="keepalive-stuck-step",
                daemon=True,
            ).start()
        if self._pacer is not None:
            threading.Thread(target=self._pacer.stop, name="keepalive-pacer-stop").start()
        if callback is not None:
            callback()

    @contextlib.contextmanager
    def _inside_call(self, name: str) -> Iterator[None]:
        self._inside = name
        try:
            yield
        finally:
            self._inside = None

    def _watch_stuck_step(self, reason: str) -> None:
        """A rank failed while the engine thread may be inside a step whose collectives
        wait for that rank (the CPU shm all-reduce and NCCL never time out on their own).
        If the step has not returned after FAILURE_GRACE_S, end the engine process: its
        parent (vLLM's front end) then fails every request, and the workers, whose death
        pipes close, exit too. A hang forever is the only alternative."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while self._inside is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        stuck = self._inside
        if stuck is None:
            return
        logger.critical(
            "keepalive executor: %s while rank 0 was inside %s; that step cannot complete "
            "(its collectives wait for the failed rank). Ending the engine process (pid %d) "
            "after %.1fs so that no request hangs.",
            reason, stuck, os.getpid(), FAILURE_GRACE_S,
        )
        for handler in logging.getLogger("vllm").handlers:
            handler.flush()
        for w in self.workers:
            if w.proc.is_alive():
                w.proc.kill()
        os._exit(EXIT_STUCK_STEP)

    def _on_worker_death(self, worker: WorkerHandle) -> None:
        worker.proc.join(1.0)  # the sentinel fires before the exit code is collected
        self._fail(
            f"worker rank {worker.rank} (pid {worker.proc.pid}) died unexpectedly "
            f"(exit code {worker.proc.exitcode})"
        )

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback`` when the executor fails (at once if it already has)."""
        with self._state_lock:
            if self.state == "running":
                self._failure_callback = callback
                return
        callback()

    def _check_usable(self) -> None:
        if self.state == "failed":
            raise ExecutorFailedError(f"keepalive executor failed: {self._failure}")
        if self.state == "stopped":
            raise ExecutorFailedError("keepalive executor is shut down")

    # ------------------------------------------------------------------ calls
    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        single_value: bool = False,
        reply: bool = True,
    ) -> Any:
        """Run ``method`` on every rank; results in rank order (or the driver's alone).

        ``reply=False`` is the per-step hot path: the driver's result only, no gather.
        """
        req = RpcRequest(method=method, args=tuple(args), kwargs=kwargs or {}, reply=reply)
        if non_block:
            try:
                resolve = self._run(req, timeout, single_value)
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                future: Future = Future()
                future.set_exception(e)
                return future
            return _StepFuture(resolve, self._finish_step)
        resolve = self._run(req, timeout, single_value)
        try:
            return resolve()
        finally:
            self._finish_step()

    def _finish_step(self) -> None:
        if self._pacer is not None:
            self._pacer.finish_step()

    def _run(
        self,
        req: RpcRequest,
        timeout: float | None,
        single_value: bool,
        local_method: str | None = None,
    ) -> Callable[[], Any]:
        """Broadcast and run one call; return a thunk producing its result.

        The driver runs ``local_method`` instead of ``req.method`` when it is given.

        On return the step is still in flight (the caller calls ``_finish_step``); on an
        exception it has already been finished.
        """
        from vllm.v1.outputs import AsyncModelRunnerOutput
        from vllm.v1.serial_utils import run_method

        self._check_usable()
        assert self._channel is not None and self._pacer is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._rpc_lock, self._inside_call(req.name):
            self._pacer.begin_step()
            try:
                try:
                    self._channel.send(req)
                except ChannelError as e:
                    if self._channel.closed:
                        self._fail(f"broadcast of {req.name} failed: {e}")
                    raise
                self._pacer.note_broadcast()
                local_error: BaseException | None = None
                value: Any = None
                try:
                    value = run_method(
                        self.driver_worker, local_method or req.method, req.args, req.kwargs
                    )
                except Exception as e:  # noqa: BLE001 - still owes the gather
                    local_error = e
                if not req.reply:
                    if local_error is not None:
                        raise local_error
                    if isinstance(value, AsyncModelRunnerOutput):
                        return value.get_output
                    return lambda: value
                if isinstance(value, AsyncModelRunnerOutput):
                    value = value.get_output()
                replies = self._gather(req, value, local_error, deadline, timeout)
                if local_error is not None:
                    raise local_error
                for r in replies[1:]:
                    if not r.ok:
                        raise WorkerRpcError(req.name, r)
                values = [r.value for r in replies]
                return (lambda: values[0]) if single_value else (lambda: values)
            except BaseException:
                self._pacer.finish_step()
                raise

    def _gather(
        self,
        req: RpcRequest,
        value: Any,
        local_error: BaseException | None,
        deadline: float | None,
        timeout: float | None,
    ) -> list[RpcReply]:
        mine = RpcReply(rank=0, ok=local_error is None, value=value,
                        error="" if local_error is None else repr(local_error))
        try:
            replies = gather_replies(
                mine,
                self._reply_group,
                dst=0,
                world_size=self.world_size,
                timeout_s=None if deadline is None else deadline - time.monotonic(),
            )
        except Exception as e:
            if deadline is not None and time.monotonic() >= deadline:
                self._fail(f"collective_rpc({req.name!r}) timed out after {timeout:g}s")
                raise TimeoutError(
                    f"collective_rpc({req.name!r}) timed out after {timeout:g}s waiting for "
                    "the other ranks; the executor is now failed (ranks are out of step)"
                ) from e
            self._fail(f"gathering replies to {req.name} failed: {e}")
            raise
        assert replies is not None
        return replies

    def execute_model(  # type: ignore[override]
        self, scheduler_output: Any, non_block: bool = False
    ) -> Any:
        """One model step on every rank; the driver's output.

        When the batch has no structured-output request the engine's grammar output is
        ``None`` by construction (``Scheduler.get_grammar_bitmask``), so workers can sample
        right after the forward pass: the step then costs one broadcast, not two, and the
        driver's ``sample_tokens(None)`` runs locally. The step stays in flight on the
        pacer until that local sampling is done.
        """
        if getattr(scheduler_output, "has_structured_output_requests", True):
            return self.collective_rpc(
                "execute_model", args=(scheduler_output,), non_block=non_block,
                single_value=True, reply=False,
            )
        req = RpcRequest(
            method=_execute_and_sample, args=(scheduler_output,), kwargs={}, reply=False
        )
        try:
            value = self._run(req, None, True, local_method="execute_model")()
        except BaseException as e:
            if non_block:
                future: Future = Future()
                future.set_exception(e)
                return future
            raise
        if value is None:
            # The step token stays taken until sample_tokens has run locally.
            self._sample_pending = True
        else:
            self._finish_step()
        if non_block:
            future = Future()
            future.set_result(value)
            return future
        return value

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: Any, non_block: bool = False
    ) -> Any:
        """Sampling on every rank (already done by workers after a fused step)."""
        if not self._sample_pending:
            return self.collective_rpc(
                "sample_tokens", args=(grammar_output,), non_block=non_block,
                single_value=True, reply=False,
            )
        try:
            if grammar_output is not None:
                raise ExecutorFailedError(
                    "sample_tokens got a grammar output after a step without structured "
                    "output requests; workers already sampled without it"
                )
            with self._inside_call("sample_tokens"):
                value = self.driver_worker.sample_tokens(None)
        except BaseException as e:
            if non_block:
                future: Future = Future()
                future.set_exception(e)
                return future
            raise
        finally:
            self._end_fused_step()
        if non_block:
            future = Future()
            future.set_result(value)
            return future
        return value

    def _end_fused_step(self) -> None:
        if self._sample_pending:
            self._sample_pending = False
            self._finish_step()

    def execute_dummy_batch(self) -> None:
        """A dummy step on every rank."""
        self.collective_rpc("execute_dummy_batch", reply=False)

    def take_draft_token_ids(self) -> Any:
        """The driver's draft tokens (every rank takes its own)."""
        return self.collective_rpc("take_draft_token_ids", single_value=True, reply=False)

    def check_health(self) -> None:
        """Raise if failed, if a worker process is gone, or if a round trip takes > 10 s."""
        self._check_usable()
        for w in self.workers:
            if not w.proc.is_alive():
                self._on_worker_death(w)
                self._check_usable()
        self.collective_rpc("check_health", timeout=10)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """False: not verified (vLLM forces async scheduling off on CPU)."""
        return False

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the pacer, send SHUTDOWN, reap every worker. Safe to call twice."""
        with self._state_lock:
            if getattr(self, "state", None) == "stopped":
                return
            was_failed = self.state == "failed"
            self.state = "stopped"
        if self._monitor is not None:
            self._monitor.stop()
        if self._pacer is not None:
            self._pacer.stop()
        if self._channel is not None and not was_failed and not self._channel.closed:
            sender = threading.Thread(
                target=self._send_shutdown, name="keepalive-send-shutdown", daemon=True
            )
            sender.start()
            sender.join(SHUTDOWN_GRACE_S)
        stop_workers(self.workers, SHUTDOWN_GRACE_S)
        if self.driver_worker is not None and getattr(self.driver_worker, "worker", None):
            try:
                self.driver_worker.shutdown()
            except Exception:  # noqa: BLE001
                logger.debug("driver worker shutdown failed", exc_info=True)
        try:
            from vllm.distributed import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # noqa: BLE001
            logger.debug("destroying the process groups failed", exc_info=True)
        init_method = getattr(self, "_init_method", "")
        if init_method.startswith("file://") and os.path.exists(init_method[7:]):
            os.unlink(init_method[7:])
        self._finalizer.detach()
        logger.info(
            "keepalive executor shut down; worker exit codes %s",
            {w.rank: w.proc.exitcode for w in self.workers},
        )

    def _send_shutdown(self) -> None:
        assert self._channel is not None
        try:
            with self._rpc_lock:
                self._channel.send_shutdown()
        except Exception as e:  # noqa: BLE001 - workers are stopped by signal instead
            logger.warning("could not broadcast SHUTDOWN to workers: %s", e)

    @staticmethod
    def _last_resort_stop(workers: list[WorkerHandle]) -> None:
        for w in workers:
            if w.proc.is_alive():
                w.proc.kill()

