"""Model steps the engine polls while they run (keepalive_executor/polled.py): the future's
``poll``/``wait_briefly`` with an injectable clock, the step thread, the executor's
``execute_model(non_block=True)`` on it (real StepRunner, Pacer and DriverRank around fakes,
as in test_executor_unit.py), and vLLM 0.34's own ``_wait_for_output`` driving it.
The end-to-end run on vLLM 0.32 (whose engine calls ``result()``) is test_executor_llm.py's.
"""

from __future__ import annotations

import collections
import queue
import threading
from types import SimpleNamespace

import pytest
from test_executor_unit import Clock, Trace, UnitExecutor, make_executor, so

from keepalive_executor.lifecycle import ExecutorFailedError
from keepalive_executor.polled import PolledStep, StepCaller

pytestmark = pytest.mark.fast


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps = 0

    def __call__(self) -> float:
        self.now += 0.25  # every look at the clock moves it: the deadline must end the wait
        return self.now


def test_poll_is_false_until_the_step_is_done():
    f = PolledStep()
    assert not f.poll()
    f.set_result("out")
    assert f.poll() and f.result() == "out"


def test_wait_briefly_returns_at_the_deadline_while_nothing_happens():
    clock = FakeClock()
    f = PolledStep(clock=clock)
    f.wait_briefly([], deadline=101.0)  # four looks at the clock, then past it
    assert clock.now >= 101.0 and not f.done()


def test_wait_briefly_returns_at_once_when_an_input_is_pending_or_the_step_is_done():
    clock = FakeClock()
    f = PolledStep(clock=clock)
    f.wait_briefly(["a request"], deadline=1e9)
    assert clock.now == 100.0  # never looked at the clock: returned on the pending input
    f.set_result(1)
    f.wait_briefly([], deadline=1e9)
    assert clock.now == 100.0


def test_wait_briefly_wakes_when_an_input_arrives_from_another_thread():
    f = PolledStep()  # real clock: the input thread appends while the engine waits
    pending: collections.deque = collections.deque()
    threading.Timer(0.05, pending.append, ("req",)).start()
    import time

    t0 = time.monotonic()
    f.wait_briefly(pending, deadline=t0 + 30)
    assert pending and time.monotonic() - t0 < 29  # not the deadline: the input woke it


def test_the_step_thread_makes_calls_in_order_and_delivers_errors():
    caller = StepCaller()
    seen: list[str] = []
    first = caller.submit(lambda: seen.append(threading.current_thread().name) or "a")
    second = caller.submit(lambda: 1 / 0)
    assert first.result(10) == "a" and seen == ["keepalive-engine-step"]
    with pytest.raises(ZeroDivisionError):
        second.result(10)
    caller.stop(timeout=10)
    late = caller.submit(lambda: "never")
    with pytest.raises(RuntimeError, match="shut down"):
        late.result(10)
    assert not any(t.name == "keepalive-engine-step" for t in threading.enumerate())


def _polled_executor(poll_steps: bool = True):
    trace, clock = Trace(), Clock()
    ex, channel, driver = make_executor(trace, clock, gather=None, poll_steps=poll_steps)
    return ex, trace, driver


def test_execute_model_returns_a_polled_future_and_the_step_runs_off_the_engine_thread():
    ex, trace, driver = _polled_executor()
    release = threading.Event()
    driver.worker.during_call.append(lambda: release.wait(10))
    future = ex.execute_model(so(), non_block=True)
    assert isinstance(future, PolledStep)
    assert not future.poll()  # rank 0 is still inside the step: the engine is free
    release.set()
    assert future.result(10) is None  # fused step: the sampled output waits
    assert ex.sample_tokens(None) == "sampled-0"
    # the blocking call is unchanged
    assert ex.execute_model(so(), non_block=False) is None
    assert ex.sample_tokens(None) == "sampled-0"
    assert [w for k, w in trace.events if k == "broadcast"] == ["execute_and_sample"] * 2
    ex.shutdown()


def test_a_failure_inside_a_polled_step_reaches_the_engine_through_the_future():
    ex, trace, driver = _polled_executor()
    driver.worker.raise_next = RuntimeError("rank 0's forward raised")
    future = ex.execute_model(so(), non_block=True)
    with pytest.raises(Exception, match="rank 0's forward raised"):
        future.result(10)
    assert ex.is_failed  # a model step's error on rank 0 fails the executor, as blocking
    with pytest.raises(ExecutorFailedError):
        ex.execute_model(so(), non_block=True).result(10)
    ex.shutdown()


def test_vllm_034s_wait_for_output_takes_requests_while_a_polled_step_runs():
    """vLLM's own busy-loop code, on a stand-in engine: a request that arrives while the
    step runs is handled before the step's output is returned (0.34 only)."""
    from vllm.v1.engine.core import EngineCoreProc

    from keepalive_executor import compat

    if not compat.release().engine_polls_step_futures:
        pytest.skip(f"vLLM {compat.installed_version()}'s engine does not poll step futures")
    handled: list = []
    step_done = threading.Event()
    engine = SimpleNamespace(input_queue=queue.Queue(), _deferred_inputs=[],
                             _handle_client_request=lambda *r: handled.append(r))
    future = PolledStep()
    add = next(t for t in _inputs_handled_during_step() if t.name == "ADD")

    def step() -> None:
        engine.input_queue.put((add, "request during the step"))
        # finish only once the engine has taken the request in
        for _ in range(2000):
            if handled:
                break
            step_done.wait(0.005)
        future.set_result("model output")

    threading.Thread(target=step).start()
    assert EngineCoreProc._wait_for_output(engine, future) == "model output"
    assert handled == [(add, "request during the step")], handled


def test_by_default_the_executor_polls_where_the_installed_engine_does():
    from keepalive_executor import compat

    class AsReleased(UnitExecutor):
        poll_steps = None  # KeepaliveExecutor's default: ask compat

    cfg = SimpleNamespace(scheduler_config=None, parallel_config=SimpleNamespace(
        pipeline_parallel_size=1))
    ex = object.__new__(AsReleased)
    ex.scheduler_config, ex._pp = cfg.scheduler_config, False
    assert ex._engine_polls_steps() == compat.release().engine_polls_step_futures
    # never with async scheduling or pipeline parallelism: their engine loop interleaves
    # execute_model and sample_tokens without waiting in between
    ex.poll_steps = True
    ex.scheduler_config = SimpleNamespace(async_scheduling=True)
    assert not ex._engine_polls_steps()
    ex.scheduler_config, ex._pp = None, True
    assert not ex._engine_polls_steps()


def _inputs_handled_during_step():
    from vllm.v1.engine import core

    return core._INPUTS_HANDLED_DURING_STEP


def test_without_polling_the_engine_gets_a_finished_step():
    """vLLM 0.32/0.33's engine calls ``result()`` at once: the step runs on its thread."""
    ex, trace, driver = _polled_executor(poll_steps=False)
    future = ex.execute_model(so(), non_block=True)
    assert not isinstance(future, PolledStep) and future.done()
    ex.sample_tokens(None)
    ex.shutdown()
