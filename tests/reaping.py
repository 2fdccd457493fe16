"""Reap what a script run leaves behind when it fails or times out.

``run_engine.run_script`` runs a scenario script in a session of its own and, on its timeout,
kills that session. A serving scenario's script starts ``vllm serve`` in another session
(``servers.Server``, as every test server), which that kill does not reach: the script's own
``finally`` that stops the server never runs, and the server (API server, engine core,
workers) stays, holding its memory and CPU, beside every test after it.

:func:`reaped` wraps a run (``run_script``-like, called with call dicts): each call's
environment carries a tag, a watch thread notes every process of the run's tree while the
scripts live (a child's title, set by vLLM with setproctitle, can hide its environment; the
tree cannot), and whatever of it is still running when the run ends is killed. A run that
returned yet left something is an error, as ``run_script`` makes one of its own session's
leftovers.

Not imported by any scenario script or by run_engine.py: the cached references' keys
(``run_engine.reference_key``) cover those files' source, and reaping is no part of what a
reference computes.
"""

from __future__ import annotations

import functools
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import lanes
import psutil

__all__ = ["TAG_ENV", "reaped", "run_reference"]

#: the environment variable that marks a run's processes
TAG_ENV = "KEEPALIVE_RUN_TAG"
#: how often the watch notes the run's tree
POLL_S = 0.5
#: how long a run that returned may take to see its leftovers exit by themselves
GRACE_S = 15.0

T = TypeVar("T")


def _tagged(proc: psutil.Process, tag: str) -> bool:
    try:
        return proc.environ().get(TAG_ENV) == tag
    except (psutil.Error, OSError):
        return False


def _note(tag: str, seen: dict[int, psutil.Process], everywhere: bool = False) -> None:
    """Add the run's processes to ``seen``: this process's descendants that carry the tag
    (or, ``everywhere``, any process that does: an orphan is no one's descendant here), with
    all their descendants."""
    try:
        pool = (list(psutil.process_iter()) if everywhere
                else psutil.Process().children(recursive=True))
    except psutil.Error:
        return
    for proc in pool:
        if proc.pid in seen or not _tagged(proc, tag):
            continue
        try:
            family = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            family = [proc]
        for p in family:
            seen.setdefault(p.pid, p)


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:  # is_running compares the start time too: a reused pid is not ours
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()}"
    except psutil.Error:
        return f"{p.pid} ?"


def _kill(procs: list[psutil.Process]) -> list[str]:
    """SIGKILL ``procs``; wait for them; name them."""
    names = [_describe(p) for p in procs]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
    return names


def reaped(run: Callable[..., T]) -> Callable[..., T]:
    """``run`` (called with call dicts, each with an ``extra_env`` as run_script takes) with
    every process its calls start killed once it ends: at once if it raised (a timeout),
    after ``GRACE_S`` if it returned, which is then an error naming them."""

    @functools.wraps(run)
    def reaping(*calls: dict[str, Any]) -> T:
        tag = uuid.uuid4().hex
        tagged = [{**c, "extra_env": {**(c.get("extra_env") or {}), TAG_ENV: tag}}
                  for c in calls]
        seen: dict[int, psutil.Process] = {}
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(POLL_S):
                _note(tag, seen)

        watcher = threading.Thread(target=watch, name="reaping-watch", daemon=True)
        watcher.start()
        try:
            result = run(*tagged)
        except BaseException:
            stop.set()
            watcher.join()
            _note(tag, seen, everywhere=True)
            left = _kill(_running([p for pid, p in seen.items() if pid != os.getpid()]))
            if left:
                print(f"reaping: the failed run left {', '.join(left)} running: killed",
                      flush=True)
            raise
        stop.set()
        watcher.join()
        _note(tag, seen, everywhere=True)
        _, lingering = psutil.wait_procs(_running(list(seen.values())), timeout=GRACE_S)
        left = _kill(_running(lingering))
        if left:
            raise AssertionError(f"the run left {', '.join(left)} running {GRACE_S:g} s after "
                                 "it ended: killed")
        return result

    return reaping


def run_reference(reference: Any) -> dict:
    """A reference's result (``run_engine.Reference``): cached, or run live with whatever
    its script leaves behind reaped, and, in the serial phase's lanes, with the machine to
    itself (``lanes.alone``, also inside a test marked overlappable): the live run measures
    mp, some of it against a bound (what a killed rank does to its server within
    dp_scripts.EXIT_WAIT_S), as the test's own measured windows do; and its mp server is load
    the other lane's regions and the guest tier were not planned beside."""
    from run_engine import run_script

    if reference.cached is not None:
        return reference.cached
    with lanes.alone():
        return reference.result(run=reaped(lambda call: run_script(**call)))
