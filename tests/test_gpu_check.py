"""``scripts/gpu_check.sh --cpu``: the GPU check's short gloo mode, run as CI runs it, so that
the one command meant for a GPU machine cannot rot unseen. Two engine start-ups (keepalive
on each transport); mp's answers come from the cached reference serve_tp2
(tests/reference_calls.py). The negative control of its idle check (the same idle without
the pacer fails) is tests/test_serve.py's. Serial: it asserts a reaction time and starts its
ranks with a 5 s collective timeout. Overlappable (tests/lanes.py) as a whole: its reaction
bound is 30 s and its idle runs keepalives every 1.25 s against that 5 s, both far from what
another test's start-up beside it costs, and its answers are outputs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from procs import session_processes

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.overlappable
def test_the_gpu_checks_cpu_mode_runs_green_and_makes_every_check_it_promises(tmp_path):
    out = tmp_path / "gpu_check.json"
    popen = subprocess.Popen(
        ["bash", "scripts/gpu_check.sh", "--cpu", "--json", str(out), "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        stdout, _ = popen.communicate(timeout=900)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    leftovers = session_processes(popen.pid)
    for p in leftovers:
        p.kill()
    assert popen.returncode == 0, stdout[-6000:]
    assert not leftovers, f"gpu_check left {leftovers}"
    result = json.loads(out.read_text())
    checks = {c["check"]: c for c in result["checks"]}
    assert all(c["ok"] for c in checks.values())
    for promised in ("transport device (gloo): greedy answers equal mp's",
                     "idle for 3x the 5 s collective timeout, then the same answers",
                     "rank 1 killed under load",
                     "transport cpu: greedy answers equal mp's",
                     "transport cpu stops cleanly"):
        assert any(promised in name for name in checks), (promised, list(checks))
    figures = result["figures"]["keepalive TP=2, transport device (gloo)"]
    assert figures["bench"]["output_tok_s"] > 0 and figures["bench"]["median_tpot_ms"] > 0
    by_process = figures["idle"]["cpu_pct_by_process"]
    assert any("KeepaliveWorker_TP1" in name for name in by_process), by_process
    assert any("EngineCore" in name for name in by_process), by_process
    assert figures["kill"]["unhealthy_s"] is not None
    assert "| keepalive TP=2, transport device (gloo) |" in stdout  # the report's table
