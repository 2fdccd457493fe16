"""The target of a process started the way vLLM's front end starts its engine process
(multiprocessing, spawn or fork, the executor class among the arguments), for
tests/test_supervision.py. Imports nothing of keepalive's: a spawned child gets it only by
unpickling ``executor_class``, as vLLM's engine process does."""

from __future__ import annotations

import time


def engine_process(notes: str, executor_class: type | None = None) -> None:
    """Say it started, then wait as an engine in vLLM's handshake with its front end."""
    with open(notes, "a") as f:
        f.write("started\n")
    time.sleep(600)
