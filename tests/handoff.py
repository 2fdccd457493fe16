"""A script's side of the lanes' start-up hand-over (tests/lanes.py ``start_up_in_region``):
once its engine has started, the script says so and waits until the test's lane has the
machine to itself again, so that its start-up ran in a region and what it measures does not.
Standard library only: the engine scripts import it (it is part of their references' key)."""

from __future__ import annotations

import os
import time

__all__ = ["ENV", "STARTED", "GO", "started"]

#: the directory of one hand-over, set by the lane for the script's process
ENV = "KEEPALIVE_LANES_HANDOFF"
STARTED = "started"
GO = "go"
#: as lanes.WAIT_LIMIT_S: no wait is longer than a whole serial phase
WAIT_LIMIT_S = 3600.0


def started() -> None:
    """The engine has started: say so, and return once the lane has the machine again. Without
    a hand-over (any run but the serial phase's lanes) it returns at once."""
    where = os.environ.get(ENV)
    if not where:
        return
    with open(os.path.join(where, STARTED), "w"):
        pass
    deadline = time.monotonic() + WAIT_LIMIT_S
    while not os.path.exists(os.path.join(where, GO)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"handoff: no go in {where} after {WAIT_LIMIT_S:.0f} s")
        time.sleep(0.02)
