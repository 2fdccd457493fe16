"""The tests' events file (tests/conftest.py writes it when KEEPALIVE_TEST_EVENTS names it):
one line per event, ``<unix time> <what> <venv> <nodeid>``, where ``what`` is ``start`` or
``end`` (a test's set-up to its teardown), ``failed`` (a phase of it failed), ``replay`` (the
nodeid is followed by a tab and the hypothesis reproduction blob of its failure) or ``lanes``
(the nodeid is followed by a tab and the seconds it held the lanes' lock exclusively, shared,
and waited for it).

    python3 scripts/test_events.py EVENTS

prints, for every test that failed, the tests that ran beside it and for how long: a test that
fails only on a loaded machine is diagnosed by what loaded it. Then, last, the failed tests'
names, one a line, each with its reproduction blob if it has one: CI keeps a log's last
lines, and the neighbours of a test that failed beside many can fill them. scripts/test.sh
runs this at its very end when the suite fails; scripts/suite_cpu.py reads the same file for
CPU per test. Standard library only."""

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
    #: test -> the hypothesis reproduction blob of its failure
    replays: dict[str, str] = field(default_factory=dict)


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
        elif what == "replay":
            name, _, blob = name.partition("\t")
            out.replays[name] = blob
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


#: the failed tests named at the end, at most (the rest are in the report above them)
NAMED_LAST = 20


def failed_last(events: Events) -> list[str]:
    """The failed tests, one a line (a property test's blob under it), for the log's end."""
    if not events.failed:
        return ["no test recorded a failure: the run failed outside the tests (set-up, "
                "collection, a tier's venv); see the log above"]
    shown = events.failed[:NAMED_LAST]
    lines = [f"{len(events.failed)} test{'s' if len(events.failed) > 1 else ''} failed:"]
    for name in shown:
        lines.append(f"FAILED {name}")
        if name in events.replays:
            lines.append(f"    replay: {events.replays[name]} on the test")
    if len(events.failed) > len(shown):
        lines.append(f"... and {len(events.failed) - len(shown)} more, named above")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    events = parse(Path(argv[0]).read_text())
    for line in [*beside(events), *failed_last(events)]:
        print(f"test_events: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
