"""The executor itself, without vLLM processes: a fake channel, a fake rank 0 and a fake reply
gather drive the real KeepaliveExecutor, StepRunner, Pacer and Lifecycle.

A hypothesis state machine issues sequences of engine calls (blocking and non-blocking steps,
fused steps, structured-output steps, collective_rpc, one from a second thread while a fused
step is open, errors on rank 0 and on other ranks, a rank failing at any point, the pacer's
thread waking at any point, also inside a step) and checks, as invariants: the lifecycle's
count of steps in flight (all the pacer reads of steps) returns to zero, no keepalive is
sent inside a step, every future resolves,
the state only moves forward, and a failed executor refuses every call.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.outputs import AsyncModelRunnerOutput

from keepalive_executor.channel import ChannelSpec, ChannelTransportError
from keepalive_executor.config import KeepaliveSettings
from keepalive_executor.driver import DriverRank
from keepalive_executor.executor import KeepaliveExecutor
from keepalive_executor.lifecycle import ExecutorFailedError, ExecutorState, WatchAction
from keepalive_executor.pieces import Pieces
from keepalive_executor.polled import PolledStep
from keepalive_executor.rpc import RpcReply, WorkerRpcError, decode_request

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml

INTERVAL = 1.0
GRACE = 0.5
STEP_TIMEOUT = 30.0
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
        self.step_id = 0  # bumped by the model before each fused step
        self.open_steps = 0  # per the model: broadcast sent, rank 0's part not done
        self.violations: list[str] = []
        self.lock = threading.Lock()
        self.got: list[tuple[str, str]] = []  # (async output, thread) per get_output()

    def add(self, kind: str, what: str) -> None:
        with self.lock:
            self.events.append((kind, what))

    def broadcasts(self) -> int:
        """Engine calls the channel really sent (keepalives and shutdown apart)."""
        with self.lock:
            return sum(1 for kind, _ in self.events if kind == "broadcast")


class FakeChannel:
    def __init__(self, trace: Trace, clock: Clock) -> None:
        self.trace = trace
        self.clock = clock
        self.send_lock = threading.RLock()
        self.closed = False
        self.break_next = False
        self.last_sent_at = clock()  # what the pacer reads: when the last frame went out

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
            self.last_sent_at = self.clock()
            return len(self.trace.events)

    def send_keepalive(self) -> int:
        with self.send_lock:
            if self.closed:
                from keepalive_executor.channel import ChannelError

                raise ChannelError("closed")
            if self.trace.open_steps:
                self.trace.violations.append("keepalive inside a step")
            self.trace.add("keepalive", "")
            self.last_sent_at = self.clock()
            return len(self.trace.events)

    def send_shutdown(self) -> int:
        self.trace.add("shutdown", "")
        self.closed = True
        return 0

    def close(self) -> None:
        self.closed = True


class FakeAsyncOutput(AsyncModelRunnerOutput):
    """What vLLM's GPU model runner returns under async scheduling: ``get_output()`` waits
    for the copy to the host. ``behaviour``: ``ok``; ``raises`` (the copy failed); ``late``
    (blocks until ``release`` is set). Every call is recorded with its thread."""

    def __init__(self, value: str, trace: Trace) -> None:
        self.value = value
        self.trace = trace
        self.behaviour = "ok"
        self.entered = threading.Event()
        self.release = threading.Event()

    def get_output(self):
        self.trace.got.append((self.value, threading.current_thread().name))
        self.entered.set()
        if self.behaviour == "late":
            self.release.wait(30)
        if self.behaviour == "raises":
            raise RuntimeError(f"copy of {self.value} failed")
        return self.value

    def get_kv_connector_output(self):  # abstract since vLLM 0.33
        return None


class FakeWorker:
    """Rank 0's vLLM worker, run by the real DriverRank on its real thread. ``during_call``:
    callables run inside the next call; ``raise_next``: what the next call raises."""

    rank = 0

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.during_call: list = []
        self.raise_next: BaseException | None = None
        self.async_outputs = False  # sample_tokens returns what the GPU runner does
        self.made: list[FakeAsyncOutput] = []
        self.during_sample = None  # called with each async output as it is made

    def _enter(self, name: str) -> None:
        for fn in self.during_call:
            fn()
        self.during_call = []
        if self.raise_next is not None:
            error, self.raise_next = self.raise_next, None
            self.trace.add("local", name)
            raise error

    def execute_model(self, so):
        self._enter("execute_model")
        self.trace.add("local", "execute_model")
        return None if so.fused_none else "model-output"

    def sample_tokens(self, grammar):
        self.trace.add("local", "sample_tokens")
        value = f"sampled-{self.trace.step_id}"
        if not self.async_outputs:
            return value
        out = FakeAsyncOutput(f"{value}#{len(self.made)}", self.trace)
        self.made.append(out)
        if self.during_sample is not None:
            self.during_sample(out)
        return out

    def _other(self, name: str):
        self._enter(name)
        self.trace.add("local", name)
        return f"{name}@0"

    def execute_dummy_batch(self):
        return self._other("execute_dummy_batch")

    def take_draft_token_ids(self):
        return self._other("take_draft_token_ids")

    def check_health(self):
        return self._other("check_health")

    def shutdown(self):
        pass


def make_driver(trace: Trace) -> DriverRank:
    driver = DriverRank(name="keepalive-driver-under-test")
    driver.worker = FakeWorker(trace)
    return driver


class FakeRanks:
    init_method = "fake://"

    def dump_stacks(self) -> int:
        return 0

    def kill(self) -> None:
        pass

    def stop(self, *, failed: bool):
        return {}


def echo_rank(worker, x=0):
    worker._enter("echo_rank")
    echo_rank.trace.add("local", "echo_rank")
    return (worker.rank, x)


class UnitExecutor(KeepaliveExecutor):
    """The real executor with fakes where processes and groups would be. Model steps run on
    the engine's thread (vLLM 0.32/0.33's engine), whatever vLLM is installed."""

    fakes: dict = {}
    poll_steps = False

    def _init_executor(self) -> None:
        f = UnitExecutor.fakes
        self._pp = f.get("outputs") is not None
        self._pieces = pieces = Pieces(self.parallel_config, clock=f["clock"],
                                       polls=self._engine_polls_steps())
        pieces.ranks = FakeRanks()
        pieces.outputs = f.get("outputs")  # pipeline steps' outputs (outputs.py)
        pieces.wire(f["settings"], f["channel"], f["driver"], f["gather"], clock=f["clock"],
                    threads=False)
        pieces.abort_groups = f.get("abort")  # what a give-up runs on NCCL (nccl.py)
        self._finalizer = weakref.finalize(self, lambda: None)


class PolledUnitExecutor(UnitExecutor):
    """The same, on the step path of an engine that polls (vLLM 0.34: polled.py)."""

    poll_steps = True


def make_executor(trace: Trace, clock: Clock, gather, abort=None, poll_steps: bool = False,
                  outputs=None):
    echo_rank.trace = trace
    cfg = SimpleNamespace(model_config=None, cache_config=None, lora_config=None,
                          load_config=None, parallel_config=SimpleNamespace(
                              world_size=WORLD, tensor_parallel_size=WORLD,
                              pipeline_parallel_size=1),
                          scheduler_config=None, device_config=None, speculative_config=None,
                          observability_config=None)
    channel, driver = FakeChannel(trace, clock), make_driver(trace)
    UnitExecutor.fakes = dict(
        clock=clock, channel=channel, driver=driver, gather=gather, abort=abort, outputs=outputs,
        settings=KeepaliveSettings(channel=ChannelSpec(), interval_s=INTERVAL, timeout_s=10,
                                   interval_source="test", timeout_source="test",
                                   failure_grace_s=GRACE, execute_timeout_s=STEP_TIMEOUT),
    )
    return (PolledUnitExecutor if poll_steps else UnitExecutor)(cfg), channel, driver


def so(structured: bool = False, fused_none: bool = True):
    return SimpleNamespace(has_structured_output_requests=structured, fused_none=fused_none)


RANK0_OUTCOMES = [None, "error", "interrupt"]


def injected(kind: str | None) -> BaseException | None:
    """What rank 0's worker raises: an Exception, or a BaseException that is not one."""
    if kind == "error":
        return RuntimeError("injected on rank 0")
    if kind == "interrupt":
        return KeyboardInterrupt("injected Ctrl-C on rank 0")
    return None


class ExecutorMachine(RuleBasedStateMachine):
    """The model: whether the executor must be failed (and why), the sampled output the
    engine's next ``sample_tokens`` must get, and how many broadcasts every call costs."""

    poll_steps = False  # PolledExecutorMachine: the step path of vLLM 0.34's engine

    def __init__(self) -> None:
        super().__init__()
        self.trace = Trace()
        self.clock = Clock()
        self.worker_error_rank: int | None = None
        self.gather_mode = "ok"  # ok | breaks | times-out | blocks
        self.gather_timeouts: list[float | None] = []
        self.gather_entered = threading.Event()
        self.gather_release = threading.Event()
        self.dead_rank: int | None = None
        self.aborts: list[str] = []  # threads that aborted the (fake) NCCL groups
        self.gave_up = False  # per the model: a step was given up
        self.ex, self.channel, self.driver = make_executor(
            self.trace, self.clock, self._gather,
            abort=lambda: self.aborts.append(threading.current_thread().name),
            poll_steps=self.poll_steps)
        self.worker = self.driver.worker
        echo_rank.trace = self.trace
        self.pacer = self.ex._pacer
        self.life = self.ex._pieces.life  # owns the steps in flight, which the pacer reads
        self.watch = self.ex._pieces.watch
        self.pending: str | None = None  # the sampled output the engine has not taken
        self.model_failure: str | None = None  # expected substring of the failure reason
        self.broadcasts = 0
        self.states = [self.ex.state]
        self.callback_calls = 0
        self.ex.register_failure_callback(self._on_failure)

    def _on_failure(self) -> None:
        self.callback_calls += 1

    def _gather(self, mine: RpcReply, timeout_s):
        self.gather_timeouts.append(timeout_s)
        mode, self.gather_mode = self.gather_mode, "ok"
        if mode == "blocks":
            self.gather_entered.set()
            self.gather_release.wait(30)
            raise RuntimeError("gloo: connection closed by peer (released by the test)")
        if mode == "breaks" or self.dead_rank is not None:
            raise RuntimeError("gloo: connection closed by peer")
        if mode == "times-out":
            assert timeout_s is not None, "a gather that must time out got no deadline"
            # gloo waits until the deadline, then raises; its timer counts whole
            # milliseconds, so it may fire a hair before the deadline by the executor's clock
            self.clock.now += timeout_s - 0.0005
            raise RuntimeError("gloo: timed out waiting for peers")
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
        return self.model_failure is not None

    def _predict_failure(self, reason: str) -> None:
        if self.model_failure is None:
            self.model_failure = reason  # the first reason wins

    def _tick_inside(self) -> None:
        """The pacer's thread wakes up in the middle of rank 0's part of a step, late."""
        self.clock.now += 5 * INTERVAL
        self.pacer.tick()

    def _fail_from_monitor(self, reason: str) -> None:
        """A rank's death is reported by the executor's monitor thread, not the engine's."""
        t = threading.Thread(target=self.ex._pieces.fail, args=(reason,))
        t.start()
        t.join()

    def _expect_refused(self, fn) -> None:
        with pytest.raises(ExecutorFailedError, match="keepalive executor failed"):
            fn()

    def _track(self, value):
        if isinstance(value, Future):
            assert value.done(), "a non-blocking call returned an unresolved future"
            fired = []
            value.add_done_callback(lambda f: fired.append(f))
            assert fired, "done-callback did not fire on a resolved future"
            return value.result()  # raises what the call raised, as a blocking call would
        return value

    def _in_engine_thread(self, fn) -> tuple[threading.Thread, list]:
        """Run ``fn`` on a thread of its own (the engine's), for steps that block."""
        outcome: list = []

        def run() -> None:
            try:
                outcome.append(("ok", fn()))
            except BaseException as e:  # noqa: BLE001 - inspected by the rule
                outcome.append(("raised", e))

        t = threading.Thread(target=run, name="engine-thread-under-test", daemon=True)
        t.start()
        return t, outcome

    def _given_up(self, t: threading.Thread, outcome: list) -> BaseException:
        """The watch gives the step up: the engine thread is released with the failure."""
        assert self.watch.check() is WatchAction.GIVE_UP
        self.gave_up = True
        t.join(10)
        assert not t.is_alive(), "the give-up did not release the engine thread"
        assert outcome[0][0] == "raised"
        assert isinstance(outcome[0][1], ExecutorFailedError)
        return outcome[0][1]

    # -- rules -----------------------------------------------------------------------
    @rule(non_block=st.booleans(), tick_inside=st.booleans(),
          rank0=st.sampled_from(RANK0_OUTCOMES))
    def execute_model_fused(self, non_block, tick_inside, rank0):
        """Also while the previous fused step's output was never taken: the engine skipped
        its sample_tokens (an error between the two calls); the ranks are still in step."""
        if self.failed:
            self._expect_refused(lambda: self._track(self.ex.execute_model(so(), non_block)))
            self.pending = None
            return
        self.trace.step_id += 1
        self.trace.open_steps += 1
        if tick_inside:
            self.worker.during_call.append(self._tick_inside)
        self.worker.raise_next = injected(rank0)
        self.broadcasts += 1
        self.pending = None  # discarded by the next model step, if any was left
        try:
            if rank0 is not None:
                with pytest.raises(type(self.worker.raise_next), match="injected"):
                    self._track(self.ex.execute_model(so(), non_block))
                self._predict_failure("execute_model raised on rank 0" if rank0 == "error"
                                      else "interrupted on rank 0 by KeyboardInterrupt")
                return
            assert self._track(self.ex.execute_model(so(), non_block)) is None
        finally:
            self.trace.open_steps -= 1
        # one broadcast, then rank 0 sampled straight after its forward pass
        assert [e for e in self.trace.events if e[0] != "keepalive"][-3:] == [
            ("broadcast", "execute_and_sample"), ("local", "execute_model"),
            ("local", "sample_tokens")]
        self.pending = f"sampled-{self.trace.step_id}"

    @rule(non_block=st.booleans())
    @precondition(lambda self: self.pending is not None)
    def sample_tokens_of_fused(self, non_block):
        pending, self.pending = self.pending, None
        if self.failed:
            self._expect_refused(lambda: self._track(self.ex.sample_tokens(None, non_block)))
            return
        before = self.trace.broadcasts()
        assert self._track(self.ex.sample_tokens(None, non_block)) == pending
        assert self.trace.broadcasts() == before  # nothing on the channel

    def _structured_execute(self, non_block: bool) -> bool:
        """execute_model of a batch with structured outputs: not fused (no local sampling).
        False if the executor refused it (failed)."""
        self.pending = None
        if self.failed:
            self._expect_refused(lambda: self._track(self.ex.execute_model(so(True), non_block)))
            return False
        self.trace.open_steps += 1
        self.broadcasts += 1
        assert self._track(self.ex.execute_model(so(True), non_block)) is None
        self.trace.open_steps -= 1
        assert self.trace.events[-2:] == [("broadcast", "execute_model"),
                                          ("local", "execute_model")]  # no local sampling
        return True

    @rule(non_block=st.booleans())
    def structured_output_step(self, non_block):
        """Not fused: execute_model and sample_tokens are two broadcasts."""
        if not self._structured_execute(non_block):
            return
        self.trace.open_steps += 1
        self.broadcasts += 1
        assert self._track(self.ex.sample_tokens("bitmask", non_block)).startswith("sampled")
        self.trace.open_steps -= 1

    @rule(non_block=st.booleans(), error_rank=st.sampled_from([None, 1, 2]),
          rank0=st.sampled_from([*RANK0_OUTCOMES, "error-others-stuck"]),
          tick_inside=st.booleans())
    def collective_rpc(self, non_block, error_rank, rank0, tick_inside):
        """Also between a fused execute_model and its sample_tokens (a user's thread)."""
        if self.failed:
            self._expect_refused(lambda: self.ex.collective_rpc(echo_rank, non_block=False))
            return
        self.worker_error_rank = error_rank
        self.worker.raise_next = injected("error" if rank0 == "error-others-stuck" else rank0)
        if rank0 == "error-others-stuck":
            self.gather_mode = "times-out"  # the others wait in a collective rank 0 skipped
        if tick_inside:
            self.worker.during_call.append(self._tick_inside)
        self.trace.open_steps += 1
        self.broadcasts += 1
        self.gather_timeouts.clear()
        try:
            call = lambda: self._track(self.ex.collective_rpc(echo_rank, non_block=non_block))  # noqa: E731
            if rank0 == "interrupt":
                with pytest.raises(KeyboardInterrupt):
                    call()
                self._predict_failure("echo_rank was interrupted on rank 0 by KeyboardInterrupt")
            elif rank0 is not None:
                with pytest.raises(RuntimeError, match="injected on rank 0"):
                    call()  # rank 0's own error, at once, whatever the others do
                # rank 0 waited for the others for the failure grace, no longer
                assert self.gather_timeouts == [pytest.approx(GRACE)]
                if rank0 == "error-others-stuck":
                    self._predict_failure("collective_rpc('echo_rank') raised on rank 0 "
                                          "(RuntimeError: injected on rank 0) and the other "
                                          "ranks did not reply within 0.5s")
            elif error_rank is not None:
                with pytest.raises(WorkerRpcError, match=f"failed on rank {error_rank}"):
                    call()
                assert self.gather_timeouts == [None]  # no deadline of its own
            else:
                assert call() == [(0, 0), (1, 0), (2, 0)]
        finally:
            self.trace.open_steps -= 1
            self.worker_error_rank = None

    @rule(timeout=st.floats(min_value=0.5, max_value=20))
    @precondition(lambda self: not self.failed)
    def collective_rpc_whose_replies_never_come_times_out(self, timeout):
        self.gather_mode = "times-out"
        self.broadcasts += 1
        self.gather_timeouts.clear()
        with pytest.raises(TimeoutError, match=f"echo_rank timed out after {timeout:g}s"):
            self.ex.collective_rpc(echo_rank, timeout=timeout)
        assert self.gather_timeouts == [pytest.approx(timeout)]  # the call's own deadline
        self._predict_failure(f"echo_rank timed out after {timeout:g}s")

    @rule()
    @precondition(lambda self: not self.failed)
    def collective_rpc_from_another_thread_waits_for_rank0s_fused_part(self):
        """In-process users call collective_rpc from their own thread: it must not land
        between rank 0's forward pass and its sampling."""
        about_to_call = threading.Event()
        threads: list = []

        def start_other() -> None:  # runs inside rank 0's forward pass
            threads.append(self._in_engine_thread(
                lambda: (about_to_call.set(), self.ex.collective_rpc(echo_rank, args=(7,)))[1]))
            assert about_to_call.wait(10)
            time.sleep(0.05)  # room for a wrong implementation to broadcast now

        self.worker.during_call.append(start_other)
        self.trace.step_id += 1
        self.broadcasts += 2
        self.pending = None
        assert self.ex.execute_model(so()) is None
        t, outcome = threads[0]
        t.join(10)
        assert not t.is_alive()
        assert outcome == [("ok", [(0, 7), (1, 0), (2, 0)])]
        assert [e for e in self.trace.events if e[0] != "keepalive"][-5:] == [
            ("broadcast", "execute_and_sample"), ("local", "execute_model"),
            ("local", "sample_tokens"), ("broadcast", "echo_rank"), ("local", "echo_rank")]
        self.pending = f"sampled-{self.trace.step_id}"

    @rule()
    @precondition(lambda self: not self.failed)
    def a_model_step_stuck_on_rank0_times_out_then_is_given_up(self):
        """The step timeout and the give-up, on the fake clock: the engine thread is
        released although rank 0's thread stays blocked."""
        inside, release = threading.Event(), threading.Event()
        self.worker.during_call.append(lambda: (inside.set(), release.wait(30)))
        self.broadcasts += 1
        self.pending = None
        t, outcome = self._in_engine_thread(self.ex.execute_dummy_batch)
        try:
            assert inside.wait(10)
            assert self.watch.check() is WatchAction.NONE  # before its deadline
            self.clock.now += STEP_TIMEOUT
            assert self.watch.check() is WatchAction.TIMEOUT
            self._predict_failure(f"execute_dummy_batch did not return within "
                                  f"{STEP_TIMEOUT:g}s (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)")
            assert self.ex.state is ExecutorState.FAILED and t.is_alive()
            self.clock.now += GRACE / 2
            assert self.watch.check() is WatchAction.NONE  # inside the grace
            self.clock.now += GRACE / 2
            assert "still inside execute_dummy_batch" in str(self._given_up(t, outcome))
        finally:
            release.set()

    @rule()
    @precondition(lambda self: not self.failed)
    def a_rank_fails_while_rank0_waits_in_the_reply_gather(self):
        """The gather has no deadline (timeout None): only the give-up can release the
        engine thread, and it must, within the failure grace of the failure."""
        self.gather_mode = "blocks"
        self.gather_entered.clear()
        self.gather_release.clear()
        self.broadcasts += 1
        t, outcome = self._in_engine_thread(lambda: self.ex.collective_rpc(echo_rank))
        try:
            assert self.gather_entered.wait(10)
            reason = "worker rank 1 (pid 1) died unexpectedly (exit code -9)"
            self._fail_from_monitor(reason)
            self._predict_failure(reason)
            assert self.ex._pieces.life.failure.stuck.name == "echo_rank"
            self.clock.now += GRACE
            assert reason in str(self._given_up(t, outcome))
        finally:
            self.gather_release.set()

    @rule(dt=st.floats(min_value=0, max_value=3 * INTERVAL))
    def time_passes_and_the_pacer_wakes(self, dt):
        self.clock.now += dt
        if self.pacer.state.value in ("idle", "busy"):
            self.pacer.tick()
        assert self.watch.check() is WatchAction.NONE  # no step: nothing to watch

    @rule(during_step=st.booleans())
    @precondition(lambda self: not self.failed)
    def a_rank_fails(self, during_step):
        reason = "worker rank 2 (pid 1) died unexpectedly (exit code -9)"
        if during_step:
            # the failure arrives while rank 0 is inside the step; the gather then breaks
            seen = {}

            def fail_now():
                self._fail_from_monitor(reason)
                seen["step"] = self.ex._pieces.life.failure.stuck
                self.dead_rank = 2

            self.worker.during_call.append(fail_now)
            self.trace.open_steps += 1
            self.broadcasts += 1
            try:
                with pytest.raises(ExecutorFailedError, match=reason.replace("(", r"\(")
                                   .replace(")", r"\)")):
                    self.ex.collective_rpc(echo_rank)
            finally:
                self.trace.open_steps -= 1
            # the failure captured the step rank 0 was inside: one atomic decision
            assert seen["step"] is not None and seen["step"].name == "echo_rank"
        else:
            self._fail_from_monitor(reason)
            assert self.ex._pieces.life.failure.stuck is None  # no step was running
        self._predict_failure(reason)

    @rule()
    @precondition(lambda self: not self.failed)
    def a_broadcast_breaks(self):
        self.channel.break_next = True
        with pytest.raises(ExecutorFailedError, match="broadcast of echo_rank failed"):
            self.ex.collective_rpc(echo_rank)
        self._predict_failure("broadcast of echo_rank failed: peer gone")

    @rule()
    @precondition(lambda self: not self.failed)
    def the_reply_gather_breaks(self):
        self.gather_mode = "breaks"
        self.broadcasts += 1
        with pytest.raises(ExecutorFailedError, match="gathering replies to echo_rank"):
            self.ex.collective_rpc(echo_rank)
        self._predict_failure("gathering replies to echo_rank failed")

    @rule()
    @precondition(lambda self: self.failed)
    def every_call_after_a_failure_is_refused(self):
        for call in (lambda: self.ex.collective_rpc(echo_rank),
                     lambda: self.ex.execute_model(so()),
                     lambda: self.ex.execute_dummy_batch(),
                     lambda: self.ex.check_health()):
            self._expect_refused(call)
        future = self.ex.execute_model(so(), non_block=True)
        if not self.poll_steps:  # refused before it returns; polled: through the future
            assert future.done()
        assert isinstance(future.exception(timeout=10), ExecutorFailedError)
        self.pending = None

    # -- invariants: the model's prediction against what the executor shows ------------
    @invariant()
    def no_step_is_in_flight_between_calls(self):
        assert self.life.in_flight == 0

    @invariant()
    def no_keepalive_inside_a_step(self):
        assert not self.trace.violations, self.trace.violations

    @invariant()
    def broadcasts_are_what_each_call_costs(self):
        assert self.trace.broadcasts() == self.broadcasts

    @invariant()
    def failed_exactly_when_the_model_says_and_for_its_reason(self):
        state = self.ex.state
        assert ORDER[state] >= ORDER[self.states[-1]]
        self.states.append(state)
        if self.model_failure is None:
            assert state is ExecutorState.RUNNING, self.ex._pieces.life.failure
        else:
            assert state is ExecutorState.FAILED
            assert self.model_failure in self.ex._pieces.life.failure.reason

    @invariant()
    def failure_callback_called_exactly_once_when_failed(self):
        assert self.callback_calls == (1 if self.failed else 0)

    @invariant()
    def the_groups_are_aborted_once_when_a_step_is_given_up(self):
        """On NCCL a given-up step's kernels would spin on: the give-up aborts the groups,
        once, and nothing else does."""
        assert len(self.aborts) == (1 if self.gave_up else 0), self.aborts

    def teardown(self):
        self.gather_release.set()
        began = time.monotonic()
        self.ex.shutdown()
        assert time.monotonic() - began < 3 * GRACE + 1.5  # bounded after any failure
        assert self.ex.state is ExecutorState.STOPPED
        assert self.life.in_flight == 0
        if not self.failed:
            assert self.trace.events[-1] == ("shutdown", "")  # SHUTDOWN is the last frame


ExecutorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                             deadline=None)
TestExecutorMachine = ExecutorMachine.TestCase


class PolledExecutorMachine(ExecutorMachine):
    """The same model on the step path vLLM 0.34's engine takes (polled.py): a non-blocking
    model step returns a future at once and runs on the step thread; the engine then waits
    for it (``wait_briefly``, then ``result()``) before its next call."""

    poll_steps = True

    def _track(self, value):
        if isinstance(value, PolledStep):
            value.exception(timeout=30)  # the engine waits for the step
        return super()._track(value)


PolledExecutorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                   deadline=None)
TestPolledExecutorMachine = PolledExecutorMachine.TestCase


DRIVER_THREAD = "keepalive-driver-under-test"


class AsyncExecutorMachine(ExecutorMachine):
    """The same machine with async scheduling's outputs: rank 0's ``sample_tokens`` returns
    what vLLM's GPU runner does (an output still on its way to the host). The model adds the
    outputs the engine has not asked for yet, oldest first, and predicts: nothing is
    resolved before the engine asks; asking for one resolves it and every older one, in
    order, on rank 0's thread; an output whose copy raises is that output's error (the
    executor stays usable); a copy that never ends is watched like a step (timeout,
    give-up); and no output is in flight for the pacer."""

    def __init__(self) -> None:
        super().__init__()
        self.worker.async_outputs = True
        self.outstanding: list[tuple[Future, FakeAsyncOutput]] = []
        self.expected_got: list[str] = []  # per the model: get_output() calls, in order

    # -- the engine's calls that return an async output ----------------------------------
    def _resolve_upto(self, i: int) -> list[tuple[Future, FakeAsyncOutput]]:
        """The model: asking for outstanding[i] resolves outstanding[0..i], in order."""
        batch, self.outstanding = self.outstanding[:i + 1], self.outstanding[i + 1:]
        if not self.failed:
            self.expected_got += [out.value for _, out in batch]
        return batch

    def _check_outcome(self, future: Future, out: FakeAsyncOutput) -> None:
        assert future.done()
        if self.failed and out.value not in self.expected_got:
            assert isinstance(future.exception(), ExecutorFailedError)
        elif out.behaviour == "raises":
            with pytest.raises(RuntimeError, match=f"copy of {out.value} failed"):
                future.result()
        else:
            assert future.result() == out.value

    @rule(non_block=st.booleans(), behaviour=st.sampled_from(["ok", "raises"]))
    @precondition(lambda self: self.pending is not None)
    def sample_tokens_of_fused(self, non_block, behaviour):
        self.pending = None
        if self.failed:
            self._expect_refused(lambda: self._track(self.ex.sample_tokens(None, non_block)))
            return
        before = self.trace.broadcasts()
        out = self.worker.made[-1]
        out.behaviour = behaviour
        if non_block:
            future = self.ex.sample_tokens(None, True)
            assert not future.done(), "an async output was resolved before it was asked for"
            self.outstanding.append((future, out))
        else:
            self._blocking(lambda: self.ex.sample_tokens(None, False))
        assert self.trace.broadcasts() == before  # nothing on the channel

    def _blocking(self, call) -> None:
        """A blocking call's own output (the newest made when the call returns): resolved at
        once, after every older one."""
        older = self._resolve_upto(len(self.outstanding) - 1)
        try:
            result = call()
        except RuntimeError as e:
            result = e
        out = self.worker.made[-1]
        self.expected_got.append(out.value)
        if out.behaviour == "raises":
            assert isinstance(result, RuntimeError), result
            assert f"copy of {out.value} failed" in str(result)
        else:
            assert result == out.value
        for future, o in older:
            self._check_outcome(future, o)

    @rule(non_block=st.booleans(), behaviour=st.sampled_from(["ok", "raises"]))
    def structured_output_step(self, non_block, behaviour):
        """Not fused: two broadcasts; sample_tokens' output is async."""
        if not self._structured_execute(non_block):
            return
        self.broadcasts += 1
        self.worker.during_sample = lambda o: setattr(o, "behaviour", behaviour)
        self.trace.open_steps += 1
        try:
            if non_block:
                future = self.ex.sample_tokens("bitmask", True)
                assert not future.done()
                self.outstanding.append((future, self.worker.made[-1]))
            else:
                self._blocking(lambda: self.ex.sample_tokens("bitmask", False))
        finally:
            self.trace.open_steps -= 1
            self.worker.during_sample = None

    @rule(data=st.data())
    @precondition(lambda self: self.outstanding)
    def the_engine_asks_for_an_output_maybe_out_of_order(self, data):
        i = data.draw(st.integers(0, len(self.outstanding) - 1))
        future, out = self.outstanding[i]
        batch = self._resolve_upto(i)
        if self.failed:
            with pytest.raises(ExecutorFailedError):
                future.result()
        else:
            try:
                future.result()  # the engine asks; the outcome is checked below
            except RuntimeError:
                pass
        for f, o in batch:
            self._check_outcome(f, o)

    def _late(self) -> tuple[Future, FakeAsyncOutput]:
        """A fused step whose output's copy does not end until released."""
        self.pending = None  # an unclaimed sampled output is discarded by this step
        self.trace.step_id += 1
        self.broadcasts += 1
        assert self.ex.execute_model(so(), non_block=True).result() is None
        future = self.ex.sample_tokens(None, non_block=True)
        out = self.worker.made[-1]
        out.behaviour = "late"
        self.outstanding.append((future, out))
        return future, out

    @rule()
    @precondition(lambda self: not self.failed)
    def a_late_output_holds_only_the_engine_that_asked(self):
        """While the engine waits for a late copy: no step is in flight (a keepalive goes
        out), and the answer comes once the copy ends."""
        future, out = self._late()
        batch = self._resolve_upto(len(self.outstanding) - 1)
        t, outcome = self._in_engine_thread(future.result)
        try:
            assert out.entered.wait(10)
            assert t.is_alive() and self.life.in_flight == 0
            self.clock.now += 2 * INTERVAL
            self.pacer.tick()
            assert self.trace.events[-1] == ("keepalive", "")
        finally:
            out.release.set()
        t.join(10)
        assert outcome == [("ok", out.value)]
        for f, o in batch:
            self._check_outcome(f, o)

    @rule()
    @precondition(lambda self: not self.failed)
    def a_rank_fails_while_the_engine_waits_for_a_late_output(self):
        """The copy waits on a GPU whose step all-reduce lost a peer: the failure gives the
        wait up after the grace, and the engine gets the failure."""
        future, out = self._late()
        batch = self._resolve_upto(len(self.outstanding) - 1)
        t, outcome = self._in_engine_thread(future.result)
        try:
            assert out.entered.wait(10)
            reason = "worker rank 1 (pid 1) died unexpectedly (exit code -9)"
            self._fail_from_monitor(reason)
            self._predict_failure(reason)
            assert "output" in self.ex._pieces.life.failure.stuck.name
            self.clock.now += GRACE
            assert reason in str(self._given_up(t, outcome))
        finally:
            out.release.set()
        for f, o in batch[:-1]:
            self._check_outcome(f, o)

    @rule()
    @precondition(lambda self: not self.failed)
    def a_copy_that_never_ends_times_out_then_is_given_up(self):
        future, out = self._late()
        batch = self._resolve_upto(len(self.outstanding) - 1)
        t, outcome = self._in_engine_thread(future.result)
        try:
            assert out.entered.wait(10)
            assert self.watch.check() is WatchAction.NONE
            self.clock.now += STEP_TIMEOUT
            assert self.watch.check() is WatchAction.TIMEOUT
            self._predict_failure("did not return within 30s (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)")
            self.clock.now += GRACE
            self._given_up(t, outcome)
        finally:
            out.release.set()
        for f, o in batch[:-1]:
            self._check_outcome(f, o)

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def outputs_are_resolved_when_asked_in_order_on_rank0s_thread(self):
        got = list(self.trace.got)
        assert [v for v, _ in got] == self.expected_got
        assert {t for _, t in got} <= {DRIVER_THREAD}, got

    @invariant()
    def outputs_nobody_asked_for_are_not_resolved(self):
        for future, out in self.outstanding:
            assert not future.done() or self.failed, out.value

    def teardown(self):
        for out in self.worker.made:
            out.release.set()
        super().teardown()


AsyncExecutorMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30,
                                                  deadline=None)
TestAsyncExecutorMachine = AsyncExecutorMachine.TestCase


def test_keepalives_are_sent_while_idle_between_steps():
    """The machine above checks keepalives never land inside a step; this checks they are
    sent at all when idle (also between a fused execute_model and its sample_tokens, when
    every rank has finished the step), so that check is not vacuous."""
    trace, clock = Trace(), Clock()
    ex, channel, driver = make_executor(trace, clock, lambda mine, t: [mine] * WORLD)
    clock.now += INTERVAL
    ex._pacer.tick()
    assert trace.events[-1] == ("keepalive", "")

    def late_tick() -> None:
        clock.now += 10 * INTERVAL
        ex._pacer.tick()

    driver.worker.during_call.append(late_tick)
    ex.execute_model(so())
    assert trace.events[-1] == ("local", "sample_tokens")  # inside the step: none sent
    ex._pacer.tick()
    assert trace.events[-1] == ("keepalive", "")
    ex.sample_tokens(None)
    ex.shutdown()


def test_a_users_collective_rpc_of_sample_tokens_leaves_a_fused_steps_sampled_half():
    """Only the engine's sample_tokens takes what a fused step sampled: a collective_rpc of
    the same method name is a call of its own (broadcast, every rank's reply), and the
    engine's sample_tokens afterwards still gets the fused step's output."""
    trace, clock = Trace(), Clock()
    ex, channel, driver = make_executor(trace, clock, lambda mine, t: [mine] * WORLD)
    trace.step_id = 1
    assert ex.execute_model(so()) is None
    trace.step_id = 2
    before = trace.broadcasts()
    assert ex.collective_rpc("sample_tokens", args=(None,)) == ["sampled-2"] * WORLD
    assert trace.broadcasts() == before + 1
    assert ex.sample_tokens(None) == "sampled-1"
    assert trace.broadcasts() == before + 1
    ex.shutdown()


def test_ctrl_c_while_rank0_is_stuck_fails_the_executor_and_shutdown_stays_bounded():
    """A real SIGINT in the calling (main) thread while rank 0's thread is blocked inside a
    collective_rpc: the call raises KeyboardInterrupt, the executor fails naming it (the
    other ranks wait in a gather rank 0 will not join), every later call is refused at once,
    and shutdown does not wait for rank 0's stuck thread."""
    import signal

    assert threading.current_thread() is threading.main_thread()
    trace, clock = Trace(), Clock()
    ex, channel, driver = make_executor(trace, clock, lambda mine, t: [mine] * WORLD)
    inside, release = threading.Event(), threading.Event()
    driver.worker.during_call.append(lambda: (inside.set(), release.wait(60)))

    main = threading.main_thread().ident
    interrupted = threading.Event()

    def on_sigint(signum, frame):  # one KeyboardInterrupt, however many signals land
        if not interrupted.is_set():
            interrupted.set()
            raise KeyboardInterrupt

    def press_ctrl_c() -> None:
        assert inside.wait(10)
        # At the main thread (a process-directed signal may land on any thread), and again
        # until it took: a signal that lands just before the thread blocks only marks the
        # handler pending, and the thread would sleep on until rank 0 returns.
        while not interrupted.wait(0.2):
            signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, on_sigint)
    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ex.collective_rpc(echo_rank)
        presser.join(10)
        assert ex.state is ExecutorState.FAILED
        assert "echo_rank was interrupted on rank 0 by KeyboardInterrupt" in \
            ex._pieces.life.failure.reason
        began = time.monotonic()
        with pytest.raises(ExecutorFailedError, match="KeyboardInterrupt"):
            ex.collective_rpc(echo_rank)
        assert time.monotonic() - began < 0.5
        began = time.monotonic()
        ex.shutdown()
        assert time.monotonic() - began < 3 * GRACE + 1.5  # not rank 0's 60 s
    finally:
        signal.signal(signal.SIGINT, previous)
        release.set()


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

    @property
    def pending(self) -> int:
        return sum(not f.done() for _, f in self.expected)

    def drain(self, timeout_s: float) -> bool:
        return self.pending == 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def test_pipeline_steps_overlap_resolve_in_order_and_stay_in_flight_until_their_output():
    trace, clock = Trace(), Clock()
    ex, channel, driver = make_executor(trace, clock, lambda mine, t: [mine] * WORLD,
                                        outputs=FakeOutputs())
    pacer, life = ex._pacer, ex._pieces.life
    # batch A: fused execute_model returns at once with a pending future; so does sample
    exec_a = ex.execute_model(so(), non_block=True)
    sample_a = ex.sample_tokens(None, non_block=True)
    assert not exec_a.done() and not sample_a.done() and life.in_flight == 1
    # batch B overlaps: broadcast and stage 0's part while A's output is still out
    exec_b = ex.execute_model(so(), non_block=True)
    sample_b = ex.sample_tokens(None, non_block=True)
    assert life.in_flight == 2
    assert [e for e in trace.events if e[0] == "broadcast"] == [
        ("broadcast", "execute_then_sample")] * 2
    clock.now += 10 * INTERVAL
    pacer.tick()  # steps in flight: no keepalive however long they take
    assert ("keepalive", "") not in trace.events
    # the last stage's outputs arrive, in order: (execute_model's, sample_tokens')
    ex._outputs.expected[0][1].set_result((None, "sampled-A"))
    assert exec_a.result() is None and sample_a.result() == "sampled-A"
    assert life.in_flight == 1 and not sample_b.done()
    ex._outputs.expected[1][1].set_result((None, "sampled-B"))
    assert sample_b.result() == "sampled-B" and exec_b.result() is None
    assert life.in_flight == 0
    pacer.tick()
    assert trace.events[-1] == ("keepalive", "")
    # a rank is lost with a step in flight: its futures fail, it leaves flight
    exec_c = ex.execute_model(so(), non_block=True)
    sample_c = ex.sample_tokens(None, non_block=True)
    threading.Thread(target=ex._pieces.fail, args=("worker rank 1 died",)).start()
    with pytest.raises(ExecutorFailedError, match="worker rank 1 died"):
        sample_c.result(timeout=10)
    assert exec_c.exception(timeout=10) is not None and life.in_flight == 0
    ex.shutdown()


def test_pipeline_keeps_p_plus_one_batches_in_flight_as_async_scheduling_asks():
    """vLLM 0.32 with async scheduling and the V2 model runner keeps P + 1 batches in flight
    under PP (VllmConfig.max_concurrent_batches): three at PP=2, each broadcast at once,
    each in flight (no keepalive) until its output arrived, resolved in step order."""
    trace, clock = Trace(), Clock()
    ex, channel, driver = make_executor(trace, clock, lambda mine, t: [mine] * WORLD,
                                        outputs=FakeOutputs())
    life = ex._pieces.life
    samples = []
    for _ in range(3):
        ex.execute_model(so(), non_block=True)
        samples.append(ex.sample_tokens(None, non_block=True))
    assert life.in_flight == 3 and not any(f.done() for f in samples)
    assert [e for e in trace.events if e[0] == "broadcast"] == [
        ("broadcast", "execute_then_sample")] * 3
    for i, (_, future) in enumerate(ex._outputs.expected):
        future.set_result((None, f"sampled-{i}"))
        assert samples[i].result() == f"sampled-{i}" and life.in_flight == 2 - i
        assert not any(f.done() for f in samples[i + 1:])
    ex.shutdown()
