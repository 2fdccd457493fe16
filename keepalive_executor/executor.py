"""KeepaliveExecutor: vLLM's executor contract on one side, the channel and pacer on the other.

The driver (rank 0) lives in the engine process and runs its share of the model in-process,
as vLLM's ``UniProcExecutor`` does; ranks 1..N-1 wait indefinitely in
:func:`keepalive_executor.worker_loop.receive_loop`. Every engine call is one step on the
channel (:mod:`keepalive_executor.steps`); while the engine is idle the pacer broadcasts a
no-op keepalive every ``interval`` (:mod:`keepalive_executor.pacer`).

The pieces, and who owns which thread::

    KeepaliveExecutor ----------- the engine's calls: one method each, a few lines
      |- Ranks (ranks.py) ------- where ranks 1..N-1 come from: spawned processes
      |                           (thread keepalive-worker-monitor) or torchrun's
      |                           (thread keepalive-liveness)
      |- DriverRank (driver.py) - rank 0's vLLM worker; every call to it runs on its
      |                           thread keepalive-driver, so a stuck one can be given up
      |- BroadcastChannel ------- bytes to every rank (channel.py)
      |- Pacer (pacer.py) ------- thread keepalive-pacer: keepalives while idle
      |- StepRunner (steps.py) -- one step: owner lock, lifecycle entry, pacer token,
      |                           broadcast, rank 0's part, reply gather
      |- DeferredOutputs -------- async scheduling: rank 0's outputs, resolved when the
      |  (deferred.py)            engine asks, in order, on rank 0's thread
      |- StepCaller (polled.py) - vLLM 0.34's engine polls model steps: thread
      |                           keepalive-engine-step makes them, the engine gets a future
      |- compat.py -------------- what differs between vLLM 0.32, 0.33 and 0.34
      `- Lifecycle + StepWatch -- running/failed/stopped; thread keepalive-step-watch:
         (lifecycle.py)           step timeouts and giving up a step a failure made endless

Failure: any piece calls :meth:`KeepaliveExecutor._fail` with a reason. The first reason wins;
vLLM's failure callback is called; every later call raises naming it. A step that was running
when the failure happened gets ``VLLM_KEEPALIVE_FAILURE_GRACE_S`` to return; then it is given
up: the waiting call fails with the reason (rank 0's thread stays blocked), and vLLM's own
error path ends the engine. The executor never ends a process.
"""

from __future__ import annotations

import faulthandler
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from vllm.v1.executor.abstract import Executor, FailureCallback

from keepalive_executor import compat, nccl, torchrun
from keepalive_executor.config import (
    KeepaliveSettings,
    async_scheduling_opt_in,
    check_features,
    check_parallel_layout,
    settings_from_vllm_config,
)
from keepalive_executor.connectors import merge as merge_connector_outputs
from keepalive_executor.driver import DriverRank
from keepalive_executor.groups import open_world_channel
from keepalive_executor.lifecycle import (
    ExecutorFailedError,
    ExecutorState,
    Failure,
    Lifecycle,
    StepInProgress,
    StepWatch,
)
from keepalive_executor.log import get_logger
from keepalive_executor.outputs import OutputReceiver, open_output_link, output_rank
from keepalive_executor.pacer import Pacer
from keepalive_executor.polled import StepCaller
from keepalive_executor.ranks import Ranks, make_ranks
from keepalive_executor.rpc import Replies, RpcReply, gather_replies
from keepalive_executor.steps import Step, StepRunner

__all__ = ["KeepaliveExecutor", "ExecutorFailedError"]

logger = get_logger(__name__)

#: Test-only: start without the pacer so tests can show that idle receivers then die.
#: Deliberately not a documented option; it logs a warning whenever it is honoured.
_TEST_DISABLE_PACER_ENV = "_KEEPALIVE_EXECUTOR_TEST_ONLY_DISABLE_PACER"
#: Test-only: pass on rank 0's KV connector output alone (what the executor did before), so a
#: test can show what merging every rank's output changes. Not an option.
_TEST_NO_CONNECTOR_MERGE_ENV = "_KEEPALIVE_EXECUTOR_TEST_ONLY_NO_CONNECTOR_MERGE"
#: Test-only: watch the ranks only once start-up is done (what the executor did before), so
#: a test can show that a rank dying inside the rendezvous then fails start-up only at its
#: timeout. Not an option.
_TEST_LATE_WORKER_WATCH_ENV = "_KEEPALIVE_EXECUTOR_TEST_ONLY_LATE_WORKER_WATCH"
#: Test-only: shut down without receiving the pipeline outputs still in flight (the old
#: order), so a test can show the output rank then blocks in its send. Not an option.
_TEST_NO_SHUTDOWN_DRAIN_ENV = "_KEEPALIVE_EXECUTOR_TEST_ONLY_NO_SHUTDOWN_DRAIN"
#: How long shutdown waits for the channel (a step finishing, the SHUTDOWN broadcast), and
#: for each of rank 0's own clean-up calls.
SHUTDOWN_SEND_S = 5.0
#: After a step timeout, how long the workers get to write their stacks before they are
#: stopped (faulthandler writes from the signal handler: milliseconds).
STACK_DUMP_WAIT_S = 0.5
#: When a step breaks on rank 0, how long to look for a rank that died: a killed peer's
#: sockets close as it exits, a hair before its process can be reaped, so rank 0's collective
#: can fail before the death watch sees the death. The reason then still names the death.
DEATH_LOOKUP_S = 0.05
STARTUP_TIMEOUT_SOURCE = "VLLM_KEEPALIVE_STARTUP_TIMEOUT_S"


def _load_model(worker: Any) -> None:
    """Run on every rank: load weights, then let the platform fix the block size."""
    from vllm.platforms import current_platform

    worker.load_model()
    current_platform.update_block_size_for_backend(worker.vllm_config)


def _destroy_groups() -> None:
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


class KeepaliveExecutor(Executor):
    """Driver in-process, the other ranks on one broadcast channel."""

    uses_ray: bool = False
    supports_pp: bool = True
    #: Whether the engine polls model steps while they run (polled.py); None: as the
    #: installed vLLM release's engine does (compat.py). Tests set it on a subclass.
    poll_steps: bool | None = None

    # ------------------------------------------------------------------ start-up
    @staticmethod
    def validate(vllm_config: Any) -> KeepaliveSettings:
        """All start-up checks, cheap enough for the front end: raises KeepaliveConfigError."""
        if not compat.check_version():
            logger.warning("keepalive executor: vLLM %s is not a supported release (%s); "
                           "starting anyway because %s=1", compat.installed_version(),
                           compat.SUPPORTED_TEXT, compat.ENV_ALLOW_UNSUPPORTED)
        compat.check_features(vllm_config)
        check_parallel_layout(vllm_config.parallel_config,
                              getattr(vllm_config, "model_config", None))
        check_features(vllm_config)
        if torchrun.in_torchrun_mode():
            torchrun.check_world_size(vllm_config.parallel_config)
            torchrun.check_features(vllm_config)
        return settings_from_vllm_config(vllm_config)

    def _init_executor(self) -> None:
        self._init_state()
        ranks = make_ranks(self.vllm_config)
        self._ranks = ranks
        self._finalizer = weakref.finalize(self, ranks.kill)
        try:
            self.settings = self.validate(self.vllm_config)
            logger.info("%s", self.settings.describe())
            self._start(ranks, self.settings)
        except BaseException as e:
            ranks.tell_error(f"rank 0's executor failed to start: {type(e).__name__}: {e}")
            self.shutdown()
            raise

    def _init_state(self, clock: Callable[[], float] = time.monotonic) -> None:
        """Every attribute, before anything can fail (also what unit tests start from)."""
        self._life = Lifecycle(clock)
        self._failure_callback: FailureCallback | None = None
        self._ranks: Ranks | None = None
        self._driver: DriverRank | None = None
        self._channel: Any = None
        self._pacer: Pacer | None = None
        self._steps: StepRunner | None = None
        self._watch: StepWatch | None = None
        self._outputs: OutputReceiver | None = None
        self._step_caller: StepCaller | None = None
        #: NCCL/RCCL: aborts this process's groups when a step is given up (nccl.py)
        self._abort_groups: Callable[[], object] | None = None
        #: every other rank's exit code, once shutdown reaped them (spawned ranks only)
        self.worker_exit_codes: dict[int, int | None] = {}
        self.world_size = self.parallel_config.world_size
        self.output_rank = output_rank(self.parallel_config)
        self._pp = self.parallel_config.pipeline_parallel_size > 1
        self._finalizer = weakref.finalize(self, lambda: None)

    def _start(self, ranks: Ranks, settings: KeepaliveSettings) -> None:
        self._watch = self._make_watch(settings)
        self._watch.start()
        driver = DriverRank()
        self._driver = driver
        if settings.nccl_error_handling is not None:
            # before any NCCL group of this process, and before the workers inherit the
            # environment: a failed collective is then an error here, not a SIGABRT
            nccl.apply_error_handling("nccl")
            self._abort_groups = nccl.abort_groups
        ranks.start(self.vllm_config, settings)
        late_watch = os.environ.get(_TEST_LATE_WORKER_WATCH_ENV) == "1"
        if late_watch:
            logger.warning("TEST ONLY: ranks watched only after start-up")
        else:
            ranks.watch(self._fail)
        # Start-up is a step of its own for the failure model: a rank lost while rank 0 waits
        # in the rendezvous fails it within the failure grace (the watch gives the wait up),
        # and a rendezvous that never completes fails it at the start-up timeout.
        self._life.enter("start-up (joining the process groups)", settings.startup_timeout_s,
                         STARTUP_TIMEOUT_SOURCE)
        try:
            driver.create(
                self.vllm_config,
                local_rank=ranks.local_rank,
                distributed_init_method=ranks.init_method,
                shared_worker_lock=ranks.shared_worker_lock,
                before_init_device=ranks.before_init_device,
            )
            channel, reply_group = driver.run(open_world_channel, settings.channel,
                                              self.parallel_config)
            link = driver.run(open_output_link, self.parallel_config,
                              settings.channel.output_timeout_s)
            ranks.wait_ready()
        finally:
            self._life.exit()
        self._life.check_usable()
        if link is not None:
            self._outputs = OutputReceiver(link, on_lost=self._fail)
        gather = partial(_gather, group=reply_group, world_size=self.world_size,
                         dst=channel.src)
        self._assemble(settings, channel, driver, gather)
        if late_watch:
            ranks.watch(self._fail)
        self.collective_rpc(_load_model)

    def _make_watch(self, settings: KeepaliveSettings) -> StepWatch:
        return StepWatch(self._life, settings.failure_grace_s, self._on_step_timeout,
                         self._give_up, horizon_s=settings.execute_timeout_s)

    def _assemble(self, settings: KeepaliveSettings, channel: Any, driver: Any,
                  gather: Callable[[RpcReply, float | None], list[RpcReply]],
                  *, clock: Callable[[], float] = time.monotonic, threads: bool = True
                  ) -> None:
        """Wire the pieces (also what unit tests call with fakes)."""
        self.settings = settings
        self._channel = channel
        self._driver = driver
        self._pacer = Pacer(
            settings.interval_s, channel.send_keepalive, send_lock=channel.send_lock,
            clock=clock, on_failure=lambda e: self._fail(f"keepalive broadcast failed: {e}"),
            on_thread_start=channel.bind_thread,
        )
        self._steps = StepRunner(
            channel=channel, pacer=self._pacer, driver=driver, lifecycle=self._life,
            gather=gather, fail=self._fail_in_step, execute_timeout_s=settings.execute_timeout_s,
            error_window_s=settings.failure_grace_s, merge=self._merge_connector_outputs,
            expect=None if self._outputs is None else self._outputs.expect,
        )
        if self._engine_polls_steps():
            self._step_caller = StepCaller()
        if self._watch is None:
            self._watch = self._make_watch(settings)
        if not threads:
            return
        if self._outputs is not None:
            self._outputs.start()
        if os.environ.get(_TEST_DISABLE_PACER_ENV) == "1":
            logger.warning("TEST ONLY: keepalive pacer disabled; idle workers will time out")
        else:
            self._pacer.start()

    def _engine_polls_steps(self) -> bool:
        """One batch at a time (no pipeline, no async scheduling) under an engine that
        polls the step's future (polled.py)."""
        polls = (compat.release().engine_polls_step_futures if self.poll_steps is None
                 else self.poll_steps)
        return (polls and not self._pp
                and not getattr(self.scheduler_config, "async_scheduling", False))

    # ------------------------------------------------------------------ failure
    @property
    def is_failed(self) -> bool:
        """True once the executor failed (vLLM's fault-tolerance sentinel reads this)."""
        return self._life.is_failed

    @property
    def failure_callback(self) -> FailureCallback | None:
        """The registered failure callback, not yet called (vLLM 0.34's sentinel and
        ``MultiprocExecutor`` expose the same attribute)."""
        return self._failure_callback

    @failure_callback.setter
    def failure_callback(self, callback: FailureCallback | None) -> None:
        with self._life.cond:
            self._failure_callback = callback

    @property
    def state(self) -> ExecutorState:
        """running, failed or stopped."""
        return self._life.state

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback`` when the executor fails (at once if it already has)."""
        with self._life.cond:
            if self._life.state is ExecutorState.RUNNING:
                self._failure_callback = callback
                return
        if self._life.is_failed:
            callback()

    def _fail(self, reason: str) -> None:
        failure = self._life.fail(reason)
        if failure is None:
            return
        with self._life.cond:
            callback, self._failure_callback = self._failure_callback, None
        logger.error("keepalive executor failed: %s", reason)
        torchrun.record_failure(reason)
        if self._channel is not None:
            self._channel.close()
        if self._pacer is not None:
            self._pacer.request_stop()
        if self._outputs is not None:
            self._outputs.fail_all(ExecutorFailedError(f"keepalive executor failed: {reason}"))
        if failure.stuck is not None:
            logger.error(
                "keepalive executor: rank 0 is inside %s; it has %gs to return "
                "(VLLM_KEEPALIVE_FAILURE_GRACE_S)", failure.stuck.name,
                self.settings.failure_grace_s,
            )
        if callback is not None:
            callback()

    def _fail_in_step(self, reason: str) -> None:
        """A step broke on rank 0 (a collective raised, rank 0 raised after the broadcast):
        if a rank died, the failure is that death, then the step's error (DEATH_LOOKUP_S)."""
        dead_worker = getattr(self._ranks, "dead_worker", None)
        deadline = time.monotonic() + DEATH_LOOKUP_S
        while dead_worker is not None and not self._life.is_failed:
            dead = dead_worker()
            if dead is not None:
                self._fail(f"{dead} (then: {reason})")
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        self._fail(reason)  # nothing if a death (or anything else) came first

    def _on_step_timeout(self, step: StepInProgress) -> None:
        # Where each rank is stuck is the first thing anyone will ask: rank 0's stacks now,
        # the workers' from their own signal handler, before failing stops them.
        logger.error("keepalive executor: %s outlived its timeout; every rank's Python "
                     "stacks follow (rank 0 first)", step.name)
        faulthandler.dump_traceback(all_threads=True)
        if self._ranks is not None and self._ranks.dump_stacks():
            time.sleep(STACK_DUMP_WAIT_S)
        self._fail(
            f"{step.name} did not return within {step.timeout_s:g}s ({step.timeout_source}); "
            "rank 0 is stuck in it"
        )

    def _give_up(self, failure: Failure, step: StepInProgress) -> None:
        """A step outlived the failure grace: it waits for a rank that is gone."""
        assert self._driver is not None
        why = (f"{failure.reason}, and rank 0 is still inside {step.name} "
               f"{self.settings.failure_grace_s:g}s later (its collectives wait for the "
               "failed rank and cannot finish)")
        self._driver.abandon(ExecutorFailedError(f"keepalive executor failed: {why}"))
        if self._abort_groups is not None:
            # the given-up step's kernels on torch's NCCL groups would spin until the
            # process exits, and torch's watchdog would time out on them: abort those
            # (ncclCommAbort). vLLM's custom all-reduce and pynccl kernels are not torch's
            # and keep spinning until vLLM's error path ends the process (design.md)
            self._abort_groups()
        logger.critical(
            "keepalive executor: %s. The pending call fails, and every later call; rank 0's "
            "thread 'keepalive-driver' stays blocked in it until this process exits. The "
            "executor does not end the process: vLLM's error path does that for its engine "
            "process; in your own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), restart the "
            "program to serve again.", why,
        )

    # ------------------------------------------------------------------ engine calls
    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Run ``method`` on every rank; results in rank order (or rank
        ``unique_reply_rank``'s alone). Raises WorkerRpcError naming a failing rank."""
        refused = compat.refused_rpc(method)
        future = (_failed(NotImplementedError(refused)) if refused is not None
                  else self._submit(Step.rpc(method, args, kwargs, timeout, unique_reply_rank)))
        return future if non_block else future.result()

    def execute_model(  # type: ignore[override]
        self, scheduler_output: Any, non_block: bool = False
    ) -> Any:
        """One model step on every rank. Without structured-output requests it is the fused
        step (one broadcast; see steps.py)."""
        step = Step.execute(scheduler_output, self._model_reply())
        if non_block and self._step_caller is not None:  # the engine polls it (polled.py)
            return self._step_caller.submit(lambda: self._submit(step).result())
        future = self._submit(step)
        return future if non_block else future.result()

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: Any, non_block: bool = False
    ) -> Any:
        """Sampling on every rank (after a fused step: what rank 0 already sampled)."""
        future = self._submit(Step.model_call("sample_tokens", (grammar_output,),
                                              self._model_reply()))
        return future if non_block else future.result()

    def execute_dummy_batch(self) -> None:
        """A dummy step on every rank."""
        self._submit(Step.model_call("execute_dummy_batch", (), Replies.DRIVER)).result()

    def take_draft_token_ids(self) -> Any:
        """The output rank's draft tokens (every rank takes its own)."""
        reply = Replies.OUTPUT if self._pp else Replies.DRIVER
        return self._submit(Step.model_call("take_draft_token_ids", (), reply)).result()

    def _submit(self, step: Step) -> Future:
        assert self._steps is not None, "keepalive executor is not started"
        return self._steps.submit(step)

    def _model_reply(self) -> Replies:
        """What a model step's policy is: the last stage's output (pipeline), every rank's
        connector outputs merged (a KV/EC connector: connectors.py), or rank 0's own."""
        if self._pp:
            return Replies.OUTPUT
        if os.environ.get(_TEST_NO_CONNECTOR_MERGE_ENV) == "1":
            return Replies.DRIVER
        if (getattr(self, "kv_output_aggregator", None) is not None
                or getattr(self, "ec_output_aggregator", None) is not None):
            return Replies.STEP
        return Replies.DRIVER

    def _merge_connector_outputs(self, output: Any, replies: list[Any]) -> Any:
        return merge_connector_outputs(output, replies, self.kv_output_aggregator,
                                       self.ec_output_aggregator)

    def compile_or_warm_up_model(self) -> Any:
        """vLLM's warm-up, returning what vLLM's returns (0.34: every rank's compilation
        times, which the engine iterates). Then, with pipeline parallelism on vLLM's V1 model
        runner (0.32, 0.33), the receive buffer it allocates only in a warm-up run that eager
        mode skips on CPU; without it every stage but the first fails its first step (mp
        too: docs/usage.md). Every rank has answered its warm-up then, which on GPUs ends in
        a full garbage collection (``freeze_gc_heap``) holding its GIL: the ranks' start-up
        is over."""
        compilation_times = super().compile_or_warm_up_model()
        if self._pp and compat.release().pipeline_buffer_fix:
            self.collective_rpc(_allocate_pipeline_buffers)
        if self._ranks is not None:
            self._ranks.end_startup()
        return compilation_times

    def check_health(self) -> None:
        """Raise if failed, if a worker process is gone, or if a round trip takes > 10 s."""
        self._life.check_usable()
        dead = getattr(self._ranks, "dead_worker", lambda: None)()
        if dead is not None:
            self._fail(dead)
            self._life.check_usable()
        self.collective_rpc("check_health", timeout=10)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """Only with ``VLLM_KEEPALIVE_ASYNC_SCHEDULING=1`` (not yet verified on GPUs; vLLM
        turns async scheduling off on CPU anyway). vLLM asks at config time, possibly in its
        front end: a bad value fails there, naming the variable."""
        return async_scheduling_opt_in()

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the pacer, receive the outputs of steps still in flight (PP, bounded), send
        SHUTDOWN (unless failed), reap the ranks. Idempotent."""
        previous = self._life.stop()
        if previous is ExecutorState.STOPPED:
            return
        failed = previous is ExecutorState.FAILED
        if self._step_caller is not None:
            self._step_caller.stop(timeout=SHUTDOWN_SEND_S)
        if self._pacer is not None:
            self._pacer.stop(timeout=SHUTDOWN_SEND_S)
        if self._outputs is not None:
            if not failed:  # after a failure the link may be gone; signals stop the ranks
                self._drain_outputs()
            self._outputs.fail_all(ExecutorFailedError("keepalive executor is shut down"))
            self._outputs.stop()
        channel, steps = self._channel, self._steps
        if not failed and channel is not None and steps is not None and not channel.closed:
            steps.send_shutdown(channel.send_shutdown, SHUTDOWN_SEND_S)
        codes = self._ranks.stop(failed=failed) if self._ranks is not None else {}
        self.worker_exit_codes = codes
        if self._driver is not None:
            # Bounded: after a failure rank 0's thread may be stuck in a step that was
            # interrupted or given up; its clean-up is then best effort, within the grace.
            bound = self.settings.failure_grace_s if failed else SHUTDOWN_SEND_S
            self._driver.shutdown_worker(bound)
            try:
                self._driver.run_within(bound, _destroy_groups)
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.debug("destroying the process groups failed", exc_info=True)
            self._driver.close(timeout=1.0)
        if self._watch is not None:
            self._watch.join(1.0)
        init_method = getattr(self._ranks, "init_method", "")
        if init_method.startswith("file://") and os.path.exists(init_method[7:]):
            os.unlink(init_method[7:])
        self._finalizer.detach()
        logger.info("keepalive executor shut down; worker exit codes %s", codes)

    def _drain_outputs(self) -> None:
        """PP: receive the outputs of batches still in flight (bounded) before SHUTDOWN. The
        output rank blocks in its send until rank 0 receives, so it would never read SHUTDOWN
        (then SIGTERM, SIGKILL). The pacer is already stopped: the in-flight steps keep it
        from sending anyway, and none can race SHUTDOWN."""
        assert self._outputs is not None
        if os.environ.get(_TEST_NO_SHUTDOWN_DRAIN_ENV) == "1":
            logger.warning("TEST ONLY: shutdown does not drain the pipeline's outputs")
        elif not self._outputs.drain(SHUTDOWN_SEND_S):
            logger.warning(
                "keepalive: %d pipeline output(s) did not arrive within %gs of shutdown; "
                "rank %d may stay blocked in its send and be stopped by signal",
                self._outputs.pending, SHUTDOWN_SEND_S, self.output_rank)


def _allocate_pipeline_buffers(worker: Any) -> bool:
    """On stages after the first, allocate the intermediate-tensor buffer if missing."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return True


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def _gather(mine: RpcReply, timeout_s: float | None, *, group: Any, world_size: int,
            dst: int = 0) -> list[RpcReply]:
    """Every rank's reply, on rank 0 (DST: its global rank, the replica's first)."""
    replies = gather_replies(mine, group, dst=dst, world_size=world_size, timeout_s=timeout_s)
    assert replies is not None
    return replies
