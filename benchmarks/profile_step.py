"""Where a decode step's time goes, seen from the engine: the executor's execute_model and
sample_tokens per step for keepalive and mp (TP=2), and for keepalive the broadcast alone.
The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so its executor can be timed.

    python benchmarks/profile_step.py keepalive|mp          # TP=2
    python benchmarks/profile_step.py uni                   # TP=1: the floor
    python benchmarks/profile_step.py keepalive|mp --pp 2   # TP=1 x PP=2
    python benchmarks/profile_step.py keepalive-nometrics   # keepalive, /metrics off

``keepalive-nometrics`` is the keepalive executor with its /metrics counters and snapshot
writer off (tests/controls.py's NoSupervisionNoMetrics; the supervision half plays no part
in-process): ``benchmarks/metrics_overhead.py`` runs it and ``keepalive`` in alternation.

Every rank also times vLLM's own ``Worker.execute_model`` and ``Worker.sample_tokens``
(``step_timer.py``, loaded as the worker extension in every worker process, whichever executor
starts it). The model work of a step is the least of the ranks' totals (the rank that starts
last waits least in the step's all-reduce); the dispatch overhead is the step's wall time
minus that.

With ``--pp 2`` both executors run with ``-O.mode=2`` and the eager backend (vLLM 0.32's mp
cannot run PP in eager mode on CPU), and the engine keeps two batches in flight: the calls
return futures, so the wait shows where the time goes (for keepalive also the output link's
receive, on its own thread, and rank 0's own share of a step on the driver thread).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
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
    pp = int(sys.argv[sys.argv.index("--pp") + 1]) if "--pp" in sys.argv else 1
    import concurrent.futures

    from vllm import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from tiny_model import build_tiny_model

    executor: object = backend
    if backend.startswith("keepalive"):
        import torch.distributed

        from keepalive_executor.channel import BroadcastChannel
        from keepalive_executor.driver import DriverRank
        from keepalive_executor.executor import KeepaliveExecutor as Cls
        from keepalive_executor.outputs import OutputLink

        if backend == "keepalive-nometrics":
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from controls import NoSupervisionNoMetrics as Cls  # noqa: N813
            executor = Cls

        timed(BroadcastChannel, "send", "broadcast (channel.send)")
        # inside it, the asynchronous collective call itself (the channel's only one per
        # decode step on rank 0)
        timed(torch.distributed, "broadcast", "  of which dist.broadcast")
        timed(DriverRank, "run", "rank 0's part (DriverRank.run)")
        if pp > 1:
            timed(OutputLink, "recv", "output link recv (own thread)")
            timed(concurrent.futures.Future, "result", "future.result (wait)")
    elif backend == "uni":
        from vllm.v1.executor.uniproc_executor import UniProcExecutor as Cls
    else:
        from vllm.v1.executor.multiproc_executor import FutureWrapper
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor as Cls

        timed(FutureWrapper, "result", "future.result (wait)")
    timed(Cls, "execute_model", "execute_model")
    timed(Cls, "sample_tokens", "sample_tokens")
    layout = (dict(tensor_parallel_size=1, pipeline_parallel_size=pp, enforce_eager=False,
                   compilation_config={"mode": 2, "backend": "eager"}, dtype="float32")
              if pp > 1 else dict(tensor_parallel_size=2, enforce_eager=True))
    if backend == "uni":
        layout["tensor_parallel_size"] = 1
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    import step_timer

    timer_dir = tempfile.mkdtemp(prefix="profile-step-")
    os.environ["PROFILE_STEP_DIR"] = timer_dir
    llm = LLM(str(build_tiny_model()), distributed_executor_backend=executor, max_model_len=256,
              max_num_seqs=8, gpu_memory_utilization=0.2,
              worker_extension_cls="step_timer.StepTimer", **layout)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = ["Hello, my name is"] * 8
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    TIMES.clear()
    before = step_timer.read_totals(timer_dir)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = step_timer.read_totals(timer_dir)
    steps = len(TIMES["execute_model"])
    print(f"backend={backend} pp={pp} steps={steps} wall={wall * 1e3:.1f} ms "
          f"({wall / steps * 1e3:.2f} ms/step, 8 sequences x 64 tokens)")
    work = {}
    for rank in sorted(after):
        seconds = sum(s - before.get(rank, {}).get(k, (0.0, 0))[0]
                      for k, (s, _) in after[rank].items())
        work[rank] = seconds / steps
        print(f"  rank {rank}: Worker.execute_model + sample_tokens {work[rank] * 1e3:7.3f} "
              "ms/step")
    if work and pp == 1:
        model = min(work.values())
        print(f"  model work (least rank) {model * 1e3:.3f} ms/step; dispatch overhead "
              f"{(wall / steps - model) * 1e3:.3f} ms/step")
    for label, xs in TIMES.items():
        # execute_model(non_block=True) returns a future; mp's work shows up in the wait,
        # which the engine does right after, so report call time and total per step
        print(f"  {label:28s} calls={len(xs):4d} median={statistics.median(xs) * 1e3:7.3f} ms "
              f"total/step={sum(xs) / steps * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
