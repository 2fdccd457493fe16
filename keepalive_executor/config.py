"""Settings of the keepalive executor: read once on the driver, validated at start-up.

Every setting goes through this module, so a bad value fails start-up (in vLLM's front end,
before any weight loads) with a message naming the setting, its value and the fix. Ranks
other than the driver receive what they need from it; the only things a torchrun follower
reads itself are node-local (its start-up timeout, the shared secret).

====================================  =============================================================
setting                               rule
====================================  =============================================================
``VLLM_KEEPALIVE_TRANSPORT``          ``device`` (the world device group: NCCL/RCCL on GPUs, gloo
                                      on CPU) or ``cpu`` (the world gloo CPU group). Default:
                                      ``cpu`` on NCCL/RCCL, ``device`` elsewhere (docs/design.md,
                                      "The GPU default transport"). ``device`` with pipeline
                                      parallelism on NCCL/RCCL is refused
keepalive interval                    ``--additional-config '{"keepalive_interval_s": X}'`` wins
                                      over ``VLLM_KEEPALIVE_INTERVAL_S``; default
                                      ``min(timeout / 4, 30 s)``; ``0 < interval <= timeout / 2``
collective timeout                    the one governing the chosen group:
                                      ``--distributed-timeout-seconds`` (device group) or
                                      ``--cpu-distributed-timeout-seconds`` (CPU group); torch's
                                      defaults when unset (gloo 1800 s, NCCL 600 s).
                                      ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` plays no part: it bounds
                                      a stuck watchdog thread, not an idle collective
                                      ``--cpu-distributed-timeout-seconds`` also bounds every
                                      ``collective_rpc``'s reply gather (rpc.py): ranks that
                                      finish one call further apart than it fail it
``VLLM_KEEPALIVE_INLINE_BYTES``       frame capacity (default 16 KiB), integer >= 0
``VLLM_KEEPALIVE_MAX_PAYLOAD_BYTES``  largest message (default 1 GiB), integer >= 0
``VLLM_KEEPALIVE_FAILURE_GRACE_S``    after a rank failed while rank 0 is inside a step: how long
                                      the step may still return before it is given up
                                      (default 0.5 s), > 0
``VLLM_KEEPALIVE_STARTUP_TIMEOUT_S``  how long ranks wait for each other at start-up
                                      (default 600 s), > 0
``VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S`` torchrun mode: a rank whose heartbeat is this old is
                                      dead (default 1.5 s on one node, 5 s across nodes,
                                      see default_liveness_timeout_s; it beats 6 times per
                                      period), > 0
``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` vLLM's own: a model step that has not returned after
                                      this long fails the executor (vLLM's default 300 s), > 0
``VLLM_KEEPALIVE_ASYNC_SCHEDULING``   ``1`` opts in to vLLM's async scheduling (not yet verified
                                      on GPUs); ``0`` or unset: the executor reports it does not
                                      support it. Read where vLLM asks, at config time
``TORCH_NCCL_ASYNC_ERROR_HANDLING``   torch's own (0-3). On NCCL/RCCL the executor sets ``2``
                                      (abort the communicators, keep the process) when it is unset,
                                      so a failed collective is an error, not a SIGABRT (the
                                      modes, and setting it, are :mod:`.nccl`'s)
====================================  =============================================================

Why at most half the timeout: a receiver's wait can start up to one interval before the next
keepalive is sent, and the pacer's thread can wake late (GIL, a loaded machine). Half leaves a
margin as large as the interval itself for that lateness; closer to the timeout, one slow
wake-up would kill every receiver.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keepalive_executor.channel import (
    DEFAULT_INLINE_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    TRANSPORTS,
    ChannelSpec,
)
from keepalive_executor.errors import KeepaliveConfigError
from keepalive_executor.nccl import (
    ENV_NCCL_ERROR_HANDLING,
    KEEPALIVE_NCCL_ERROR_HANDLING,
    NCCL_ERROR_HANDLING_MODES,
    error_handling_mode,
)
from keepalive_executor.torchrun.env import torchrun_local_world_size

__all__ = [
    "ENV_INTERVAL",
    "ENV_TRANSPORT",
    "ENV_INLINE_BYTES",
    "ENV_MAX_PAYLOAD_BYTES",
    "ENV_FAILURE_GRACE",
    "ENV_STARTUP_TIMEOUT",
    "ENV_LIVENESS_TIMEOUT",
    "ENV_EXECUTE_TIMEOUT",
    "ENV_ASYNC_SCHEDULING",
    "ADDITIONAL_CONFIG_INTERVAL",
    "KeepaliveConfigError",
    "KeepaliveSettings",
    "parse_seconds",
    "parse_interval",
    "validate_interval",
    "default_interval",
    "default_liveness_timeout_s",
    "group_timeout_s",
    "startup_timeout_s",
    "async_scheduling_opt_in",
    "settings_from_vllm_config",
    "check_parallel_layout",
    "check_features",
]

ENV_INTERVAL = "VLLM_KEEPALIVE_INTERVAL_S"
ENV_TRANSPORT = "VLLM_KEEPALIVE_TRANSPORT"
ENV_INLINE_BYTES = "VLLM_KEEPALIVE_INLINE_BYTES"
ENV_MAX_PAYLOAD_BYTES = "VLLM_KEEPALIVE_MAX_PAYLOAD_BYTES"
ENV_FAILURE_GRACE = "VLLM_KEEPALIVE_FAILURE_GRACE_S"
ENV_STARTUP_TIMEOUT = "VLLM_KEEPALIVE_STARTUP_TIMEOUT_S"
ENV_LIVENESS_TIMEOUT = "VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S"
ENV_EXECUTE_TIMEOUT = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
ENV_ASYNC_SCHEDULING = "VLLM_KEEPALIVE_ASYNC_SCHEDULING"
ADDITIONAL_CONFIG_INTERVAL = "keepalive_interval_s"

#: torch.distributed's defaults (torch/distributed/constants.py: default_pg_timeout and
#: default_pg_nccl_timeout).
TORCH_GLOO_TIMEOUT_S = 1800.0
TORCH_NCCL_TIMEOUT_S = 600.0
MAX_DEFAULT_INTERVAL_S = 30.0
DEFAULT_FAILURE_GRACE_S = 0.5
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_LIVENESS_TIMEOUT_S = 1.5
DEFAULT_LIVENESS_TIMEOUT_MULTI_NODE_S = 5.0
VLLM_EXECUTE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class KeepaliveSettings:
    """What the driver runs with (every field validated)."""

    channel: ChannelSpec
    interval_s: float
    timeout_s: float
    interval_source: str
    timeout_source: str
    failure_grace_s: float = DEFAULT_FAILURE_GRACE_S
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    liveness_timeout_s: float = DEFAULT_LIVENESS_TIMEOUT_S
    execute_timeout_s: float = VLLM_EXECUTE_TIMEOUT_S
    transport_source: str = "default"
    #: vLLM's own decision (``scheduler_config.async_scheduling``) and the opt-in
    async_scheduling: bool = False
    async_opt_in: bool = False
    #: TORCH_NCCL_ASYNC_ERROR_HANDLING in force and where it came from (None: not NCCL)
    nccl_error_handling: int | None = None
    nccl_error_handling_source: str = ""

    @property
    def transport(self) -> str:
        """``device`` or ``cpu``: which world group the channel runs on."""
        return self.channel.transport

    def describe(self) -> str:
        """The one start-up log line."""
        return (
            f"keepalive executor: transport={self.transport}, "
            f"interval={self.interval_s:g}s ({self.interval_source}), "
            f"timeout={self.timeout_s:g}s ({self.timeout_source}), "
            f"inline={self.channel.inline_bytes}B, failure grace={self.failure_grace_s:g}s, "
            f"step timeout={self.execute_timeout_s:g}s, "
            f"async scheduling={self._async_description()}"
            + ("" if self.transport_source == "default"
               else f", transport from {self.transport_source}")
            + ("" if self.nccl_error_handling is None else
               f", NCCL errors: {ENV_NCCL_ERROR_HANDLING}={self.nccl_error_handling} "
               f"({self.nccl_error_handling_source}: "
               f"{NCCL_ERROR_HANDLING_MODES[self.nccl_error_handling]})")
        )

    def _async_description(self) -> str:
        if self.async_scheduling:
            return f"on ({ENV_ASYNC_SCHEDULING}=1, not yet verified on GPUs)"
        if self.async_opt_in:
            return f"off (vLLM turned it off although {ENV_ASYNC_SCHEDULING}=1)"
        return f"off (opt in with {ENV_ASYNC_SCHEDULING}=1)"


def parse_seconds(raw: Any, source: str, *, example: float = 5) -> float:
    """A user-supplied positive, finite number of seconds, or an error naming ``source``."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise KeepaliveConfigError(
            f"{source}={raw!r} is not a number: set it to a positive number of seconds, "
            f"e.g. {example:g}"
        ) from None
    if isinstance(raw, bool) or not math.isfinite(value):
        raise KeepaliveConfigError(
            f"{source}={raw!r} is not a finite number of seconds: set it to e.g. {example:g}"
        )
    return value


def _positive_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    if raw == "":
        return default
    value = parse_seconds(raw, name, example=default)
    if value <= 0:
        raise KeepaliveConfigError(
            f"{name}={raw!r} must be positive: set it to a number of seconds above 0 "
            f"(default {default:g})"
        )
    return value


def parse_interval(raw: Any, source: str) -> float:
    """Turn a user-supplied interval into seconds or raise naming ``source``."""
    return parse_seconds(raw, source)


def validate_interval(interval: float, timeout: float, source: str, timeout_source: str) -> None:
    """Enforce ``0 < interval <= timeout / 2`` with an error that says how to fix it."""
    if interval <= 0:
        raise KeepaliveConfigError(
            f"{source}={interval:g} must be positive: set it to a number of seconds above 0 "
            f"and at most half the collective timeout ({timeout:g}s from {timeout_source}), "
            f"e.g. {default_interval(timeout):g}"
        )
    if interval > timeout / 2:
        raise KeepaliveConfigError(
            f"{source}={interval:g} is too close to the collective timeout of {timeout:g}s "
            f"({timeout_source}): the keepalive interval must be at most half the timeout, "
            f"i.e. <= {timeout / 2:g}. Lower {source} (e.g. to {default_interval(timeout):g}) "
            f"or raise {timeout_source}."
        )


def default_interval(timeout: float) -> float:
    """A quarter of the timeout, at most 30 s."""
    return min(timeout / 4.0, MAX_DEFAULT_INTERVAL_S)


def group_timeout_s(
    transport: str, parallel_config: Any, dist_backend: str, env: Mapping[str, str] | None = None
) -> tuple[float, str]:
    """The timeout governing the group the channel runs on, and where it came from.

    ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` plays no part: ProcessGroupNCCL's heartbeat monitor
    checks that the *watchdog thread* makes progress (its loop bumps the heartbeat every pass,
    whether collectives are pending or not), so it bounds a watchdog stuck in a CUDA or NCCL
    call, not how long a collective may wait. A pending broadcast is bounded by the group's
    timeout alone (the watchdog's per-work timeout), which is what the interval is checked
    against. (``env`` is accepted for symmetry with the other readers.)
    """
    if transport == "cpu":
        seconds = parallel_config.cpu_distributed_timeout_seconds
        if seconds is not None:
            return float(seconds), "--cpu-distributed-timeout-seconds"
        return TORCH_GLOO_TIMEOUT_S, "torch's gloo default"
    seconds = parallel_config.distributed_timeout_seconds
    if seconds is not None:
        timeout, source = float(seconds), "--distributed-timeout-seconds"
    elif dist_backend in ("nccl", "xccl", "hccl"):
        timeout, source = TORCH_NCCL_TIMEOUT_S, f"torch's {dist_backend} default"
    else:
        timeout, source = TORCH_GLOO_TIMEOUT_S, f"torch's {dist_backend} default"
    return timeout, source


def _parse_transport(env: Mapping[str, str], dist_backend: str, pp: int) -> tuple[str, str]:
    """The channel's transport and where it came from. On NCCL/RCCL the default is the gloo
    CPU group (docs/design.md, "The GPU default transport"); ``device`` stays selectable,
    except with pipeline parallelism: an NCCL broadcast travels a ring, so a frame could
    wait behind a busy later stage, which the overlap of pipeline steps relies on not
    happening (shown for gloo only)."""
    raw = env.get(ENV_TRANSPORT, "")
    if raw.strip() == "":
        if dist_backend == "nccl":
            return "cpu", "default on NCCL/RCCL: the gloo CPU group"
        return "device", "default"
    value = raw.strip().lower()
    if value not in TRANSPORTS:
        raise KeepaliveConfigError(
            f"{ENV_TRANSPORT}={raw!r} is not a known transport: use 'device' (the world "
            "device group: NCCL/RCCL on GPUs, gloo on CPU) or 'cpu' (the world gloo group)"
        )
    if value == "device" and dist_backend == "nccl" and pp > 1:
        raise KeepaliveConfigError(
            f"{ENV_TRANSPORT}=device with --pipeline-parallel-size={pp} on NCCL/RCCL is not "
            "supported: an NCCL broadcast travels a ring, so rank 0's next step could wait "
            "behind a busy later stage. Unset it (the gloo CPU group is the default on GPUs) "
            "or set it to 'cpu'."
        )
    return value, ENV_TRANSPORT


_TRUE, _FALSE = ("1", "true"), ("", "0", "false")


def async_scheduling_opt_in(env: Mapping[str, str] | None = None) -> bool:
    """``VLLM_KEEPALIVE_ASYNC_SCHEDULING``: ``1`` (or ``true``) opts in to vLLM's async
    scheduling; ``0``, ``false`` or unset leaves it off. Anything else raises naming it.
    vLLM asks the executor class at config time (``VllmConfig.__post_init__``), possibly in
    its front-end process, so this is read there, as vLLM asks."""
    env = os.environ if env is None else env
    raw = env.get(ENV_ASYNC_SCHEDULING, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise KeepaliveConfigError(
        f"{ENV_ASYNC_SCHEDULING}={raw!r} is not 0 or 1: set it to 1 to opt in to async "
        "scheduling (not yet verified on GPUs), or unset it"
    )


def _parse_bytes(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise KeepaliveConfigError(
            f"{name}={raw!r} must be a non-negative integer number of bytes (default {default})"
        )
    return value


def startup_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """``VLLM_KEEPALIVE_STARTUP_TIMEOUT_S``, validated (read where each rank starts)."""
    env = os.environ if env is None else env
    return _positive_seconds(env, ENV_STARTUP_TIMEOUT, DEFAULT_STARTUP_TIMEOUT_S)


def default_liveness_timeout_s(env: Mapping[str, str]) -> float:
    """The liveness timeout when ``VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S`` is not set.

    One node (torchrun's ``LOCAL_WORLD_SIZE == WORLD_SIZE``, or not under torchrun): 1.5 s.
    The heartbeat crosses loopback only, which loses no packets, so the only stalls are
    scheduling ones, and a process that dies is seen by its torchrun agent anyway; the
    heartbeat is there for a frozen rank, noticed within 2 s. Across nodes: 5 s, the order
    of vLLM's Ray executor (which polls every 5 s). A heartbeat then crosses a network, where
    one lost segment costs a TCP retransmission (Linux: 200 ms minimum RTO, doubling): 5 s
    rides out four consecutive retransmissions (0.2 + 0.4 + 0.8 + 1.6 s), or any stall of
    either side's thread up to 3.3 s (the timeout minus a beat period and a poll), and still
    notices a lost node within 6.7 s (the timeout plus two polls).
    """
    local, world = torchrun_local_world_size(env), env.get("WORLD_SIZE")
    if local and world and local != world:
        return DEFAULT_LIVENESS_TIMEOUT_MULTI_NODE_S
    return DEFAULT_LIVENESS_TIMEOUT_S


def settings_from_vllm_config(
    vllm_config: Any,
    env: Mapping[str, str] | None = None,
    dist_backend: str | None = None,
) -> KeepaliveSettings:
    """Read and validate every keepalive setting; raise KeepaliveConfigError if any is bad."""
    env = os.environ if env is None else env
    if dist_backend is None:
        from vllm.platforms import current_platform

        dist_backend = current_platform.dist_backend
    pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    transport, transport_source = _parse_transport(env, dist_backend, pp)
    timeout, timeout_source = group_timeout_s(
        transport, vllm_config.parallel_config, dist_backend, env
    )
    additional = getattr(vllm_config, "additional_config", None) or {}
    if ADDITIONAL_CONFIG_INTERVAL in additional:
        source = f"--additional-config {ADDITIONAL_CONFIG_INTERVAL}"
        interval = parse_interval(additional[ADDITIONAL_CONFIG_INTERVAL], source)
    elif env.get(ENV_INTERVAL, "") != "":
        source = ENV_INTERVAL
        interval = parse_interval(env[ENV_INTERVAL], source)
    else:
        source = "default: min(timeout/4, 30s)"
        interval = default_interval(timeout)
    validate_interval(interval, timeout, source, timeout_source)
    execute_timeout_s = _positive_seconds(env, ENV_EXECUTE_TIMEOUT, VLLM_EXECUTE_TIMEOUT_S)
    startup_s = startup_timeout_s(env)
    opt_in = async_scheduling_opt_in(env)
    running_async = bool(getattr(getattr(vllm_config, "scheduler_config", None),
                                 "async_scheduling", False))
    if running_async and not opt_in:
        raise KeepaliveConfigError(
            f"vLLM runs with async scheduling but {ENV_ASYNC_SCHEDULING} is not 1 in the "
            f"engine's process: set {ENV_ASYNC_SCHEDULING}=1 where the engine runs too, or "
            "pass --no-async-scheduling"
        )
    nccl_mode, nccl_source = error_handling_mode(env)
    if dist_backend == "nccl" and nccl_mode is None:
        nccl_mode, nccl_source = KEEPALIVE_NCCL_ERROR_HANDLING, "set by keepalive"
    elif dist_backend != "nccl":
        nccl_mode, nccl_source = None, ""
    return KeepaliveSettings(
        channel=ChannelSpec(
            transport=transport,
            inline_bytes=_parse_bytes(env, ENV_INLINE_BYTES, DEFAULT_INLINE_BYTES),
            max_payload_bytes=_parse_bytes(env, ENV_MAX_PAYLOAD_BYTES, DEFAULT_MAX_PAYLOAD_BYTES),
            output_timeout_s=execute_timeout_s,
            group_timeout_s=timeout,
            startup_timeout_s=startup_s,
        ),
        interval_s=interval,
        timeout_s=timeout,
        interval_source=source,
        timeout_source=timeout_source,
        failure_grace_s=_positive_seconds(env, ENV_FAILURE_GRACE, DEFAULT_FAILURE_GRACE_S),
        startup_timeout_s=startup_s,
        liveness_timeout_s=_positive_seconds(
            env, ENV_LIVENESS_TIMEOUT, default_liveness_timeout_s(env)
        ),
        execute_timeout_s=execute_timeout_s,
        transport_source=transport_source,
        async_scheduling=running_async,
        async_opt_in=opt_in,
        nccl_error_handling=nccl_mode,
        nccl_error_handling_source=nccl_source,
    )


def check_features(vllm_config: Any) -> None:
    """Reject feature combinations this executor does not run yet, naming the flags."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp <= 1:
        return
    problems = []
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        problems.append("--kv-transfer-config (a KV connector's per-rank outputs are merged "
                        "without pipeline parallelism only)")
    if getattr(vllm_config, "ec_transfer_config", None) is not None:
        # the PP path returns the last stage's output alone: no rank's ec_connector_output
        # would reach the scheduler
        problems.append("--ec-transfer-config (an EC connector's per-rank outputs are merged "
                        "without pipeline parallelism only)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append("--speculative-config (not tested with pipeline parallelism)")
    if problems:
        raise KeepaliveConfigError(
            f"--distributed-executor-backend keepalive with --pipeline-parallel-size={pp} "
            "does not support " + "; ".join(problems) + ": drop the flag, or use -pp 1"
        )


def check_parallel_layout(parallel_config: Any, model_config: Any = None) -> None:
    """Reject layouts this executor does not run yet, naming the flag to change.

    Data parallelism: vLLM 0.32 runs the replicas of a dense model as independent engines
    (``reconfigure_for_independent_dp_rank``: each engine core sees ``data_parallel_size``
    1 and its own torch world), so each replica gets its own keepalive executor and channel.
    A mixture-of-experts model keeps one world across the replicas (``DPEngineCoreProc``);
    the channel and reply groups are then replica-local groups inside it
    (groups.open_world_channel), the PP output link is not: DP with PP refused there, and
    so are replicas this server does not start itself (``--data-parallel-size-local`` below
    ``--data-parallel-size``: other nodes, ``--headless``), which every rank of that world
    would have to build the same groups with."""
    problems = []
    if getattr(parallel_config, "prefill_context_parallel_size", 1) > 1:
        problems.append(
            "--prefill-context-parallel-size="
            f"{parallel_config.prefill_context_parallel_size} (not supported: use 1)"
        )
    dp = parallel_config.data_parallel_size
    moe_dp = dp > 1 and getattr(model_config, "is_moe", False)
    if moe_dp and getattr(parallel_config, "pipeline_parallel_size", 1) > 1:
        problems.append(
            f"--data-parallel-size={dp} with --pipeline-parallel-size="
            f"{parallel_config.pipeline_parallel_size} for a mixture-of-experts model (its "
            "replicas share one torch.distributed world; the channel is made replica-local "
            "there, the pipeline's output link is not: use -pp 1 with -dp, or -dp 1)"
        )
    dp_local = getattr(parallel_config, "data_parallel_size_local", dp)
    if moe_dp and dp_local < dp:
        problems.append(
            f"--data-parallel-size-local={dp_local} with --data-parallel-size={dp} for a "
            "mixture-of-experts model (its replicas share one torch.distributed world, in "
            "which every rank must build the executor's replica-local groups in the same "
            "order; replicas started on other nodes or by other processes are not lined up: "
            "run every replica from this server, i.e. drop --data-parallel-size-local, "
            "--headless and --data-parallel-rank)"
        )
    if getattr(parallel_config, "nnodes", 1) > 1:
        problems.append(
            f"--nnodes={parallel_config.nnodes} (several nodes are not supported by the "
            "executor-spawned mode: use 1)"
        )
    if problems:
        raise KeepaliveConfigError(
            "--distributed-executor-backend keepalive does not support "
            + "; ".join(problems)
        )
