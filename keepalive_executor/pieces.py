"""Rank 0's pieces, wired: their start-up, their failure and their shutdown.

:class:`~keepalive_executor.executor.KeepaliveExecutor` is the engine's contract and nothing
else; what it stands on lives here, so the executor reads like vLLM's ``UniProcExecutor``::

    Pieces
      |- Ranks (ranks.py) ------- where ranks 1..N-1 come from: spawned processes
      |                           (thread keepalive-worker-monitor) or torchrun's
      |                           (thread keepalive-liveness)
      |- DriverRank (driver.py) - rank 0's vLLM worker; every call to it runs on its
      |                           thread keepalive-driver, so a stuck one can be given up
      |- BroadcastChannel ------- bytes to every rank (channel.py)
      |- Pacer (pacer.py) ------- thread keepalive-pacer: keepalives while no step is in
      |                           flight (it reads the lifecycle's count and the
      |                           channel's last frame; nothing calls it per step)
      |- StepRunner (steps.py) -- one engine call, one Step: owner lock, lifecycle entry,
      |                           broadcast, rank 0's part, the reply policy; async
      |                           outputs resolved when asked (deferred.py)
      |- OutputReceiver --------- pipeline parallelism: thread keepalive-output-recv
      |  (outputs.py)             receives the last stage's outputs, in step order
      |- StepCaller (polled.py) - vLLM 0.34's engine polls model steps: thread
      |                           keepalive-engine-step makes them, the engine gets a future
      `- Lifecycle + StepWatch -- running/failed/stopped; the step rank 0 is inside and
         (lifecycle.py)           the steps in flight; thread keepalive-step-watch: step
                                  timeouts and giving up a step a failure made endless

Start-up (:meth:`Pieces.start`) is a step of its own for the failure model: the ranks are
watched from the moment they exist, and rank 0's wait in the rendezvous is given up like any
step once a rank is lost.

Failure (:meth:`Pieces.fail`): the first reason wins; vLLM's failure callback is called; the
channel closes, the pacer stops, pending pipeline outputs fail; every later call raises
naming the reason. A step that was running when the failure happened gets
``VLLM_KEEPALIVE_FAILURE_GRACE_S`` to return; then it is given up (:meth:`Pieces._give_up`):
the waiting call fails with the reason (rank 0's thread stays blocked), and vLLM's own error
path ends the engine. Nothing here ends a process.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from keepalive_executor import compat, nccl, startup_timeouts, torchrun
from keepalive_executor.config import (
    KeepaliveSettings,
    check_features,
    check_parallel_layout,
    settings_from_vllm_config,
)
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
from keepalive_executor.protections import Protections
from keepalive_executor.ranks import Ranks, make_ranks
from keepalive_executor.reporting import Reporting, describe
from keepalive_executor.rpc import RpcReply, gather_replies
from keepalive_executor.steps import Step, StepRunner

__all__ = ["Pieces", "validate"]

logger = get_logger(__name__)

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


def _load_model(worker: Any) -> None:
    """Run on every rank: load weights, then let the platform fix the block size."""
    from vllm.platforms import current_platform

    worker.load_model()
    current_platform.update_block_size_for_backend(worker.vllm_config)


def _destroy_groups() -> None:
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


class Pieces:
    """Rank 0's pieces for one executor (see the module docstring). ``polls``: hand the
    engine's non-blocking model steps to a thread of their own (polled.py)."""

    def __init__(self, parallel_config: Any, *, clock: Callable[[], float] = time.monotonic,
                 polls: bool = False, protections: Protections = Protections()) -> None:
        self.life = Lifecycle(clock)
        #: all on but in a negative control's executor (protections.py)
        self.protections = protections
        self.failure_callback: Callable[[], None] | None = None
        self.parallel_config = parallel_config
        self.polls = polls
        self.settings: KeepaliveSettings | None = None
        self.ranks: Ranks | None = None
        self.driver: Any = None
        self.channel: Any = None
        self.pacer: Pacer | None = None
        self.steps: StepRunner | None = None
        self.watch: StepWatch | None = None
        self.outputs: Any = None  # OutputReceiver (pipeline only)
        self.step_caller: StepCaller | None = None
        #: NCCL/RCCL: aborts this process's groups when a step is given up (nccl.py)
        self.abort_groups: Callable[[], object] | None = None
        #: the /metrics snapshot, the failure record, the front end's watch (reporting.py)
        self.report = Reporting(protections)
        #: the engine's start-up is over (every rank answered its warm-up)
        self.started = False
        #: every other rank's exit code, once shutdown reaped them (spawned ranks only)
        self.worker_exit_codes: dict[int, int | None] = {}

    # ------------------------------------------------------------------ start-up
    def start(self, vllm_config: Any) -> None:
        """Validate, bring every rank up, wire the pieces, load the model. On any error:
        tell the other ranks, shut down, raise."""
        ranks = self.ranks = make_ranks(vllm_config, self.protections)
        # from the first moment: an engine whose front end is gone ends, start-up included
        self.report.watch_frontend(on_gone=self.fail, end_ranks=self.kill)
        try:
            settings = validate(vllm_config)
            if not self.protections.startup_timeouts:
                settings = replace(settings, channel=replace(settings.channel,
                                                             startup_timeout_s=None))
            self.settings = settings
            logger.info("%s", settings.describe())
            for name in self.protections.off():
                logger.warning("keepalive: protection %r is OFF (a negative control's "
                               "executor; see protections.py)", name)
            self._start(vllm_config, ranks, settings)
        except BaseException as e:
            ranks.tell_error(f"rank 0's executor failed to start: {type(e).__name__}: {e}")
            self.shutdown()
            raise

    def _start(self, vllm_config: Any, ranks: Ranks, settings: KeepaliveSettings) -> None:
        self.watch = self._make_watch(settings)
        self.watch.start()
        driver = self.driver = DriverRank()
        if settings.nccl_error_handling is not None:
            # before any NCCL group of this process, and before the workers inherit the
            # environment: a failed collective is then an error here, not a SIGABRT
            nccl.apply_error_handling("nccl")
            self.abort_groups = nccl.abort_groups
        ranks.start(vllm_config, settings)
        early_watch = self.protections.early_worker_watch
        if early_watch:
            ranks.watch(self.fail)
        # Start-up is a step of its own for the failure model: a rank lost while rank 0 waits
        # in the rendezvous fails it within the failure grace (the watch gives the wait up),
        # and a rendezvous that never completes fails it at the start-up timeout.
        self.life.enter("start-up (joining the process groups)", settings.startup_timeout_s,
                        STARTUP_TIMEOUT_SOURCE)
        try:
            # vLLM's groups are created under the start-up timeout (startup_timeouts.py);
            # the executor gives them the user's back once the warm-up is over
            with startup_timeouts.during_startup(self.parallel_config,
                                                 settings.channel.startup_timeout_s):
                driver.create(
                    vllm_config,
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
            self.life.exit()
        self.life.check_usable()
        if link is not None:
            self.outputs = OutputReceiver(link, on_lost=self.fail)
        gather = partial(_gather, group=reply_group,
                         world_size=self.parallel_config.world_size, dst=channel.src)
        self.report.start_metrics(vllm_config, settings, channel.frame_bytes,
                                  lambda: describe(self.life, self.ranks, self.started))
        self.wire(settings, channel, driver, gather)
        if not early_watch:
            ranks.watch(self.fail)
        self.steps.submit(Step.rpc(_load_model)).result()  # type: ignore[union-attr]

    def _make_watch(self, settings: KeepaliveSettings) -> StepWatch:
        return StepWatch(self.life, settings.failure_grace_s, self._on_step_timeout,
                         self._give_up, horizon_s=settings.execute_timeout_s)

    def wire(self, settings: KeepaliveSettings, channel: Any, driver: Any,
             gather: Callable[[RpcReply, float | None], list[RpcReply]],
             *, clock: Callable[[], float] = time.monotonic, threads: bool = True) -> None:
        """Wire the pieces on a channel and a rank 0 (also what unit tests call with
        fakes; ``threads=False``: start none)."""
        self.settings = settings
        self.channel = channel
        self.driver = driver
        life = self.life
        # the pacer is told nothing: it reads the steps in flight from the lifecycle and
        # the last frame's time from the channel when it wakes (pacer.py)
        self.pacer = Pacer(
            settings.interval_s, self.report.counted(channel.send_keepalive),
            send_lock=channel.send_lock,
            busy=lambda: life.in_flight > 0, last_frame=lambda: channel.last_sent_at,
            clock=clock, on_failure=lambda e: self.fail(f"keepalive broadcast failed: {e}"),
            on_thread_start=channel.bind_thread,
        )
        self.steps = StepRunner(
            channel=channel, driver=driver, lifecycle=life,
            gather=gather, fail=self._fail_in_step, execute_timeout_s=settings.execute_timeout_s,
            error_window_s=settings.failure_grace_s,
            expect=None if self.outputs is None else self.outputs.expect,
            meter=self.report.meter,
        )
        if self.polls:
            self.step_caller = StepCaller()
        if self.watch is None:
            self.watch = self._make_watch(settings)
        if not threads:
            return
        if self.outputs is not None:
            self.outputs.start()
        if self.protections.keepalives:
            self.pacer.start()

    # ------------------------------------------------------------------ failure
    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the executor fails (at once if it already has)."""
        with self.life.cond:
            if self.life.state is ExecutorState.RUNNING:
                self.failure_callback = callback
                return
        if self.life.is_failed:
            callback()

    def fail(self, reason: str) -> None:
        """The executor fails for ``reason`` (only the first reason counts)."""
        failure = self.life.fail(reason)
        if failure is None:
            return
        with self.life.cond:
            callback, self.failure_callback = self.failure_callback, None
        logger.error("keepalive executor failed: %s", reason)
        torchrun.record_failure(reason)
        self.report.failed(reason)
        if self.channel is not None:
            self.channel.close()
        if self.pacer is not None:
            self.pacer.request_stop()
        if self.outputs is not None:
            self.outputs.fail_all(ExecutorFailedError(f"keepalive executor failed: {reason}"))
        if failure.stuck is not None and self.settings is not None:
            logger.error(
                "keepalive executor: rank 0 is inside %s; it has %gs to return "
                "(VLLM_KEEPALIVE_FAILURE_GRACE_S)", failure.stuck.name,
                self.settings.failure_grace_s,
            )
        if callback is not None:
            callback()

    def end_startup(self) -> None:
        """The engine's start-up is over (its last start-up call returned: compat.py)."""
        if self.ranks is not None:
            self.ranks.end_startup()
        self.started = True
        self.report.changed()

    def dead_worker(self) -> str | None:
        """The first rank known to be dead, if the ranks can tell (spawned ranks)."""
        return getattr(self.ranks, "dead_worker", lambda: None)()

    def _fail_in_step(self, reason: str) -> None:
        """A step broke on rank 0 (a collective raised, rank 0 raised after the broadcast):
        if a rank died, the failure is that death, then the step's error (DEATH_LOOKUP_S)."""
        can_tell = getattr(self.ranks, "dead_worker", None) is not None
        deadline = time.monotonic() + DEATH_LOOKUP_S
        while can_tell and not self.life.is_failed:
            dead = self.dead_worker()
            if dead is not None:
                self.fail(f"{dead} (then: {reason})")
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        self.fail(reason)  # nothing if a death (or anything else) came first

    def _on_step_timeout(self, step: StepInProgress) -> None:
        # Where each rank is stuck is the first thing anyone will ask: rank 0's stacks now,
        # the workers' from their own signal handler, before failing stops them.
        logger.error("keepalive executor: %s outlived its timeout; every rank's Python "
                     "stacks follow (rank 0 first)", step.name)
        faulthandler.dump_traceback(all_threads=True)
        if self.ranks is not None and self.ranks.dump_stacks():
            time.sleep(STACK_DUMP_WAIT_S)
        self.fail(
            f"{step.name} did not return within {step.timeout_s:g}s ({step.timeout_source}); "
            "rank 0 is stuck in it"
        )

    def _give_up(self, failure: Failure, step: StepInProgress) -> None:
        """A step outlived the failure grace: it waits for a rank that is gone."""
        assert self.driver is not None and self.settings is not None
        why = (f"{failure.reason}, and rank 0 is still inside {step.name} "
               f"{self.settings.failure_grace_s:g}s later (its collectives wait for the "
               "failed rank and cannot finish)")
        self.driver.abandon(ExecutorFailedError(f"keepalive executor failed: {why}"))
        if self.abort_groups is not None:
            # the given-up step's kernels on torch's NCCL groups would spin until the
            # process exits, and torch's watchdog would time out on them: abort those
            # (ncclCommAbort). vLLM's custom all-reduce and pynccl kernels are not torch's
            # and keep spinning until vLLM's error path ends the process (design.md)
            self.abort_groups()
        logger.critical(
            "keepalive executor: %s. The pending call fails, and every later call; rank 0's "
            "thread 'keepalive-driver' stays blocked in it until this process exits. The "
            "executor does not end the process: vLLM's error path does that for its engine "
            "process; in your own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), restart the "
            "program to serve again.", why,
        )

    # ------------------------------------------------------------------ shutdown
    def kill(self) -> None:
        """The executor was collected without a shutdown: end the other ranks."""
        if self.ranks is not None:
            self.ranks.kill()

    def shutdown(self) -> None:
        """Stop the pacer, receive the outputs of steps still in flight (PP, bounded), send
        SHUTDOWN (unless failed), reap the ranks. Idempotent."""
        self.report.shutting_down()
        previous = self.life.stop()
        if previous is ExecutorState.STOPPED:
            return
        failed = previous is ExecutorState.FAILED
        if self.step_caller is not None:
            self.step_caller.stop(timeout=SHUTDOWN_SEND_S)
        if self.pacer is not None:
            self.pacer.stop(timeout=SHUTDOWN_SEND_S)
        if self.outputs is not None:
            if not failed:  # after a failure the link may be gone; signals stop the ranks
                self._drain_outputs()
            self.outputs.fail_all(ExecutorFailedError("keepalive executor is shut down"))
            self.outputs.stop()
        channel, steps = self.channel, self.steps
        if not failed and channel is not None and steps is not None and not channel.closed:
            _send_shutdown(steps.owner, channel.send_shutdown, SHUTDOWN_SEND_S)
        codes = self.ranks.stop(failed=failed) if self.ranks is not None else {}
        self.report.stop(failed=failed)
        self.worker_exit_codes = codes
        if self.driver is not None:
            # Bounded: after a failure rank 0's thread may be stuck in a step that was
            # interrupted or given up; its clean-up is then best effort, within the grace.
            grace = self.settings.failure_grace_s if self.settings is not None else 0.5
            bound = grace if failed else SHUTDOWN_SEND_S
            self.driver.shutdown_worker(bound)
            try:
                self.driver.run_within(bound, _destroy_groups)
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.debug("destroying the process groups failed", exc_info=True)
            self.driver.close(timeout=1.0)
        if self.watch is not None:
            self.watch.join(1.0)
        init_method = getattr(self.ranks, "init_method", "")
        if init_method.startswith("file://") and os.path.exists(init_method[7:]):
            os.unlink(init_method[7:])
        logger.info("keepalive executor shut down; worker exit codes %s", codes)

    def _drain_outputs(self) -> None:
        """PP: receive the outputs of batches still in flight (bounded) before SHUTDOWN. The
        output rank blocks in its send until rank 0 receives, so it would never read SHUTDOWN
        (then SIGTERM, SIGKILL). The pacer is already stopped: the in-flight steps keep it
        from sending anyway, and none can race SHUTDOWN."""
        assert self.outputs is not None
        if not self.protections.shutdown_drain:
            return
        if not self.outputs.drain(SHUTDOWN_SEND_S):
            logger.warning(
                "keepalive: %d pipeline output(s) did not arrive within %gs of shutdown; "
                "rank %d may stay blocked in its send and be stopped by signal",
                self.outputs.pending, SHUTDOWN_SEND_S, output_rank(self.parallel_config))


def _send_shutdown(owner: Any, channel_shutdown: Callable[[], Any], timeout_s: float) -> bool:
    """Broadcast SHUTDOWN once no step holds the channel (``owner``, the step runner's lock),
    from thread keepalive-send-shutdown; bounded by ``timeout_s`` whatever the channel does."""
    if not owner.acquire(timeout=timeout_s):
        logger.warning("keepalive: a step still holds the channel; SHUTDOWN not sent")
        return False
    try:
        outcome: list[BaseException | None] = []

        def send() -> None:
            try:
                channel_shutdown()
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - workers are then stopped by signal
                outcome.append(e)

        sender = threading.Thread(target=send, name="keepalive-send-shutdown", daemon=True)
        sender.start()
        sender.join(timeout_s)
    finally:
        owner.release()
    if not outcome or outcome[0] is not None:
        logger.warning("could not broadcast SHUTDOWN to the other ranks: %s",
                       outcome[0] if outcome else f"still sending after {timeout_s:g}s")
        return False
    return True


def _gather(mine: RpcReply, timeout_s: float | None, *, group: Any, world_size: int,
            dst: int = 0) -> list[RpcReply]:
    """Every rank's reply, on rank 0 (DST: its global rank, the replica's first)."""
    replies = gather_replies(mine, group, dst=dst, world_size=world_size, timeout_s=timeout_s)
    assert replies is not None
    return replies
