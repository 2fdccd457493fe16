"""Which CPUs a rank's threads run on (CPU platforms; a no-op elsewhere).

vLLM gives each rank a share of the cores (``VLLM_CPU_OMP_THREADS_BIND``, one entry per rank,
``OMPProcessManager``). vLLM's mp executor sets OpenMP variables before it starts a worker,
and the launcher does the same for spawned workers (``launcher._omp_env``). A rank that is
already running binds its own thread instead: rank 0's driver thread and a torchrun rank
(:func:`bind_threads`), and the engine thread takes rank 0's share too
(:func:`share_binding`). Rank 0's side and the workers' side both call this, so it lives
below both.
"""

from __future__ import annotations

import os
from typing import Any

from keepalive_executor.log import get_logger

__all__ = ["bind_threads", "share_binding"]

logger = get_logger(__name__)


def bind_threads(vllm_config: Any, local_rank: int) -> None:
    """On CPU, bind this process's threads to the CPUs vLLM gives ``local_rank``.

    vLLM's mp executor sets OpenMP variables before it starts a worker; a process that is
    already running (the in-process driver, a torchrun rank) binds its own thread instead,
    before any OpenMP pool exists, and later threads inherit the mask.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(vllm_config)
    if manager.skip_setup or not manager.cpu_lists:
        return
    cpus = manager.cpu_lists[local_rank]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    logger.info("keepalive rank with local rank %d bound to CPUs %s", local_rank, cpus)


def share_binding(cpus: set[int] | None) -> None:
    """Give the calling thread (the engine's) rank 0's CPUs, as it had when rank 0 ran on it.

    On CPU, vLLM binds rank 0 to its share of the cores (``VLLM_CPU_OMP_THREADS_BIND``) and
    the other ranks to theirs. The engine thread hands each call to the driver's thread and
    then does the scheduling between steps; left unbound it floats onto the other ranks'
    cores, and a step (whose all-reduce waits for every rank) gets slower: 3.5-4.8 ms instead
    of 2.0-2.6 ms per decode step here (docs/benchmarks.md, "Where the time goes").
    """
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        if os.sched_getaffinity(0) != cpus:
            os.sched_setaffinity(0, cpus)  # this thread only
    except OSError as e:  # a container may forbid it: slower, not wrong
        logger.debug("could not bind the engine thread to %s: %s", sorted(cpus), e)
