"""Start, watch and stop the executor's worker processes (ranks 1..N-1).

* **ready handshake**: each worker sends ``{"status": "ALIVE"}`` on its ready pipe once it is
  constructed (before the rendezvous, which the driver then joins) and ``{"status": "READY"}``
  once it has joined the process groups and built its channel. :func:`wait_for_ready` waits
  for every pipe *and* every process sentinel, so a worker that dies during start-up is reported at
  once, naming its rank and exit code, rather than after a timeout.
* **death detection**: :class:`WorkerMonitor` (thread ``keepalive-worker-monitor``) waits on
  the sentinels and calls back with the first rank that exits.
* **orphans**: each worker holds the read end of a *death pipe* whose write end only the
  parent holds; when the parent dies, for any reason, the pipe closes and the worker exits.
* **stop**: :func:`stop_workers` waits a grace period, then SIGTERM, then SIGKILL. After a
  failure the death pipes are closed *first* (as vLLM's ``mp`` does), so the workers exit at
  once instead of after the grace; after a clean SHUTDOWN they are closed last, so a worker
  still finishing its loop is not mistaken for an orphan.

:class:`SpawnedRanks` puts these together behind :class:`keepalive_executor.ranks.Ranks`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from keepalive_executor import compat
from keepalive_executor.log import STACK_DUMP_SIGNAL, get_logger
from keepalive_executor.metrics import RankStatus

__all__ = [
    "WorkerHandle", "spawn_worker", "wait_for_ready", "WorkerMonitor", "stop_workers",
    "SpawnedRanks", "WorkerStartupError",
]

logger = get_logger(__name__)
#: After SHUTDOWN (or after a failure, with the death pipes closed), how long workers get to
#: exit before SIGTERM, then SIGKILL (vLLM's VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS default).
SHUTDOWN_GRACE_S = 5.0


class WorkerStartupError(RuntimeError):
    """A worker process failed before it was ready."""


@dataclass
class WorkerHandle:
    """The parent's view of one worker process."""

    rank: int
    proc: BaseProcess
    ready_pipe: Connection | None
    death_writer: Connection | None
    pid: int | None = field(default=None)

    def close_pipes(self) -> None:
        """Close the parent's pipe ends (closing the death pipe tells the worker to go)."""
        for name in ("ready_pipe", "death_writer"):
            conn = getattr(self, name)
            if conn is not None:
                conn.close()
                setattr(self, name, None)


@contextmanager
def _omp_env(vllm_config: Any, rank: int) -> Iterator[None]:
    """On CPU, set the OpenMP binding variables the worker must inherit (as vLLM's mp does)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    with OMPProcessManager(vllm_config).configure_omp_envs(rank=rank, local_rank=rank):
        yield


def device_index(vllm_config: Any) -> int:
    """The index in ``device_config.device`` (``cuda:2`` -> 2), else 0."""
    parts = str(vllm_config.device_config.device).split(":")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def spawn_worker(vllm_config: Any, rank: int, worker_kwargs: dict[str, Any],
                 local_rank: int | None = None) -> WorkerHandle:
    """Start the worker process for ``rank`` (spawn context, daemonic)."""
    from vllm.utils.system_utils import get_mp_context

    from keepalive_executor.worker_loop import worker_main

    ctx = get_mp_context()
    local = rank if local_rank is None else local_rank
    ready_reader, ready_writer = ctx.Pipe(duplex=False)
    death_reader, death_writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=worker_main,
        kwargs=dict(
            vllm_config=vllm_config,
            rank=rank,
            local_rank=local,
            ready_pipe=ready_writer,
            death_pipe=death_reader,
            **worker_kwargs,
        ),
        name=f"KeepaliveWorker-{rank}",
        daemon=True,
    )
    with _omp_env(vllm_config, rank), compat.worker_numa_binding(vllm_config, local):
        proc.start()
    ready_writer.close()
    death_reader.close()
    return WorkerHandle(rank=rank, proc=proc, ready_pipe=ready_reader, death_writer=death_writer)


def wait_for_ready(workers: list[WorkerHandle], timeout_s: float, status: str = "READY") -> None:
    """Block until every worker sent ``status`` (ALIVE, then READY); raise naming the first
    that died or hung. The pipes stay open after ALIVE and are closed after READY."""
    pending = {w.ready_pipe: w for w in workers if w.ready_pipe is not None}
    sentinels = {w.proc.sentinel: w for w in workers}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            ranks = sorted(w.rank for w in pending.values())
            raise WorkerStartupError(
                f"keepalive workers {ranks} not {status} after {timeout_s:g}s"
            )
        ready = multiprocessing.connection.wait([*pending, *sentinels], timeout=left)
        for obj in ready:
            if obj in pending:
                w = pending.pop(obj)
                try:
                    msg = obj.recv()
                except EOFError:
                    w.proc.join(5)
                    raise WorkerStartupError(
                        f"keepalive worker rank {w.rank} exited during start-up "
                        f"(exit code {w.proc.exitcode}); see its log above"
                    ) from None
                if msg.get("status") != status:
                    raise WorkerStartupError(
                        f"worker rank {w.rank} sent {msg!r}, expected {status}"
                    )
                w.pid = msg.get("pid")
                if status == "READY":
                    obj.close()
                    w.ready_pipe = None
            elif obj in sentinels:
                w = sentinels.pop(obj)
                if w.ready_pipe in pending:
                    # Its READY may still be in the pipe; only a dead *and* silent worker fails.
                    if not w.ready_pipe.poll():
                        raise WorkerStartupError(
                            f"keepalive worker rank {w.rank} exited during start-up "
                            f"(exit code {w.proc.exitcode}); see its log above"
                        )


class WorkerMonitor:
    """Thread that reports the first worker to exit while it is not being stopped."""

    def __init__(self, workers: list[WorkerHandle], on_death: Callable[[WorkerHandle], None]):
        self._workers = list(workers)
        self._on_death = on_death
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._thread = threading.Thread(
            target=self._run, name="keepalive-worker-monitor", daemon=True
        )

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (before workers are asked to exit). Safe to call twice."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self._wake_w.send(None)
        except OSError:
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5)
        self._wake_w.close()
        self._wake_r.close()

    def _run(self) -> None:
        by_sentinel = {w.proc.sentinel: w for w in self._workers}
        ready = multiprocessing.connection.wait([*by_sentinel, self._wake_r])
        if self._stopping.is_set():
            return
        dead = [by_sentinel[s] for s in ready if s in by_sentinel]
        if dead:
            self._on_death(dead[0])


def stop_workers(workers: list[WorkerHandle], grace_s: float, *, close_first: bool = False
                 ) -> None:
    """Wait ``grace_s`` for workers to exit, then SIGTERM, then SIGKILL; reap them all.
    ``close_first``: close the death pipes before waiting (after a failure)."""
    procs = [w.proc for w in workers]
    if close_first:
        for w in workers:
            w.close_pipes()

    def alive() -> list[BaseProcess]:
        return [p for p in procs if p.is_alive()]

    def wait(seconds: float) -> bool:
        end = time.monotonic() + seconds
        while alive() and time.monotonic() < end:
            multiprocessing.connection.wait([p.sentinel for p in alive()], timeout=0.1)
        return not alive()

    if not wait(grace_s):
        for p in alive():
            logger.warning("keepalive worker %s did not exit; sending SIGTERM", p.name)
            p.terminate()
        if not wait(4.0):
            for p in alive():
                logger.warning("keepalive worker %s ignored SIGTERM; sending SIGKILL", p.name)
                p.kill()
            wait(4.0)
    for w in workers:
        w.close_pipes()
        w.proc.join(0.1)


class SpawnedRanks:
    """Ranks 1..N-1 as worker processes of this engine process (one node; see ranks.py)."""

    def __init__(self, vllm_config: Any, *, alive_wait: bool = True) -> None:
        """``alive_wait`` False (Protections.alive_wait, a negative control only): rank 0
        joins the rendezvous without waiting for ALIVE, as before the handshake."""
        from vllm.utils.network_utils import get_file_store_init_method
        from vllm.utils.system_utils import get_mp_context

        # Keep gloo's sockets on loopback: there is only one node in this mode.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.init_method: str = get_file_store_init_method()
        # as UniProcExecutor does: a device index in --device (cuda:2) is rank 0's local
        # rank; the other ranks follow it (GPU-only; on CPU there is no index)
        self.local_rank = device_index(vllm_config)
        self.shared_worker_lock = get_mp_context().Lock()
        self.workers: list[WorkerHandle] = []
        self._timeout_s = 0.0
        self._alive_wait = alive_wait  # False: ALIVE is read in wait_ready instead
        self._world_size = vllm_config.parallel_config.world_size
        self._monitor: WorkerMonitor | None = None
        #: stop() began: a worker that ends now was told to
        self._stopping = False

    def start(self, vllm_config: Any, settings: Any) -> None:
        """Spawn every worker; return once each said ALIVE (constructed, imports done):
        the process-group rendezvous waits at most the collective timeout, shorter than a
        cold start can take, so rank 0 joins it only now."""
        self._timeout_s = settings.startup_timeout_s
        common = dict(
            distributed_init_method=self.init_method,
            spec=settings.channel,
            shared_worker_lock=self.shared_worker_lock,
        )
        for rank in range(1, self._world_size):
            self.workers.append(spawn_worker(vllm_config, rank, common,
                                             local_rank=self.local_rank + rank))
        if self._alive_wait:
            wait_for_ready(self.workers, self._timeout_s, status="ALIVE")

    def before_init_device(self) -> None:
        """Nothing: the workers join through the file store on their own."""

    def wait_ready(self) -> None:
        """Every worker said READY (joined the groups, built its channel)."""
        if not self._alive_wait:
            wait_for_ready(self.workers, self._timeout_s, status="ALIVE")
        wait_for_ready(self.workers, self._timeout_s)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Sentinels: a dead worker is reported at once."""

        def died(worker: WorkerHandle) -> None:
            worker.proc.join(1.0)  # the sentinel fires before the exit code is collected
            on_death(
                f"worker rank {worker.rank} (pid {worker.proc.pid}) died unexpectedly "
                f"(exit code {worker.proc.exitcode})"
            )

        if self.workers:
            self._monitor = WorkerMonitor(self.workers, died)
            self._monitor.start()

    def dead_worker(self) -> str | None:
        """A description of a worker that is no longer running, if any (health checks)."""
        for w in self.workers:
            if not w.proc.is_alive():
                w.proc.join(1.0)
                return (f"worker rank {w.rank} (pid {w.proc.pid}) died unexpectedly "
                        f"(exit code {w.proc.exitcode})")
        return None

    def status(self) -> dict[int, RankStatus]:
        """Each worker process: alive, or ended (a loss unless stop() asked it to)."""
        out = {}
        for w in self.workers:
            up = w.proc.is_alive()
            out[w.rank] = RankStatus(up, lost_cause=None if up or self._stopping else "exited")
        return out

    def end_startup(self) -> None:
        """Nothing: a sentinel fires when a process ends, however long its GIL is held."""

    def tell_error(self, message: str) -> None:
        """Nothing to tell: stop() ends the workers."""

    def dump_stacks(self) -> int:
        """Every live worker writes its Python stacks to the log (it goes on running)."""
        asked = 0
        for w in self.workers:
            if w.proc.is_alive() and w.proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, STACK_DUMP_SIGNAL)
                    asked += 1
        return asked

    def kill(self) -> None:
        """SIGKILL every worker now."""
        kill_all(self.workers)

    def stop(self, *, failed: bool) -> dict[int, int | None]:
        """Stop the monitor, then reap the workers (death pipes first after a failure)."""
        self._stopping = True
        if self._monitor is not None:
            self._monitor.stop()
        stop_workers(self.workers, SHUTDOWN_GRACE_S, close_first=failed)
        return {w.rank: w.proc.exitcode for w in self.workers}


def kill_all(workers: list[WorkerHandle]) -> None:
    """SIGKILL every worker still running (also the executor's last-resort finalizer)."""
    for w in workers:
        if w.proc.is_alive():
            w.proc.kill()
