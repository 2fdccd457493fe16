"""The negative controls' executors: the keepalive executor with one protection off
(keepalive_executor/protections.py), each named as a backend by its qualified name, as
vLLM allows: ``--distributed-executor-backend controls.NoKeepalives`` or
``distributed_executor_backend="controls.NoKeepalives"`` (tests/ must be on the path of
every process that builds the engine: the tests put it on PYTHONPATH)."""

import os
import threading
import time

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


class NoAliveWaitNoStartupTimeouts(KeepaliveExecutor):
    """Rank 0 joins the rendezvous without waiting for ALIVE (before the handshake), under
    the user's collective timeout (before start-up ran under the start-up timeout): either
    protection alone lets a rank slower to start than that timeout join, so the alive
    wait's control turns both off."""

    protections = Protections(alive_wait=False, startup_timeouts=False)


class NoShutdownDrain(KeepaliveExecutor):
    """Pipeline shutdown without receiving the outputs in flight (the old order)."""

    protections = Protections(shutdown_drain=False)


class NoConnectorMerge(KeepaliveExecutor):
    """Rank 0's KV connector output alone (before the merge)."""

    protections = Protections(connector_merge=False)


class ShortStartupTimeouts(KeepaliveExecutor):
    """vLLM's start-up collectives under the user's timeouts (the order before)."""

    protections = Protections(startup_timeouts=False)


class NoSupervisionNoMetrics(KeepaliveExecutor):
    """No watch over the front end (an engine outlives a killed API server, as under mp) and
    no /metrics snapshot (no vllm_keepalive_ series): test_supervision.py's control, one
    check on it per protection; neither plays a part in the other's check."""

    protections = Protections(metrics=False, supervision=False)


class NoKeepalivesNoSupervision(KeepaliveExecutor):
    """test_serve.py's control: no pacer (it dies of an idle period) and no failure record
    (so its `vllm serve` exits 0 after that death, as under mp)."""

    protections = Protections(keepalives=False, supervision=False)


class KeepalivesUntilArmed(KeepaliveExecutor):
    """The keepalive executor, every protection on, until a test creates the file
    ``stop_keepalives`` in ``KEEPALIVE_FAULT_DIR`` (tests/fault_injection.py's way of arming
    a fault while a server runs): then its pacer stops for good, and from there on it is
    :class:`NoKeepalives`. A test checks a scenario that survives thanks to the keepalives,
    then arms this and checks that the same scenario, on the same server, fails: the control
    costs no start-up of its own (a 4-rank one is about a minute here)."""

    def _init_executor(self) -> None:
        super()._init_executor()
        fault_dir = os.environ.get("KEEPALIVE_FAULT_DIR")
        if fault_dir:
            threading.Thread(target=self._stop_keepalives_when_armed,
                             args=(os.path.join(fault_dir, "stop_keepalives"),),
                             name="keepalive-control-arm", daemon=True).start()

    def _stop_keepalives_when_armed(self, path: str) -> None:
        # not fault_injection's _take, which removes the file when it fires: under data
        # parallelism every replica's executor watches the same file
        while not os.path.exists(path):
            time.sleep(0.1)
        self._pacer.stop()
        print(f"controls.KeepalivesUntilArmed: {path} found, keepalives stopped", flush=True)


#: every control above but the armed one, by the protection it turns off
#: (tests/test_plugin.py checks that each is one of them and that the production executor
#: has all on)
BY_PROTECTION = {
    "keepalives": NoKeepalives,
    "liveness": NoKeepalivesNoLiveness,
    "early_worker_watch": LateWorkerWatch,
    "alive_wait": NoAliveWaitNoStartupTimeouts,
    "shutdown_drain": NoShutdownDrain,
    "connector_merge": NoConnectorMerge,
    "startup_timeouts": ShortStartupTimeouts,
    "metrics": NoSupervisionNoMetrics,
    "supervision": NoSupervisionNoMetrics,
}
#: the controls that turn off more than one protection, each for a check per protection
SEVERAL = (NoKeepalivesNoLiveness, NoAliveWaitNoStartupTimeouts, NoSupervisionNoMetrics,
           NoKeepalivesNoSupervision)
