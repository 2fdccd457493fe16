"""What the executor does so that a scenario does not fail, one switch each, all on.

Every "survives X" test of this project has a negative control: the same scenario with the
one protection that makes it survive turned off, which must fail. The control gets that by
subclassing the executor (``tests/controls.py``) and naming the subclass as the backend,
as vLLM allows (``--distributed-executor-backend controls.NoKeepalives``)::

    class NoKeepalives(KeepaliveExecutor):
        protections = Protections(keepalives=False)

so production code reads a class attribute, never the environment, and nothing a user can
set turns a protection off by accident. Each one that is off is logged at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Protections"]


@dataclass(frozen=True)
class Protections:
    #: the pacer: no-op broadcasts while idle keep every rank's wait inside its timeout
    keepalives: bool = True
    #: spawned ranks watched from ALIVE on: a rank dying inside the rendezvous fails
    #: start-up within the failure grace (off: only once start-up is done)
    early_worker_watch: bool = True
    #: rank 0 joins the rendezvous only after every spawned rank said ALIVE (off: at once,
    #: so a rank slower to start than the collective timeout fails start-up)
    alive_wait: bool = True
    #: pipeline: shutdown receives the outputs still in flight before SHUTDOWN (off: the
    #: output rank is left blocked in its send)
    shutdown_drain: bool = True
    #: every rank's KV/EC connector outputs merged into the step's (off: rank 0's alone)
    connector_merge: bool = True
    #: torchrun mode: rank 0 watches every other rank's heartbeat (off: a frozen rank goes
    #: unnoticed)
    liveness: bool = True
    #: vLLM's start-up collectives under the start-up timeout where the user's timeouts are
    #: shorter, the user's from the end of the warm-up on (off: ranks that reach one further
    #: apart than the user's timeout fail the start-up)
    startup_timeouts: bool = True
    #: the executor's /metrics series: rank 0's counters and the snapshot the front end's
    #: collector reads (off: no snapshot, so no vllm_keepalive_ series)
    metrics: bool = True
    #: what a supervisor sees: a failure recorded for `vllm serve`'s exit status, and the
    #: engine ended when the process that started it is gone (off: `vllm serve` exits 0
    #: after a failure, and an engine outlives a killed API server, as under mp)
    supervision: bool = True

    def off(self) -> list[str]:
        """The names of the protections turned off."""
        return [f.name for f in fields(self) if not getattr(self, f.name)]
