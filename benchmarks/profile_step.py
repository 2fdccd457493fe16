"""Where a decode step's time goes, seen from the engine: the executor's execute_model and
sample_tokens per step for keepalive and mp (TP=2), and for keepalive the broadcast alone.
The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so its executor can be timed.

    python benchmarks/profile_step.py keepalive|mp
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(cls: type, name: str, label: str) -> None:
    fn = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label].append(time.perf_counter() - t0)

    setattr(cls, name, wrapper)


def main() -> None:
    backend = sys.argv[1]
    from vllm import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from tiny_model import build_tiny_model

    if backend == "keepalive":
        from keepalive_executor.channel import BroadcastChannel
        from keepalive_executor.executor import KeepaliveExecutor as Cls

        timed(BroadcastChannel, "send", "broadcast (channel.send)")
    else:
        from vllm.v1.executor.multiproc_executor import FutureWrapper
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor as Cls

        timed(FutureWrapper, "result", "future.result (wait)")
    timed(Cls, "execute_model", "execute_model")
    timed(Cls, "sample_tokens", "sample_tokens")
    llm = LLM(str(build_tiny_model()), tensor_parallel_size=2, distributed_executor_backend=backend,
              enforce_eager=True, max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.2)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = ["Hello, my name is"] * 8
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    TIMES.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = len(TIMES["execute_model"])
    print(f"backend={backend} steps={steps} wall={wall * 1e3:.1f} ms "
          f"({wall / steps * 1e3:.2f} ms/step, 8 sequences x 64 tokens)")
    for label, xs in TIMES.items():
        # execute_model(non_block=True) returns a future; mp's work shows up in the wait,
        # which the engine does right after, so report call time and total per step
        print(f"  {label:28s} calls={len(xs):4d} median={statistics.median(xs) * 1e3:7.3f} ms "
              f"total/step={sum(xs) / steps * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
