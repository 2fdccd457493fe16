"""How many module boundaries one engine call crosses inside keepalive_executor on rank 0.

    python benchmarks/step_crossings.py [-v]

Drives the real executor, step runner, pacer, lifecycle and driver thread on the unit tests'
fakes (tests/test_executor_unit.py: a fake channel, reply gather and vLLM worker; TP, no
pipeline) through one fused ``execute_model`` and its ``sample_tokens``, with a profile hook
on the calling thread and rank 0's driver thread. A *crossing* is a call into, or a return
back into, a package function of another module than the nearest package frame below it on
the same thread (both directions count, as a reader climbing down and back up would). The
hand-offs are the threads the call's package code ran on, beyond the calling one (each one
there and back). The fake channel decodes each payload with rpc.decode_request: that call
stands where the real channel's ``send`` is.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PKG = str(ROOT / "keepalive_executor") + "/"


def _module(frame: FrameType) -> str | None:
    name = frame.f_code.co_filename
    return name[len(PKG):] if name.startswith(PKG) else None


def _below(frame: FrameType) -> FrameType | None:
    back = frame.f_back
    while back is not None and _module(back) is None:
        back = back.f_back
    return back


def main() -> None:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import test_executor_unit as fakes

    events: list[tuple[str, str, str, str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        here = _module(frame)
        if event not in ("call", "return") or here is None:
            return
        below, thread = _below(frame), threading.current_thread().name
        if below is None:
            if event == "call":
                events.append(("entry", thread, here, frame.f_code.co_name))
        elif _module(below) != here:
            path = (f"{_module(below)} -> {here}" if event == "call"
                    else f"{here} -> {_module(below)}")
            events.append((event, thread, path, frame.f_code.co_name))

    trace, clock = fakes.Trace(), fakes.Clock()
    ex, _, driver = fakes.make_executor(trace, clock, lambda mine, t: [mine] * fakes.WORLD)
    ex.execute_model(fakes.so())  # warm-up
    ex.sample_tokens(None)
    for label, call in (("execute_model", lambda: ex.execute_model(fakes.so())),
                        ("sample_tokens", lambda: ex.sample_tokens(None))):
        events.clear()
        driver.run(sys.setprofile, profile)
        sys.setprofile(profile)
        call()
        sys.setprofile(None)
        driver.run(sys.setprofile, None)
        time.sleep(0.05)
        crossings = [e for e in events if e[0] != "entry"]
        modules = sorted({m for e in crossings for m in e[2].split(" -> ")})
        threads = {e[1] for e in events}
        print(f"{label}: {len(crossings)} crossings, {len(threads) - 1} hand-off(s) "
              f"(threads {sorted(threads)}); modules {modules}")
        if "-v" in sys.argv:
            for e in events:
                print("   ", *e)
    ex.shutdown()


if __name__ == "__main__":
    main()
