"""scripts/test_events.py: what ran beside a failed test, read from the events every test
writes (tests/conftest.py). A real pytest run writes the events here; nothing starts an
engine. Fast."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import test_events  # noqa: E402


def test_a_failed_test_is_named_with_what_overlapped_it_and_for_how_long():
    text = "\n".join([
        "100.0 start .venv tests/a.py::x",
        "101.0 start .venv tests/b.py::y",
        "105.0 failed .venv tests/b.py::y",
        "105.0 failed .venv tests/b.py::y",  # xdist's controller reports it again
        "106.0 end .venv tests/b.py::y",
        "106.5 start .venv-vllm-0.34.0 tests/c.py::z",
        "108.0 end .venv-vllm-0.34.0 tests/c.py::z",
        "110.0 end .venv tests/a.py::x",
        "110.1 lanes .venv tests/a.py::x\t1.0 2.0 3.0",
    ])
    events = test_events.parse(text)
    assert events.failed == ["tests/b.py::y"]
    assert events.held == {"tests/a.py::x": [1.0, 2.0, 3.0]}
    assert (106.5, 108.0, "[.venv-vllm-0.34.0] tests/c.py::z") in events.spans
    # b ran 101-106: a beside it all along, c (106.5-108) not at all
    assert test_events.beside(events) == [
        "tests/b.py::y: failed; ran 5 s, beside:",
        "         0 s to      5 s  tests/a.py::x",
    ]


def test_the_conftest_hooks_write_the_events_of_a_real_run(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "def test_passes():\n    pass\n\n\ndef test_fails():\n    assert False\n")
    events = tmp_path / "events"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
         str(tmp_path / "test_two.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests"),
             "KEEPALIVE_TEST_EVENTS": str(events)})
    assert run.returncode == 1, run.stdout[-3000:]
    parsed = test_events.parse(events.read_text())
    assert [n.split("::")[-1] for n in parsed.failed] == ["test_fails"]
    assert sorted(n.split("::")[-1] for _, _, n in parsed.spans) == ["test_fails", "test_passes"]
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "test_events.py"), str(events)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "test_fails: failed; ran" in out.stdout, out
