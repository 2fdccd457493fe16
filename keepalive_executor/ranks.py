"""Where ranks 1..N-1 come from, behind one interface the executor uses in both modes.

==========================  ======================================  ==========================
                            :class:`~keepalive_executor.launcher.   :class:`~keepalive_executor.
                            SpawnedRanks` (``vllm serve``, ``LLM``)  torchrun.ranks.TorchrunRanks`
==========================  ======================================  ==========================
start                       spawn one process per rank, wait for    post the configuration
                            each to say ALIVE                       (signed) on torchrun's store
join the process groups     ``file://`` store in the temp dir       torchrun's store, per attempt
ready                       each process says READY                 the rendezvous itself
watch for death             process sentinels (immediate)           store heartbeats (bounded by
                                                                    the liveness timeout; ten
                                                                    times it in start-up)
tell a start-up error       nothing to tell (processes are killed)  post the error on the store
stop                        SHUTDOWN, then wait/SIGTERM/SIGKILL;    SHUTDOWN; torchrun owns the
                            after a failure: death pipes closed     processes
                            first
==========================  ======================================  ==========================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from keepalive_executor.metrics import RankStatus
from keepalive_executor.protections import Protections

__all__ = ["Ranks", "make_ranks"]

OnDeath = Callable[[str], None]


class Ranks(Protocol):
    """The other ranks, as the executor sees them."""

    #: what vLLM gets as ``distributed_init_method``
    init_method: str
    #: rank 0's local rank (its CPU binding / device)
    local_rank: int
    #: vLLM's ``shared_worker_lock`` for rank 0's worker
    shared_worker_lock: Any

    def start(self, vllm_config: Any, settings: Any) -> None:
        """Bring the other ranks up to the point where they join the process groups
        (``settings``: the validated KeepaliveSettings)."""

    def before_init_device(self) -> None:
        """Called on rank 0's thread just before it joins the process groups."""

    def wait_ready(self) -> None:
        """Block until every other rank has joined the groups and built its channel."""

    def watch(self, on_death: OnDeath) -> None:
        """Death detection, called right after :meth:`start`: ``on_death(reason)`` for the
        first rank lost, from as early as the implementation can tell (spawned ranks: at
        once, so a rank that dies before the rendezvous fails start-up in about a second)."""

    def end_startup(self) -> None:
        """The engine's start-up is over: every rank answered its warm-up, which on GPUs
        ends in a full garbage collection holding each rank's GIL (so a heartbeat's silence
        is judged more leniently before this)."""

    def tell_error(self, message: str) -> None:
        """Rank 0 will not start: let the waiting ranks exit with ``message``."""

    def status(self) -> dict[int, RankStatus]:
        """Every other rank's status now (cheap: read by the /metrics snapshot writer)."""

    def dump_stacks(self) -> int:
        """Have every other rank this process can reach write its Python stacks to its log
        (a step outlived its timeout; what each rank is doing is the first question); return
        how many were asked."""

    def kill(self) -> None:
        """End every rank this process owns now (the engine process is about to end)."""

    def stop(self, *, failed: bool) -> dict[int, int | None]:
        """Stop watching and reap what this process owns; return the exit codes known."""


def make_ranks(vllm_config: Any, protections: Protections) -> Ranks:
    """The spawned ranks, or torchrun's when this process tree runs under torchrun."""
    from keepalive_executor import torchrun

    if torchrun.in_torchrun_mode():
        from keepalive_executor.torchrun.ranks import TorchrunRanks

        return TorchrunRanks(vllm_config, liveness=protections.liveness)
    from keepalive_executor.launcher import SpawnedRanks

    return SpawnedRanks(vllm_config, alive_wait=protections.alive_wait)
