"""Settings of the keepalive executor: read once on the driver, validated at start-up.

Every setting goes through this module, so a bad value fails start-up (in vLLM's front end,
before any weight loads) with a message naming the setting, its value and the fix. Ranks
other than the driver receive what they need from it; the only things a torchrun follower
reads itself are node-local (its start-up timeout, the shared secret).

====================================  =============================================================
setting                               rule
====================================  =============================================================
``VLLM_KEEPALIVE_TRANSPORT``          ``device`` (default: the world device group, NCCL/RCCL on
                                      GPUs, gloo on CPU) or ``cpu`` (the world gloo CPU group)
keepalive interval                    ``--additional-config '{"keepalive_interval_s": X}'`` wins
                                      over ``VLLM_KEEPALIVE_INTERVAL_S``; default
                                      ``min(timeout / 4, 30 s)``; ``0 < interval <= timeout / 2``
collective timeout                    the one governing the chosen group:
                                      ``--distributed-timeout-seconds`` (device group) or
                                      ``--cpu-distributed-timeout-seconds`` (CPU group); torch's
                                      defaults when unset (gloo 1800 s, NCCL 600 s). On NCCL the
                                      interval must also be at most half of
                                      ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (torch's default 480 s)
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

__all__ = [
    "ENV_INTERVAL",
    "ENV_TRANSPORT",
    "ENV_INLINE_BYTES",
    "ENV_MAX_PAYLOAD_BYTES",
    "ENV_FAILURE_GRACE",
    "ENV_STARTUP_TIMEOUT",
    "ENV_LIVENESS_TIMEOUT",
    "ENV_EXECUTE_TIMEOUT",
    "ENV_NCCL_HEARTBEAT",
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
ENV_NCCL_HEARTBEAT = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
ADDITIONAL_CONFIG_INTERVAL = "keepalive_interval_s"

#: torch.distributed's defaults (torch/distributed/constants.py: default_pg_timeout and
#: default_pg_nccl_timeout; the NCCL heartbeat from ProcessGroupNCCL's heartbeatTimeoutInSec_).
TORCH_GLOO_TIMEOUT_S = 1800.0
TORCH_NCCL_TIMEOUT_S = 600.0
TORCH_NCCL_HEARTBEAT_S = 480.0
MAX_DEFAULT_INTERVAL_S = 30.0
DEFAULT_FAILURE_GRACE_S = 0.5
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_LIVENESS_TIMEOUT_S = 1.5
DEFAULT_LIVENESS_TIMEOUT_MULTI_NODE_S = 5.0
VLLM_EXECUTE_TIMEOUT_S = 300.0


class KeepaliveConfigError(ValueError):
    """A keepalive setting is invalid; the message names it, its value and the fix."""


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
            f"step timeout={self.execute_timeout_s:g}s"
        )


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

    On NCCL the watchdog's heartbeat timeout also bounds how long a rank may look stuck, so
    the smaller of the two governs.
    """
    env = os.environ if env is None else env
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
    if dist_backend == "nccl":
        heartbeat = _positive_seconds(env, ENV_NCCL_HEARTBEAT, TORCH_NCCL_HEARTBEAT_S)
        if heartbeat < timeout:
            timeout, source = heartbeat, ENV_NCCL_HEARTBEAT
    return timeout, source


def _parse_transport(env: Mapping[str, str]) -> str:
    raw = env.get(ENV_TRANSPORT, "device")
    value = raw.strip().lower()
    if value not in TRANSPORTS:
        raise KeepaliveConfigError(
            f"{ENV_TRANSPORT}={raw!r} is not a known transport: use 'device' (the world "
            "device group: NCCL/RCCL on GPUs, gloo on CPU) or 'cpu' (the world gloo group)"
        )
    return value


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
    local, world = env.get("LOCAL_WORLD_SIZE"), env.get("WORLD_SIZE")
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
    transport = _parse_transport(env)
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
    return KeepaliveSettings(
        channel=ChannelSpec(
            transport=transport,
            inline_bytes=_parse_bytes(env, ENV_INLINE_BYTES, DEFAULT_INLINE_BYTES),
            max_payload_bytes=_parse_bytes(env, ENV_MAX_PAYLOAD_BYTES, DEFAULT_MAX_PAYLOAD_BYTES),
            output_timeout_s=execute_timeout_s,
        ),
        interval_s=interval,
        timeout_s=timeout,
        interval_source=source,
        timeout_source=timeout_source,
        failure_grace_s=_positive_seconds(env, ENV_FAILURE_GRACE, DEFAULT_FAILURE_GRACE_S),
        startup_timeout_s=startup_timeout_s(env),
        liveness_timeout_s=_positive_seconds(
            env, ENV_LIVENESS_TIMEOUT, default_liveness_timeout_s(env)
        ),
        execute_timeout_s=execute_timeout_s,
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


def check_parallel_layout(parallel_config: Any) -> None:
    """Reject layouts this executor does not run yet, naming the flag to change."""
    problems = []
    if getattr(parallel_config, "prefill_context_parallel_size", 1) > 1:
        problems.append(
            "--prefill-context-parallel-size="
            f"{parallel_config.prefill_context_parallel_size} (not supported: use 1)"
        )
    if parallel_config.data_parallel_size > 1:
        problems.append(
            f"--data-parallel-size={parallel_config.data_parallel_size} "
            "(data parallelism is not supported: use 1)"
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
