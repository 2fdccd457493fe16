"""tests/lanes.py, the serial phase's two lanes: a worker holding the machine excludes
everything of the other worker, and overlappable regions admit only each other. Checked on
real flocks, with a probe descriptor standing in for the other worker (flock locks belong to
an open file description, so two descriptors of one process conflict like two processes)."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

HERE = Path(__file__).resolve().parent


def _fresh_copy(name: str):
    """A copy of the module with state of its own: two copies in one process are two lanes
    (each opens its own descriptors)."""
    spec = importlib.util.spec_from_file_location(name, HERE / "lanes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def lanes(tmp_path, monkeypatch):
    """A fresh copy of the module (its state is per process), with the lanes on."""
    monkeypatch.setenv("KEEPALIVE_SERIAL_LANES", str(tmp_path / "lanes.lock"))
    module = _fresh_copy("lanes_under_test")
    yield module
    module.release()


@pytest.fixture
def probe(tmp_path):
    fd = os.open(tmp_path / "lanes.lock", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


def can_take(fd: int, mode: int) -> bool:
    """Whether the other worker could take the lock in ``mode`` now (it is left free)."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def test_a_held_lane_excludes_the_other_and_its_regions_admit_only_regions(lanes, probe):
    assert can_take(probe, fcntl.LOCK_EX)  # nobody holds it yet
    lanes.hold()
    assert not can_take(probe, fcntl.LOCK_SH)  # not even the other's region
    with lanes.overlappable():
        assert can_take(probe, fcntl.LOCK_SH)  # the other's region may run beside this one
        assert not can_take(probe, fcntl.LOCK_EX)  # the other's test may not
    assert not can_take(probe, fcntl.LOCK_SH)
    lanes.release()  # after its last test
    assert can_take(probe, fcntl.LOCK_EX)


def test_the_lock_stays_shared_until_the_last_thread_leaves_its_region(lanes, probe):
    lanes.hold()
    first_in, second_in, first_may_leave = (threading.Event() for _ in range(3))

    def first() -> None:
        with lanes.overlappable():
            first_in.set()
            first_may_leave.wait(30)

    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(30)
    with lanes.overlappable():
        second_in.set()
        first_may_leave.set()
        t.join(30)
        assert not t.is_alive()
        assert can_take(probe, fcntl.LOCK_SH)  # one thread left: still a region
    assert not can_take(probe, fcntl.LOCK_SH)


def test_a_worker_waits_for_the_machine_while_the_other_holds_it(lanes, probe):
    fcntl.flock(probe, fcntl.LOCK_EX)  # the other worker, in its test
    held = threading.Event()
    t = threading.Thread(target=lambda: (lanes.hold(), held.set()), daemon=True)
    t.start()
    assert not held.wait(0.5)
    fcntl.flock(probe, fcntl.LOCK_UN)
    assert held.wait(30)
    assert not can_take(probe, fcntl.LOCK_SH)


def test_leaving_a_region_waits_until_the_other_workers_region_ends(lanes, probe):
    lanes.hold()
    inside, go, left = (threading.Event() for _ in range(3))

    def start_up() -> None:
        with lanes.overlappable():
            inside.set()
            go.wait(30)
        left.set()

    t = threading.Thread(target=start_up, daemon=True)
    t.start()
    assert inside.wait(30)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the other worker's region, beside
    go.set()
    assert not left.wait(0.5)  # the lane's test goes on only once the other region ended
    fcntl.flock(probe, fcntl.LOCK_UN)
    assert left.wait(30)
    assert not can_take(probe, fcntl.LOCK_SH)


def test_a_wrapped_method_runs_inside_a_region_and_returns_its_result(lanes, probe):
    lanes.hold()

    def wait_ready(x: int) -> tuple[int, bool, bool]:
        return x, can_take(probe, fcntl.LOCK_SH), can_take(probe, fcntl.LOCK_EX)

    assert lanes.wrap(wait_ready)(7) == (7, True, False)


def test_without_the_variable_nothing_takes_a_lock(lanes, probe, monkeypatch):
    monkeypatch.delenv("KEEPALIVE_SERIAL_LANES")
    lanes.hold()
    with lanes.overlappable():
        assert can_take(probe, fcntl.LOCK_EX)
    assert can_take(probe, fcntl.LOCK_EX)
    assert lanes.start_up_in_region(lambda env: env) == {}  # no hand-over asked of a script


def test_a_lane_waiting_for_the_machine_gets_it_before_the_other_takes_it_back(lanes):
    """flock grants a lock to whoever asks first: without the turnstile a lane going from
    region to test and back takes it again within microseconds, and the other, waiting, would
    wait for as long as that goes on."""
    other = _fresh_copy("the_other_lane")
    lanes.hold()
    cycles: list[int] = []
    at: list[int] = []

    def busy_lane() -> None:
        for _ in range(100):
            with lanes.overlappable():
                time.sleep(0.002)
            cycles.append(1)

    def waiting_lane() -> None:
        other.hold()
        at.append(len(cycles))
        other.release()

    a, b = threading.Thread(target=busy_lane), threading.Thread(target=waiting_lane)
    b.start()
    turnstile = os.open(os.environ["KEEPALIVE_SERIAL_LANES"] + ".turnstile", os.O_RDWR)
    try:
        deadline = time.monotonic() + 30
        while can_take(turnstile, fcntl.LOCK_EX) and time.monotonic() < deadline:
            time.sleep(0.005)  # until the other lane queues (it keeps the turnstile)
    finally:
        os.close(turnstile)
    a.start()
    a.join(60)
    b.join(60)
    assert at and at[0] <= 1, (at, len(cycles))
    assert len(cycles) == 100


def test_a_measured_window_inside_a_region_has_the_machine_to_itself(lanes, probe):
    lanes.hold()
    with lanes.overlappable():  # a test marked overlappable
        assert can_take(probe, fcntl.LOCK_SH)
        with lanes.alone():  # its kill and reaction time
            assert not can_take(probe, fcntl.LOCK_SH)
            with lanes.overlappable():  # a server started in the window: still alone
                assert not can_take(probe, fcntl.LOCK_SH)
            assert not can_take(probe, fcntl.LOCK_SH)
        assert can_take(probe, fcntl.LOCK_SH)  # a region again
    assert not can_take(probe, fcntl.LOCK_SH)


def test_an_overlappable_test_is_a_region_until_a_test_that_is_not_starts(lanes, probe):
    lanes.hold()
    lanes.start_test(True)  # marked overlappable
    assert can_take(probe, fcntl.LOCK_SH) and not can_take(probe, fcntl.LOCK_EX)
    with lanes.overlappable():  # its server's start-up
        pass
    assert can_take(probe, fcntl.LOCK_SH)  # still its region after the start-up
    lanes.start_test(True)  # the next one marked too: no exclusive turn in between
    assert can_take(probe, fcntl.LOCK_SH)
    lanes.start_test(False)
    assert not can_take(probe, fcntl.LOCK_SH)


# a reference's script that says whether anything could run beside it: another lane's region,
# or the guest, would take the lock shared
SEES_THE_LOCK = """
import fcntl, json, os, sys
kw = json.loads(sys.argv[2])
fd = os.open(kw["lock"], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    alone = False
except BlockingIOError:
    alone = True
print("RESULT " + json.dumps({"alone": alone}))
"""


def test_a_reference_run_live_has_the_machine_to_itself_in_an_overlappable_test(
        lanes, probe, tmp_path, monkeypatch):
    """A stale reference runs live in the test that asks for it, often inside its region
    (test_data_parallel's and test_serve's tests are overlappable): the live run is a
    measurement of mp (answers, and what a killed rank does to its server within a bound), as
    the test's own measured windows are, and an extra mp server beside the other lane's region
    and the guest is load nobody planned for. So it runs with the machine to itself, and the
    test's region resumes after it; a cached one takes nothing."""
    import reaping
    from run_engine import Reference

    monkeypatch.setattr(reaping, "lanes", lanes)
    script = tmp_path / "sees_the_lock.py"
    script.write_text(SEES_THE_LOCK)
    call = dict(name="sees", script=str(script), lock=str(tmp_path / "lanes.lock"))
    lanes.hold()
    lanes.start_test(True)  # a test marked overlappable: its region
    live = Reference("sees", call, {"cpu_isa": "any"}, tmp_path / "sees.json", None,
                     ["no cached file"])
    assert reaping.run_reference(live) == {"alone": True}
    assert can_take(probe, fcntl.LOCK_SH)  # its region again
    cached = Reference("sees", call, {"cpu_isa": "any"}, tmp_path / "sees.json",
                       {"alone": "cached"}, [])
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the other lane's region, beside
    try:
        assert reaping.run_reference(cached) == {"alone": "cached"}  # no wait for the machine
    finally:
        fcntl.flock(probe, fcntl.LOCK_UN)


@pytest.fixture
def guest(tmp_path, monkeypatch):
    """A fresh copy of the module as the lanes' guest (the no-engine tier beside them)."""
    monkeypatch.setenv("KEEPALIVE_SERIAL_LANES", str(tmp_path / "lanes.lock"))
    monkeypatch.setenv("KEEPALIVE_LANES_GUEST", "1")
    module = _fresh_copy("guest_under_test")
    yield module
    module.release()


def test_a_guest_runs_beside_regions_and_never_while_a_lane_holds_the_machine(guest, probe):
    fcntl.flock(probe, fcntl.LOCK_EX)  # a lane in its test
    visited = threading.Event()
    t = threading.Thread(target=lambda: (guest.visit(), visited.set()), daemon=True)
    t.start()
    assert not visited.wait(0.5)  # the guest's next test waits for the lane's to end
    fcntl.flock(probe, fcntl.LOCK_SH)  # the lane enters a region
    assert visited.wait(30)
    t.join(30)
    fcntl.flock(probe, fcntl.LOCK_UN)
    # the guest's test in progress: a lane's region may run beside it, a lane's test may not
    assert can_take(probe, fcntl.LOCK_SH) and not can_take(probe, fcntl.LOCK_EX)
    guest.leave()  # between the guest's tests nothing is held
    assert can_take(probe, fcntl.LOCK_EX)
    # what makes a lane take the machine makes a guest take nothing more than its share
    guest.visit()
    guest.hold()
    guest.start_test(False)
    with guest.overlappable(), guest.alone():
        assert can_take(probe, fcntl.LOCK_SH) and not can_take(probe, fcntl.LOCK_EX)
    guest.leave()
    assert can_take(probe, fcntl.LOCK_EX)


def test_a_lane_waiting_for_the_machine_takes_it_before_the_guests_next_test(guest):
    """The guest's tests follow each other within microseconds (most take milliseconds): a
    lane that waits for the machine gets it once the guest's test in progress has ended."""
    lane = _fresh_copy("a_lane")
    lane.guest = lambda: False  # this copy is a lane, in the guest's environment
    guest.visit()  # the guest's test in progress
    tests_run: list[int] = []
    at: list[int] = []

    def guest_tests() -> None:
        guest.leave()
        for _ in range(100):
            guest.visit()
            time.sleep(0.002)
            guest.leave()
            tests_run.append(1)

    def waiting_lane() -> None:
        lane.hold()
        at.append(len(tests_run))
        lane.release()

    b = threading.Thread(target=waiting_lane)
    b.start()
    turnstile = os.open(os.environ["KEEPALIVE_SERIAL_LANES"] + ".turnstile", os.O_RDWR)
    try:
        deadline = time.monotonic() + 30
        while can_take(turnstile, fcntl.LOCK_EX) and time.monotonic() < deadline:
            time.sleep(0.005)  # until the lane queues (it keeps the turnstile)
    finally:
        os.close(turnstile)
    a = threading.Thread(target=guest_tests)
    a.start()
    a.join(60)
    b.join(60)
    assert at and at[0] <= 1, (at, len(tests_run))
    assert len(tests_run) == 100


SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
import handoff
marks = sys.argv[1]
open(marks + ".up", "w").close()  # its engine's start-up, in progress
while not os.path.exists(marks + ".proceed"):
    time.sleep(0.01)
handoff.started()
print(time.time())  # what it measures begins
"""


@pytest.mark.parametrize("marked", [False, True], ids=["test", "overlappable-test"])
def test_a_scripts_start_up_is_a_region_and_what_it_measures_waits_for_the_machine(
        lanes, probe, tmp_path, marked):
    lanes.hold()
    lanes.start_test(marked)
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(tests=str(HERE)))
    marks = str(tmp_path / "marks")
    box: dict = {}

    def run(env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), marks], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=60)

    def in_region() -> None:
        box["r"] = lanes.start_up_in_region(run)
        # the script has ended: the machine stays this lane's, or a region in a marked test
        box["after"] = can_take(probe, fcntl.LOCK_SH)

    t = threading.Thread(target=in_region)
    t.start()
    deadline = time.monotonic() + 30
    while not os.path.exists(marks + ".up") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert can_take(probe, fcntl.LOCK_SH) and not can_take(probe, fcntl.LOCK_EX)  # a region
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the other lane's region, beside it
    Path(marks + ".proceed").touch()  # the start-up is over
    time.sleep(0.5)
    assert t.is_alive()  # the script waits for the machine
    released_at = time.time()
    fcntl.flock(probe, fcntl.LOCK_UN)  # the other lane's region ends
    t.join(60)
    assert box["r"].returncode == 0, box["r"].stderr
    assert float(box["r"].stdout) >= released_at
    assert box["after"] is marked


def test_the_time_held_in_each_mode_and_waited_is_added_up_per_test(lanes, probe):
    fcntl.flock(probe, fcntl.LOCK_EX)  # the other lane, in its test
    t0 = time.monotonic()
    t = threading.Thread(target=lanes.hold)
    t.start()
    time.sleep(0.3)
    fcntl.flock(probe, fcntl.LOCK_UN)
    t.join(30)
    time.sleep(0.2)  # this lane's test
    with lanes.overlappable():
        time.sleep(0.2)  # its region
    first = lanes.spent()
    elapsed = time.monotonic() - t0
    assert first["waiting"] >= 0.3 and first["exclusive"] >= 0.2 and first["shared"] >= 0.2
    assert sum(first.values()) <= elapsed
    time.sleep(0.1)
    lanes.release()
    second = lanes.spent()  # from the first call on only: the last exclusive stretch
    assert second["exclusive"] >= 0.1 and second["waiting"] == second["shared"] == 0
