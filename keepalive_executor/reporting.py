"""Rank 0's reports to the process that started its engine, wired for :mod:`.pieces`.

* the ``/metrics`` counters and their snapshot (metrics.py; read by the front end's
  collector.py), refreshed at once when the executor's state changes;
* the failure record, which makes ``vllm serve`` exit 1 (supervision.py, run_dir.py);
* the watch over the front end, which ends the engine when the front end is gone
  (supervision.py).

Each is optional in the same way: with no run directory (no front end claimed one, or its
base directory is unusable: warned once) there is no snapshot and no record, and serving goes
on. ``Protections.metrics`` and ``Protections.supervision`` turn them off for the negative
controls.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from keepalive_executor import __version__, compat, run_dir
from keepalive_executor.collector import MultiprocessMirror
from keepalive_executor.lifecycle import ExecutorState, Lifecycle
from keepalive_executor.log import get_logger
from keepalive_executor.metrics import (
    SNAPSHOT_PERIOD_S,
    NullMeter,
    SnapshotWriter,
    StepMeter,
    open_writer,
)
from keepalive_executor.protections import Protections
from keepalive_executor.supervision import FrontendWatch, StopSignals, drop_early_watch

__all__ = ["Reporting", "describe", "engine_index", "launcher_name"]

logger = get_logger(__name__)


def engine_index(parallel_config: Any) -> str:
    """vLLM's ``engine`` label of this engine: its data-parallel rank."""
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel_config, "data_parallel_rank", 0)
    return str(index)


def launcher_name() -> str:
    """``spawned`` (the executor starts the ranks), or the launcher that started them."""
    from keepalive_executor.torchrun import in_torchrun_mode
    from keepalive_executor.torchrun.launchers import ENV_LAUNCHER, TORCHRUN

    if not in_torchrun_mode():
        return "spawned"
    return os.environ.get(ENV_LAUNCHER) or TORCHRUN


def describe(life: Lifecycle, ranks: Any, started: bool) -> dict[str, Any]:
    """What the /metrics snapshot says of the executor (its state: ``starting`` until the
    engine's start-up is over, ``failed`` from a failure on, shutdown included) and of its
    ranks (rank 0 is the process that writes). On the snapshot writer's thread."""
    if life.failure is not None:
        state = ExecutorState.FAILED.value
    elif life.state is ExecutorState.RUNNING and not started:
        state = "starting"
    else:
        state = life.state.value
    out: dict[str, dict[str, Any]] = {"0": {"up": True, "heartbeat_at": None}}
    lost = []
    wall = time.time()
    status = getattr(ranks, "status", None)
    for rank, st in (status() if status is not None else {}).items():
        out[str(rank)] = {"up": st.up, "heartbeat_at": None if st.heartbeat_age_s is None
                          else wall - st.heartbeat_age_s}
        if st.lost_cause is not None:
            lost.append({"rank": rank, "cause": st.lost_cause})
    return {"state": state, "ranks": out, "rank_failures": lost}


def snapshot_period_s(settings: Any) -> float:
    """How often the snapshot is written: ``SNAPSHOT_PERIOD_S``; in launcher mode as often
    as rank 0 reads the heartbeats (a sixth of the liveness timeout, 0.25 s on one node), so
    that the heartbeat ages a scrape computes from it are never more than that stale, well
    inside the timeout they are read against."""
    from keepalive_executor.torchrun import in_torchrun_mode
    from keepalive_executor.torchrun.liveness import BEATS_PER_TIMEOUT

    if not in_torchrun_mode():
        return SNAPSHOT_PERIOD_S
    return min(SNAPSHOT_PERIOD_S, settings.liveness_timeout_s / BEATS_PER_TIMEOUT)


class Reporting:
    """The reports of one executor (see the module docstring). ``describe()`` is the
    executor's side of a snapshot: state, ranks, failures; called on the writer's thread."""

    def __init__(self, protections: Protections) -> None:
        self._protections = protections
        self.meter: StepMeter = NullMeter()
        self._writer: SnapshotWriter | None = None
        self._watch: FrontendWatch | None = None
        self._stop_signals = StopSignals()
        self._static: dict[str, Any] = {}

    def watch_frontend(self, on_gone: Callable[[str], None],
                       end_ranks: Callable[[], None]) -> None:
        """Watch the front end from now on, if this engine runs in a process of its own;
        note a stop signal to this process (a failure after it is no failure of the run)."""
        if not self._protections.supervision:
            drop_early_watch()  # a negative control's engine outlives its front end
            return
        if self._watch is None:
            self._stop_signals.install()
            self._watch = FrontendWatch.for_this_engine(on_gone, end_ranks)
            if self._watch is not None:
                self._watch.start()

    def start_metrics(self, vllm_config: Any, settings: Any, frame_bytes: int,
                      describe: Callable[[], dict[str, Any]]) -> None:
        """Count from now on (:attr:`meter`), and write snapshots; ``frame_bytes``: the
        channel's frame size."""
        if not self._protections.metrics:
            return
        pc = vllm_config.parallel_config
        model = getattr(vllm_config, "model_config", None)
        self._static = {
            "engine": engine_index(pc),
            "model_name": str(getattr(model, "served_model_name", "") or ""),
            "info": {
                "version": __version__,
                "vllm_version": compat.installed_version(),
                "launcher": launcher_name(),
                "transport": settings.transport,
                "world_size": pc.world_size,
                "interval_s": settings.interval_s,
            },
        }
        meter = StepMeter(frame_bytes, settings.channel.inline_bytes)

        def snapshot_fields() -> dict[str, Any]:
            return {**self._static, **describe()}

        # (several API servers: vLLM's /metrics reads prometheus_client's files: collector.py)
        writer = open_writer(self._static["engine"], meter, snapshot_fields,
                             MultiprocessMirror.from_environ(),
                             period_s=snapshot_period_s(settings))
        if writer is None:
            return
        self.meter, self._writer = meter, writer
        writer.start()

    def counted(self, send_keepalive: Callable[[], object]) -> Callable[[], None]:
        """``send_keepalive``, counted on the meter (the pacer's thread is its one caller)."""
        meter = self.meter

        def send() -> None:
            send_keepalive()
            meter.keepalive_sent()

        return send

    def changed(self) -> None:
        """The executor's state or a rank's changed: a snapshot now."""
        if self._writer is not None:
            self._writer.poke()

    def failed(self, reason: str) -> None:
        """The executor failed: record it for the exit status (unless this process was
        asked to stop first: a rank that left with the stop), and snapshot it."""
        if self._stop_signals.received is not None:
            logger.info("keepalive: not recorded for the exit status: the failure came after "
                        "signal %d asked this process to stop", self._stop_signals.received)
        elif self._protections.supervision:
            run_dir.record_failure(reason)
        self.changed()

    def shutting_down(self) -> None:
        """The executor's shutdown begins: the front end may end first now, which is no
        failure."""
        if self._watch is not None:
            self._watch.stop()

    def stop(self, *, failed: bool) -> None:
        """The executor is shut down: a last snapshot (removed unless it failed)."""
        self.shutting_down()
        if self._writer is not None:
            self._writer.stop(keep=failed)
