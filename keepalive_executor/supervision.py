"""What a supervisor (systemd, Kubernetes, Slurm, a shell) sees of a keepalive server.

Two promises that vLLM's own front end does not keep for any executor (``mp`` included):

1. **A failed executor is a failed server.** After a rank dies, vLLM's engine process ends
   and its API server shuts down in an orderly way and exits 0, so ``Restart=on-failure``
   never fires. :func:`install_exit_status` wraps ``vllm serve``'s command in the process
   that runs it (the plugin is loaded there while the command's parser is built, before the
   command is bound): the command claims a run directory (run_dir.py) for the engines it
   starts, and when it returns, if any executor of the run recorded a failure, it exits 1
   naming the reasons. A clean shutdown (SIGTERM, SIGINT) records none, and exits 0.
2. **No engine outlives the process that started it.** If the API server is killed
   (``kill -9``, the OOM killer), vLLM's engine process and its ranks go on holding their
   memory. :class:`FrontendWatch`, thread ``keepalive-frontend-watch`` in the engine
   process, waits on the front end's pid (a pidfd: no polling where Linux has one) and, when
   it is gone, fails the executor (which releases a step in flight and wakes vLLM's engine
   loop), ends the ranks this process owns at once, and ends the process itself
   ``FRONTEND_GONE_EXIT_S`` later (exit code ``ORPHANED``, as a spawned worker whose engine
   is gone) unless vLLM's error path ended it first. It does not wait for that path:
   vLLM's engine process first waits up to 5 s to tell a front end that no longer exists
   that it died (``_send_engine_dead``). The watch starts with the engine process, not with
   its executor: a front end killed while the engine starts would otherwise leave it
   waiting up to five minutes in vLLM's handshake with a front end that is gone (mp's
   engines too). An engine process that vLLM spawns imports this module while it unpickles
   its arguments (the executor class among them); one that it forks runs
   :func:`watch_front_end_early` from an ``os.register_at_fork`` hook. Until the executor
   adopts the watch (:meth:`FrontendWatch.for_this_engine`) there are no ranks to end: the
   process ends ``FRONTEND_GONE_EXIT_S`` after its front end.

A stop is not a failure. SIGTERM or SIGINT to the whole process group (Ctrl-C in a terminal,
systemd's default ``KillMode=control-group``) reaches the ranks too, and a rank that leaves
in the middle of a step fails the executor on its way down. :class:`StopSignals` notes, in the
engine process, that it was asked to stop (its handler runs before the ranks' deaths are
seen: a rank's own handler runs only once its wait on the channel returns), and from then on
a failure is logged but not recorded for the exit status.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from keepalive_executor import exit_codes, run_dir
from keepalive_executor.log import get_logger

__all__ = ["install_exit_status", "serve_with_exit_status", "StopSignals", "FrontendWatch",
           "ProcessWatch", "watch_front_end_early", "FRONTEND_GONE_EXIT_S", "POLL_S"]

logger = get_logger(__name__)

#: After the front end is gone (and the ranks ended): how long vLLM's own error path gets to
#: end the engine process before the watch ends it.
FRONTEND_GONE_EXIT_S = 1.0
#: Where no pidfd can be had: how often the watch looks at the parent's pid.
POLL_S = 0.25
_MARK = "_keepalive_exit_status"


def install_exit_status() -> bool:
    """Wrap ``vllm serve``'s command (if vLLM's CLI is loaded in this process: it is in the
    one that runs ``vllm serve``); True if it is wrapped (now or before)."""
    serve = sys.modules.get("vllm.entrypoints.cli.serve")
    command_class = getattr(serve, "ServeSubcommand", None)
    if command_class is None:
        return False
    cmd = command_class.__dict__.get("cmd")
    func = getattr(cmd, "__func__", cmd)
    if func is None:
        return False
    if getattr(func, _MARK, False):
        return True

    def wrapped(args: Any) -> None:
        code = serve_with_exit_status(lambda: func(args))
        if code != exit_codes.OK:
            raise SystemExit(code)

    setattr(wrapped, _MARK, True)
    wrapped.__doc__ = func.__doc__
    command_class.cmd = staticmethod(wrapped)
    return True


def serve_with_exit_status(run: Callable[[], Any]) -> int:
    """Run ``vllm serve``'s command as the front end of a run of its own; its exit status:
    ``FAILED`` if an executor of the run recorded a failure, else what the command ended
    with (its own exceptions propagate)."""
    pid = run_dir.claim(force=True)
    try:
        try:
            run()
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        reasons = run_dir.failures(pid)
        if reasons:
            logger.error("keepalive executor failed (%s); exiting with status %d",
                         "; ".join(reasons), exit_codes.FAILED)
            return exit_codes.FAILED
        return exit_codes.OK
    finally:
        run_dir.remove(pid)


class StopSignals:
    """Whether this process was asked to stop (SIGTERM, SIGINT) since :meth:`install`. The
    handlers in place (vLLM's engine process has its own) still run, after the note."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> bool:
        """Chain a note in front of the current handlers; False where this cannot be done
        (not the main thread: signal handlers are the main thread's)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.SIGNALS:
            previous = signal.getsignal(sig)

            def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                self.received = signum
                if callable(previous):
                    previous(signum, frame)
                elif previous == signal.SIG_DFL:  # what the default would have done
                    signal.signal(signum, signal.SIG_DFL)
                    signal.raise_signal(signum)

            signal.signal(sig, handler)
        return True


class ProcessWatch:
    """A thread that waits for process ``pid`` to end (a pidfd; polled where Linux has none)
    and then calls ``on_gone(reason)`` and ``end_ranks()`` (each if given), and ends this
    process ``exit_after_s`` later with :meth:`exit_code` unless it ended first. One way to
    stop it: :meth:`stop`. Subclasses say who ``pid`` is (:meth:`reason`) and how this
    process exits (:meth:`exit_code`)."""

    thread_name = "keepalive-process-watch"

    def __init__(self, pid: int, on_gone: Callable[[str], None] | None = None,
                 end_ranks: Callable[[], None] | None = None, *,
                 exit_after_s: float = FRONTEND_GONE_EXIT_S,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.pid = pid
        self._on_gone = on_gone
        self._end_ranks = end_ranks
        self._exit_after_s = exit_after_s
        self._exit = exit
        self._stopped = threading.Event()
        self._fd: int | None = None
        try:
            self._fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._fd = None  # polled instead (or gone already: the poll sees it at once)
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._fds_closed = False
        self._started = False
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def reason(self) -> str:
        return f"process {self.pid} is gone"

    def exit_code(self) -> int:
        return exit_codes.ORPHANED

    def adopt(self, on_gone: Callable[[str], None] | None,
              end_ranks: Callable[[], None] | None) -> None:
        """From now on, call these when the process is gone (an executor took the watch)."""
        with self._lock:
            self._on_gone, self._end_ranks = on_gone, end_ranks

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        self._thread.start()

    def stop(self) -> None:
        """The process may end from now on: that is no failure."""
        self._stopped.set()
        with self._lock:
            if not self._fds_closed:  # (the thread closes them when it ends)
                os.write(self._wake_w, b"x")

    def _still_there(self) -> bool:
        """Where no pidfd could be had: is the process still there?"""
        return run_dir.owner_alive(self.pid)

    def _gone(self) -> bool:
        """Block until the process ends (True) or :meth:`stop` (False)."""
        if self._fd is not None:
            ready, _, _ = select.select([self._fd, self._wake_r], [], [])
            return self._fd in ready and not self._stopped.is_set()
        while not self._stopped.is_set():
            if not self._still_there():
                return True
            select.select([self._wake_r], [], [], POLL_S)
        return False

    def _run(self) -> None:
        try:
            if not self._gone():
                return
        finally:
            with self._lock:
                self._fds_closed = True
                for fd in (self._fd, self._wake_r, self._wake_w):
                    if fd is not None:
                        with contextlib.suppress(OSError):
                            os.close(fd)
        reason = self.reason()
        logger.error("keepalive: %s", reason)
        with self._lock:
            on_gone, end_ranks = self._on_gone, self._end_ranks
        if on_gone is not None:
            on_gone(reason)
        if end_ranks is not None:
            end_ranks()
        # vLLM's error path (or this process's own shutdown) may end the process meanwhile
        # (this daemon thread ends with it); either way, the process does not outlive this.
        time.sleep(self._exit_after_s)
        code = self.exit_code()
        logger.error("keepalive: this process is still running %gs after that; it exits "
                     "now (exit code %d)", self._exit_after_s, code)
        self._exit(code)


class FrontendWatch(ProcessWatch):
    """Thread ``keepalive-frontend-watch`` in an engine process: ends it (and, once an
    executor adopted the watch, fails that executor and ends its ranks first) when process
    ``pid``, the front end that started it, is gone. Exit code ``ORPHANED``."""

    thread_name = "keepalive-frontend-watch"

    def reason(self) -> str:
        return (f"the process that started this engine (pid {self.pid}, vLLM's front end) "
                "is gone; this engine and its ranks end with it")

    def _still_there(self) -> bool:
        return os.getppid() == self.pid  # the front end is this process's parent

    @classmethod
    def for_this_engine(cls, on_gone: Callable[[str], None],
                        end_ranks: Callable[[], None]) -> FrontendWatch | None:
        """A watch over this process's front end, if this engine runs in a process of its
        own (the one started with the process, adopted, else a new one); None in the front
        end itself, or where the front end is another process's parent and still there."""
        early = _early_watch
        if early is not None and early.pid == run_dir.current():
            early.adopt(on_gone, end_ranks)
            return early
        pid = _front_end_to_watch()
        return None if pid is None else cls(pid, on_gone, end_ranks)


#: the watch started with this engine process (watch_front_end_early), until adopted
_early_watch: FrontendWatch | None = None


def watch_front_end_early() -> FrontendWatch | None:
    """In a process that vLLM's front end started (it exported its pid: run_dir.py), watch
    the front end from now on; nothing in any other process. Idempotent. A front end that
    is gone already (killed while this process imported what it needs: spawned, this
    process runs Python only after a second or more) is noticed at once, in a process that
    multiprocessing is spawning: the pid names no process any more. A process that merely
    inherited a stale pid is left alone."""
    global _early_watch
    if _early_watch is not None:
        return _early_watch
    pid = _front_end_to_watch()
    if pid is None:
        return None
    _early_watch = FrontendWatch(pid)
    _early_watch.start()
    return _early_watch


def _front_end_to_watch() -> int | None:
    """The front end this process must end with: its parent, if that is the run's front end;
    or a front end already gone, if this process is being spawned (by it: only the front
    end's descendants inherit its pid, and its ranks are spawned only once the engine
    watches). None anywhere else: the front end itself, a grandchild (a spawned rank, which
    its own parent watches), a process that only inherited a stale pid."""
    pid = run_dir.current()
    if pid is None or pid == os.getpid():
        return None
    if pid == os.getppid():
        return pid
    return pid if _being_spawned() and not run_dir.owner_alive(pid) else None


def drop_early_watch() -> None:
    """A negative control's executor (no supervision): stop the watch started early."""
    global _early_watch
    if _early_watch is not None:
        _early_watch.stop()
        _early_watch = None


def _being_spawned() -> bool:
    """Is this process a multiprocessing child unpickling its arguments (spawn)?"""
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _after_fork_in_child() -> None:
    global _early_watch
    _early_watch = None  # the parent's watch (its thread is not in this process)
    watch_front_end_early()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# a spawned engine process imports this module while it unpickles its arguments
watch_front_end_early()
