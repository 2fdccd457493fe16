"""keepalive's /metrics series without an engine: rank 0's counters (metrics.StepMeter), the
snapshot writer, the run directory, and the front end's collector read through
prometheus_client's own text exposition. The series on a real `vllm serve`: test_serve.py
(spawned ranks, and the control without snapshots), test_data_parallel.py (one engine
label per replica), test_torchrun.py (heartbeat ages)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from keepalive_executor import collector, metrics, run_dir
from keepalive_executor.collector import SERIES, KeepaliveCollector, read_snapshots
from keepalive_executor.metrics import DISPATCH_BUCKETS_S, SnapshotWriter, StepMeter

pytestmark = pytest.mark.fast


@pytest.fixture
def run(tmp_path, monkeypatch) -> int:
    """A run of this process's, in a private base of the test's own."""
    base = tmp_path / "runtime"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.delenv(run_dir.FRONTEND_ENV, raising=False)
    return run_dir.claim(force=True)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """Every sample of the registry's text exposition, parsed back by prometheus_client."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """A server's /metrics over HTTP, its keepalive samples parsed by prometheus_client."""
    import urllib.request

    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith(collector.PREFIX)}


def value(found: dict, name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in found.items()
            if n == name and all(dict(ls).get(k) == w for k, w in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def describe(state: str = "running", **extra) -> dict:
    return {"engine": "0", "model_name": "tiny", "state": state,
            "info": {"version": "0.1.0", "vllm_version": "0.32.0", "launcher": "spawned",
                     "transport": "cpu", "world_size": 2, "interval_s": 1.25},
            "ranks": {"0": {"up": True, "heartbeat_at": None},
                      "1": {"up": True, "heartbeat_at": None}},
            "rank_failures": [], **extra}


def test_a_step_costs_its_frame_plus_its_payload_when_it_does_not_fit_inline():
    clock = iter([100.0, 101.0, 102.0])
    meter = StepMeter(frame_bytes=32 + 16, inline_bytes=16, wall=lambda: next(clock))
    meter.step_sent("execute", 16, 0.0002)
    meter.step_sent("rpc", 17, 0.003)
    meter.keepalive_sent()
    assert meter.bytes == {"step": 48, "rpc": 48 + 17, "keepalive": 48}
    assert meter.steps == {"execute": 1, "sample": 0, "rpc": 1}
    assert meter.keepalives == 1
    assert meter.last_broadcast == {"step": 100.0, "rpc": 101.0, "keepalive": 102.0}


@given(st.lists(st.floats(min_value=0, max_value=1.0, allow_nan=False), max_size=50))
def test_the_dispatch_histogram_counts_each_step_once_in_its_le_bucket(times):
    meter = StepMeter()
    for t in times:
        meter.step_sent("sample", 0, t)
    counts = meter.dispatch_counts
    assert sum(counts) == len(times) == meter.steps["sample"]
    bounds = [*DISPATCH_BUCKETS_S, float("inf")]
    for i, bound in enumerate(bounds):  # prometheus' le: a value equal to a bound is in it
        assert sum(counts[:i + 1]) == sum(1 for t in times if t <= bound)
    assert meter.dispatch_sum == pytest.approx(sum(times))


def test_the_collector_serves_a_snapshot_as_prometheus_series_with_ages_at_scrape_time(run):
    meter = StepMeter(frame_bytes=100, inline_bytes=50, wall=lambda: 1000.0)
    meter.step_sent("execute", 10, 0.00007)
    meter.keepalive_sent()
    ranks = {"0": {"up": True, "heartbeat_at": None}, "1": {"up": True, "heartbeat_at": 990.0},
             "2": {"up": False, "heartbeat_at": 900.0}}
    path = run_dir.engine_snapshot_path("0")
    writer = SnapshotWriter(path, meter, lambda: describe(
        ranks=ranks, rank_failures=[{"rank": 2, "cause": "heartbeat"}]), wall=lambda: 999.0)
    assert writer.write()
    now = [1000.0]
    registry = CollectorRegistry()
    registry.register(KeepaliveCollector(wall=lambda: now[0]))
    found = samples(registry)
    assert {n for n, _ in found} >= {s for s in SERIES if not s.endswith("_seconds")}
    assert value(found, "vllm_keepalive_keepalives_sent_total", engine="0",
                 model_name="tiny") == 1
    assert value(found, "vllm_keepalive_steps_total", kind="execute") == 1
    assert value(found, "vllm_keepalive_broadcast_bytes_total", kind="keepalive") == 100
    assert value(found, "vllm_keepalive_executor_state", state="running") == 1
    assert value(found, "vllm_keepalive_executor_state", state="failed") == 0
    assert value(found, "vllm_keepalive_info", vllm_version="0.32.0", launcher="spawned",
                 interval_seconds="1.25", world_size="2") == 1
    assert value(found, "vllm_keepalive_step_dispatch_seconds_bucket", le="5e-05") == 0
    assert value(found, "vllm_keepalive_step_dispatch_seconds_bucket", le="0.0001") == 1
    assert value(found, "vllm_keepalive_step_dispatch_seconds_count") == 1
    assert value(found, "vllm_keepalive_rank_up", rank="2") == 0
    assert value(found, "vllm_keepalive_rank_failures_total", rank="2", cause="heartbeat") == 1
    assert value(found, "vllm_keepalive_rank_failures_total", rank="1", cause="exited") == 0
    assert value(found, "vllm_keepalive_rank_heartbeat_age_seconds", rank="1") == 10
    assert value(found, "vllm_keepalive_snapshot_timestamp_seconds") == 999
    now[0] = 1005.0  # the engine wrote nothing since: the age still grows
    assert value(samples(registry), "vllm_keepalive_rank_heartbeat_age_seconds",
                 rank="1") == 15


def test_no_snapshot_no_series(run):
    registry = CollectorRegistry()
    registry.register(KeepaliveCollector())
    assert not [n for n, _ in samples(registry) if n.startswith("vllm_keepalive_")]


def test_a_torn_snapshot_is_warned_once_and_its_last_good_reading_is_served(run, caplog):
    path = run_dir.engine_snapshot_path("0")
    assert SnapshotWriter(path, StepMeter(), lambda: describe(), wall=lambda: 50.0).write()
    registry = CollectorRegistry()
    registry.register(KeepaliveCollector())
    assert value(samples(registry), "vllm_keepalive_snapshot_timestamp_seconds") == 50
    Path(path).write_text('{"version": 1, "written_at": 6')  # as a crash mid-write would
    with caplog.at_level(logging.WARNING, logger="vllm"):
        for _ in range(3):
            assert value(samples(registry), "vllm_keepalive_snapshot_timestamp_seconds") == 50
    assert sum("cannot read the /metrics snapshot" in r.message for r in caplog.records) == 1


def test_a_snapshot_the_collector_cannot_make_series_of_fails_no_scrape(run, caplog):
    """A snapshot of the right version but a wrong shape (another release's, say): the
    scrape answers, with the other collectors' series, and one warning."""
    path = run_dir.run_dir(create=True)
    Path(path, f"engine-0-{os.getpid()}.json").write_text(
        json.dumps({"version": 1, "written_at": 1.0, "engine": "0", "steps": [1, 2]}))
    registry = CollectorRegistry()
    registry.register(KeepaliveCollector())
    from prometheus_client import Gauge

    Gauge("another_series", "another collector's", registry=registry).set(3)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        for _ in range(2):
            found = samples(registry)
            assert found[("another_series", ())] == 3
            assert not [n for n, _ in found if n.startswith("vllm_keepalive_")]
    assert sum("could not be built" in r.message for r in caplog.records) == 1


def test_an_unwritable_directory_is_one_warning_never_an_error(tmp_path, caplog):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    writer = SnapshotWriter(str(locked / "engine-0-1.json"), StepMeter(), lambda: describe())
    with caplog.at_level(logging.WARNING, logger="vllm"):
        if os.geteuid() == 0:  # root writes anywhere: a path under a file fails for anyone
            writer.path = str(tmp_path / "a-file" / "engine-0-1.json")
            (tmp_path / "a-file").write_text("")
        assert writer.write() is False and writer.write() is False
    assert sum("could not write the /metrics snapshot" in r.message
               for r in caplog.records) == 1


def test_the_writer_thread_writes_at_once_on_a_poke_and_removes_its_file_unless_failed(run):
    state = ["running"]
    path = run_dir.engine_snapshot_path("0")
    writer = SnapshotWriter(path, StepMeter(), lambda: describe(state[0]), period_s=60)
    writer.start()
    deadline = time.monotonic() + 10
    while writer.written < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    state[0] = "failed"
    writer.poke()  # the period is a minute: only the poke can write it
    while json.loads(Path(path).read_text())["state"] != "failed":
        assert time.monotonic() < deadline, "the poke wrote nothing"
        time.sleep(0.01)
    writer.stop(keep=True)
    assert json.loads(Path(path).read_text())["state"] == "failed"
    second = SnapshotWriter(path, StepMeter(), lambda: describe("stopped"), period_s=60)
    second.start()
    second.stop(keep=False)
    assert not os.path.exists(path)


def test_a_dead_engines_snapshot_gives_way_to_a_live_one_for_the_same_engine(run):
    path = run_dir.run_dir(create=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    for pid, written in ((dead, 200.0), (os.getpid(), 100.0)):
        snap = {"version": 1, "written_at": written, "pid": int(pid), **describe()}
        Path(path, f"engine-0-{pid}.json").write_text(json.dumps(snap))
    [only] = read_snapshots([run])
    assert only["pid"] == os.getpid()  # alive beats newer


def test_a_run_is_claimed_once_unless_forced_and_a_fresh_claim_empties_a_stale_directory(
        tmp_path, monkeypatch):
    base = tmp_path / "rt"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.setenv(run_dir.FRONTEND_ENV, "1")  # inherited from a parent: kept
    assert run_dir.claim(force=False) == 1
    (base / "keepalive-executor").mkdir(mode=0o700)
    stale = base / "keepalive-executor" / f"run-{os.getpid()}"
    stale.mkdir(mode=0o700)
    (stale / "failed-12345").write_text("an earlier process with this pid\n")
    assert run_dir.claim(force=True) == os.getpid()
    assert not stale.exists() and run_dir.failures() == []
    run_dir.record_failure("worker rank 1 died\nunexpectedly")
    assert run_dir.failures() == ["worker rank 1 died unexpectedly"]
    assert run_dir.claim(force=True) == os.getpid()  # its own run: nothing removed
    assert run_dir.failures() == ["worker rank 1 died unexpectedly"]
    run_dir.remove()
    assert run_dir.failures() == []


def test_a_base_directory_others_can_enter_is_refused_with_a_warning(tmp_path, monkeypatch,
                                                                      caplog):
    base = tmp_path / "rt"
    (base / "keepalive-executor").mkdir(parents=True, mode=0o755)
    os.chmod(base / "keepalive-executor", 0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert run_dir.base_dir() is None
    assert "must be a directory owned by this user with mode 700" in caplog.text


def test_the_multiprocess_mirror_serves_the_same_samples_as_the_collector(run, tmp_path):
    """What vLLM's multiprocess /metrics reads back from the mirror's files (two engines,
    one process each) equals what the collector serves from the same snapshots."""
    from prometheus_client.multiprocess import MultiProcessCollector

    prom = tmp_path / "prom"
    prom.mkdir()
    snaps = []
    for engine, pid in (("0", 4001), ("1", 4002)):
        meter = StepMeter(frame_bytes=100, inline_bytes=50, wall=lambda: 500.0)
        for t in (0.00003, 0.0004, 0.0004, 0.2):
            meter.step_sent("execute", 70 * int(engine), t)
        meter.keepalive_sent()
        snap = {"version": 1, "written_at": 600.0, "pid": pid,
                **describe(), "engine": engine, **meter.counters()}
        mirror = collector.MultiprocessMirror(str(prom), pid=pid)
        mirror.write(snap)
        mirror.write(snap)  # rewritten each second: values replaced, not added
        mirror.close(keep=True)
        snaps.append(snap)
    read_back = CollectorRegistry()
    MultiProcessCollector(read_back, path=str(prom))
    direct = {}
    for fam in collector.families(snaps, 600.0):
        for sm in fam.samples:
            direct[(sm.name, tuple(sorted(sm.labels.items())))] = sm.value
    assert samples(read_back) == direct
    assert value(direct, "vllm_keepalive_step_dispatch_seconds_bucket", engine="1",
                 le="0.0005") == 3
    mirror = collector.MultiprocessMirror(str(prom), pid=4001)
    mirror.write(snaps[0])
    mirror.close(keep=False)  # a clean stop: that engine's files are gone
    assert sorted(os.listdir(prom)) == sorted(
        f"{kind}_keepalive-4002.db" for kind in ("counter", "gauge_mostrecent", "histogram"))


SERVED = textwrap.dedent("""
    # an API server's /metrics, as vLLM mounts it, in a process of its own
    import os, sys
    mode, run_base = sys.argv[1], sys.argv[2]
    if mode == "multiprocess":  # as vLLM's launcher sets it for several API servers
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(run_base, "prom")
        os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    os.environ["XDG_RUNTIME_DIR"] = run_base
    from keepalive_executor import collector, run_dir
    from keepalive_executor.metrics import SnapshotWriter, StepMeter
    run_dir.claim(force=True)
    ours = sys.argv[3] == "plugin"
    # the engine's side: its snapshot, mirrored where vLLM's multiprocess metrics read
    mirror = collector.MultiprocessMirror.from_environ() if ours else None
    SnapshotWriter(run_dir.engine_snapshot_path("0"), StepMeter(),
                   lambda: {"engine": "0", "model_name": "tiny", "state": "running"},
                   mirror=mirror).write()
    if ours:  # the front end's side
        collector.install()
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router
    app = FastAPI()
    attach_router(app)
    body = TestClient(app).get("/metrics").text
    print('vllm_keepalive_executor_state{engine="0",model_name="tiny",state="running"} 1.0'
          in body)
""")


@pytest.mark.parametrize("mode", ["default", "multiprocess"])
def test_the_api_servers_metrics_route_serves_the_series(tmp_path, mode):
    """The contract the series rest on, per vLLM release: /metrics as vLLM's API server
    mounts it (vllm.entrypoints.serve.instrumentator.metrics.attach_router) serves the
    default registry, where the collector is, with one API server; with several
    (multiprocess mode) a registry built per request from prometheus_client's files, where
    the engine's mirror writes. Without the collector and the mirror (the control) the route
    has no keepalive series."""
    found = {}
    for how in ("plugin", "control"):
        base = tmp_path / how
        base.mkdir(mode=0o700)
        out = subprocess.run([sys.executable, "-c", SERVED, mode, str(base), how],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert out.returncode == 0, out.stderr[-3000:]
        found[how] = out.stdout.split()[-1]
    assert found == {"plugin": "True", "control": "False"}


def test_the_exported_names_follow_prometheus_conventions():
    for name in SERIES:
        assert name.startswith(collector.PREFIX) and ":" not in name
    assert all(n.endswith("_total") for n in SERIES if "sent" in n or "failures" in n)
    assert set(metrics.FAILURE_CAUSES) == {"exited", "heartbeat"}


DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / \
    "keepalive-dashboard.json"


def test_the_dashboards_queries_name_series_that_exist():
    """examples/grafana/keepalive-dashboard.json: every keepalive series a query names is
    one the collector exports (a histogram by its _bucket, _sum or _count), every vLLM
    series one that vLLM's own metrics code defines, and every exported series is shown."""
    import vllm

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    named = {n for e in exprs for n in re.findall(r"\bvllm[_:][a-zA-Z0-9_:]*", e)}
    ours = {re.sub(r"_(bucket|sum|count)$", "", n) if "dispatch" in n else n
            for n in named if n.startswith(collector.PREFIX)}
    assert ours <= set(SERIES), ours - set(SERIES)
    assert set(SERIES) - ours == set(), "not on the dashboard"
    vllm_source = (Path(vllm.__file__).parent / "v1" / "metrics" / "loggers.py").read_text()
    theirs = {n for n in named if n.startswith("vllm:")}
    assert theirs and all(f'"{re.sub(r"_total$", "", n)}"' in vllm_source for n in theirs), \
        theirs
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])


def test_a_run_claimed_by_a_process_of_its_own_is_removed_when_that_process_exits(run):
    """A process that resolved the executor itself (an `LLM` in a user's program) leaves no
    run directory behind; `vllm serve` removes its own (supervision.py)."""
    script = ("from keepalive_executor import run_dir; import os; "
              "os.environ.pop(run_dir.FRONTEND_ENV, None); pid = run_dir.claim(force=False); "
              "run_dir.record_failure('x'); print(pid, run_dir.run_dir(pid))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    pid, path = out.stdout.split()
    assert path.endswith(f"run-{pid}") and not os.path.exists(path)
