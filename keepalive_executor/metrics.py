"""What the executor did, counted on rank 0 and written for the front end's ``/metrics``.

Two halves, one per process (the series and their meaning: docs/metrics.md):

* here, in the engine process: :class:`StepMeter`, plain counters that the threads already
  sending frames bump after each send (rank 0's driver thread for steps, the pacer for
  keepalives: one writer each, no lock, no I/O: a step pays two clock reads and a few
  integer additions), and :class:`SnapshotWriter`, thread ``keepalive-metrics``, which every
  ``SNAPSHOT_PERIOD_S`` and at once on a state change writes everything as one JSON file in
  the run directory (run_dir.py), atomically (a temporary file, then a rename);
* in the front end: :mod:`keepalive_executor.prometheus` reads those files when
  ``/metrics`` is scraped and computes ages then, so a wedged engine still reports true ones.

The snapshot (format :data:`SNAPSHOT_VERSION`)::

    {"version": 1, "written_at": <wall s>, "pid": <engine pid>, "engine": "<dp rank>",
     "model_name": "...", "state": "starting|running|failed|stopped",
     "info": {"version", "vllm_version", "launcher", "transport", "world_size", "interval_s"},
     "keepalives": n, "steps": {"execute": n, "sample": n, "rpc": n},
     "bytes": {"step": n, "rpc": n, "keepalive": n},
     "last_broadcast": {"step": <wall s>|null, "rpc": ..., "keepalive": ...},
     "dispatch": {"le": [bounds], "counts": [per bucket, +Inf last], "sum": s},
     "ranks": {"<rank>": {"up": bool, "heartbeat_at": <wall s>|null}},
     "rank_failures": [{"rank": r, "cause": "exited|heartbeat"}]}

A directory that cannot be written gives one warning; the writer keeps trying, and the
series go stale (``vllm_keepalive_snapshot_timestamp_seconds`` says since when). Nothing
here ever fails the executor.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from keepalive_executor import run_dir
from keepalive_executor.log import get_logger

__all__ = ["SNAPSHOT_VERSION", "SNAPSHOT_PERIOD_S", "DISPATCH_BUCKETS_S", "STEP_KINDS",
           "FRAME_KINDS", "FAILURE_CAUSES", "RankStatus", "StepMeter", "NullMeter",
           "Mirror", "SnapshotWriter", "open_writer"]

logger = get_logger(__name__)

SNAPSHOT_VERSION = 1
#: How often the writer refreshes the snapshot (and at once on every state change); in
#: launcher mode as often as the heartbeats are read (reporting.snapshot_period_s).
SNAPSHOT_PERIOD_S = 1.0
#: Upper bounds of the step-dispatch histogram's buckets (50 us to 100 ms), +Inf implied.
DISPATCH_BUCKETS_S = (5e-05, 1e-04, 2.5e-04, 5e-04, 1e-03, 2.5e-03, 5e-03, 1e-02, 2.5e-02,
                      5e-02, 1e-01)
#: the engine calls counted: execute_model (and the other model calls: a dummy batch, draft
#: tokens), sample_tokens, collective_rpc
STEP_KINDS = ("execute", "sample", "rpc")
#: what a frame rank 0 sent carried: a model step, a collective_rpc, a keepalive
FRAME_KINDS = ("step", "rpc", "keepalive")
#: why a rank was declared lost: its process ended (spawned ranks), or its heartbeat stopped
#: for the liveness timeout (launcher mode)
FAILURE_CAUSES = ("exited", "heartbeat")


@dataclass(frozen=True)
class RankStatus:
    """One rank as rank 0 sees it now (each kind of ranks reports its own: ranks.py)."""

    #: alive as far as rank 0 can tell
    up: bool
    #: launcher mode: seconds since its heartbeat last moved (None: no heartbeat watched)
    heartbeat_age_s: float | None = None
    #: why it was declared lost, one of FAILURE_CAUSES (None: it was not)
    lost_cause: str | None = None


class StepMeter:
    """The counters. :meth:`step_sent` is called by rank 0's driver thread only and
    :meth:`keepalive_sent` by the pacer's only, so no field has two writers; the snapshot
    writer only reads (a snapshot may be one step behind in one field, never torn within
    an integer). ``frame_bytes`` and ``inline_bytes``: the channel's geometry, for the bytes
    a message costs on the wire (a frame, plus the payload again if it did not fit inline).
    """

    def __init__(self, frame_bytes: int = 0, inline_bytes: int = 0,
                 wall: Callable[[], float] = time.time) -> None:
        self.frame_bytes = frame_bytes
        self.inline_bytes = inline_bytes
        self._wall = wall
        self.keepalives = 0
        self.steps = dict.fromkeys(STEP_KINDS, 0)
        self.bytes = dict.fromkeys(FRAME_KINDS, 0)
        self.last_broadcast: dict[str, float | None] = dict.fromkeys(FRAME_KINDS)
        self.dispatch_counts = [0] * (len(DISPATCH_BUCKETS_S) + 1)
        self.dispatch_sum = 0.0

    def wire_bytes(self, payload: int) -> int:
        """What a message of ``payload`` bytes costs on the channel."""
        return self.frame_bytes + (payload if payload > self.inline_bytes else 0)

    def step_sent(self, kind: str, payload: int, dispatch_s: float) -> None:
        """An engine call of ``kind`` (STEP_KINDS) was broadcast, ``dispatch_s`` after the
        engine made it."""
        frame = "rpc" if kind == "rpc" else "step"
        self.steps[kind] += 1
        self.bytes[frame] += self.wire_bytes(payload)
        self.last_broadcast[frame] = self._wall()
        self.dispatch_counts[bisect.bisect_left(DISPATCH_BUCKETS_S, dispatch_s)] += 1
        self.dispatch_sum += dispatch_s

    def keepalive_sent(self) -> None:
        """The pacer broadcast a keepalive."""
        self.keepalives += 1
        self.bytes["keepalive"] += self.frame_bytes
        self.last_broadcast["keepalive"] = self._wall()

    def counters(self) -> dict[str, Any]:
        """The counters as the snapshot carries them (copies)."""
        return {
            "keepalives": self.keepalives,
            "steps": dict(self.steps),
            "bytes": dict(self.bytes),
            "last_broadcast": dict(self.last_broadcast),
            "dispatch": {"le": list(DISPATCH_BUCKETS_S), "counts": list(self.dispatch_counts),
                         "sum": self.dispatch_sum},
        }


class NullMeter(StepMeter):
    """Counts nothing (the series switched off: a negative control, or no run directory)."""

    def step_sent(self, kind: str, payload: int, dispatch_s: float) -> None:
        """Nothing."""

    def keepalive_sent(self) -> None:
        """Nothing."""


class Mirror(Protocol):
    """Another place each snapshot goes (collector.MultiprocessMirror: prometheus_client's
    multiprocess files, which vLLM's /metrics reads when it runs several API servers)."""

    def write(self, snapshot: dict[str, Any]) -> None: ...

    def close(self, *, keep: bool) -> None: ...


class SnapshotWriter:
    """Thread ``keepalive-metrics``: every ``period_s``, and at once after :meth:`poke`,
    writes ``describe()`` merged with the meter's counters to ``path``. Started and stopped
    by its owner (pieces.py); :meth:`stop` writes a last snapshot, then removes the file
    unless the executor failed (a failed engine's last word stays until the front end
    removes the run directory)."""

    def __init__(self, path: str, meter: StepMeter, describe: Callable[[], dict[str, Any]],
                 *, period_s: float = SNAPSHOT_PERIOD_S,
                 wall: Callable[[], float] = time.time, mirror: Mirror | None = None) -> None:
        self.path = path
        self._mirror = mirror
        self._meter = meter
        self._describe = describe
        self._period_s = period_s
        self._wall = wall
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._warned = False
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="keepalive-metrics",
                                        daemon=True)

    def start(self) -> None:
        """Start the thread (once); the first snapshot is written at once."""
        self._thread.start()

    def poke(self) -> None:
        """Something changed (a state, a rank): write now, not at the next period."""
        self._wake.set()

    def stop(self, *, keep: bool, timeout: float = 2.0) -> None:
        """Write a last snapshot and end the thread; remove the file unless ``keep``."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not keep:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        if self._mirror is not None:
            self._mirror.close(keep=keep)

    def snapshot(self) -> dict[str, Any]:
        """The snapshot as it would be written now."""
        snap = {"version": SNAPSHOT_VERSION, "written_at": self._wall(), "pid": os.getpid()}
        snap.update(self._describe())
        snap.update(self._meter.counters())
        return snap

    def write(self) -> bool:
        """Write one snapshot; False (warned once) if it could not be written."""
        tmp = f"{self.path}.{threading.get_ident()}.tmp"
        try:
            snap = self.snapshot()
            data = json.dumps(snap, separators=(",", ":"))
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, self.path)
            if self._mirror is not None:
                self._mirror.write(snap)
        except Exception as e:  # noqa: BLE001 - metrics never fail the executor
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not self._warned:
                self._warned = True
                logger.warning("keepalive: could not write the /metrics snapshot %s (%s); "
                               "the vllm_keepalive_ series go stale until it can", self.path, e)
            return False
        self.written += 1
        return True

    def _run(self) -> None:
        while True:
            self.write()
            if self._stopping.is_set():
                return
            self._wake.wait(self._period_s)
            self._wake.clear()


def open_writer(engine: str, meter: StepMeter, describe: Callable[[], dict[str, Any]],
                mirror: Mirror | None = None,
                period_s: float = SNAPSHOT_PERIOD_S) -> SnapshotWriter | None:
    """A writer for this engine process's snapshot in its run directory, or None if there
    is no usable run directory (warned by run_dir)."""
    path = run_dir.engine_snapshot_path(engine)
    return None if path is None else SnapshotWriter(path, meter, describe, mirror=mirror,
                                                    period_s=period_s)
