"""Hypothesis in the suite's runs (tests/conftest.py's profile): randomized in every run,
CI's included, and a failure replayable: its report carries the reproduction blob, and the
example database is the checkout's, whatever the working directory, so the next session
(the other phase, the 0.33/0.34 tier, the next run here) tries the saved failure first.
Real pytest sessions of a small property module, tests/conftest.py loaded; no engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent

PROPERTIES = """
import os
from hypothesis import given, strategies as st

def _record(name, x):
    with open(os.environ["EXAMPLES_OUT"] + "." + name, "a") as f:
        f.write(f"{x}\\n")

@given(st.integers(0, 10**9))
def test_records_what_it_is_given(x):
    _record("passes", x)

@given(st.integers(0, 10**9))
def test_fails_above_a_bound(x):
    _record("fails", x)
    assert x < 10**8
"""


def _session(tmp_path: Path, name: str, ci: bool) -> tuple[str, dict[str, list[str]]]:
    """A pytest session of PROPERTIES as the suite runs it, CI set or not, the database in
    tmp_path: (its output, the examples each test was given, in order)."""
    (tmp_path / "test_props.py").write_text(PROPERTIES)
    out = tmp_path / name
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests"),
           "EXAMPLES_OUT": str(out), "HYPOTHESIS_STORAGE_DIRECTORY": str(tmp_path / "hyp")}
    if ci:
        env["CI"] = "true"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
         str(tmp_path / "test_props.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]  # the bound fails
    return run.stdout, {t: Path(f"{out}.{t}").read_text().split() for t in ("passes", "fails")}


@pytest.mark.parametrize("ci", [True, False], ids=["CI-set", "CI-unset"])
def test_every_run_explores_anew_and_its_failure_is_replayed(tmp_path, ci):
    first, a = _session(tmp_path, "a", ci)
    second, b = _session(tmp_path, "b", ci)
    assert a["passes"] != b["passes"], "two runs gave the same examples: derandomized"
    for output in (first, second):
        assert "@reproduce_failure(" in output, output[-3000:]  # the blob, in the report
        assert "x=100000000" in output, output[-3000:]  # (shrunk)
    # the next session's first example is the failure the first one saved
    assert b["fails"][0] == "100000000", b["fails"][:5]


def test_the_example_database_is_the_checkouts_wherever_pytest_runs(tmp_path):
    """The 0.33/0.34 tier runs from another venv, a run may start elsewhere: one database."""
    show = subprocess.run(
        [sys.executable, "-c", "import conftest; from hypothesis import settings; "
                               "print(settings.default.database)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests"), "CI": "true"})
    where = REPO / ".hypothesis" / "examples"
    assert show.stdout.strip() == f"DirectoryBasedExampleDatabase(PosixPath('{where}'))", \
        show.stdout + show.stderr[-2000:]
