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
   that it died (``_send_engine_dead``).

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
           "FRONTEND_GONE_EXIT_S", "POLL_S"]

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


class FrontendWatch:
    """Thread ``keepalive-frontend-watch``: calls ``on_gone(reason)`` once when process
    ``pid`` (this engine process's parent, the front end) ends; ``ORPHANED`` exit after
    ``exit_after_s`` if the process is still there by then (``end_ranks`` first). One way
    to stop it: :meth:`stop` (the executor's shutdown)."""

    def __init__(self, pid: int, on_gone: Callable[[str], None],
                 end_ranks: Callable[[], None], *,
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
            self._fd = None  # polled instead
        self._wake_r, self._wake_w = os.pipe()
        self._fds_lock = threading.Lock()
        self._fds_closed = False
        self._thread = threading.Thread(target=self._run, name="keepalive-frontend-watch",
                                        daemon=True)

    @classmethod
    def for_this_engine(cls, on_gone: Callable[[str], None],
                        end_ranks: Callable[[], None]) -> FrontendWatch | None:
        """A watch over this process's front end, if it is this process's parent (the
        engine runs in a process of its own); None in the front end itself."""
        pid = run_dir.current()
        if pid is None or pid == os.getpid() or pid != os.getppid():
            return None
        return cls(pid, on_gone, end_ranks)

    def start(self) -> None:
        """Start the thread (once)."""
        self._thread.start()

    def stop(self) -> None:
        """The engine is shutting down: the front end may end first, that is no failure."""
        self._stopped.set()
        with self._fds_lock:
            if not self._fds_closed:  # (the thread closes them when it ends)
                os.write(self._wake_w, b"x")

    def _gone(self) -> bool:
        """Block until the front end ends (True) or :meth:`stop` (False)."""
        if self._fd is not None:
            ready, _, _ = select.select([self._fd, self._wake_r], [], [])
            return self._fd in ready and not self._stopped.is_set()
        while not self._stopped.is_set():
            if os.getppid() != self.pid:
                return True
            ready, _, _ = select.select([self._wake_r], [], [], POLL_S)
        return False

    def _run(self) -> None:
        try:
            if not self._gone():
                return
        finally:
            with self._fds_lock:
                self._fds_closed = True
                for fd in (self._fd, self._wake_r, self._wake_w):
                    if fd is not None:
                        with contextlib.suppress(OSError):
                            os.close(fd)
        reason = (f"the process that started this engine (pid {self.pid}, vLLM's front end) "
                  "is gone; this engine and its ranks end with it")
        logger.error("keepalive: %s", reason)
        self._on_gone(reason)
        self._end_ranks()
        # vLLM's error path may end the process meanwhile (this daemon thread ends with it);
        # either way, the process does not outlive this.
        time.sleep(self._exit_after_s)
        logger.error("keepalive: the engine process is still running %gs after its front "
                     "end ended; it exits now", self._exit_after_s)
        self._exit(exit_codes.ORPHANED)
