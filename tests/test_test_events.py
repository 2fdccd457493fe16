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
        "from hypothesis import given, strategies as st\n\n\n"
        "def test_passes():\n    pass\n\n\ndef test_fails():\n    assert False\n\n\n"
        "@given(st.integers())\ndef test_property_fails(x):\n    assert x < 10\n")
    events = tmp_path / "events"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
         str(tmp_path / "test_two.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests"),
             "KEEPALIVE_TEST_EVENTS": str(events),
             "HYPOTHESIS_STORAGE_DIRECTORY": str(tmp_path / "hypothesis")})
    assert run.returncode == 1, run.stdout[-3000:]
    parsed = test_events.parse(events.read_text())
    assert [n.split("::")[-1] for n in parsed.failed] == ["test_fails", "test_property_fails"]
    assert sorted(n.split("::")[-1] for _, _, n in parsed.spans) == [
        "test_fails", "test_passes", "test_property_fails"]
    # the property's reproduction blob, as its report printed it (tests/conftest.py)
    [(name, blob)] = parsed.replays.items()
    assert name.endswith("::test_property_fails") and blob.startswith("@reproduce_failure(")
    assert blob in run.stdout
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "test_events.py"), str(events)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "test_fails: failed; ran" in out.stdout, out


def test_the_failed_tests_are_named_last_after_every_neighbour(tmp_path, capsys):
    """CI keeps the end of a log: the names of the failed tests must be the last lines, after
    the report of their neighbours (once, only the neighbours were kept: a lane's failed test
    beside the 0.34 tier's tests, whose lines filled the excerpt), each once, in the order
    they failed, with a property test's reproduction blob under its name."""
    lines = ["100.0 start .venv tests/lane.py::t", "100.5 failed .venv tests/lane.py::t"]
    for i in range(40):  # the guest tier's tests, one after the other beside it
        lines += [f"{101 + i}.0 start .venv-vllm-0.34.0 tests/test_x.py::test_{i}",
                  f"{101 + i}.5 end .venv-vllm-0.34.0 tests/test_x.py::test_{i}"]
    lines += ["150.0 end .venv tests/lane.py::t",
              "151.0 start .venv tests/prop.py::p", "152.0 failed .venv tests/prop.py::p",
              "152.0 replay .venv tests/prop.py::p\t@reproduce_failure('6.170.27', b'AXic')",
              "152.1 failed .venv tests/prop.py::p", "153.0 end .venv tests/prop.py::p"]
    events = tmp_path / "events"
    events.write_text("\n".join(lines) + "\n")
    assert test_events.main([str(events)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any("test_x.py::test_39" in line for line in out)  # the neighbours are reported...
    assert out[-4:] == [  # ...and then, last, what failed
        "test_events: 2 tests failed:",
        "test_events: FAILED tests/lane.py::t",
        "test_events: FAILED tests/prop.py::p",
        "test_events:     replay: @reproduce_failure('6.170.27', b'AXic') on the test",
    ], out[-6:]


def test_test_sh_prints_the_failed_tests_after_everything_else():
    """scripts/test.sh's whole run ends with scripts/test_events.py's report (its names last,
    above): nothing is printed after it, the phase figures included."""
    lines = [ln.strip() for ln in (REPO / "scripts" / "test.sh").read_text().splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    report = [i for i, ln in enumerate(lines) if "scripts/test_events.py" in ln]
    assert len(report) == 1, "test.sh runs test_events.py once, at its end"
    assert not [ln for ln in lines[report[0] + 1:] if "echo" in ln or "python" in ln
                or "pytest" in ln or "cat " in ln], lines[report[0]:]
