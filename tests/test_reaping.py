"""A stale reference run live that times out leaves nothing behind: its script starts its
mp server in a session of its own (servers.Server), which killing the script's session on
the timeout does not reach. No engine here: a script that starts such a child and hangs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest
import reaping
from reaping import reaped, run_reference
from run_engine import Reference, run_script

# a script that ends well, its child (in a session of its own) still running
LEAVES = """
import json, subprocess, sys
kw = json.loads(sys.argv[2])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)  # a log file of its own
with open(kw["pidfile"], "w") as f:
    f.write(str(child.pid))
print("RESULT {}")
"""
HANGS = """
import json, subprocess, sys, time
kw = json.loads(sys.argv[2])
# as servers.Server starts vllm serve: a session of its own; and its environment without the
# run's tag, as vLLM's engine core and workers show theirs once setproctitle has run
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"})
with open(kw["pidfile"], "w") as f:
    f.write(str(child.pid))
time.sleep(600)
"""
TIMEOUT_S = 5.0


def _stale_reference(tmp_path: Path) -> Reference:
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    call = dict(name="hangs", script=str(script), timeout=TIMEOUT_S,
                pidfile=str(tmp_path / "child.pid"))
    return Reference("hangs", call, {}, tmp_path / "hangs.json", None, ["no cached file"])


def _running_after(pidfile: Path, seconds: float) -> bool:
    """Whether the child the script named in PIDFILE still runs ``seconds`` from now (if it
    does, it is killed then)."""
    assert pidfile.exists(), f"the script started no child within {TIMEOUT_S:g} s"
    try:
        child = psutil.Process(int(pidfile.read_text()))
    except psutil.NoSuchProcess:
        return False
    _, alive = psutil.wait_procs([child], timeout=seconds)
    for p in alive:
        p.kill()
    return bool(alive)


@pytest.mark.parametrize("run", ["reaped", "negative-control-unreaped"])
def test_a_stale_reference_that_times_out_leaves_no_server(tmp_path, run):
    """The reference fixture's way (run_reference): the server is gone with the script. The
    negative control, the reference run as before (Reference.result), leaves it running."""
    ref = _stale_reference(tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        if run == "reaped":
            run_reference(ref)
        else:
            ref.result()
    if run == "reaped":
        assert not _running_after(Path(ref.call["pidfile"]), 5), \
            "the timed-out reference left its server running"
    else:  # (the child sleeps 600 s: it does not exit by itself)
        assert _running_after(Path(ref.call["pidfile"]), 1), "the control's child is gone"


def test_a_run_that_returns_but_leaves_a_process_is_an_error_naming_it(tmp_path, monkeypatch):
    """The same watch after a run that ends well: what it left is killed, and named."""
    monkeypatch.setattr(reaping, "GRACE_S", 1.0)
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    call = dict(name="leaves", script=str(script), pidfile=str(tmp_path / "child.pid"))
    with pytest.raises(AssertionError, match=r"the run left \d+ python running"):
        reaped(lambda c: run_script(**c))(call)
    assert not _running_after(Path(call["pidfile"]), 0)


def test_a_run_that_leaves_nothing_returns_its_result(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text('print("RESULT " + \'{"answer": 42}\')\n')
    started = time.monotonic()
    assert reaped(lambda c: run_script(**c))(dict(name="ok", script=str(script))) == \
        {"answer": 42}
    assert time.monotonic() - started < reaping.GRACE_S  # no grace waited for
