"""The tests' events file (tests/conftest.py writes it when KEEPALIVE_TEST_EVENTS names it):
one line per event, ``<unix time> <what> <venv> <nodeid>``, where ``what`` is ``start`` or
``end`` (a test's set-up to its teardown), ``failed`` (a phase of it failed) or ``lanes``
(the nodeid is followed by a tab and the seconds it held the lanes' lock exclusively, shared,
and waited for it).

    python3 scripts/test_events.py EVENTS

prints, for every test that failed, the tests that ran beside it and for how long: a test that
fails only on a loaded machine is diagnosed by what loaded it. scripts/test.sh runs this when
the suite fails; scripts/suite_cpu.py reads the same file for CPU per test. Standard library
only."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Events:
    #: (start, end, test) of every test that ended
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    #: the tests that failed, in the order they failed
    failed: list[str] = field(default_factory=list)
    #: test -> [exclusive, shared, waited] seconds of the lanes' lock
    held: dict[str, list[float]] = field(default_factory=dict)


def parse(text: str) -> Events:
    """The events of ``text``; a test of another venv than ``.venv`` is named ``[venv] id``."""
    out = Events()
    started: dict[str, float] = {}
    for line in text.splitlines():
        when, what, venv, nodeid = line.split(" ", 3)
        name = nodeid if venv == ".venv" else f"[{venv}] {nodeid}"
        if what == "lanes":
            name, _, figures = name.partition("\t")
            out.held[name] = [float(f) for f in figures.split()]
        elif what == "start":
            started[name] = float(when)
        elif what == "failed":
            if name not in out.failed:
                out.failed.append(name)
        elif what == "end" and name in started:
            out.spans.append((started.pop(name), float(when), name))
    return out


def beside(events: Events) -> list[str]:
    """For each failed test, its span and every test whose span overlapped it."""
    lines = []
    for name in events.failed:
        mine = [(s, e) for s, e, n in events.spans if n == name]
        if not mine:
            lines.append(f"{name}: failed; no end recorded")
            continue
        start, end = mine[-1]
        lines.append(f"{name}: failed; ran {end - start:.0f} s, beside:")
        others = [(max(start, s), min(end, e), n) for s, e, n in events.spans
                  if n != name and s < end and e > start]
        for s, e, n in sorted(others):
            lines.append(f"    {s - start:6.0f} s to {e - start:6.0f} s  {n}")
        if not others:
            lines.append("    nothing")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    for line in beside(parse(Path(argv[0]).read_text())):
        print(f"test_events: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
