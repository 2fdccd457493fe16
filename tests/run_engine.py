"""Run one scenario of engine_scripts.py in a fresh interpreter and check it left nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from procs import session_processes
from servers import env

__all__ = ["HERE", "PYTHONPATH", "run_script", "run_scripts"]

HERE = Path(__file__).resolve().parent
#: tests/ on the path of every process an engine starts (fault injection, test connectors)
PYTHONPATH = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])


def run_script(name: str, timeout: float = 600, extra_env: dict | None = None,
               script: str = "engine_scripts.py", **kwargs) -> dict:
    """Run SCRIPT's NAME in a fresh interpreter; return its RESULT or fail with its log."""
    popen = subprocess.Popen(
        [sys.executable, str(HERE / script), name, json.dumps(kwargs)],
        env=env(**(extra_env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, 9)
            popen.wait()
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
    # No orphans: once the script has exited, nothing of its session may be left running.
    leftovers = session_processes(popen.pid)
    if leftovers:
        for p in leftovers:
            p.kill()
        raise AssertionError(f"{name} left processes behind: {leftovers}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(
        f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )




def run_scripts(*calls: dict) -> list[dict]:
    """Several run_script calls at once (each a dict of its arguments), results in order.
    The comparisons between executors run both engines side by side: the figures compared
    are outputs, not times, and the suite is shorter for it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(lambda c=c: run_script(**c)) for c in calls]
        return [f.result() for f in futures]
