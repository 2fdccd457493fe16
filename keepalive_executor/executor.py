"""KeepaliveExecutor: vLLM's executor contract on one side, rank 0's pieces on the other.

The driver (rank 0) lives in the engine process and runs its share of the model in-process,
as vLLM's ``UniProcExecutor`` does; ranks 1..N-1 wait indefinitely in
:func:`keepalive_executor.worker_loop.receive_loop`. Every engine call is one
:class:`~keepalive_executor.steps.Step`, and :meth:`StepRunner.submit
<keepalive_executor.steps.StepRunner.submit>` (the only way in) answers it with a Future, as
mp's ``FutureWrapper`` does; while the engine is idle the pacer broadcasts a no-op keepalive
every ``interval`` (:mod:`keepalive_executor.pacer`). What the executor stands on (the ranks,
rank 0's worker and thread, the channel, the pacer, the step runner, the step watch), its
start-up, failure and shutdown live in :mod:`keepalive_executor.pieces`; this class is the
engine's calls, a few lines each.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm.v1.executor.abstract import Executor, FailureCallback

from keepalive_executor import compat, startup_timeouts
from keepalive_executor.config import async_scheduling_opt_in
from keepalive_executor.connectors import merge as merge_connector_outputs
from keepalive_executor.lifecycle import ExecutorFailedError, ExecutorState
from keepalive_executor.log import get_logger
from keepalive_executor.pieces import Pieces, validate
from keepalive_executor.protections import Protections
from keepalive_executor.rpc import Replies, RpcRequest
from keepalive_executor.steps import Step, execute_and_sample, execute_then_sample

__all__ = ["KeepaliveExecutor", "ExecutorFailedError"]

logger = get_logger(__name__)


class KeepaliveExecutor(Executor):
    """Driver in-process, the other ranks on one broadcast channel."""

    uses_ray: bool = False
    supports_pp: bool = True
    #: Whether the engine polls model steps while they run (polled.py); None: as the
    #: installed vLLM release's engine does (compat.py). Tests set it on a subclass.
    poll_steps: bool | None = None
    #: What the executor does so that a scenario does not fail, all on; a test's negative
    #: control is a subclass with one off (protections.py, tests/controls.py).
    protections: Protections = Protections()
    validate = staticmethod(validate)
    #: vLLM 0.34's engine refuses POST /checkpoint/prepare before it pauses anything
    #: (compat.refuse_checkpoints_first): the channel cannot be suspended for a checkpoint
    refuses_process_checkpoints: bool = True
    #: the worker method after whose return the start-up is over, once the warm-up has
    #: told (compat.last_startup_call); None before that, and after the start-up
    _startup_ends_after: str | None = None

    def _init_executor(self) -> None:
        compat.refuse_checkpoints_first()  # this engine process's, before it serves
        self._pp = self.parallel_config.pipeline_parallel_size > 1
        self._pieces = pieces = Pieces(self.parallel_config, polls=self._engine_polls_steps(),
                                       protections=self.protections)
        self._finalizer = weakref.finalize(self, pieces.kill)
        pieces.start(self.vllm_config)

    def _engine_polls_steps(self) -> bool:
        """One batch at a time (no pipeline, no async scheduling) under an engine that
        polls the step's future (polled.py)."""
        polls = (compat.release().engine_polls_step_futures if self.poll_steps is None
                 else self.poll_steps)
        return (polls and not self._pp
                and not getattr(self.scheduler_config, "async_scheduling", False))

    # what tests and tools read of the pieces
    _ranks = property(lambda self: self._pieces.ranks)
    _channel = property(lambda self: self._pieces.channel)
    _pacer = property(lambda self: self._pieces.pacer)
    _outputs = property(lambda self: self._pieces.outputs)
    worker_exit_codes = property(lambda self: self._pieces.worker_exit_codes)

    # ------------------------------------------------------------------ failure
    @property
    def is_failed(self) -> bool:
        """True once the executor failed (vLLM's fault-tolerance sentinel reads this)."""
        return self._pieces.life.is_failed

    @property
    def state(self) -> ExecutorState:
        """running, failed or stopped."""
        return self._pieces.life.state

    @property
    def failure_callback(self) -> FailureCallback | None:
        """The registered failure callback, not yet called (vLLM 0.34's sentinel and
        ``MultiprocExecutor`` expose the same attribute)."""
        return self._pieces.failure_callback

    @failure_callback.setter
    def failure_callback(self, callback: FailureCallback | None) -> None:
        with self._pieces.life.cond:
            self._pieces.failure_callback = callback

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback`` when the executor fails (at once if it already has)."""
        self._pieces.register_failure_callback(callback)

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
        if non_block:
            return future
        result = future.result()
        self._after_startup_call(method)  # 0.34: the start-up's last call is an RPC
        return result

    def execute_model(  # type: ignore[override]
        self, scheduler_output: Any, non_block: bool = False
    ) -> Any:
        """One model step on every rank. Without structured-output requests (vLLM's grammar
        output is then None by construction) it is the fused step: every rank samples
        right after its forward pass, one broadcast (steps.py)."""
        fused = not getattr(scheduler_output, "has_structured_output_requests", True)
        step = self._model_step("execute_model", (scheduler_output,), fused=fused)
        caller = self._pieces.step_caller
        if non_block and caller is not None:  # the engine polls it (polled.py)
            return caller.submit(lambda: self._submit(step).result())
        future = self._submit(step)
        return future if non_block else future.result()

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: Any, non_block: bool = False
    ) -> Any:
        """Sampling on every rank (after a fused step: what rank 0 already sampled)."""
        future = self._submit(self._model_step("sample_tokens", (grammar_output,)))
        return future if non_block else future.result()

    def execute_dummy_batch(self) -> None:
        """A dummy step on every rank."""
        self._submit(self._model_step("execute_dummy_batch", (), Replies.DRIVER)).result()

    def take_draft_token_ids(self) -> Any:
        """The output rank's draft tokens (every rank takes its own)."""
        reply = Replies.OUTPUT if self._pp else Replies.DRIVER
        return self._submit(self._model_step("take_draft_token_ids", (), reply)).result()

    def _submit(self, step: Step) -> Future:
        steps = self._pieces.steps
        assert steps is not None, "keepalive executor is not started"
        return steps.submit(step)

    def _model_step(self, method: str, args: tuple, reply: Replies | None = None, *,
                    fused: bool = False) -> Step:
        """A model step under ``reply``, or this executor's policy. ``fused``: rank 0 runs
        ``execute_then_sample`` (both outputs), the other ranks ``execute_and_sample``; the
        output rank of a pipeline sends both halves (steps.py)."""
        if self._startup_ends_after is not None:
            # the release's last start-up call never came (a release this one was not
            # written for): the first model step ends the start-up instead
            logger.warning("keepalive: the engine's first model step came before %s, after "
                           "which the start-up was to end; it ends now",
                           self._startup_ends_after)
            self._after_startup_call(self._startup_ends_after)
        merge = None
        if reply is None:
            reply, merge = self._policy()
        if not fused:
            return Step(method, RpcRequest(method, args, {}, reply), model=True, merge=merge)
        wire = execute_then_sample if reply is Replies.OUTPUT else execute_and_sample
        return Step(method, RpcRequest(wire, args, {}, reply), local=execute_then_sample,
                    model=True, merge=merge)

    def _policy(self) -> tuple[Replies, Callable[[Any, list[Any]], Any] | None]:
        """A model step's reply policy: the last stage's output (pipeline), every rank's
        connector outputs merged (a KV/EC connector: connectors.py), or rank 0's own."""
        if self._pp:
            return Replies.OUTPUT, None
        if self.protections.connector_merge and (
                getattr(self, "kv_output_aggregator", None) is not None
                or getattr(self, "ec_output_aggregator", None) is not None):
            return Replies.STEP, self._merge_connector_outputs
        return Replies.DRIVER, None

    def _merge_connector_outputs(self, output: Any, replies: list[Any]) -> Any:
        return merge_connector_outputs(output, replies, self.kv_output_aggregator,
                                       self.ec_output_aggregator)

    def compile_or_warm_up_model(self) -> Any:
        """vLLM's warm-up, returning what vLLM's returns (0.34: every rank's compilation
        times, which the engine iterates). Then, with pipeline parallelism on vLLM's V1 model
        runner (0.32, 0.33), the receive buffer it allocates only in a warm-up run that eager
        mode skips on CPU; without it every stage but the first fails its first step (mp
        too: docs/usage.md). The start-up ends here, or after the call the release makes
        last (:meth:`_after_startup_call`)."""
        compilation_times = super().compile_or_warm_up_model()
        if self._pp and compat.release().pipeline_buffer_fix:
            self.collective_rpc(_allocate_pipeline_buffers)
        self._startup_ends_after = compat.release().last_startup_call(self.vllm_config)
        self._after_startup_call("compile_or_warm_up_model")
        return compilation_times

    def _after_startup_call(self, method: Any) -> None:
        """Once the engine's last start-up call (``compat.last_startup_call``) has returned
        on every rank, the start-up is over: every rank's groups get the user's timeouts
        back (startup_timeouts.py), and the pieces hear it (the ranks' liveness, /metrics)."""
        if method != self._startup_ends_after:
            return
        self._startup_ends_after = None
        if startup_timeouts.pending():
            self.collective_rpc(_end_startup_timeouts)
        self._pieces.end_startup()

    def check_health(self) -> None:
        """Raise if failed, if a worker process is gone, or if a round trip takes > 10 s."""
        life = self._pieces.life
        life.check_usable()
        dead = self._pieces.dead_worker()
        if dead is not None:
            self._pieces.fail(dead)
            life.check_usable()
        self.collective_rpc("check_health", timeout=10)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """Only with ``VLLM_KEEPALIVE_ASYNC_SCHEDULING=1`` (not yet verified on GPUs; vLLM
        turns async scheduling off on CPU anyway). vLLM asks at config time, possibly in its
        front end: a bad value fails there, naming the variable."""
        return async_scheduling_opt_in()

    def shutdown(self) -> None:
        """Stop the pacer, receive the pipeline's outputs in flight, send SHUTDOWN (unless
        failed), reap the ranks (pieces.py). Idempotent."""
        pieces = getattr(self, "_pieces", None)
        if pieces is not None:
            pieces.shutdown()
            self._finalizer.detach()


def _allocate_pipeline_buffers(worker: Any) -> bool:
    """On stages after the first, allocate the intermediate-tensor buffer if missing."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = worker.model_runner
    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return True


def _end_startup_timeouts(worker: Any) -> int:
    """On every rank, once the engine's start-up is over: vLLM's groups get the user's
    timeouts back (startup_timeouts.py); returns how many."""
    return startup_timeouts.restore()


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future
