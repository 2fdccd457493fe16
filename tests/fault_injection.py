"""Test-only fault injection, loaded by servers through vLLM's own extension points
(``--worker-cls`` and ``--scheduler-cls``). Faults are armed by creating files in the
directory named by ``KEEPALIVE_FAULT_DIR``, so a test can arm them while the server runs:

* ``raise_rank1``       rank 1 raises inside its next execute_model
* ``raise_rank0``       rank 0 (the driver) raises inside its next execute_model, after the
                        other ranks received the step
* ``stall_rank1``       rank 1 sleeps N seconds inside its next execute_model (a stuck step)
* ``stall_after_rank1`` rank 1 sleeps N seconds after its next execute_model returned, before
                        its result is sent (a pipeline's last stage holding an output back)
* ``kill_pid``          rank 0 SIGKILLs the process whose pid the file holds, inside its next
                        execute_model (after the other ranks received the step): a rank lost
                        in the middle of a step, deterministically
* ``stall_schedule``    the engine loop sleeps N seconds in its next schedule(), outside any step

Each file is removed when it fires, so a fault fires once.

Start-up delays of rank 1 (environment, inherited by its process), for
:class:`SlowStartCPUWorker` (and :class:`FaultyCPUWorker`, which is one):

* ``KEEPALIVE_SLOW_PROFILE_S``  sleep before the engine's profile run
  (determine_available_memory): rank 0, done with its own part, waits that much longer in
  the call's reply gather on the CPU group (with ``--enforce-eager`` and an explicit KV
  cache size vLLM's CPU worker runs no forward there)
* ``KEEPALIVE_SLOW_CONSTRUCT_S``  sleep while the worker is being constructed, as a cold
  interpreter importing vLLM on a loaded machine does (before the worker says ALIVE)
* ``KEEPALIVE_DIE_BEFORE_RENDEZVOUS`` exit with this code just before it joins them (after
  ALIVE: a GPU ``init_device`` failure, say), first writing the time of death
  (``time.time()``) to the file ``KEEPALIVE_DEATH_STAMP``

and of rank 0:

* ``KEEPALIVE_LATE_RANK0_S``  rank 0 sleeps this long just before it joins the process
  groups, while every other rank already waits there: in torchrun mode in its worker's
  constructor (rank 0 joins the default group after it, before ``init_device``; the
  followers join as soon as they have the bootstrap), in the spawned mode at the start of
  ``init_device`` (after every worker said ALIVE and went on into its own)
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.cpu_worker import CPUWorker


def _take(name: str) -> str | None:
    """The armed fault's content, removing it; None if not armed. Every fault is armed with
    some content, and a test arms it with ``Path.write_text``, which creates the file before
    writing it: an empty file is one still being written, not yet armed (a step that read
    it then got '' and failed on ``float('')`` in a fresh-clone run)."""
    d = os.environ.get("KEEPALIVE_FAULT_DIR")
    if not d:
        return None
    path = os.path.join(d, name)
    try:
        with open(path) as f:
            content = f.read()
    except FileNotFoundError:
        return None
    if not content:
        return None
    os.unlink(path)
    return content


def stall_rank1_in_rpc(worker: Any, seconds: float) -> int:
    """A collective_rpc callable: rank 1 sleeps SECONDS before it replies, the others reply
    at once (rank 0 then waits for rank 1 in the reply gather on the CPU group)."""
    if worker.rank == 1:
        time.sleep(seconds)
    return worker.rank


def _torchrun_mode() -> bool:
    from keepalive_executor.torchrun.env import LAUNCHER_ENV

    return os.environ.get(LAUNCHER_ENV) == "torchrun"


def _late_rank0(where: str) -> None:
    seconds = float(os.environ.get("KEEPALIVE_LATE_RANK0_S", "0"))
    if seconds:
        print(f"fault_injection: rank 0 joins the process groups {seconds:g}s late ({where})",
              flush=True)
        time.sleep(seconds)


class SlowStartCPUWorker(CPUWorker):
    """A CPUWorker whose rank 1 is slow to start, or dies before the rendezvous; or whose
    rank 0 is late to the rendezvous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.rank == 1:
            time.sleep(float(os.environ.get("KEEPALIVE_SLOW_CONSTRUCT_S", "0")))
        if self.rank == 0 and _torchrun_mode():
            _late_rank0("torchrun mode, before the default group")

    def init_device(self) -> None:
        if self.rank == 0 and not _torchrun_mode():
            _late_rank0("spawned mode, in init_device")
        if self.rank == 1:
            code = os.environ.get("KEEPALIVE_DIE_BEFORE_RENDEZVOUS")
            if code is not None:
                with open(os.environ["KEEPALIVE_DEATH_STAMP"], "w") as f:
                    f.write(repr(time.time()))
                os._exit(int(code))
        super().init_device()

    def determine_available_memory(self) -> Any:
        # rank 0 reaches the call's reply gather KEEPALIVE_SLOW_PROFILE_S before rank 1
        if self.rank == 1:
            time.sleep(float(os.environ.get("KEEPALIVE_SLOW_PROFILE_S", "0")))
        return super().determine_available_memory()


class FaultyCPUWorker(SlowStartCPUWorker):
    """A CPUWorker whose steps fail or stall on demand (and which starts slowly when the
    environment asks, as SlowStartCPUWorker does)."""

    def execute_model(self, scheduler_output: Any) -> Any:
        if self.rank == 1 and _take("raise_rank1") is not None:
            raise RuntimeError("injected step failure on rank 1")
        if self.rank == 0 and _take("raise_rank0") is not None:
            raise RuntimeError("injected step failure on rank 0")
        if self.rank == 0 and (pid := _take("kill_pid")) is not None:
            os.kill(int(pid), signal.SIGKILL)
        if self.rank == 1 and (seconds := _take("stall_rank1")) is not None:
            time.sleep(float(seconds))
        out = super().execute_model(scheduler_output)
        if self.rank == 1 and (seconds := _take("stall_after_rank1")) is not None:
            time.sleep(float(seconds))
        return out


class StallingScheduler(Scheduler):
    """A Scheduler whose engine loop stalls on demand, outside any model step."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        seconds = _take("stall_schedule")
        if seconds is not None:
            time.sleep(float(seconds))
        return super().schedule(*args, **kwargs)
