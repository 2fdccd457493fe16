"""tests/procs.py's keep_niceness: a process started in a session of its own keeps its
starter's niceness as its scheduling group's (README: a suite run under ``nice`` keeps its
test servers at that niceness)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml

HERE = Path(__file__).resolve().parent

# A starter at nice 7 opens a new session for ``cat /proc/self/autogroup``, with or without
# keep_niceness, as servers.py and run_engine.py start their servers and scripts.
STARTER = """
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from procs import keep_niceness
os.nice(7)
pre = keep_niceness if sys.argv[2] == "keep" else None
print(subprocess.run(["cat", "/proc/self/autogroup"], start_new_session=True, preexec_fn=pre,
                     capture_output=True, text=True, check=True).stdout.strip())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"),
                    reason="no autogroup scheduling on this kernel: nothing to carry")
@pytest.mark.parametrize("mode, nice", [("keep", 7), ("negative-control-plain", 0)])
def test_a_new_session_keeps_its_starters_niceness_only_with_keep_niceness(mode, nice):
    out = subprocess.run([sys.executable, "-c", STARTER, str(HERE), mode],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith(f" nice {nice}"), out
