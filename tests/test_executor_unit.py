"""The executor itself, without vLLM processes: a fake channel, a fake rank 0 and a fake reply
gather drive the real KeepaliveExecutor, StepRunner, Pacer and Lifecycle.

A hypothesis state machine issues sequences of engine calls (blocking and non-blocking steps,
fused steps, structured-output steps, collective_rpc, one from a second thread while a fused
step is open, errors on rank 0 and on other ranks, a rank failing at any point, the pacer's
thread waking at any point, also inside a step) and checks, as invariants: the pacer's
in-flight count returns to zero, no keepalive is sent inside a step, every future resolves,
the state only moves forward, and a failed executor refuses every call.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from keepalive_executor.channel import ChannelSpec, ChannelTransportError
from keepalive_executor.config import KeepaliveSettings
from keepalive_executor.executor import KeepaliveExecutor
from keepalive_executor.lifecycle import ExecutorFailedError, ExecutorState
from keepalive_executor.rpc import RpcReply, WorkerRpcError, decode_request

INTERVAL = 1.0
WORLD = 3
ORDER = {ExecutorState.RUNNING: 0, ExecutorState.FAILED: 1, ExecutorState.STOPPED: 2}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Trace:
    """What every fake saw, in order; and the model's own view of open steps."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.open_steps = 0  # per the model: broadcast sent, rank 0's part not done
        self.violations: list[str] = []
        self.lock = threading.Lock()

    def add(self, kind: str, what: str) -> None:
        with self.lock:
            self.events.append((kind, what))


class FakeChannel:
    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.send_lock = threading.RLock()
        self.closed = False
        self.break_next = False

    def bind_thread(self) -> None:
        pass

    def send(self, data: bytes) -> int:
        with self.send_lock:
            if self.closed:
                from keepalive_executor.channel import ChannelError

                raise ChannelError("closed")
            if self.break_next:
                self.break_next = False
                self.closed = True
                raise ChannelTransportError("peer gone")
            call = decode_request(data)
            self.trace.add("broadcast", call.name)
            return len(self.trace.events)

    def send_keepalive(self) -> int:
        with self.send_lock:
            if self.closed:
                from keepalive_executor.channel import ChannelError

                raise ChannelError("closed")
            if self.trace.open_steps:
                self.trace.violations.append("keepalive inside a step")
            self.trace.add("keepalive", "")
            return len(self.trace.events)

    def send_shutdown(self) -> int:
        self.trace.add("shutdown", "")
        self.closed = True
        return 0

    def close(self) -> None:
        self.closed = True


class FakeDriver:
    """Rank 0. ``fused_returns_none``: execute_model returns None (sampling pending)."""

    def __init__(self, trace: Trace, clock: Clock) -> None:
        self.trace = trace
        self.clock = clock
        self.raise_next = False
        self.during_call: list = []  # callables run inside the next local call
        self.abandoned: BaseException | None = None

    def call(self, method, args=(), kwargs=None):
        name = method if isinstance(method, str) else method.__name__
        for fn in self.during_call:
            fn()
        self.during_call = []
        if self.raise_next:
            self.raise_next = False
            self.trace.add("local", name)
            raise RuntimeError(f"injected on rank 0 in {name}")
        if callable(method):
            return method(self.worker, *args, **(kwargs or {}))
        return getattr(self.worker, name)(*args)

    @property
    def worker(self):
        """What rank 0's vLLM worker answers; records every call it gets."""
        trace = self.trace

        def execute_model(so):
            trace.add("local", "execute_model")
            return None if so.fused_none else "model-output"

        def sample_tokens(grammar):
            trace.add("local", "sample_tokens")
            return "sampled"

        def other(name):
            def fn(*a):
                trace.add("local", name)
                return f"{name}@0"
            return fn

        return SimpleNamespace(rank=0, execute_model=execute_model, sample_tokens=sample_tokens,
                               execute_dummy_batch=other("execute_dummy_batch"),
                               take_draft_token_ids=other("take_draft_token_ids"),
                               check_health=other("check_health"))

    def run(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def abandon(self, error):
        self.abandoned = error
        return True

    def shutdown_worker(self):
        pass

    def close(self, timeout=5.0):
        pass


class FakeRanks:
    init_method = "fake://"

    def kill(self) -> None:
        pass

    def stop(self, *, failed: bool):
        return {}


def echo_rank(worker, x=0):
    echo_rank.trace.add("local", "echo_rank")
    return (worker.rank, x)


class UnitExecutor(KeepaliveExecutor):
    """The real executor with fakes where processes and groups would be."""

    fakes: dict = {}

    def _init_executor(self) -> None:
        f = UnitExecutor.fakes
        self._init_state(clock=f["clock"])
        self._ranks = FakeRanks()
        self._assemble(f["settings"], f["channel"], f["driver"], f["gather"], clock=f["clock"],
                       threads=False)


def make_executor(trace: Trace, clock: Clock, gather):
    echo_rank.trace = trace
    cfg = SimpleNamespace(model_config=None, cache_config=None, lora_config=None,
                          load_config=None, parallel_config=SimpleNamespace(
                              world_size=WORLD, tensor_parallel_size=WORLD,
                              pipeline_parallel_size=1),
                          scheduler_config=None, device_config=None, speculative_config=None,
                          observability_config=None)
    channel, driver = FakeChannel(trace), FakeDriver(trace, clock)
    UnitExecutor.fakes = dict(
        clock=clock, channel=channel, driver=driver, gather=gather,
        settings=KeepaliveSettings(channel=ChannelSpec(), interval_s=INTERVAL, timeout_s=10,
                                   interval_source="test", timeout_source="test"),
    )
    return UnitExecutor(cfg), channel, driver


def so(structured: bool = False, fused_none: bool = True):
    return SimpleNamespace(has_structured_output_requests=structured, fused_none=fused_none)


class ExecutorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.trace = Trace()
        self.clock = Clock()
        self.worker_error_rank: int | None = None
        self.gather_breaks = False
        self.ex, self.channel, self.driver = make_executor(self.trace, self.clock, self._gather)
        echo_rank.trace = self.trace
        self.pacer = self.ex._pacer
        self.pending_fused = False
        self.states = [self.ex.state]
        self.futures: list[Future] = []
        self.callbacks_fired = 0
        self.failed_reason: str | None = None
        self.callback_calls = 0
        self.ex.register_failure_callback(self._on_failure)

    def _on_failure(self) -> None:
        self.callback_calls += 1

    def _gather(self, mine: RpcReply, timeout_s):
        if self.gather_breaks:
            self.gather_breaks = False
            raise RuntimeError("gloo: connection closed by peer")
        replies = [mine]
        for r in range(1, WORLD):
            if r == self.worker_error_rank:
                replies.append(RpcReply(rank=r, ok=False, error="ValueError: on purpose"))
            else:
                replies.append(RpcReply(rank=r, ok=True, value=(r, 0)))
        self.worker_error_rank = None
        return replies

    # -- helpers -------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self.ex.state is not ExecutorState.RUNNING

    def _tick_inside(self) -> None:
        """The pacer's thread wakes up in the middle of rank 0's part of a step, late."""
        self.clock.now += 5 * INTERVAL
        self.pacer.tick()

    def _fail_from_monitor(self, reason: str) -> None:
        """A rank's death is reported by the executor's monitor thread, not the engine's."""
        t = threading.Thread(target=self.ex._fail, args=(reason,))
        t.start()
        t.join()

    def _expect_refused(self, fn) -> None:
        with pytest.raises(ExecutorFailedError):
            fn()

    def _track(self, value):
        if isinstance(value, Future):
            assert value.done(), "a non-blocking call returned an unresolved future"
            fired = []
            value.add_done_callback(lambda f: fired.append(f))
            assert fired, "done-callback did not fire on a resolved future"
            self.futures.append(value)
            return value.result()  # raises what the call raised, as a blocking call would
        return value

    # -- rules -----------------------------------------------------------------------
    @rule(non_block=st.booleans(), tick_inside=st.booleans(), rank0_raises=st.booleans())
    @precondition(lambda self: not self.pending_fused)
    def execute_model_fused(self, non_block, tick_inside, rank0_raises):
        if self.failed:
            self._expect_refused(lambda: self._track(self.ex.execute_model(so(), non_block)))
            return
        self.trace.open_steps += 1
        if tick_inside:
            self.driver.during_call.append(self._tick_inside)
        self.driver.raise_next = rank0_raises
        if rank0_raises:
            with pytest.raises(RuntimeError, match="injected on rank 0"):
                self._track(self.ex.execute_model(so(), non_block))
            self.trace.open_steps -= 1
            # the other ranks ran the step: the executor must have failed, naming the call
            assert self.ex.state is ExecutorState.FAILED
            assert "execute_model raised on rank 0" in self.ex._life.failure.reason
            return
        out = self._track(self.ex.execute_model(so(), non_block))
        assert out is None
        self.pending_fused = True  # the step stays open until sample_tokens

    @rule(non_block=st.booleans(), tick_inside=st.booleans())
    @precondition(lambda self: self.pending_fused)
    def sample_tokens_of_fused(self, non_block, tick_inside):
        if tick_inside:
            self.driver.during_call.append(self._tick_inside)
        failed_before = self.failed
        try:
            result = self._track(self.ex.sample_tokens(None, non_block))
        except ExecutorFailedError:
            assert failed_before
        else:
            assert not failed_before
            assert result == "sampled"
            # rank 0 sampled right after its forward pass, nothing on the channel between
            local = [i for i, e in enumerate(self.trace.events) if e[0] != "keepalive"]
            assert [self.trace.events[i] for i in local[-2:]] == [
                ("local", "execute_model"), ("local", "sample_tokens")]
        finally:
            self.pending_fused = False
            self.trace.open_steps -= 1

    @rule(non_block=st.booleans())
    @precondition(lambda self: not self.pending_fused)
    def structured_output_step(self, non_block):
        """Not fused: execute_model and sample_tokens are two broadcasts."""
        if self.failed:
            self._expect_refused(lambda: self._track(self.ex.execute_model(so(True), non_block)))
            return
        self.trace.open_steps += 1
        assert self._track(self.ex.execute_model(so(True), non_block)) is None
        self.trace.open_steps -= 1
        assert self.trace.events[-2:] == [("broadcast", "execute_model"),
                                          ("local", "execute_model")]  # no local sampling
        self.trace.open_steps += 1
        assert self._track(self.ex.sample_tokens("bitmask", non_block)) == "sampled"
        self.trace.open_steps -= 1

    @rule(non_block=st.booleans(), error_rank=st.sampled_from([None, 1, 2]),
          tick_inside=st.booleans())
    @precondition(lambda self: not self.pending_fused)
    def collective_rpc(self, non_block, error_rank, tick_inside):
        if self.failed:
            self._expect_refused(lambda: self.ex.collective_rpc(echo_rank, non_block=False))
            return
        self.worker_error_rank = error_rank
        if tick_inside:
            self.driver.during_call.append(self._tick_inside)
        self.trace.open_steps += 1
        try:
            if error_rank is None:
                out = self._track(self.ex.collective_rpc(echo_rank, non_block=non_block))
                assert out == [(0, 0), (1, 0), (2, 0)]
            else:
                with pytest.raises(WorkerRpcError, match=f"failed on rank {error_rank}"):
                    self._track(self.ex.collective_rpc(echo_rank, non_block=non_block))
        finally:
            self.trace.open_steps -= 1
        assert self.ex.state is ExecutorState.RUNNING  # an error reply keeps ranks in step

    @rule()
    @precondition(lambda self: self.pending_fused and not self.failed)
    def collective_rpc_from_another_thread_waits_for_the_fused_step(self):
        """In-process users call collective_rpc from their own thread: it must not land
        between rank 0's forward pass and its sampling."""
        about_to_call = threading.Event()
        outcome: list = []

        def other() -> None:
            about_to_call.set()
            outcome.append(self.ex.collective_rpc(echo_rank, args=(7,)))

        t = threading.Thread(target=other, daemon=True)
        t.start()
        assert about_to_call.wait(10)
        time.sleep(0.05)  # room for a wrong implementation to broadcast now
        assert ("broadcast", "echo_rank") not in self.trace.events[-3:], self.trace.events[-3:]
        self.ex.sample_tokens(None)
        self.pending_fused = False
        self.trace.open_steps -= 1
        t.join(10)
        assert not t.is_alive()
        assert outcome == [[(0, 7), (1, 0), (2, 0)]]
        names = self.trace.events
        sampled = max(i for i, e in enumerate(names) if e == ("local", "sample_tokens"))
        rpc = max(i for i, e in enumerate(names) if e == ("broadcast", "echo_rank"))
        assert sampled < rpc

    @rule()
    @precondition(lambda self: self.pending_fused and not self.failed)
    def same_thread_call_while_fused_is_refused_without_failing(self):
        with pytest.raises(RuntimeError, match="call sample_tokens first"):
            self.ex.collective_rpc(echo_rank)
        assert self.ex.state is ExecutorState.RUNNING

    @rule(dt=st.floats(min_value=0, max_value=3 * INTERVAL))
    def time_passes_and_the_pacer_wakes(self, dt):
        self.clock.now += dt
        if self.pacer.state.value in ("idle", "busy"):
            self.pacer.tick()

    @rule(during_step=st.booleans())
    @precondition(lambda self: not self.failed)
    def a_rank_fails(self, during_step):
        reason = "worker rank 2 (pid 1) died unexpectedly (exit code -9)"
        if during_step and not self.pending_fused:
            # the failure arrives while rank 0 is inside the step
            seen = {}

            def fail_now():
                self._fail_from_monitor(reason)
                seen["step"] = self.ex._life.failure.stuck

            self.driver.during_call.append(fail_now)
            self.trace.open_steps += 1
            try:
                self.ex.collective_rpc(echo_rank)
            except ExecutorFailedError:
                pass
            finally:
                self.trace.open_steps -= 1
            # the failure captured the step rank 0 was inside: one atomic decision
            assert seen["step"] is not None and seen["step"].name == "echo_rank"
        else:
            self._fail_from_monitor(reason)
            if self.pending_fused:
                assert self.ex._life.failure.stuck.name == "execute_model"
        assert self.ex.state is ExecutorState.FAILED
        self.failed_reason = reason

    @rule()
    @precondition(lambda self: not self.failed and not self.pending_fused)
    def a_broadcast_breaks(self):
        self.channel.break_next = True
        with pytest.raises(ExecutorFailedError, match="broadcast of echo_rank failed"):
            self.ex.collective_rpc(echo_rank)
        assert self.ex.state is ExecutorState.FAILED

    @rule()
    @precondition(lambda self: not self.failed and not self.pending_fused)
    def the_reply_gather_breaks(self):
        self.gather_breaks = True
        with pytest.raises(ExecutorFailedError, match="gathering replies to echo_rank"):
            self.ex.collective_rpc(echo_rank)
        assert self.ex.state is ExecutorState.FAILED

    @rule()
    @precondition(lambda self: self.failed and not self.pending_fused)
    def every_call_after_a_failure_is_refused(self):
        for call in (lambda: self.ex.collective_rpc(echo_rank),
                     lambda: self.ex.execute_model(so()),
                     lambda: self.ex.execute_dummy_batch(),
                     lambda: self.ex.check_health()):
            with pytest.raises(ExecutorFailedError, match="keepalive executor failed"):
                call()
        future = self.ex.execute_model(so(), non_block=True)
        assert future.done() and isinstance(future.exception(), ExecutorFailedError)

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def pacer_in_flight_is_the_open_fused_step_only(self):
        assert self.pacer.in_flight == (1 if self.pending_fused else 0)

    @invariant()
    def no_keepalive_inside_a_step(self):
        assert not self.trace.violations, self.trace.violations

    @invariant()
    def state_only_moves_forward(self):
        state = self.ex.state
        assert ORDER[state] >= ORDER[self.states[-1]]
        self.states.append(state)
        assert self.ex.is_failed == (self.failed_reason is not None or
                                     self.ex._life.failure is not None)

    @invariant()
    def failure_callback_called_exactly_once_when_failed(self):
        assert self.callback_calls == (1 if self.ex.is_failed else 0)

    @invariant()
    def every_future_resolved(self):
        assert all(f.done() for f in self.futures)

    def teardown(self):
        if self.pending_fused and not self.failed:
            self.ex.sample_tokens(None)
        self.ex.shutdown()
        assert self.ex.state is ExecutorState.STOPPED
        assert self.pacer.in_flight == 0
        if not self.ex.is_failed:
            assert self.trace.events[-1] == ("shutdown", "")  # SHUTDOWN is the last frame


ExecutorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                             deadline=None)
TestExecutorMachine = ExecutorMachine.TestCase


def test_keepalives_are_sent_while_idle_between_steps():
    """The machine above checks keepalives never land inside a step; this checks they are
    sent at all when idle, so that check is not vacuous."""
    trace, clock = Trace(), Clock()
    ex, channel, driver = make_executor(trace, clock, lambda mine, t: [mine] * WORLD)
    clock.now += INTERVAL
    ex._pacer.tick()
    assert trace.events[-1] == ("keepalive", "")
    ex.execute_model(so())
    clock.now += 10 * INTERVAL
    ex._pacer.tick()
    assert trace.events[-1] == ("local", "sample_tokens")  # fused step open: none sent
    ex.sample_tokens(None)
    ex._pacer.tick()
    assert trace.events[-1] == ("keepalive", "")
    ex.shutdown()


class FakeOutputs:
    """Rank 0's output receiver for pipeline steps: the test resolves the futures."""

    def __init__(self) -> None:
        self.expected: list[tuple[str, Future]] = []

    def expect(self, name: str) -> Future:
        future: Future = Future()
        self.expected.append((name, future))
        return future

    def fail_all(self, error: BaseException) -> None:
        for _, f in self.expected:
            if not f.done():
                f.set_exception(error)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def test_pipeline_steps_overlap_resolve_in_order_and_hold_the_pacer_until_their_output():
    trace, clock = Trace(), Clock()
    ex, channel, driver = make_executor(trace, clock, lambda mine, t: [mine] * WORLD)
    ex._pp, ex._outputs = True, FakeOutputs()
    pacer = ex._pacer
    # batch A: fused execute_model returns at once with a pending future; so does sample
    exec_a = ex.execute_model(so(), non_block=True)
    sample_a = ex.sample_tokens(None, non_block=True)
    assert not exec_a.done() and not sample_a.done() and pacer.in_flight == 1
    # batch B overlaps: broadcast and stage 0's part while A's output is still out
    exec_b = ex.execute_model(so(), non_block=True)
    sample_b = ex.sample_tokens(None, non_block=True)
    assert pacer.in_flight == 2
    assert [e for e in trace.events if e[0] == "broadcast"] == [
        ("broadcast", "execute_then_sample")] * 2
    clock.now += 10 * INTERVAL
    pacer.tick()  # steps in flight: no keepalive however long they take
    assert ("keepalive", "") not in trace.events
    # the last stage's outputs arrive, in order: (execute_model's, sample_tokens')
    ex._outputs.expected[0][1].set_result((None, "sampled-A"))
    assert exec_a.result() is None and sample_a.result() == "sampled-A"
    assert pacer.in_flight == 1 and not sample_b.done()
    ex._outputs.expected[1][1].set_result((None, "sampled-B"))
    assert sample_b.result() == "sampled-B" and exec_b.result() is None
    assert pacer.in_flight == 0
    pacer.tick()
    assert trace.events[-1] == ("keepalive", "")
    # a rank is lost with a step in flight: its futures fail, the pacer is released
    exec_c = ex.execute_model(so(), non_block=True)
    sample_c = ex.sample_tokens(None, non_block=True)
    threading.Thread(target=ex._fail, args=("worker rank 1 died",)).start()
    with pytest.raises(ExecutorFailedError, match="worker rank 1 died"):
        sample_c.result(timeout=10)
    assert exec_c.exception(timeout=10) is not None and pacer.in_flight == 0
    ex.shutdown()
