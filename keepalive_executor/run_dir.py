"""The run directory: where an engine's executor tells the process that started it what it
does (its ``/metrics`` snapshot) and that it failed (the exit status).

The executor lives in vLLM's engine-core process; ``/metrics`` and the exit status belong to
the process that started the engine (the *front end*: ``vllm serve``'s API server, the
launcher of several API servers, ``python -m keepalive_executor serve``'s rank 0, or the
user's own process around an ``LLM``). The two share no memory (the engine core is a child
process), so they share a directory instead::

    <private base>/run-<front end's pid>/            mode 0700, owned by this user
        engine-<dp rank>-<engine pid>.json           the executor's snapshot (metrics.py),
                                                     replaced atomically about once a second
        failed-<engine pid>                          one line per failure reason, appended
                                                     when the executor fails

Which front end: the process that claims the run (:func:`claim`) sets ``FRONTEND_ENV`` to
its pid before any engine process starts, and every engine process inherits it. ``vllm
serve`` claims at the start of its command (supervision.py), so a server started from a
process that ran engines of its own starts a run of its own; a process that never ran the
command claims when it first resolves the executor class (an ``LLM``), unless a run is
already set. Several engines of one front end (``-dp N``) share its run; each writes its own
files.

The private base is ``$XDG_RUNTIME_DIR/keepalive-executor`` when that directory exists, else
``/tmp/keepalive-executor-<uid>``; it must be a directory owned by this user with mode 0700,
and a run directory likewise. A base that is not is refused here with a warning, never an
exception: metrics and the exit status are never a reason to fail serving.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
from collections.abc import Mapping

from keepalive_executor.log import get_logger

__all__ = ["FRONTEND_ENV", "base_dir", "claim", "current", "run_dir", "engine_snapshot_path",
           "record_failure", "failures", "remove", "owner_alive"]

logger = get_logger(__name__)

#: The front end's pid, inherited by every engine process it starts (internal: not a setting).
FRONTEND_ENV = "KEEPALIVE_EXECUTOR_FRONTEND_PID"
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _private(path: str) -> bool:
    """Whether ``path`` is a directory of this user's that nobody else can enter."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & 0o077)


def _make_private(path: str) -> bool:
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return _private(path)


def base_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """This user's private base directory (created if missing), or None (warned once)."""
    environ = os.environ if environ is None else environ
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        path = os.path.join(runtime, "keepalive-executor")
    else:
        path = os.path.join("/tmp", f"keepalive-executor-{os.getuid()}")
    try:
        if _make_private(path):
            return path
    except OSError as e:
        _warn_once(path, "keepalive: cannot create %s (%s): no /metrics series and no exit "
                   "status from the executor", path, e)
        return None
    _warn_once(path, "keepalive: %s must be a directory owned by this user with mode 700; it "
               "is not, so the executor writes no /metrics series and no exit status "
               "(fix or remove it)", path)
    return None


def _run_path(pid: int, environ: Mapping[str, str] | None = None) -> str | None:
    base = base_dir(environ)
    return None if base is None else os.path.join(base, f"run-{pid}")


def claim(*, force: bool) -> int:
    """Make this process the front end of the engines it starts from now on; returns the
    front end's pid. ``force`` False: only if no run is set in this process yet (a run
    inherited from another process is kept). A run directory this process claims afresh is
    emptied first: anything in it is from a dead process that had the same pid. Unless
    ``force`` (the caller removes it: supervision.py), it is removed when this process
    exits."""
    current_pid = current()
    if current_pid is not None and not force:
        return current_pid
    pid = os.getpid()
    os.environ[FRONTEND_ENV] = str(pid)
    if current_pid != pid:
        path = _run_path(pid)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        if not force:
            atexit.register(remove, pid)
    return pid


def current(environ: Mapping[str, str] | None = None) -> int | None:
    """The front end's pid this process belongs to, if a run is set."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ[FRONTEND_ENV])
    except (KeyError, ValueError):
        return None


def run_dir(pid: int | None = None, *, create: bool = False) -> str | None:
    """The run directory of front end ``pid`` (default: this process's run), or None if
    there is no run, no usable base, or (``create`` False) no such directory."""
    pid = current() if pid is None else pid
    if pid is None:
        return None
    path = _run_path(pid)
    if path is None:
        return None
    if create:
        try:
            if not _make_private(path):
                _warn_once(path, "keepalive: %s is not a private directory of this user; "
                           "no /metrics series or exit status from this executor", path)
                return None
        except OSError as e:
            _warn_once(path, "keepalive: cannot create %s (%s)", path, e)
            return None
    elif not _private(path):
        return None
    return path


def engine_snapshot_path(engine: str) -> str | None:
    """Where this engine process writes its snapshot (its run directory created), or None."""
    path = run_dir(create=True)
    return None if path is None else os.path.join(path, f"engine-{engine}-{os.getpid()}.json")


def record_failure(reason: str) -> None:
    """Engine side: note that the executor failed, for the front end's exit status. One
    small append, only when the executor fails; an error is logged, never raised."""
    path = run_dir(create=True)
    if path is None:
        return
    try:
        with open(os.path.join(path, f"failed-{os.getpid()}"), "a") as f:
            f.write(reason.replace("\n", " ") + "\n")
    except OSError as e:
        logger.warning("keepalive: could not record the failure in %s: %s", path, e)


def failures(pid: int | None = None) -> list[str]:
    """Front end side: every failure the engines of run ``pid`` (default: this process's)
    recorded."""
    path = run_dir(pid)
    if path is None:
        return []
    reasons: list[str] = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(path)):
            if name.startswith("failed-"):
                with contextlib.suppress(OSError), open(os.path.join(path, name)) as f:
                    reasons.extend(line.strip() for line in f if line.strip())
    return reasons


def remove(pid: int | None = None) -> None:
    """Remove the run directory of ``pid`` (default: this process's), if it is there."""
    path = run_dir(pid)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def owner_alive(pid: int) -> bool:
    """Whether process ``pid`` (an engine that wrote a file) still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
