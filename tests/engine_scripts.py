"""Engine-level scenarios, each run as its own process by the tests (vLLM spawns children,
binds threads and owns global state, so every engine gets a fresh interpreter).

``python engine_scripts.py NAME JSON_KWARGS`` prints one line ``RESULT <json>`` at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import handoff

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "A driver broadcasts the work;",
    "One, two, three,",
]


def engine_kwargs(model: str, tp: int, backend: str | None, **extra: Any) -> dict:
    kw = dict(
        model=model,
        tensor_parallel_size=tp,
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        gpu_memory_utilization=0.2,
        seed=0,
    )
    if backend is not None:
        kw["distributed_executor_backend"] = backend
    kw.update(extra)
    return kw


def work_frames(executor: Any) -> int:
    """How many frames rank 0 has broadcast that were not keepalives (steps, calls): the
    difference of two readings counts the broadcasts in between."""
    return executor._channel._next_seq - executor._pacer.keepalives_sent


def set_binding(tp: int) -> None:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if tp == 2 else "0"


def whoami(worker: Any) -> tuple[int, int]:
    """collective_rpc callable: (rank, pid) of the process it runs in."""
    return (worker.rank, os.getpid())


def thread_names(worker: Any) -> list[str]:
    """The threads of this rank's process (rank 0's: the engine process)."""
    import threading

    return sorted(t.name for t in threading.enumerate())


def fail_on_rank_1(worker: Any) -> int:
    """collective_rpc callable that raises on rank 1 only."""
    if worker.rank == 1:
        raise ValueError("injected failure on rank one")
    return worker.rank


def llm_generate(model: str, tp: int, backend: str | None, max_tokens: int = 24,
                 extras: bool = False, shard_dir: str | None = None) -> dict:
    """Greedy outputs of LLM; with ``extras`` also exercise collective_rpc end to end."""
    set_binding(tp)
    from vllm import LLM, SamplingParams

    # float32: vLLM would run the float32 checkpoint in bfloat16 on CPU, and bf16 rounding of
    # sums split across ranks makes greedy paths part by chance
    llm = LLM(**engine_kwargs(model, tp, backend, dtype="float32"))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    result: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if extras:
        result["whoami"] = llm.collective_rpc(whoami)
        result["main_pid"] = os.getpid()
        result["rank0_threads"] = llm.collective_rpc(thread_names)[0]
        try:
            llm.collective_rpc(fail_on_rank_1)
            result["rank1_error"] = None
        except Exception as e:  # noqa: BLE001 - the test reads the message
            result["rank1_error"] = f"{type(e).__name__}: {e}"
        # still usable after a failed rpc: same greedy answers again
        again = llm.generate(PROMPTS, params, use_tqdm=False)
        result["tokens_after_error"] = [list(o.outputs[0].token_ids) for o in again]
        if shard_dir is not None:
            llm.llm_engine.engine_core.save_sharded_state(path=shard_dir)
            result["shards"] = sorted(os.listdir(shard_dir))
    return result


def slow_start(model: str, timeout_s: int, backend: str = "keepalive") -> dict:
    """Start TP=2 with rank 1 slow to start (see fault_injection.SlowStartCPUWorker) and a
    collective timeout shorter than the delay; generate if it started."""
    set_binding(2)
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    try:
        llm = LLM(**engine_kwargs(model, 2, backend, distributed_timeout_seconds=timeout_s,
                                  worker_cls="fault_injection.SlowStartCPUWorker"))
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return {"started": False, "error": f"{type(e).__name__}: {e}",
                "elapsed_s": time.monotonic() - t0}
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    return {"started": True, "tokens": len(out[0].outputs[0].token_ids),
            "elapsed_s": time.monotonic() - t0}


def startup_death(model: str, stamp: str, backend: str = "keepalive") -> dict:
    """Start TP=2 with rank 1 dying after ALIVE, before the rendezvous (see
    fault_injection.SlowStartCPUWorker): how long after the death start-up fails, and how;
    and when after it the executor logged its failure and its give-up of rank 0's wait
    (``failed_after_death_s``, ``gave_up_after_death_s``; None if it logged none)."""
    import logging

    set_binding(2)
    from vllm import LLM

    logged: dict[str, float] = {}
    make_record = logging.getLogRecordFactory()

    def noting_moments(*args: Any, **kwargs: Any) -> logging.LogRecord:
        # the record factory, not a handler: vLLM's logging set-up during LLM() resets the
        # handlers of every logger below ``vllm``
        record = make_record(*args, **kwargs)
        if record.name.startswith("vllm.keepalive_executor"):
            text = record.getMessage()
            if text.startswith("keepalive executor failed:"):
                logged.setdefault("failed", record.created)
            elif "still inside" in text:
                logged.setdefault("gave_up", record.created)
        return record

    logging.setLogRecordFactory(noting_moments)
    try:
        LLM(**engine_kwargs(model, 2, backend,
                            worker_cls="fault_injection.SlowStartCPUWorker"))
    except Exception as e:  # noqa: BLE001 - the test reads the message
        failed_at = time.time()
        with open(stamp) as f:
            died_at = float(f.read())
        since = {f"{k}_after_death_s": logged[k] - died_at if k in logged else None
                 for k in ("failed", "gave_up")}
        return {"started": False, "error": f"{type(e).__name__}: {e}",
                "after_death_s": failed_at - died_at, **since}
    return {"started": True}


async def _stream(engine: Any, prompt: str, rid: str, max_tokens: int,
                  abort_after: int | None = None) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    chunks = 0
    async for out in engine.generate(prompt, params, request_id=rid):
        chunks += 1
        tokens = list(out.outputs[0].token_ids)
        if abort_after is not None and chunks >= abort_after:
            await engine.abort(rid)
            break
    return {"tokens": tokens, "chunks": chunks}


def async_engine(model: str, idle_s: float, timeout_s: int, transport: str = "device") -> dict:
    """AsyncLLMEngine: concurrent streams, an abort, an idle past the timeout of the group the
    channel is on (``transport``), more, shutdown."""
    set_binding(2)
    import psutil
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    timeout = ({"distributed_timeout_seconds": timeout_s} if transport == "device"
               else {"cpu_distributed_timeout_seconds": timeout_s})
    args = AsyncEngineArgs(**engine_kwargs(model, 2, "keepalive", **timeout))
    engine = AsyncLLMEngine.from_engine_args(args)
    me = psutil.Process()
    result: dict[str, Any] = {"workers_running": [
        p.name() for p in me.children(recursive=True) if "KeepaliveWorker_TP1" in p.name()]}

    async def run() -> None:
        first = await asyncio.gather(
            *[_stream(engine, p, f"a{i}", 16) for i, p in enumerate(PROMPTS)],
            _stream(engine, PROMPTS[0], "abort-me", 200, abort_after=3),
        )
        result["first"] = [r["tokens"] for r in first[:-1]]
        result["aborted_chunks"] = first[-1]["chunks"]
        before = await engine.collective_rpc(keepalives_received)
        await asyncio.sleep(idle_s)
        after = await engine.collective_rpc(keepalives_received)
        result["keepalives_during_idle"] = after[1] - before[1]  # as rank 1 saw them
        second = await asyncio.gather(
            *[_stream(engine, p, f"b{i}", 16) for i, p in enumerate(PROMPTS)]
        )
        result["second"] = [r["tokens"] for r in second]

    asyncio.run(run())
    engine.shutdown()
    deadline = time.monotonic() + 30
    while _engine_children(me) and time.monotonic() < deadline:
        time.sleep(0.2)
    result["children_left"] = _engine_children(me)
    return result


def _engine_children(me: Any) -> list[str]:
    """Descendants other than multiprocessing's resource tracker (it belongs to this
    process and exits with it; the session check in helpers.run_script covers that)."""
    out = []
    for c in me.children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
        except Exception:  # noqa: BLE001 - gone meanwhile
            continue
        if "resource_tracker" not in cmd:
            out.append(f"{c.pid} {cmd[:120]}")
    return out


def keepalives_received(worker: Any) -> int | None:
    """collective_rpc callable: the keepalives this rank's receive loop has seen (None on
    rank 0, which sends them)."""
    from keepalive_executor.worker_loop import receive_counts

    counts = receive_counts(worker)
    return None if worker.rank == 0 else counts.keepalives


def echo_len(worker: Any, data: Any) -> int:
    """collective_rpc callable: the size of what arrived."""
    return len(data)


def sleep_on_rank0(worker: Any, seconds: float) -> int:
    """collective_rpc callable: rank 0 stalls inside the call, the others return at once."""
    if worker.rank == 0:
        time.sleep(seconds)
    return worker.rank


def step_stall(model: str, short_s: float, long_s: float, cpu_timeout_s: int) -> dict:
    """A stall of rank 0 inside a call whose replies rank 1 waits for on the gloo CPU group:
    shorter than that group's timeout it is harmless; longer, it must fail clearly."""
    set_binding(2)
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model, 2, "keepalive", cpu_distributed_timeout_seconds=cpu_timeout_s))
    handoff.started()  # the serial phase's lanes: the start-up above measures nothing
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    result: dict[str, Any] = {"short": llm.collective_rpc(sleep_on_rank0, args=(short_s,))}
    result["generate_after_short"] = len(llm.generate(PROMPTS, params, use_tqdm=False))
    t0 = time.monotonic()
    try:
        llm.collective_rpc(sleep_on_rank0, args=(long_s,))
        result["long_error"] = None
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["long_error"] = f"{type(e).__name__}: {e}"
    result["long_elapsed_s"] = time.monotonic() - t0
    return result


def _driver_only_object() -> Any:
    """An object whose class exists only in this process: it pickles by reference to a
    module no other rank has, so every other rank fails to decode a call carrying it."""
    import types

    module = types.ModuleType("keepalive_driver_only")
    cls = type("OnlyHere", (), {"__module__": "keepalive_driver_only"})
    module.OnlyHere = cls
    sys.modules["keepalive_driver_only"] = module
    return cls()


def inprocess_holes(model: str, fault_dir: str, backend: str = "keepalive") -> dict:
    """One in-process engine (the user's process; VLLM_ENABLE_V1_MULTIPROCESSING=0, so
    arguments reach the executor as they are), five checks in order, the fatal one last:
    0. over-size and unpicklable collective_rpc arguments fail before anything is sent, and
       the channel stays in sync (a small one still arrives, the answers stay the same);
    1. a collective_rpc argument only rank 0 can decode: an error naming the rank, and the
       engine stays usable;
    2. collective_rpc from a second thread while the first generates: same answers, no hang;
    3. rank 0 raises inside a model step: the call fails, and every later call fails at once
       naming it (the other ranks already ran that step);
    4. shutdown after that failure, timed."""
    import threading

    set_binding(2)
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model, 2, backend, worker_cls="fault_injection.FaultyCPUWorker"))
    handoff.started()  # the serial phase's lanes: the start-up above measures nothing
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    gen = lambda: [list(o.outputs[0].token_ids)  # noqa: E731
                   for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    result: dict[str, Any] = {}
    before = gen()
    for name, arg in [("oversize", b"x" * (2 << 20)), ("unpicklable", threading.Lock())]:
        try:
            llm.collective_rpc(echo_len, args=(arg,))
            result[name] = None
        except Exception as e:  # noqa: BLE001 - the test reads the message
            result[name] = f"{type(e).__name__}: {e}"
    result["small"] = llm.collective_rpc(echo_len, args=(b"y" * 1000,))
    result["same_after_bad_input"] = gen() == before
    try:
        llm.collective_rpc(echo_len, args=([_driver_only_object()],))
        result["undecodable"] = None
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["undecodable"] = f"{type(e).__name__}: {e}"
    result["same_after_undecodable"] = gen() == before
    rpc_results: list = []
    stop = threading.Event()

    def other_thread() -> None:
        while not stop.is_set() and len(rpc_results) < 50:
            rpc_results.append([r for r, _ in llm.collective_rpc(whoami)])

    t = threading.Thread(target=other_thread)
    t.start()
    concurrent = [gen() for _ in range(3)]
    stop.set()
    t.join(60)
    result["concurrent_same"] = all(c == before for c in concurrent)
    result["concurrent_rpcs"] = len(rpc_results)
    result["concurrent_rpc_ranks_ok"] = all(r == [0, 1] for r in rpc_results)
    with open(os.path.join(fault_dir, "raise_rank0"), "w") as f:
        f.write("1")
    try:
        gen()
        result["rank0_error"] = None
    except Exception as e:  # noqa: BLE001
        result["rank0_error"] = f"{type(e).__name__}: {e}"
    t0 = time.monotonic()
    try:
        gen()
        result["next_error"] = None
    except Exception as e:  # noqa: BLE001
        result["next_error"] = f"{type(e).__name__}: {e}"
    result["next_error_s"] = time.monotonic() - t0
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    t0 = time.monotonic()
    llm.llm_engine.engine_core.shutdown()
    result["shutdown_s"] = time.monotonic() - t0
    result["worker_exit_codes"] = getattr(executor, "worker_exit_codes", None)
    return result


def rank0_fails_before_allreduce(worker: Any) -> int:
    """collective_rpc callable: rank 0 raises (an OOM, a validation error in a weight-sync
    method) before a TP all-reduce that every other rank enters."""
    import torch
    from vllm.distributed.parallel_state import get_tp_group

    if worker.rank == 0:
        raise ValueError("rank 0 refused the new weights")
    torch.distributed.all_reduce(torch.ones(1), group=get_tp_group().cpu_group)
    return worker.rank


def inprocess_rpc_errors(model: str, backend: str = "keepalive", fault_dir: str = "") -> dict:
    """One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), three checks, the fatal one
    last:
    1. a function defined in ``__main__`` after the engine started (a notebook's) runs on
       every rank, as under mp;
    2. a method every rank lacks: rank 0's error, and the engine stays usable (in step);
    3. rank 0 raises before a collective the others enter: rank 0's error reaches the caller
       at once, every later call is refused naming it, and shutdown is bounded."""
    set_binding(2)
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model, 2, backend))
    handoff.started()  # the serial phase's lanes: the start-up above measures nothing
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gen = lambda: [list(o.outputs[0].token_ids)  # noqa: E731
                   for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    result: dict[str, Any] = {}
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    before = gen()
    if backend == "keepalive":
        # one broadcast per fused decode step: count the frames of one greedy request
        steps = {"n": 0}
        execute = executor.execute_model

        def counting(*args: Any, **kwargs: Any) -> Any:
            steps["n"] += 1
            return execute(*args, **kwargs)

        executor.execute_model = counting
        mark = work_frames(executor)
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16,
                                                 ignore_eos=True), use_tqdm=False)
        result["steps"] = steps["n"]
        result["step_broadcasts"] = work_frames(executor) - mark
        executor.execute_model = execute
    main = sys.modules["__main__"].__dict__
    exec("def notebook_fn(worker):\n    return ('notebook', worker.rank)\n", main)
    try:
        result["notebook"] = llm.collective_rpc(main["notebook_fn"])
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["notebook"] = f"{type(e).__name__}: {e}"
    try:
        llm.collective_rpc("no_such_method_anywhere")
        result["missing_everywhere"] = None
    except Exception as e:  # noqa: BLE001
        result["missing_everywhere"] = f"{type(e).__name__}: {e}"
    result["same_after_missing"] = gen() == before
    t0 = time.monotonic()
    try:
        llm.collective_rpc(rank0_fails_before_allreduce, timeout=60)
        result["rank0_error"] = None
    except Exception as e:  # noqa: BLE001
        result["rank0_error"] = f"{type(e).__name__}: {e}"
    result["rank0_error_s"] = time.monotonic() - t0
    # bounded, so that an executor that hangs here (mp does: rank 1 is stuck in the
    # all-reduce) still yields its figures
    result["next_error"], result["next_error_s"] = _bounded(gen, 30)
    _, result["shutdown_s"] = _bounded(llm.llm_engine.engine_core.shutdown, 30)
    result["worker_exit_codes"] = getattr(executor, "worker_exit_codes", None)
    if "hung" in (result["next_error"] or "") or result["shutdown_s"] >= 30:
        _end_hung(result)
    return result


def _bounded(fn: Any, bound_s: float) -> tuple[str | None, float]:
    """Run ``fn`` on a daemon thread for at most ``bound_s``: (its error or None, or
    "hung ..." if it did not return; seconds)."""
    import threading

    outcome: list[str | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 - the caller reads the message
            outcome.append(f"{type(e).__name__}: {e}")

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound_s)
    took = time.monotonic() - t0
    return (outcome[0] if outcome else f"hung: no return within {bound_s:g}s"), took


def _end_hung(result: dict) -> None:
    """Print the result and end this process and its children now (a call is still hung)."""
    import psutil

    print("RESULT " + json.dumps(result), flush=True)
    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(0)


def inprocess_rank_killed(model: str, fault_dir: str, backend: str = "keepalive",
                          timeout_s: int | None = None) -> dict:
    """In the user's own process: rank 1 is SIGKILLed inside a step (rank 0 does it, see
    fault_injection ``kill_pid``). The call must fail within a bound and this process must
    live on (the executor does not own it). ``timeout_s``: the collective timeout (the
    environment may also make rank 1 slow to start, see fault_injection); the start-up's
    duration and the first answer's length are reported."""
    import psutil

    set_binding(2)
    from vllm import LLM, SamplingParams

    extra = {} if timeout_s is None else {"distributed_timeout_seconds": timeout_s}
    t0 = time.monotonic()
    llm = LLM(**engine_kwargs(model, 2, backend, worker_cls="fault_injection.FaultyCPUWorker",
                              **extra))
    started_s = time.monotonic() - t0
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    title = "KeepaliveWorker_TP1" if backend == "keepalive" else "Worker_TP1"
    [victim] = [p for p in psutil.Process().children(recursive=True) if title in p.name()]
    with open(os.path.join(fault_dir, "kill_pid"), "w") as f:
        f.write(str(victim.pid))
    result: dict[str, Any] = {"pid": os.getpid(), "started_s": started_s,
                              "first_tokens": len(first[0].outputs[0].token_ids)}
    t0 = time.monotonic()
    try:
        llm.generate(PROMPTS, params, use_tqdm=False)
        result["error"] = None
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
    result["error_s"] = time.monotonic() - t0  # the kill happens in the first step
    result["victim_killed"] = not victim.is_running() or victim.status() == "zombie"
    t0 = time.monotonic()
    try:
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
        result["later_error"] = None
    except Exception as e:  # noqa: BLE001
        result["later_error"] = f"{type(e).__name__}: {e}"
    result["later_error_s"] = time.monotonic() - t0
    return result


def pp_shutdown_in_flight(model: str, fault_dir: str, no_drain: bool = False,
                          stall_s: float = 1.5) -> dict:
    """-tp 1 -pp 2 in this process: put two batches in the pipeline as the engine's batch
    queue holds them (200-token prefills in 64-token chunks), then shut the executor down before
    their outputs arrived: rank 1 (the output rank) stalls ``stall_s`` after computing the
    first batch, before sending its output (fault_injection ``stall_after_rank1``), and
    shutdown starts once rank 0 has broadcast both batches; so both outputs are still to come
    when it starts, whatever the machine's speed. ``no_drain``: the old order (the negative
    control's executor, tests/controls.py)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    os.environ["KEEPALIVE_FAULT_DIR"] = fault_dir
    from vllm import LLM, SamplingParams

    backend = "controls.NoShutdownDrain" if no_drain else "keepalive"
    llm = LLM(**engine_kwargs(model, 1, backend, pipeline_parallel_size=2,
                              max_num_batched_tokens=64,
                              worker_cls="fault_injection.FaultyCPUWorker"))
    handoff.started()  # the serial phase's lanes: the start-up above measures nothing
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = len(llm.generate(PROMPTS[:2], params, use_tqdm=False))  # the pipeline works
    core = llm.llm_engine.engine_core.engine_core
    executor = core.model_executor
    long_prompt = {"prompt_token_ids": [(i * 7) % 500 + 3 for i in range(200)]}
    for i in range(2):
        llm.llm_engine.add_request(f"in-flight-{i}", long_prompt, params)
    with open(os.path.join(fault_dir, "stall_after_rank1"), "w") as f:
        f.write(str(stall_s))
    mark = work_frames(executor)
    core.step_with_batch_queue()  # schedules a batch and returns without waiting for it
    # a second batch, as the engine's queue (size 2) would hold it: the engine's own next
    # step would also wait for the first output, so its calls are made here instead
    second = core.scheduler.schedule()
    executor.execute_model(second, non_block=True)
    executor.sample_tokens(None, non_block=True)
    in_flight = executor._outputs.pending
    # rank 0's driver thread broadcasts each step: shut down once both are out (a step not
    # yet begun when shutdown starts is never sent, and its output never comes)
    deadline = time.monotonic() + 30
    while work_frames(executor) < mark + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    broadcast = work_frames(executor) - mark
    t0 = time.monotonic()
    executor.shutdown()
    took = time.monotonic() - t0
    codes = {w.rank: w.proc.exitcode for w in executor._ranks.workers}
    return {"before": before, "in_flight": in_flight, "batch_queue": len(core.batch_queue),
            "broadcast": broadcast, "shutdown_s": took,
            "codes": {str(k): v for k, v in codes.items()}}


if __name__ == "__main__":
    name, kwargs = sys.argv[1], json.loads(sys.argv[2])
    out = globals()[name](**kwargs)
    print("RESULT " + json.dumps(out), flush=True)
