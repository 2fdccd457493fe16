"""Two lanes for the serial phase: two pytest workers share the machine, and a test's measured
moments still have it to themselves.

scripts/test.sh runs the `serial` tests that are neither `timers` nor `heavy` in two
pytest-xdist workers and points ``KEEPALIVE_SERIAL_LANES`` at a lock file both open. A worker
holds the lock exclusively from its first test on: whatever its tests do runs with no other
test doing anything but what its own idle servers do (a keepalive every interval, a
heartbeat). It gives exclusivity up only inside an *overlappable* region, where it holds the
lock shared: two such regions, one per worker, may run at once; an exclusive holder never
runs beside either.

The regions are the waits for a server's start-up (``Server.wait_ready`` and its subclasses'
own; conftest.py wraps them when the lanes are on), a test's idle periods (``idle``), and the
whole of a test marked ``overlappable`` (pytest marker) but for its measured windows
(``alone``): a test whose claims hold on a busy machine (answers equal to mp's, surviving an
idle of two collective timeouts with a keepalive every quarter of one) but for a reaction
time, which it measures alone. A
start-up measures nothing here: its collectives run under the start-up timeout
(keepalive_executor/startup_timeouts.py), and one start-up keeps about one core of the two
busy (its processes import vLLM one after another), so two side by side take about as long as
one. A start-up in a script (``run_script``) is a region only through ``start_up_in_region``
(the script calls ``handoff.started()`` once its engine is up): a test whose claim is about
its start-up does not use it. A cached reference that runs live (its key does not match
this machine: a CPU without its own variant, a changed script) runs alone, in whatever test
asks for it (tests/reaping.py, ``run_reference``): it measures mp, as a test's windows do.
When a region ends, the worker waits for exclusivity again before its test goes on: the
servers it started idle meanwhile, which a keepalive server survives by design and which a
negative control (no keepalives) may not (test_serve.py's and test_pipeline.py's controls
allow for it). By design means while its threads get a core: scripts/test.sh turns Linux's
autogroup scheduling off for the run, under which a busy server's session kept an idle one
beside it off CPU 0 for up to 26.5 s here, past a 5 s collective timeout (docs/usage.md).

Fairness: flock converts a lock by dropping it and taking it again, and grants it to whoever
asks first, so a worker that goes from region to test to region could keep the lock for good
while the other waits. Every acquisition therefore queues first on a second lock, the
turnstile, which a worker waiting for exclusivity keeps until it has it: the other worker
cannot take the main lock again in any mode meanwhile, so the two take turns.

A guest (``KEEPALIVE_LANES_GUEST`` set beside ``KEEPALIVE_SERIAL_LANES``: the no-engine
tier on vLLM 0.33 and 0.34, a pytest session of another venv, whose tests assert no time
bound) holds the lock shared for each of its tests and for its collection, and nothing
between them: it runs beside regions, fills the CPU they leave idle, and never runs while a
lane holds the machine. A lane that waits for the machine waits at most for the guest's test
in progress (the turnstile keeps the guest from starting another meanwhile).

Without ``KEEPALIVE_SERIAL_LANES`` (any other run, and the scripts that compute the cached
references) nothing here takes a lock.
"""

from __future__ import annotations

import fcntl
import functools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import handoff

__all__ = ["ENV", "GUEST_ENV", "active", "guest", "hold", "release", "start_test", "visit",
           "leave", "overlappable", "alone", "wrap", "idle", "start_up_in_region", "spent"]

ENV = "KEEPALIVE_SERIAL_LANES"
GUEST_ENV = "KEEPALIVE_LANES_GUEST"

#: no wait for the lock is longer than a whole serial phase: past it, something holds it that
#: never lets go, and the run fails saying so instead of hanging
WAIT_LIMIT_S = handoff.WAIT_LIMIT_S

_mutex = threading.Lock()
#: the descriptors of the main lock and the turnstile once held; the mode held; how many
#: regions this process is inside (threads: a fixture starts several servers at once from a
#: thread pool; the test itself, if marked overlappable); whether a window is alone
#: (and since when the current mode has been held or waited for: 0 when neither)
_state: dict[str, Any] = {"fd": None, "turn": None, "mode": None, "regions": 0,
                          "alone": False, "since": 0.0}
#: seconds spent since the last ``spent()``: holding the lock exclusively, holding it shared,
#: waiting for it (what scripts/suite_cpu.py reports per test)
_spent: dict[str, float] = {"exclusive": 0.0, "shared": 0.0, "waiting": 0.0}
_NAMES = {fcntl.LOCK_EX: "exclusive", fcntl.LOCK_SH: "shared"}


def active() -> bool:
    return bool(os.environ.get(ENV))


def guest() -> bool:
    return active() and bool(os.environ.get(GUEST_ENV))


def _lane() -> bool:
    """Whether this process is a lane with the lock open (regions and windows are a lane's:
    in a guest, or without the lanes, they take nothing)."""
    return _state["fd"] is not None and not guest()


def _flock(fd: int, mode: int) -> None:
    """flock, waiting at most WAIT_LIMIT_S (polled: a blocking flock cannot time out)."""
    deadline = time.monotonic() + WAIT_LIMIT_S
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"lanes: the other lane held {os.environ[ENV]} for "
                                   f"{WAIT_LIMIT_S:.0f} s") from None
            time.sleep(0.02)


def _ensure(mode: int) -> None:
    """Hold the main lock in ``mode``: queue on the turnstile, take it, leave the turnstile.
    Waiting for exclusivity keeps the turnstile, so the other worker cannot slip in again
    meanwhile. (Called with _mutex held, or before any other thread uses the lanes.)"""
    fd, turn = _state["fd"], _state["turn"]
    if fd is None or _state["mode"] == mode:
        return
    fcntl.flock(fd, fcntl.LOCK_UN)
    _account(None)
    _flock(turn, fcntl.LOCK_EX)
    try:
        _flock(fd, mode)
    finally:
        fcntl.flock(turn, fcntl.LOCK_UN)
    _account(mode)


def _account(mode: int | None) -> None:
    """The mode changes to ``mode`` (None: not held, waiting or between a guest's tests):
    the time in the mode before is added up."""
    now = time.monotonic()
    before = _state["mode"]
    if before is not None:
        _spent[_NAMES[before]] += now - _state["since"]
    elif _state["fd"] is not None and _state["since"] and mode is not None:
        _spent["waiting"] += now - _state["since"]
    _state.update(mode=mode, since=now)


def spent() -> dict[str, float]:
    """The seconds held exclusively, held shared and waited for since the last call (a test's,
    when conftest calls it at each test's end), which start again from zero."""
    with _mutex:
        if _state["fd"] is not None:
            _account(_state["mode"])
        out = dict(_spent)
        for k in _spent:
            _spent[k] = 0.0
        return out


def hold() -> None:
    """Open the lock files and take the lock exclusively (before this process's first test);
    it is held until ``release`` after its last test, or until the process exits."""
    if not active() or guest() or _state["fd"] is not None:
        return
    _open()
    _ensure(fcntl.LOCK_EX)


def _open() -> None:
    path = os.environ[ENV]
    _state["fd"] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    _state["turn"] = os.open(path + ".turnstile", os.O_RDWR | os.O_CREAT, 0o600)


def visit() -> None:
    """A guest's turn (its collection, each of its tests): the lock held shared, taken in
    turn behind a lane that waits for the machine."""
    if not guest():
        return
    with _mutex:
        if _state["fd"] is None:
            _open()
        _ensure(fcntl.LOCK_SH)


def leave() -> None:
    """Between a guest's turns: nothing held, so a lane waiting for the machine takes it."""
    if not guest():
        return
    with _mutex:
        if _state["fd"] is not None and _state["mode"] is not None:
            fcntl.flock(_state["fd"], fcntl.LOCK_UN)
            _account(None)
            _state["since"] = 0.0  # not held, and not waiting either


def release() -> None:
    """Give the machine up for good (after this process's last test)."""
    if _state["fd"] is not None:
        _account(None)
        _state["since"] = 0.0
    for name in ("fd", "turn"):
        if _state[name] is not None:
            os.close(_state[name])
            _state[name] = None
    _state.update(mode=None, regions=0, alone=False)


def start_test(overlappable_test: bool) -> None:
    """Before a test's set-up: a test marked overlappable is a region until the next test
    starts (no exclusive turn in between when that one is overlappable too); any other holds
    the lock exclusively but in its own regions."""
    if guest():
        return
    with _mutex:
        _state["regions"] = 1 if overlappable_test else 0
        _ensure(fcntl.LOCK_SH if overlappable_test else fcntl.LOCK_EX)


@contextmanager
def overlappable() -> Iterator[None]:
    """A region that may run beside the other worker's region (the lock held shared). Entering
    waits while the other worker holds the lock exclusively; leaving waits until its region,
    if it is in one, has ended."""
    if not _lane():
        yield
        return
    with _mutex:
        _state["regions"] += 1
        if not _state["alone"]:
            _ensure(fcntl.LOCK_SH)
    try:
        yield
    finally:
        with _mutex:
            _state["regions"] -= 1
            if _state["regions"] == 0 and not _state["alone"]:
                _ensure(fcntl.LOCK_EX)


@contextmanager
def alone() -> Iterator[None]:
    """A measured window inside a region (a test marked ``overlappable``: a reaction time, a
    kill and what follows): the machine to itself for the window's length. Entering waits
    until the other worker's region, if any, has ended; regions entered meanwhile (a server
    started in the window) stay exclusive."""
    if not _lane() or _state["alone"]:
        yield
        return
    with _mutex:
        _ensure(fcntl.LOCK_EX)
        _state["alone"] = True
    try:
        yield
    finally:
        with _mutex:
            _state["alone"] = False
            if _state["regions"] > 0:
                _ensure(fcntl.LOCK_SH)


def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run inside an overlappable region."""
    @functools.wraps(method)
    def in_region(*args: Any, **kwargs: Any) -> Any:
        with overlappable():
            return method(*args, **kwargs)
    in_region.__wrapped_by_lanes__ = True  # type: ignore[attr-defined]
    return in_region


def idle(seconds: float) -> None:
    """A test's idle period (its servers wait for work, nothing is measured until it ends)
    as an overlappable region: the other worker may start servers meanwhile. The idle lasts
    ``seconds`` at least, longer if the other's region outlasts it."""
    with overlappable():
        time.sleep(seconds)


def start_up_in_region(run: Callable[[dict[str, str]], Any]) -> Any:
    """``run(extra_env)`` starts a script whose engine, once started, calls
    ``handoff.started()``: its start-up runs in a region, and the script goes on only once
    this lane has the machine to itself again (its engine idles meanwhile, which a keepalive
    engine survives by design), which it keeps until the script has ended, in a test marked
    overlappable too. Returns what ``run`` returns. Without the lanes this only runs it."""
    if not _lane():
        return run({})
    with (tempfile.TemporaryDirectory(prefix="keepalive-handoff-") as where,
          ThreadPoolExecutor(1) as pool):
        script = pool.submit(run, {handoff.ENV: where})
        with overlappable():
            while not script.done() and not os.path.exists(os.path.join(where, handoff.STARTED)):
                time.sleep(0.05)
        with alone():  # (in a test marked overlappable too) what the script measures
            with open(os.path.join(where, handoff.GO), "w"):
                pass
            return script.result()
