"""The executor's view of torchrun's ranks (see :mod:`keepalive_executor.ranks`)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from keepalive_executor.config import startup_timeout_s
from keepalive_executor.log import STACK_DUMP_SIGNAL, get_logger
from keepalive_executor.metrics import RankStatus
from keepalive_executor.torchrun.bootstrap import (
    connect_store,
    init_world_process_group,
    load_secret,
    post_bootstrap,
    post_error,
)
from keepalive_executor.torchrun.env import TorchrunEnv, pid_space, set_parent_death_signal
from keepalive_executor.torchrun.liveness import LivenessMonitor

__all__ = ["TorchrunRanks"]

logger = get_logger(__name__)


class TorchrunRanks:
    """Ranks 1..N-1 are torchrun's processes, on this node or others; rank 0 (this engine
    process) hands them its configuration over torchrun's store and watches their
    heartbeats there. It spawns nothing and kills nothing."""

    def __init__(self, vllm_config: Any, *, liveness: bool = True) -> None:
        """``liveness`` False (Protections.liveness, a negative control only): no heartbeat
        monitor, so a frozen rank goes unnoticed."""
        from vllm.utils.system_utils import get_mp_context

        self._liveness = liveness
        self.env = TorchrunEnv.from_environ()
        self._vllm_config = vllm_config
        self._timeout_s = startup_timeout_s()
        self._store = connect_store(self.env)
        self._secret, source = load_secret(self.env)
        logger.info("keepalive torchrun mode: the bootstrap is signed with %s", source)
        # torchrun signals rank 0's whole process group. Leave it, so that this engine
        # process gets one SIGTERM, from vLLM's front end, as under `vllm serve`: a second
        # one would kill it in vLLM's teardown before SHUTDOWN reaches the other ranks. It
        # still dies with its parent.
        try:
            os.setpgid(0, 0)
        except OSError as e:  # e.g. already a session leader: keep vLLM's behaviour
            logger.warning("keepalive: could not leave rank 0's process group: %s", e)
        set_parent_death_signal(signal.SIGKILL)
        self.init_method: str = self.env.group_label()
        self.local_rank = self.env.local_rank
        self.shared_worker_lock = get_mp_context().Lock()
        self._liveness_timeout_s = 0.0
        self._monitor: LivenessMonitor | None = None
        self._on_death: Callable[[str], None] | None = None

    def start(self, vllm_config: Any, settings: Any) -> None:
        """Post the signed bootstrap: the configuration every other rank follows."""
        self._liveness_timeout_s = settings.liveness_timeout_s
        payload = {
            "vllm_config": vllm_config,
            "init_method": self.init_method,
            "spec": settings.channel,
            "liveness_timeout_s": settings.liveness_timeout_s,
            # a follower in the same pid space watches this process (liveness.DriverWatch)
            "driver": {"pid": os.getpid(), "pid_space": pid_space()},
        }
        # waits for every follower's nonce (bound to this launch), within the start-up timeout
        if not post_bootstrap(self._store, self.env, payload, self._secret, self._timeout_s):
            raise RuntimeError(
                "torchrun's store already holds a bootstrap for this run and attempt "
                f"({self.env.key('bootstrap')}): another rank 0 is running, or something "
                "else posted there first (the other ranks refuse anything not signed by "
                "this deployment)"
            )
        logger.info(
            "keepalive torchrun mode: configuration published for ranks 1..%d (%s, heartbeat "
            "liveness timeout %gs); joining the process groups at %s",
            self.env.world_size - 1, "one node" if self.env.one_node else "several nodes",
            settings.liveness_timeout_s, self.init_method,
        )

    def before_init_device(self) -> None:
        """Join the default group on torchrun's store, scoped to this attempt."""
        init_world_process_group(self.env, self._vllm_config, self._timeout_s)

    def wait_ready(self) -> None:
        """The rendezvous in before_init_device was every rank's readiness; the heartbeat
        monitor starts now (a follower beats from its bootstrap on, and may still be
        importing vLLM before that: a slow start is torchrun's to bound, not a loss)."""
        if self._on_death is not None:
            self._start_monitor(self._on_death)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Heartbeats on the store, from :meth:`wait_ready` on (a client of its own: the
        monitor runs in a thread). A rank lost before then fails the rendezvous, which
        torchrun's agent ends."""
        self._on_death = on_death

    def end_startup(self) -> None:
        """The heartbeat monitor's start-up window ends: a rank still for the liveness
        timeout is lost from now on (see :mod:`keepalive_executor.torchrun.liveness`)."""
        if self._monitor is not None:
            self._monitor.end_startup()

    def _start_monitor(self, on_death: Callable[[str], None]) -> None:
        if self.env.world_size < 2:
            return
        if not self._liveness:
            return
        self._monitor = LivenessMonitor(
            connect_store(self.env), self.env.key, range(1, self.env.world_size),
            self._liveness_timeout_s, on_death,
        )
        self._monitor.start()

    def status(self) -> dict[int, RankStatus]:
        """Each follower: up unless the heartbeat monitor declared it lost, with its
        heartbeat's age (no monitor yet, or none: up, age unknown)."""
        monitor = self._monitor
        ages = monitor.heartbeat_ages() if monitor is not None else {}
        lost = monitor.lost_rank if monitor is not None else None
        return {r: RankStatus(r != lost, ages.get(r),
                              "heartbeat" if r == lost else None)
                for r in range(1, self.env.world_size)}

    def dump_stacks(self) -> int:
        """The followers are torchrun's processes, maybe on other nodes: this process cannot
        signal them. Each registered the stack-dump signal; say how to use it."""
        logger.error(
            "keepalive: for the other ranks' stacks, send %s to each rank's process on its "
            "node (it writes every thread's stack to its log and goes on)",
            STACK_DUMP_SIGNAL.name)
        return 0

    def tell_error(self, message: str) -> None:
        """Post rank 0's start-up error, so every waiting rank exits saying why."""
        try:
            post_error(self._store, self.env, message, self._secret)
        except Exception:  # noqa: BLE001 - they still time out or are stopped by torchrun
            logger.warning("could not post the start-up error to torchrun's store",
                           exc_info=True)

    def kill(self) -> None:
        """Nothing: torchrun owns the processes (they exit when the channel breaks)."""

    def stop(self, *, failed: bool) -> dict[int, int | None]:
        """Stop watching; torchrun reaps its processes."""
        if self._monitor is not None:
            self._monitor.stop()
        return {}
