"""Run a command as a child subreaper would (``prctl(PR_SET_CHILD_SUBREAPER)``: systemd and
container runtimes are one), and write how every process of its tree ended.

    python tests/subreaper.py STATUS_FILE -- COMMAND ARGS...

Every descendant whose parent dies is re-parented to this process, so it can reap them all
and learn their exit statuses, which a test of "nothing outlives the API server, and the
engine exits non-zero" needs: the engine process is the API server's child, and a killed
API server cannot report it. Each reaped process is one JSON line in STATUS_FILE, appended
as it is reaped: ``{"pid": ..., "code": ..., "signal": ..., "at": <time.time()>}`` (code
None if a signal ended it). The command's own line comes first once it ends; the
subreaper exits when no child is left, with the command's exit code (128+signal if one
ended it). SIGTERM and SIGINT are passed on to the command.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    status_file, sep, *command = argv
    assert sep == "--" and command, __doc__
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: child.send_signal(s))
    own = None
    with open(status_file, "a", buffering=1) as out:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            line = {"pid": pid, "at": time.time(),
                    "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                    "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}
            if pid == child.pid:
                child.returncode = 0  # reaped here: Popen must not wait for it again
                own = line
            out.write(json.dumps(line) + "\n")
    if own is None:
        return 1
    return own["code"] if own["code"] is not None else 128 + own["signal"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
