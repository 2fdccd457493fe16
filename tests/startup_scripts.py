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
    fault_injection.SlowStartCPUWorker): did it start? Then rank 1 stalls STALL_S where
    rank 0 waits for it on a group that had its timeout raised during the start-up: how does
    that call end, and when?

    Where depends on the CPU. Inside a step (fault_injection's stall_rank1) when TP's
    all-reduce runs on the device group (gloo): vLLM's CPU builds without
    ``init_shm_manager`` (the AVX2 one). With it (the AVX512 builds), vLLM runs TP's
    all-reduce in its shared-memory communicator, whose wait has no timeout at all, so a
    stalled step there only ends when the stall does; the stall is then inside a
    collective_rpc instead, whose reply gather runs on the CPU group
    (fault_injection.stall_rank1_in_rpc)."""
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
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    # rank 0 is in this process (an in-process engine)
    shm = isinstance(get_tp_group().device_communicator.dist_module, _CPUSHMDistributed)
    result["tp_all_reduce"] = "shared memory" if shm else "device group"
    if not shm:
        Path(fault_dir, "stall_rank1").write_text(str(stall_s))
    t1 = time.monotonic()
    try:
        if shm:
            from fault_injection import stall_rank1_in_rpc

            llm.collective_rpc(stall_rank1_in_rpc, args=(stall_s,))
        else:
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
        result["stall_error"] = None
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["stall_error"] = f"{type(e).__name__}: {e}"
    result["stall_s"] = time.monotonic() - t1
    result["stall_fired"] = shm or not Path(fault_dir, "stall_rank1").exists()
    return result


if __name__ == "__main__":
    name, kwargs = sys.argv[1], json.loads(sys.argv[2])
    out = globals()[name](**kwargs)
    print("RESULT " + json.dumps(out), flush=True)
