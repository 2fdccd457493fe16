"""The front end's half of keepalive's ``/metrics`` series: a prometheus collector that reads
the engines' snapshots (metrics.py) when ``/metrics`` is scraped.

Two ways, because vLLM serves ``/metrics`` in two ways (read in 0.32 and 0.34:
``vllm/entrypoints/serve/instrumentator/metrics.py``):

* **One API server** (the default without ``-dp``): prometheus_client's default registry.
  :func:`install`, run where the plugin loads, registers one :class:`KeepaliveCollector`
  there, which reads the run's snapshots at scrape time: ages
  (``vllm_keepalive_rank_heartbeat_age_seconds``) are computed then, so a wedged engine
  still shows its true ages; a snapshot that cannot be read gives one warning and its last
  good reading is served again (``vllm_keepalive_snapshot_timestamp_seconds`` shows how old).
* **Several API servers** (``-dp N`` starts N by default; vLLM sets
  ``PROMETHEUS_MULTIPROC_DIR`` before it starts the engines): the route answers from a
  registry built per request, holding only prometheus_client's ``MultiProcessCollector``,
  which reads the ``*.db`` files of that directory. No collector of ours can be on it, so
  each engine's snapshot writer also writes its samples there (:class:`MultiprocessMirror`),
  in prometheus_client's own file format: counters summed across processes (one engine per
  ``engine`` label, so nothing is added up), gauges as the most recent value, histograms
  per bucket. Every API server then shows every replica, as vLLM's own series do. Ages are
  then as of the last snapshot (at most ``SNAPSHOT_PERIOD_S`` old), and a heartbeat age
  only exists in launcher mode, which refuses ``-dp``.
 Names follow Prometheus'
conventions in a namespace of their own: vLLM removes every collector named ``vllm:...``
when it unregisters its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from keepalive_executor import run_dir
from keepalive_executor.log import get_logger
from keepalive_executor.metrics import FAILURE_CAUSES, FRAME_KINDS, STEP_KINDS

__all__ = ["PREFIX", "SERIES", "STATES", "KeepaliveCollector", "MultiprocessMirror",
           "read_snapshots", "install"]

logger = get_logger(__name__)

PREFIX = "vllm_keepalive_"
STATES = ("starting", "running", "failed", "stopped")
#: every series this collector exports (counters by their sample name, with ``_total``)
SERIES = tuple(PREFIX + name for name in (
    "info", "executor_state", "snapshot_timestamp_seconds", "interval_seconds",
    "keepalives_sent_total",
    "steps_total", "broadcast_bytes_total", "last_broadcast_timestamp_seconds",
    "step_dispatch_seconds", "rank_up", "rank_heartbeat_age_seconds", "rank_failures_total",
))
_SNAPSHOT = re.compile(r"^engine-(?P<engine>[^-]+)-(?P<pid>\d+)\.json$")


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
        self._warned = False

    def describe(self) -> list:
        """Nothing up front: the series exist only while an engine writes snapshots."""
        return []

    def collect(self) -> Iterator[Any]:
        """The series, from the snapshots as they are now. Never raises: an error here
        would fail the whole /metrics answer, vLLM's own series with it."""
        try:
            snaps = read_snapshots(self._pids(), self._cache)
            found = list(families(snaps, self._wall())) if snaps else []
        except Exception as e:  # noqa: BLE001 - one warning, no series this scrape
            if not self._warned:
                self._warned = True
                logger.warning("keepalive: the /metrics series could not be built (%s: %s); "
                               "vLLM's own series are served without them", type(e).__name__, e)
            return
        yield from found


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
    interval = fam(GaugeMetricFamily, "interval_seconds", "the keepalive interval: the most "
                   "time the channel stays silent while the engine is up")
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
        interval.add_metric(labels, float(i.get("interval_s", 0)))
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
    yield from (info, state, written, interval, keepalives, steps, sent, last, dispatch, up, age,
                failures)


class MultiprocessMirror:
    """An engine's snapshot as prometheus_client multiprocess files in ``directory``
    (``PROMETHEUS_MULTIPROC_DIR``), named for this project (``<type>_keepalive-<pid>.db``):
    the engine process may hold prometheus_client files of its own under its plain pid."""

    def __init__(self, directory: str, pid: int | None = None) -> None:
        self.directory = directory
        tag = f"keepalive-{os.getpid() if pid is None else pid}"
        self._paths = {"counter": f"counter_{tag}.db", "gauge": f"gauge_mostrecent_{tag}.db",
                       "histogram": f"histogram_{tag}.db"}
        self._files: dict[str, Any] = {}

    @classmethod
    def from_environ(cls) -> MultiprocessMirror | None:
        """A mirror if this process runs under vLLM's multiprocess metrics, else None."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        return cls(directory) if directory and os.path.isdir(directory) else None

    def _file(self, kind: str) -> Any:
        from prometheus_client.mmap_dict import MmapedDict

        if kind not in self._files:
            self._files[kind] = MmapedDict(os.path.join(self.directory, self._paths[kind]))
        return self._files[kind]

    def write(self, snapshot: dict[str, Any]) -> None:
        """The snapshot's samples, as prometheus_client's multiprocess mode stores them."""
        from prometheus_client.mmap_dict import mmap_key

        written = float(snapshot.get("written_at", 0.0))
        for family in families([snapshot], written):
            kind = family.type
            previous: dict[tuple, float] = {}
            for sample in family.samples:
                names, values = list(sample.labels), list(sample.labels.values())
                value = sample.value
                if kind == "histogram":
                    if sample.name.endswith("_count"):
                        continue  # computed by the reader from the buckets
                    if sample.name.endswith("_bucket"):  # stored per bucket, not cumulative
                        rest = tuple((k, v) for k, v in sample.labels.items() if k != "le")
                        value, previous[rest] = value - previous.get(rest, 0.0), value
                key = mmap_key(family.name, sample.name, names, values, family.documentation)
                self._file(kind).write_value(key, value, written)

    def close(self, *, keep: bool) -> None:
        """Close the files; remove them unless ``keep`` (a failed engine's last word)."""
        for kind, f in self._files.items():
            f.close()
            if not keep:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, self._paths[kind]))
        self._files.clear()


_collector: KeepaliveCollector | None = None


def install() -> None:
    """Register the collector on prometheus_client's default registry (the one vLLM's
    /metrics serves with one API server). Idempotent; never raises."""
    global _collector
    if _collector is not None:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    _collector = KeepaliveCollector()
    REGISTRY.register(_collector)
