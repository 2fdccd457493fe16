"""Start-up scenarios of the timeouts (keepalive_executor/startup_timeouts.py), each run as its
own process by tests/test_startup_timeouts.py: ``python startup_scripts.py NAME JSON_KWARGS``
prints one line ``RESULT <json>`` at the end (tests/run_engine.py's run_script)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import handoff
from engine_scripts import PROMPTS, engine_kwargs, set_binding


def slow_profile_then_stall(model: str, timeout_s: int, stall_s: float, fault_dir: str,
                            backend: str = "keepalive") -> dict:
    """TP=2 in this process, both collective timeouts TIMEOUT_S, rank 1 reaching the
    engine's profile run KEEPALIVE_SLOW_PROFILE_S later than rank 0 (the environment;
    fault_injection.SlowStartCPUWorker): did it start? Then rank 1 stalls STALL_S inside a
    step (fault_injection's stall_rank1): how does that step end, and when?"""
    set_binding(2)
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4)
    t0 = time.monotonic()
    try:
        llm = LLM(**engine_kwargs(model, 2, backend, distributed_timeout_seconds=timeout_s,
                                  cpu_distributed_timeout_seconds=timeout_s,
                                  worker_cls="fault_injection.FaultyCPUWorker"))
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return {"started": False, "error": f"{type(e).__name__}: {e}",
                "startup_s": time.monotonic() - t0}
    result: dict = {"started": True, "startup_s": time.monotonic() - t0}
    handoff.started()  # the serial phase's lanes: what follows is measured alone
    from keepalive_executor import startup_timeouts

    result["still_raised"] = startup_timeouts.pending()
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    result["tokens"] = len(out[0].outputs[0].token_ids)
    Path(fault_dir, "stall_rank1").write_text(str(stall_s))
    t1 = time.monotonic()
    try:
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
        result["stall_error"] = None
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["stall_error"] = f"{type(e).__name__}: {e}"
    result["stall_s"] = time.monotonic() - t1
    result["stall_fired"] = not Path(fault_dir, "stall_rank1").exists()
    return result


if __name__ == "__main__":
    name, kwargs = sys.argv[1], json.loads(sys.argv[2])
    out = globals()[name](**kwargs)
    print("RESULT " + json.dumps(out), flush=True)
