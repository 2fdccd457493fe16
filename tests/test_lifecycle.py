"""The failure model: named states, the atomic "step running / rank failed" decision, the
step watch (pure decision and its thread) and rank 0's own thread giving up a stuck call."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keepalive_executor.driver import DriverRank
from keepalive_executor.lifecycle import (
    ExecutorFailedError,
    ExecutorState,
    Failure,
    Lifecycle,
    StepInProgress,
    StepWatch,
    WatchAction,
    decide,
)

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml

ORDER = {ExecutorState.RUNNING: 0, ExecutorState.FAILED: 1, ExecutorState.STOPPED: 2}


@given(st.lists(st.sampled_from(["enter", "exit", "fail", "stop"]), max_size=30))
def test_states_only_move_forward_and_steps_are_refused_unless_running(ops):
    life = Lifecycle(clock=lambda: 0.0)
    last = life.state
    inside = False
    for op in ops:
        if op == "enter":
            if life.state is not ExecutorState.RUNNING:
                with pytest.raises(ExecutorFailedError):
                    life.enter("x")
            elif inside:
                with pytest.raises(RuntimeError, match="began while rank 0 is inside"):
                    life.enter("x")
            elif life.state is ExecutorState.RUNNING:
                life.enter("x")
                inside = True
        elif op == "exit":
            life.exit()
            inside = False
        elif op == "fail":
            was = life.state
            failure = life.fail("boom")
            assert (failure is not None) == (was is ExecutorState.RUNNING)
        else:
            life.stop()
        assert ORDER[life.state] >= ORDER[last]
        last = life.state
    if life.failure is not None:
        assert life.is_failed and "boom" in str(life.error())


@given(st.lists(st.sampled_from(["enter", "enter-local", "hold", "exit", "arrive", "fail"]),
                max_size=40),
       st.data())
def test_steps_in_flight_are_counted_once_each_whatever_the_order(ops, data):
    """The one count the pacer reads. The model: a step is in flight from its entry (not a
    local one) until rank 0 left it, or, once held, until its output arrived too; leaving,
    arriving in any order a give-up allows never counts a step twice nor drops one still in
    flight. A step is held at most once, as the step runner does (a pipeline step has one
    output); the model has one arrival per step."""
    from concurrent.futures import Future

    life = Lifecycle(clock=lambda: 0.0)
    inside: tuple | None = None  # (entry, local) rank 0 is inside
    model: dict[int, dict] = {}  # per entry id: {"left": bool, "held": bool, "arrived": bool}
    outputs: list[tuple[int, Future]] = []
    for op in ops:
        if op.startswith("enter") and inside is None and life.state is ExecutorState.RUNNING:
            local = op == "enter-local"
            entry = life.enter("step", local=local)
            inside = (entry, local)
            if not local:
                model[id(entry)] = {"left": False, "held": False, "arrived": False}
        elif (op == "hold" and inside is not None and not inside[1]
              and not model[id(inside[0])]["held"]):  # one output per step: one hold
            future: Future = Future()
            life.hold(inside[0], until=future)
            model[id(inside[0])]["held"] = True
            outputs.append((id(inside[0]), future))
        elif op == "exit" and inside is not None:
            life.exit()
            if not inside[1]:
                model[id(inside[0])]["left"] = True
            inside = None
        elif op == "arrive" and outputs:
            key, future = outputs.pop(data.draw(st.integers(0, len(outputs) - 1)))
            future.set_result(None)
            model[key]["arrived"] = True
        elif op == "fail":
            life.fail("rank 1 died")  # refuses new steps; steps in flight are not forgotten
        expected = sum(1 for m in model.values()
                       if not m["left"] or (m["held"] and not m["arrived"]))
        assert life.in_flight == expected, (op, model)


def test_a_step_left_before_its_hold_stays_out_of_flight():
    """After a give-up the caller may leave the step before rank 0's thread holds it: the
    hold then adds nothing (it would otherwise stay in flight forever, no keepalive again)."""
    from concurrent.futures import Future

    life = Lifecycle(clock=lambda: 0.0)
    entry = life.enter("execute_model")
    life.exit()
    future: Future = Future()
    life.hold(entry, until=future)
    assert life.in_flight == 0
    future.set_result(None)
    assert life.in_flight == 0
    # the normal order: held inside, left, then the output arrives
    entry = life.enter("execute_model")
    life.hold(entry, until=(later := Future()))
    life.exit()
    assert life.in_flight == 1
    later.set_result(None)
    assert life.in_flight == 0


def test_a_failure_captures_the_step_another_thread_is_inside():
    life = Lifecycle(clock=lambda: 5.0)
    life.enter("execute_model", 300, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("f", life.fail("rank 1 died")))
    t.start()
    t.join()
    assert out["f"].stuck.name == "execute_model" and out["f"].at == 5.0
    # reported by the step's own thread (it is leaving the step): nothing is stuck
    life2 = Lifecycle(clock=lambda: 5.0)
    life2.enter("x")
    assert life2.fail("broadcast failed").stuck is None


def _step(since=0.0, deadline=None):
    return StepInProgress("s", since, deadline)


@given(now=st.floats(0, 1000), deadline=st.none() | st.floats(0, 1000),
       at=st.floats(0, 1000), grace=st.floats(0.01, 10))
def test_watch_decision(now, deadline, at, grace):
    # nothing inside: nothing to do, wait for a change
    assert decide(now, ExecutorState.RUNNING, None, None, grace) == (WatchAction.NONE, None)
    action, wake = decide(now, ExecutorState.RUNNING, _step(deadline=deadline), None, grace)
    if deadline is None:
        assert (action, wake) == (WatchAction.NONE, None)
    elif now >= deadline:
        assert action is WatchAction.TIMEOUT
    else:
        assert (action, wake) == (WatchAction.NONE, deadline)
    failure = Failure("rank 1 died", at, _step())
    action, wake = decide(now, ExecutorState.FAILED, _step(deadline=deadline), failure, grace)
    if now >= at + grace:
        assert action is WatchAction.GIVE_UP
    else:
        assert (action, wake) == (WatchAction.NONE, at + grace)
    assert decide(now, ExecutorState.STOPPED, _step(), failure, grace)[0] is WatchAction.NONE


class Recorder:
    def __init__(self) -> None:
        self.timeouts: list[StepInProgress] = []
        self.give_ups: list[tuple[Failure, StepInProgress, float]] = []
        self.event = threading.Event()

    def on_timeout(self, step: StepInProgress) -> None:
        self.timeouts.append(step)
        self.event.set()

    def on_give_up(self, failure: Failure, step: StepInProgress) -> None:
        self.give_ups.append((failure, step, time.monotonic()))
        self.event.set()


def _fail_from_another_thread(life: Lifecycle, reason: str) -> None:
    t = threading.Thread(target=life.fail, args=(reason,))
    t.start()
    t.join()


def test_watch_gives_up_a_step_that_outlives_the_grace_and_only_then():
    life, rec = Lifecycle(), Recorder()
    watch = StepWatch(life, 0.3, rec.on_timeout, rec.on_give_up)
    watch.start()
    life.enter("execute_model")
    _fail_from_another_thread(life, "worker rank 1 died")
    assert rec.event.wait(30)
    failure, step, when = rec.give_ups[0]
    assert step.name == "execute_model" and failure.reason == "worker rank 1 died"
    assert when - failure.at >= 0.3  # never before the grace
    life.stop()
    watch.join(5)
    assert len(rec.give_ups) == 1 and not rec.timeouts


def test_negative_control_a_step_that_returns_within_the_grace_is_not_given_up():
    life, rec = Lifecycle(), Recorder()
    watch = StepWatch(life, 2.0, rec.on_timeout, rec.on_give_up)
    watch.start()
    life.enter("execute_model")
    _fail_from_another_thread(life, "worker rank 1 died")
    life.exit()  # the step was already finishing: it returns
    time.sleep(2.5)  # past the grace: a wrong watch would have given it up by now
    life.stop()
    watch.join(5)
    assert rec.give_ups == [] and rec.timeouts == []


def test_watch_fails_a_step_past_its_timeout():
    life, rec = Lifecycle(), Recorder()
    watch = StepWatch(life, 0.3, rec.on_timeout, rec.on_give_up)
    watch.start()
    life.enter("execute_model", 0.2, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")
    assert rec.event.wait(30)
    assert [s.name for s in rec.timeouts] == ["execute_model"]
    # what the executor's on_timeout does; then the stuck step is given up after the grace
    rec.event.clear()
    _fail_from_another_thread(life, "execute_model did not return")
    assert rec.event.wait(30) and len(rec.give_ups) == 1
    life.stop()
    watch.join(5)


def test_a_model_step_wakes_no_watch_and_a_shorter_deadline_does():
    """Entering and leaving a step wake the sleeping watch only when it would look too late:
    a model step's deadline (its timeout is the watch's horizon) never is; a collective_rpc
    with a shorter timeout is. (Wakes counted on the lifecycle's condition.)"""
    now = [100.0]
    life = Lifecycle(clock=lambda: now[0])
    wakes = []
    real_notify = life.cond.notify_all
    life.cond.notify_all = lambda: (wakes.append(now[0]), real_notify())  # type: ignore[method-assign]
    life.watch_looks_at = 100.0 + 300  # the watch sleeps for its horizon
    for _ in range(3):
        now[0] += 1
        life.enter("execute_model", 300, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")
        life.exit()
    assert wakes == []
    life.enter("collective_rpc('check_health')", 10, "the call's timeout")
    assert wakes == [103.0]
    life.exit()
    life.watch_looks_at = None  # the watch waits to be woken: any deadline wakes it
    life.enter("execute_model", 300, "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")
    assert wakes == [103.0, 103.0]
    life.exit()
    life.fail("rank 1 died")  # a failure always wakes it
    assert len(wakes) == 3


def test_driver_thread_abandon_fails_the_stuck_call_and_every_later_one():
    """Rank 0's calls run on the driver's thread, so a call stuck in a collective can be
    given up without ending the process."""
    driver = DriverRank()
    assert driver.run(lambda: threading.current_thread().name) == "keepalive-driver"
    stuck = threading.Event()
    outcome: list = []

    def caller() -> None:
        try:
            driver.run(lambda: (stuck.set(), threading.Event().wait()))
        except ExecutorFailedError as e:
            outcome.append(e)

    t = threading.Thread(target=caller, daemon=True)
    t.start()
    assert stuck.wait(10)
    assert driver.abandon(ExecutorFailedError("rank 1 died; rank 0 stuck"))
    t.join(10)
    assert not t.is_alive() and "rank 0 stuck" in str(outcome[0])
    with pytest.raises(ExecutorFailedError, match="rank 0 stuck"):
        driver.run(lambda: 1)
