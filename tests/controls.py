"""The negative controls' executors: the keepalive executor with one protection off
(keepalive_executor/protections.py), each named as a backend by its qualified name, as
vLLM allows: ``--distributed-executor-backend controls.NoKeepalives`` or
``distributed_executor_backend="controls.NoKeepalives"`` (tests/ must be on the path of
every process that builds the engine: the tests put it on PYTHONPATH)."""

from keepalive_executor.executor import KeepaliveExecutor
from keepalive_executor.protections import Protections


class NoKeepalives(KeepaliveExecutor):
    """No pacer: idle ranks time out."""

    protections = Protections(keepalives=False)


class NoKeepalivesNoLiveness(KeepaliveExecutor):
    """torchrun mode without the pacer and the heartbeat monitor (a frozen rank then goes
    unnoticed, and an idle follower times out)."""

    protections = Protections(keepalives=False, liveness=False)


class LateWorkerWatch(KeepaliveExecutor):
    """Spawned ranks watched only once start-up is done (the order before)."""

    protections = Protections(early_worker_watch=False)


class NoAliveWait(KeepaliveExecutor):
    """Rank 0 joins the rendezvous without waiting for ALIVE (before the handshake)."""

    protections = Protections(alive_wait=False)


class NoShutdownDrain(KeepaliveExecutor):
    """Pipeline shutdown without receiving the outputs in flight (the old order)."""

    protections = Protections(shutdown_drain=False)


class NoConnectorMerge(KeepaliveExecutor):
    """Rank 0's KV connector output alone (before the merge)."""

    protections = Protections(connector_merge=False)


#: every control above, by the protection it turns off (tests/test_plugin.py checks that
#: each is one of them and that the production executor has all on)
BY_PROTECTION = {
    "keepalives": NoKeepalives,
    "liveness": NoKeepalivesNoLiveness,
    "early_worker_watch": LateWorkerWatch,
    "alive_wait": NoAliveWait,
    "shutdown_drain": NoShutdownDrain,
    "connector_merge": NoConnectorMerge,
}
