"""Shared fixtures: spawning rank processes for channel scenarios."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import re
import sys
import tempfile
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# the tiny local model's builder lives with the scripts (it is not part of the runtime)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))


# ---------------------------------------------------------------- hypothesis in every run
#
# Randomized in every run, CI's included, every failure replayable. Random exploration is what
# finds a bug no earlier run met (the executor's in-flight model bug was found so), and a
# derandomized run repeats the same examples for as long as the code stands still; so no run
# is derandomized, and instead: a failure's report carries its reproduction blob
# (``@reproduce_failure(...)``: that example, exactly, on that test), which the events file
# keeps too, for scripts/test_events.py to print last; and the example database is the
# checkout's (.hypothesis/, or HYPOTHESIS_STORAGE_DIRECTORY), whatever the working directory
# and the venv, shared by both phases and the 0.33/0.34 tier: the first examples a session
# tries are the failures an earlier one saved. Hypothesis itself, when it sees CI set,
# derandomizes and keeps no database; this profile says what the suite does in any
# environment. No deadline and no too-slow health check: a loaded 2-core machine is no
# measure of either. (Loaded here, before the test modules build their settings from the
# default; --hypothesis-profile still wins. A run's seed is not forced: with
# --hypothesis-seed, hypothesis uses no database.)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hypothesis_profile() -> None:
    from hypothesis import HealthCheck, settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    where = os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY") or os.path.join(REPO, ".hypothesis")
    settings.register_profile(
        "keepalive", parent=settings.get_profile("default"), derandomize=False,
        print_blob=True, deadline=None, suppress_health_check=[HealthCheck.too_slow],
        database=DirectoryBasedExampleDatabase(os.path.join(where, "examples")))
    settings.load_profile("keepalive")


_hypothesis_profile()


#: Where the reference files are as the run found them (set by the first pytest process,
#: inherited by xdist's workers): a reference computed live during the run rewrites its file,
#: so the freshness test must look at the files as they came with the checkout.
SNAPSHOT_ENV = "KEEPALIVE_REFERENCE_SNAPSHOT"


def pytest_configure(config) -> None:
    import shutil

    if hasattr(config, "workerinput") or os.environ.get(SNAPSHOT_ENV):
        return
    from run_engine import REFERENCE_DIR

    snapshot = tempfile.mkdtemp(prefix="keepalive-references-")
    for path in REFERENCE_DIR.glob("*.json"):
        shutil.copy2(path, snapshot)
    os.environ[SNAPSHOT_ENV] = snapshot
    config.add_cleanup(lambda: shutil.rmtree(snapshot, ignore_errors=True))


def pytest_sessionstart(session) -> None:
    """In the serial phase's two lanes (tests/lanes.py), a worker waits for a server's
    start-up in an overlappable region. Wrapped here, not in servers.py: the lanes belong to
    this test session, while servers.py is shared with the scripts that compute the cached
    references and with the benchmarks (and its source is part of the references' keys).
    A guest of the lanes (the no-engine tier beside them) holds the lock shared from here:
    its collection imports vLLM, which must not run beside a lane's measured moments."""
    import lanes

    if not lanes.active():
        return
    if lanes.guest():
        if getattr(session.config.option, "numprocesses", None):
            raise pytest.UsageError("a guest of the lanes runs in one process (-n 0): it is "
                                    "the process that holds the lock for each test")
        lanes.visit()
        return
    from launchers import LaunchedServer
    from servers import Server, TorchrunServer

    for cls in (Server, TorchrunServer, LaunchedServer):
        if not getattr(cls.wait_ready, "__wrapped_by_lanes__", False):
            cls.wait_ready = lanes.wrap(cls.wait_ready)


_UNGROUPED: set[str] = set()


def pytest_collection_finish(session) -> None:
    """Find the tests a ``--dist loadgroup`` run failed to group. pytest-xdist keeps the tests
    that share a session-scoped engine run (``xdist_group``) on one worker by suffixing their
    node ids with ``@group`` on each worker; pytest 9.2.0 ignores that suffix (xdist 3.8 sets
    a field it no longer reads), so each worker started the shared engine again and phase 1
    ran every such engine twice, unnoticed. scripts/constraints.txt pins a pytest that
    groups; under one that does not, each such test fails in its set-up (below)."""
    if getattr(session.config.option, "loadgroup", False):
        _UNGROUPED.update(item.nodeid for item in session.items
                          if item.get_closest_marker("xdist_group") and "@" not in item.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    import lanes

    # a lane holds the machine from its first test's set-up on (not from its session's start:
    # xdist schedules no test before every worker has collected); a test marked overlappable
    # is a region of its lane, but for the windows it measures alone (tests/lanes.py)
    lanes.hold()
    lanes.start_test(item.get_closest_marker("overlappable") is not None)
    lanes.visit()  # a guest's test: the lock shared
    if item.nodeid in _UNGROUPED:
        pytest.fail(f"--dist loadgroup did not group this test (marked xdist_group) under "
                    f"pytest {pytest.__version__}: the tests sharing its engine would each "
                    "start it again; install the pytest of scripts/constraints.txt",
                    pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    """After a lane's last test, and its fixtures' teardown, it gives the machine up (xdist
    runs a worker's last test only once it knows no other follows). A guest lets go after
    each of its tests."""
    import lanes

    lanes.leave()
    if nextitem is None:
        lanes.release()


#: scripts/test.sh points this at a file (scripts/test_events.py reads it): every test appends
#: when it started and ended (set-up to teardown) and whether it failed; test.sh then names
#: what ran beside each failed test, and scripts/suite_cpu.py shares out each second's busy
#: CPU among the tests running in it
EVENTS_ENV = "KEEPALIVE_TEST_EVENTS"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(EVENTS_ENV)
    if path:
        _event(path, "start", item.nodeid)
    yield
    if path:
        import lanes

        _event(path, "end", item.nodeid)
        if lanes.active():  # how long it held the lanes' lock, in which mode, and waited
            figures = lanes.spent()
            _event(path, "lanes", item.nodeid + "\t" + " ".join(
                f"{figures[k]:.1f}" for k in ("exclusive", "shared", "waiting")))


#: a hypothesis failure's reproduction blob, as its report prints it (print_blob, above)
_BLOB = re.compile(r"@reproduce_failure\([^)]*\)")


def pytest_runtest_logreport(report):
    path = os.environ.get(EVENTS_ENV)
    if path and report.failed:  # for scripts/test_events.py: what ran beside it
        _event(path, "failed", report.nodeid)
        blob = _BLOB.search(report.longreprtext or "")
        if blob:  # printed again with the failed test's name at the log's end
            _event(path, "replay", f"{report.nodeid}\t{blob.group(0)}")


def _event(path: str, what: str, nodeid: str) -> None:
    # one write of one short line in append mode: the workers' lines never interleave
    with open(path, "a") as f:
        f.write(f"{time.time():.3f} {what} {os.path.basename(sys.prefix)} {nodeid}\n")


def run_ranks(scenario: str, world: int, *, timeout_s: float, wall_s: float, **kw) -> dict:
    """Run ``dist_scenarios.<scenario>`` on ``world`` spawned ranks; return {rank: result}.

    Every child is reaped (killed if needed) before this returns: no orphans.
    """
    import dist_scenarios

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tempfile.gettempdir(), f"ka_test_{uuid.uuid4().hex}")
    procs = [
        ctx.Process(target=dist_scenarios.entry,
                    args=(scenario, r, world, q, store, timeout_s, kw), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + wall_s
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, res = q.get(timeout=0.5)
                results[rank] = res
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        if os.path.exists(store):
            os.unlink(store)
    return results


@pytest.fixture(scope="session")
def ranks():
    return run_ranks


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny local Llama (built once per session; no hub)."""
    from tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="session")
def reference(tiny_model, tmp_path_factory):
    """``reference(NAME)``: the result of reference_calls.REFERENCES[NAME] (vLLM's mp, or
    TP=1), cached in tests/references/ when its key matches this environment, otherwise run
    live now and its file rewritten (run_engine.Reference); each is looked up once per
    session, and the test output says which it was. A live run that fails or times out
    leaves nothing running (tests/reaping.py: its script's server is in a session of its
    own)."""
    from reaping import run_reference
    from reference_calls import REFERENCES
    from run_engine import Reference, reference_call, say

    results: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in results:
            work = tmp_path_factory.mktemp(f"{name}-ref")
            ref = Reference.look_up(name, reference_call(REFERENCES[name], tiny_model, work),
                                    tiny_model)
            say(ref.message())
            results[name] = run_reference(ref)
        return results[name]

    return get


@pytest.fixture
def tcp_store():
    """A real TCPStore server on loopback (what torchrun's agent hosts): (server, port,
    a function that opens another client)."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = TCPStore("127.0.0.1", port, is_master=True,
                      timeout=datetime.timedelta(seconds=10))

    def client() -> TCPStore:
        return TCPStore("127.0.0.1", port, is_master=False,
                        timeout=datetime.timedelta(seconds=10))

    return server, port, client
