"""The front end's half of keepalive's ``/metrics`` series: a prometheus collector that reads
the engines' snapshots (metrics.py) when ``/metrics`` is scraped.

vLLM serves ``/metrics`` from the registry ``vllm.v1.metrics.prometheus.
get_prometheus_registry()`` returns: prometheus_client's default registry with one API
server, a fresh registry holding a ``MultiProcessCollector`` with several (``-dp N`` starts N
by default), built when the app is built. :func:`install`, run where the plugin loads,
registers one :class:`KeepaliveCollector` on the default registry, and wraps that function
so that the registry it returns in multiprocess mode carries the collector too (each API
server reads every engine's snapshot of its run, so every one of them shows every replica,
as vLLM's own series do; the ``engine`` label tells them apart).

The series are computed at scrape time: ages (``vllm_keepalive_rank_heartbeat_age_seconds``)
from the wall times in the snapshot, so a wedged engine still shows its true ages; a
snapshot that cannot be read gives one warning and its last good reading is served again
(``vllm_keepalive_snapshot_timestamp_seconds`` shows how old). Names follow Prometheus'
conventions in a namespace of their own: vLLM removes every collector named ``vllm:...``
when it unregisters its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from keepalive_executor import run_dir
from keepalive_executor.log import get_logger
from keepalive_executor.metrics import FAILURE_CAUSES, FRAME_KINDS, STEP_KINDS

__all__ = ["PREFIX", "SERIES", "STATES", "KeepaliveCollector", "read_snapshots", "install"]

logger = get_logger(__name__)

PREFIX = "vllm_keepalive_"
STATES = ("starting", "running", "failed", "stopped")
#: every series this collector exports (counters by their sample name, with ``_total``)
SERIES = tuple(PREFIX + name for name in (
    "info", "executor_state", "snapshot_timestamp_seconds", "keepalives_sent_total",
    "steps_total", "broadcast_bytes_total", "last_broadcast_timestamp_seconds",
    "step_dispatch_seconds", "rank_up", "rank_heartbeat_age_seconds", "rank_failures_total",
))
_SNAPSHOT = re.compile(r"^engine-(?P<engine>[^-]+)-(?P<pid>\d+)\.json$")
_MARK = "_keepalive_collector"


def _run_pids() -> list[int]:
    pid = run_dir.current()
    return [] if pid is None else [pid]


class _Cache:
    """The last good reading of each snapshot file, for a read that fails (warned once)."""

    def __init__(self) -> None:
        self.good: dict[str, dict[str, Any]] = {}
        self.warned: set[str] = set()

    def read(self, path: str) -> dict[str, Any] | None:
        try:
            with open(path) as f:
                snap = json.load(f)
            if not isinstance(snap, dict) or snap.get("version") != 1:
                raise ValueError(f"not a version-1 snapshot: {str(snap)[:80]}")
        except FileNotFoundError:
            self.good.pop(path, None)
            return None
        except (OSError, ValueError) as e:
            if path not in self.warned:
                self.warned.add(path)
                logger.warning("keepalive: cannot read the /metrics snapshot %s (%s); "
                               "serving its last good reading", path, e)
            return self.good.get(path)
        self.good[path] = snap
        return snap


def read_snapshots(pids: Iterable[int], cache: _Cache | None = None) -> list[dict[str, Any]]:
    """The newest snapshot of each engine of the runs ``pids``: an engine whose process is
    gone counts only if no live process writes for the same engine (a failed engine's last
    snapshot stays until its front end ends)."""
    cache = cache or _Cache()
    newest: dict[str, tuple[bool, float, dict[str, Any]]] = {}
    for pid in pids:
        path = run_dir.run_dir(pid)
        if path is None:
            continue
        with contextlib.suppress(OSError):
            names = sorted(os.listdir(path))
            for name in names:
                m = _SNAPSHOT.match(name)
                if m is None:
                    continue
                snap = cache.read(os.path.join(path, name))
                if snap is None:
                    continue
                rank = (run_dir.owner_alive(int(m["pid"])), float(snap.get("written_at", 0)))
                engine = str(snap.get("engine", m["engine"]))
                if engine not in newest or rank > newest[engine][:2]:
                    newest[engine] = (*rank, snap)
    return [snap for _, _, snap in (newest[e] for e in sorted(newest))]


class KeepaliveCollector:
    """A prometheus_client collector of every engine snapshot of this process's run."""

    def __init__(self, pids: Callable[[], list[int]] = _run_pids,
                 wall: Callable[[], float] = time.time) -> None:
        self._pids = pids
        self._wall = wall
        self._cache = _Cache()

    def describe(self) -> list:
        """Nothing up front: the series exist only while an engine writes snapshots."""
        return []

    def collect(self) -> Iterator[Any]:
        """The series, from the snapshots as they are now."""
        snaps = read_snapshots(self._pids(), self._cache)
        if snaps:
            yield from families(snaps, self._wall())


def families(snaps: list[dict[str, Any]], now: float) -> Iterator[Any]:
    """The metric families of ``snaps`` at wall time ``now``."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    base = ["model_name", "engine"]

    def fam(kind: type, name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
        return kind(PREFIX + name, doc, labels=[*base, *extra])

    info_labels = ("version", "vllm_version", "launcher", "transport", "world_size",
                   "interval_seconds")
    info = fam(GaugeMetricFamily, "info", "keepalive executor build and configuration "
               "(value 1)", info_labels)
    state = fam(GaugeMetricFamily, "executor_state", "1 for the executor's current state",
                ("state",))
    written = fam(GaugeMetricFamily, "snapshot_timestamp_seconds", "when the engine last "
                  "wrote its snapshot (Unix time): older than a few seconds = stale series")
    keepalives = fam(CounterMetricFamily, "keepalives_sent", "no-op keepalives the pacer sent")
    steps = fam(CounterMetricFamily, "steps", "engine calls broadcast, by kind", ("kind",))
    sent = fam(CounterMetricFamily, "broadcast_bytes", "bytes rank 0 broadcast on the "
               "channel, by what the frames carried", ("kind",))
    last = fam(GaugeMetricFamily, "last_broadcast_timestamp_seconds", "when rank 0 last "
               "sent a frame of that kind (Unix time)", ("kind",))
    dispatch = fam(HistogramMetricFamily, "step_dispatch_seconds", "rank 0's time from the "
                   "engine's call to its broadcast sent")
    up = fam(GaugeMetricFamily, "rank_up", "1 while the rank is alive, 0 once declared "
             "lost", ("rank",))
    age = fam(GaugeMetricFamily, "rank_heartbeat_age_seconds", "launcher mode: seconds "
              "since the rank's heartbeat last moved, as rank 0 saw it", ("rank",))
    failures = fam(CounterMetricFamily, "rank_failures", "ranks declared lost, by cause",
                   ("rank", "cause"))
    for snap in snaps:
        labels = [str(snap.get("model_name", "")), str(snap.get("engine", ""))]
        i = snap.get("info", {})
        info.add_metric([*labels, str(i.get("version", "")), str(i.get("vllm_version", "")),
                         str(i.get("launcher", "")), str(i.get("transport", "")),
                         str(i.get("world_size", "")), f"{float(i.get('interval_s', 0)):g}"], 1)
        for s in STATES:
            state.add_metric([*labels, s], 1.0 if snap.get("state") == s else 0.0)
        written.add_metric(labels, float(snap.get("written_at", 0)))
        keepalives.add_metric(labels, float(snap.get("keepalives", 0)))
        for kind in STEP_KINDS:
            steps.add_metric([*labels, kind], float(snap.get("steps", {}).get(kind, 0)))
        for kind in FRAME_KINDS:
            sent.add_metric([*labels, kind], float(snap.get("bytes", {}).get(kind, 0)))
            at = snap.get("last_broadcast", {}).get(kind)
            if at is not None:
                last.add_metric([*labels, kind], float(at))
        d = snap.get("dispatch", {})
        counts, bounds = d.get("counts", []), d.get("le", [])
        if counts:
            cumulative, buckets = 0.0, []
            for bound, count in zip([*map(float, bounds), float("inf")], counts, strict=False):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", cumulative))
            dispatch.add_metric(labels, buckets, float(d.get("sum", 0.0)))
        lost = {(int(f["rank"]), f["cause"]) for f in snap.get("rank_failures", [])}
        for rank, status in sorted(snap.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
            up.add_metric([*labels, rank], 1.0 if status.get("up") else 0.0)
            if status.get("heartbeat_at") is not None:
                age.add_metric([*labels, rank], max(0.0, now - float(status["heartbeat_at"])))
            if rank != "0":
                for cause in FAILURE_CAUSES:
                    failures.add_metric([*labels, rank, cause],
                                        1.0 if (int(rank), cause) in lost else 0.0)
    yield from (info, state, written, keepalives, steps, sent, last, dispatch, up, age,
                failures)


_collector: KeepaliveCollector | None = None


def install() -> None:
    """Register the collector on prometheus_client's default registry, and on the registry
    vLLM builds for ``/metrics`` in multiprocess mode. Idempotent; never raises (a vLLM
    without that function serves the default registry's series only)."""
    global _collector
    if _collector is not None:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    _collector = KeepaliveCollector()
    REGISTRY.register(_collector)
    try:
        import vllm.v1.metrics.prometheus as vllm_prometheus
    except ImportError:
        logger.debug("vllm.v1.metrics.prometheus not found: multiprocess /metrics unwrapped")
        return
    original = vllm_prometheus.get_prometheus_registry
    if getattr(original, _MARK, False):
        return

    def get_prometheus_registry() -> Any:
        registry = original()
        if registry is not REGISTRY and _collector is not None:
            with contextlib.suppress(ValueError):  # already registered on it
                registry.register(_collector)
        return registry

    setattr(get_prometheus_registry, _MARK, True)
    get_prometheus_registry.__doc__ = original.__doc__
    # the modules that imported the function by name before the plugin loaded
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "get_prometheus_registry",
                                               None) is original:
            module.get_prometheus_registry = get_prometheus_registry  # type: ignore[attr-defined]
