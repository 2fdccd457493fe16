"""Times vLLM's ``Worker.execute_model`` and ``Worker.sample_tokens`` in every worker process,
whichever executor started it, for ``profile_step.py``: the model work of a step, apart from
its dispatch.

Loaded as vLLM's ``worker_extension_cls`` (``step_timer.StepTimer``), which every worker
imports whatever its executor; importing this module wraps the two methods. Each rank keeps
running totals in ``$PROFILE_STEP_DIR/rank<R>`` (one ``pwrite`` per call, a few
microseconds), which the engine process reads before and after the timed run.

With ``PROFILE_STEP_LOG=1`` as well, each rank also appends one line per call to
``$PROFILE_STEP_DIR/rank<R>.calls``: method, start and end (``time.monotonic()``, which all
processes of one machine share) and, for ``execute_model``, the step's scheduled tokens
(``profile_serve.py`` tells prefill from decode steps by it).
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.v1.worker.gpu_worker import Worker

_TOTALS = {"execute_model": [0.0, 0], "sample_tokens": [0.0, 0]}
_FD: dict[int, int] = {}
_CALLS: dict[int, Any] = {}


def _log_call(worker: Any, name: str, start: float, end: float, args: tuple) -> None:
    directory = os.environ.get("PROFILE_STEP_DIR")
    if not directory or os.environ.get("PROFILE_STEP_LOG") != "1":
        return
    f = _CALLS.get(worker.rank)
    if f is None:
        f = _CALLS[worker.rank] = open(os.path.join(directory, f"rank{worker.rank}.calls"), "a",
                                       buffering=1)
    tokens = getattr(args[0], "total_num_scheduled_tokens", -1) if args else -1
    f.write(f"{name} {start:.6f} {end:.6f} {tokens}\n")


def _record(worker: Any, name: str, seconds: float) -> None:
    total = _TOTALS[name]
    total[0] += seconds
    total[1] += 1
    directory = os.environ.get("PROFILE_STEP_DIR")
    if not directory:
        return
    fd = _FD.get(worker.rank)
    if fd is None:
        fd = _FD[worker.rank] = os.open(os.path.join(directory, f"rank{worker.rank}"),
                                        os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    line = " ".join(f"{k} {s:.9f} {n}" for k, (s, n) in _TOTALS.items())
    os.pwrite(fd, f"{line:<200}\n".encode(), 0)


def _wrap(name: str) -> None:
    fn = getattr(Worker, name)
    if getattr(fn, "_step_timer", False):
        return

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        m0 = time.monotonic()
        try:
            return fn(self, *args, **kwargs)
        finally:
            _record(self, name, time.perf_counter() - t0)
            _log_call(self, name, m0, time.monotonic(), args)

    wrapper._step_timer = True  # type: ignore[attr-defined]
    setattr(Worker, name, wrapper)


_wrap("execute_model")
_wrap("sample_tokens")


def read_totals(directory: str) -> dict[int, dict[str, tuple[float, int]]]:
    """Per rank: {method: (seconds, calls)} so far."""
    out: dict[int, dict[str, tuple[float, int]]] = {}
    for entry in os.listdir(directory):
        if not entry.startswith("rank") or entry.endswith(".calls"):
            continue
        with open(os.path.join(directory, entry)) as f:
            words = f.read().split()
        out[int(entry[4:])] = {words[i]: (float(words[i + 1]), int(words[i + 2]))
                               for i in range(0, len(words), 3)}
    return out


class StepTimer:
    """The extension class itself adds nothing: importing this module is the point."""
