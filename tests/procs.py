"""Process accounting for tests and benchmarks: what is still running, and of whose."""

from __future__ import annotations

import os
import time

import psutil

__all__ = ["session_processes", "alive", "left_after", "tagged_processes", "name_of",
           "keep_niceness"]


def keep_niceness() -> None:
    """``preexec_fn`` of a process started in a session of its own: carry this process's
    niceness into the new session's scheduling group. With Linux's autogroup scheduling
    (``/proc/sys/kernel/sched_autogroup_enabled``) every session is a group of its own that
    competes for the CPU at nice 0 whatever its processes' niceness, so without this the
    servers of a suite run at low priority (``nice -n 19 bash scripts/test.sh`` on a shared
    machine) would take as much CPU as anything else. At nice 0 it changes nothing; without
    autogroups, or if the write is refused, nothing changes. Only os calls: it runs between
    fork and exec."""
    try:
        fd = os.open("/proc/self/autogroup", os.O_WRONLY)
        try:
            os.write(fd, str(os.getpriority(os.PRIO_PROCESS, 0)).encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def session_processes(sid: int, wait_s: float = 15.0) -> list[psutil.Process]:
    """Processes still alive in session ``sid`` after up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def left_after(procs: list[psutil.Process], seconds: float) -> list[str]:
    """Processes of ``procs`` still running ``seconds`` from now (each may exit meanwhile)."""
    psutil.wait_procs([p for p in procs if p.is_running()], timeout=seconds)
    return alive(procs)


def alive(procs: list[psutil.Process]) -> list[str]:
    """``"pid name"`` of each process still running (zombies count as gone)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Every live process whose environment still shows ``KEEPALIVE_TEST_TAG=tag``.

    torchrun starts each rank in its own session, so a session does not find them; the
    inherited environment finds those that did not overwrite it (setproctitle does).
    """
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("KEEPALIVE_TEST_TAG") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found




def name_of(p: psutil.Process) -> str:
    """The process's name, or "?" once it is gone."""
    try:
        return p.name()
    except psutil.Error:
        return "?"
