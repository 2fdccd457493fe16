"""The non-driver rank: wait on the driver's broadcast indefinitely, run what it says.

A worker process (ranks 1..N-1) goes through::

    start -> init_worker -> ALIVE on the ready pipe -> init_device (joins the process
          groups) -> build channel -> READY -> receive loop -> SHUTDOWN -> exit (code 0)

The driver joins the process groups only after every worker said ALIVE: the rendezvous
waits at most the collective timeout, which may be seconds, while a worker's start-up
(a fresh interpreter importing vLLM on a loaded machine) may take longer.

In the receive loop a KEEPALIVE is "nothing to do": the worker goes straight back to waiting.
A PAYLOAD is an engine call's envelope (:mod:`keepalive_executor.rpc`), decoded here: the
worker runs the call on its vLLM worker and, if the call wants replies, joins the reply
gather. A call whose body this rank cannot decode is answered with an error reply naming the
rank when the driver waits for replies (the ranks stay in step); a model step it cannot
decode or run is fatal for this rank (the driver already runs it). Exit codes
(:mod:`keepalive_executor.exit_codes`):

* 0  after SHUTDOWN;
* 1  the channel broke (driver died, collective timed out) or a no-reply step failed;
* 2  the parent process went away (death pipe closed) outside a shutdown.
"""

from __future__ import annotations

import os
import signal
import threading
import traceback
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from keepalive_executor import compat, exit_codes, nccl, startup_timeouts
from keepalive_executor.channel import (
    BroadcastChannel,
    ChannelError,
    ChannelSpec,
    MessageKind,
)
from keepalive_executor.compat import WorkerWatchdog
from keepalive_executor.connectors import step_reply
from keepalive_executor.groups import open_world_channel
from keepalive_executor.log import get_logger, register_stack_dump
from keepalive_executor.outputs import OutputSender, open_output_link, resolve_output
from keepalive_executor.rpc import (
    Replies,
    RequestDecodeError,
    RpcReply,
    RpcRequest,
    decode_request,
    gather_replies,
)

__all__ = [
    "ReceiveCounts", "receive_counts",
    "receive_loop", "name_process", "run_worker", "worker_main",
    "WorkerStepError",
]

logger = get_logger(__name__)

#: where run_worker leaves its loop's counts on the vLLM worker it drives
_COUNTS_ATTR = "_keepalive_receive_counts"


@dataclass
class ReceiveCounts:
    """What one receive loop has seen so far, owned by that loop. :func:`run_worker` leaves
    its loop's on the vLLM worker it drives, so a ``collective_rpc`` can read it on every
    rank (:func:`receive_counts`); for observability and tests, nothing here reads it."""

    keepalives: int = 0


def receive_counts(worker: Any) -> ReceiveCounts | None:
    """The counts of the receive loop driving ``worker`` (the object a ``collective_rpc``
    callable gets), None where no receive loop drives it (rank 0)."""
    return getattr(worker, _COUNTS_ATTR, None)


class WorkerStepError(RuntimeError):
    """A call without replies (a model step) raised on this rank."""


def run_request(worker: Any, req: RpcRequest) -> Any:
    """Run one request on a vLLM worker (wrapper). An async output (async scheduling) is
    returned as it is: it is resolved only where it is returned (see :func:`_run_one` and
    the output link), never on a rank that drops it, as vLLM's mp does on its non-output
    ranks."""
    from vllm.v1.serial_utils import run_method

    return run_method(worker, req.method, req.args, req.kwargs or {})


def receive_loop(
    worker: Any,
    channel: BroadcastChannel,
    reply_group: Any,
    *,
    rank: int,
    world_size: int,
    run: Any = run_request,
    output: Any = None,
    counts: ReceiveCounts | None = None,
    watchdog: WorkerWatchdog | None = None,
) -> int:
    """Follow the driver until SHUTDOWN; return the number of keepalives seen.

    ``output``: this rank's end of the output link, if it is the output rank of a pipeline
    (it sends the result of every ``Replies.OUTPUT`` call to rank 0). ``counts``: where the
    loop counts what it sees as it goes (a fresh one if not given). ``watchdog``: vLLM's
    stack-dump watchdog (compat.py), off while the loop waits, fed around each call."""
    counts = ReceiveCounts() if counts is None else counts
    watchdog = WorkerWatchdog() if watchdog is None else watchdog
    while True:
        with watchdog.waiting():
            msg = channel.recv()
        watchdog.feed()
        if msg.kind is MessageKind.KEEPALIVE:
            counts.keepalives += 1
            continue
        if msg.kind is MessageKind.SHUTDOWN:
            logger.info("rank %d: SHUTDOWN from the driver after %d keepalives", rank,
                        counts.keepalives)
            return counts.keepalives
        assert msg.data is not None
        try:
            call = decode_request(msg.data)
        except RequestDecodeError as e:
            # Not even the header: the driver speaks another format. Fatal, and loud.
            raise WorkerStepError(f"rank {rank}: {e}") from e
        if call.request is None:
            logger.error("rank %d could not decode %s: %s", rank, call.name, call.error)
            reply = RpcReply(rank=rank, ok=False,
                             error=f"rank {rank} could not decode the call: {call.error}")
            if call.replies is Replies.OUTPUT and output is not None:
                output.send(reply)  # rank 0 learns why before this rank goes
            if call.replies is not Replies.ALL:
                raise WorkerStepError(f"rank {rank}: could not decode {call.name}: {call.error}")
        elif call.replies is Replies.OUTPUT:
            _run_output_step(worker, call.request, rank, run, output)
            watchdog.feed()
            continue
        else:
            reply = _run_one(worker, call.request, rank, run)
        watchdog.feed()
        if call.replies is not Replies.DRIVER:
            if call.replies is Replies.STEP:
                reply = RpcReply(rank=rank, ok=True, value=step_reply(reply.value))
            gather_replies(reply, reply_group, dst=channel.src, world_size=world_size)


def _run_output_step(worker: Any, req: RpcRequest, rank: int, run: Any, output: Any) -> None:
    """A pipeline step: every rank runs it; the output rank sends its result to rank 0 (the
    link resolves an async output first: outputs.py); the other ranks drop theirs."""
    try:
        value = run(worker, req)
    except Exception as e:
        logger.exception("rank %d: %s raised", rank, req.name)
        if output is not None:
            output.send(RpcReply(rank=rank, ok=False, error=f"{type(e).__name__}: {e}",
                                 traceback=traceback.format_exc()))
        raise WorkerStepError(f"rank {rank}: {req.name} raised {e!r}") from e
    if output is not None:
        output.send(RpcReply(rank=rank, ok=True, value=value))


def _run_one(worker: Any, req: RpcRequest, rank: int, run: Any) -> RpcReply:
    try:
        value = run(worker, req)
        if req.replies is not Replies.DRIVER:  # returned: resolved; dropped: never
            value = resolve_output(value)
        return RpcReply(rank=rank, ok=True, value=value)
    except Exception as e:  # noqa: BLE001 - reported to the driver or fatal
        logger.exception("rank %d: %s raised", rank, req.name)
        if req.replies is not Replies.ALL:
            raise WorkerStepError(f"rank {rank}: {req.name} raised {e!r}") from e
        return RpcReply(
            rank=rank,
            ok=False,
            error=f"{type(e).__name__}: {e}",
            traceback=traceback.format_exc(),
        )


def _watch_parent(death_pipe: Connection, shutting_down: threading.Event) -> None:
    """Exit the process when the parent dies (its end of the pipe closes)."""

    def watch() -> None:
        try:
            death_pipe.recv()
        except (EOFError, OSError):
            pass
        if not shutting_down.is_set():
            logger.error("keepalive worker: parent process exited; exiting")
            os._exit(exit_codes.ORPHANED)

    threading.Thread(target=watch, name="keepalive-parent-watch", daemon=True).start()


def process_name(rank: int, parallel_config: Any = None) -> str:
    """``KeepaliveWorker_TP<rank>``; under pipeline parallelism
    ``KeepaliveWorker_PP<stage>_TP<rank in the stage>``, as vLLM's mp names its workers."""
    pp = getattr(parallel_config, "pipeline_parallel_size", 1)
    if pp <= 1:
        return f"KeepaliveWorker_TP{rank}"
    tp = parallel_config.tensor_parallel_size
    return f"KeepaliveWorker_PP{rank // tp}_TP{rank % tp}"


def name_process(rank: int, parallel_config: Any = None) -> None:
    """The process's name in ps/top ("VLLM::" + process_name), and its log-line prefix."""
    from vllm.utils.system_utils import decorate_logs, set_process_title

    name = process_name(rank, parallel_config)
    set_process_title(name=name)
    decorate_logs(name)


def run_worker(
    *,
    vllm_config: Any,
    rank: int,
    local_rank: int,
    distributed_init_method: str,
    spec: ChannelSpec,
    shared_worker_lock: Any,
    on_ready: Any,
    stop_requested: threading.Event,
    on_constructed: Any = None,
) -> int:
    """Build this rank's vLLM worker, follow the driver, clean up; return the exit code.

    ``stop_requested`` is set by whoever asked this rank to stop (a signal): once it is
    set, a channel that breaks (the driver went away) is a normal end, code 0.
    ``on_constructed()`` runs once the worker exists (imports done), just before it joins
    the process groups; ``on_ready()`` once it has joined them and built its channel.
    """
    from vllm.logger import configure_logging_if_needed
    from vllm.platforms import current_platform
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    # vLLM configures logging per process from the config (level, format, file).
    configure_logging_if_needed(vllm_config.logging_config)
    world_size = vllm_config.parallel_config.world_size
    code = exit_codes.FAILED
    wrapper = None
    on_nccl = False
    try:
        from vllm.v1.executor.vllm_net_devices import set_worker_net_device

        set_worker_net_device(local_rank, vllm_config)  # NIC selection, as mp's workers do
        wrapper = WorkerWrapperBase(rpc_rank=rank, global_rank=rank)
        all_kwargs: list[dict] = [{} for _ in range(world_size)]
        all_kwargs[rank] = dict(
            vllm_config=vllm_config,
            local_rank=local_rank,
            rank=rank,
            distributed_init_method=distributed_init_method,
            is_driver_worker=False,
            shared_worker_lock=shared_worker_lock,
        )
        wrapper.init_worker(all_kwargs)
        if on_constructed is not None:
            on_constructed()
        # before this process's first NCCL group (init_device creates them)
        on_nccl = nccl.apply_error_handling(current_platform.dist_backend) is not None
        # vLLM's groups under the start-up timeout until rank 0 ends it (startup_timeouts.py)
        with startup_timeouts.during_startup(vllm_config.parallel_config,
                                             spec.startup_timeout_s):
            wrapper.init_device()
            channel, reply_group = open_world_channel(spec, vllm_config.parallel_config)
            output = open_output_link(vllm_config.parallel_config, spec.output_timeout_s)
        if output is not None and vllm_config.scheduler_config.async_scheduling:
            output = OutputSender(output, bind_thread=partial(_bind_device, wrapper))
        counts = ReceiveCounts()
        setattr(wrapper, _COUNTS_ATTR, counts)
        on_ready()
        watchdog = compat.start_worker_watchdog(rank, vllm_config)  # after ready, as mp
        receive_loop(wrapper, channel, reply_group, rank=rank, world_size=world_size,
                     output=output, counts=counts, watchdog=watchdog)
        if output is not None:
            output.close()
        code = exit_codes.OK
    except ChannelError as e:
        if stop_requested.is_set():
            logger.info("keepalive worker rank %d: driver gone after a stop request", rank)
            code = exit_codes.OK
        else:
            logger.error("keepalive worker rank %d stops: %s", rank, e)
    except WorkerStepError as e:
        logger.error("keepalive worker rank %d stops: %s", rank, e)
    except SystemExit:
        code = exit_codes.OK if stop_requested.is_set() else exit_codes.FAILED
    except BaseException:  # noqa: BLE001 - logged, then a non-zero exit
        logger.exception("keepalive worker rank %d failed", rank)
    finally:
        stop_requested.set()
        clean_up(wrapper, code, abort=nccl.abort_groups if on_nccl else None)
    return code


def clean_up(wrapper: Any, code: int, abort: Any = None) -> None:
    """After the receive loop: on an error exit first abort the NCCL groups (``abort``,
    bounded), so that a kernel of the step that broke cannot hold the worker's shutdown on
    the GPU; then vLLM's worker shutdown; after a clean exit also destroy the groups."""
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    try:
        if code != exit_codes.OK and abort is not None:
            abort(wait_s=nccl.ABORT_WAIT_S)
        if wrapper is not None and getattr(wrapper, "worker", None) is not None:
            wrapper.shutdown()
        if code == exit_codes.OK:
            destroy_model_parallel()
            destroy_distributed_environment()
    except Exception:  # noqa: BLE001 - best effort on the way out
        logger.debug("cleanup after the receive loop failed", exc_info=True)


def _bind_device(wrapper: Any) -> None:
    """In a thread of a worker that makes CUDA calls: that worker's device (vLLM's mp does
    the same in its output thread: without it the thread's first call creates a context on
    device 0)."""
    from vllm.platforms import current_platform

    device = getattr(getattr(wrapper, "worker", None), "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        current_platform.set_device(device)


def worker_main(
    *, rank: int, ready_pipe: Connection, death_pipe: Connection, **worker_kwargs: Any
) -> None:
    """Entry point of a worker process started by the executor.

    ``worker_kwargs`` are :func:`run_worker`'s (the configuration, local rank, init method,
    channel spec, shared lock), as the launcher passes them.
    """
    shutting_down = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        shutting_down.set()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    register_stack_dump()
    _watch_parent(death_pipe, shutting_down)

    name_process(rank, worker_kwargs["vllm_config"].parallel_config)

    def alive() -> None:
        ready_pipe.send({"status": "ALIVE", "rank": rank, "pid": os.getpid()})

    def ready() -> None:
        ready_pipe.send({"status": "READY", "rank": rank, "pid": os.getpid()})
        ready_pipe.close()

    code = run_worker(rank=rank, on_ready=ready, on_constructed=alive,
                      stop_requested=shutting_down, **worker_kwargs)
    os._exit(code)
