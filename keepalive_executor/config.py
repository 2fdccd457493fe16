"""Settings of the keepalive executor, read once on the driver and validated at start-up.

Only the driver reads these; worker ranks receive what they need from the driver, so they
have nothing to parse or get wrong.

=============================  ==========================================================
setting                        rule
=============================  ==========================================================
``VLLM_KEEPALIVE_TRANSPORT``   ``device`` (default: the world device group, NCCL/RCCL on
                               GPUs, gloo on CPU) or ``cpu`` (the world gloo CPU group)
keepalive interval             ``--additional-config '{"keepalive_interval_s": X}'`` wins
                               over ``VLLM_KEEPALIVE_INTERVAL_S``; default
                               ``min(timeout / 4, 30 s)``; must satisfy
                               ``0 < interval <= timeout / 2``
collective timeout             the one governing the chosen group:
                               ``--distributed-timeout-seconds`` (device group) or
                               ``--cpu-distributed-timeout-seconds`` (CPU group); torch's
                               defaults when unset (gloo 1800 s, NCCL 600 s)
=============================  ==========================================================

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

from keepalive_executor.channel import DEFAULT_INLINE_BYTES, DEFAULT_MAX_PAYLOAD_BYTES

__all__ = [
    "ENV_INTERVAL",
    "ENV_TRANSPORT",
    "ENV_INLINE_BYTES",
    "ENV_MAX_PAYLOAD_BYTES",
    "ADDITIONAL_CONFIG_INTERVAL",
    "TRANSPORTS",
    "KeepaliveConfigError",
    "KeepaliveSettings",
    "parse_interval",
    "validate_interval",
    "default_interval",
    "group_timeout_s",
    "settings_from_vllm_config",
    "check_parallel_layout",
]

ENV_INTERVAL = "VLLM_KEEPALIVE_INTERVAL_S"
ENV_TRANSPORT = "VLLM_KEEPALIVE_TRANSPORT"
ENV_INLINE_BYTES = "VLLM_KEEPALIVE_INLINE_BYTES"
ENV_MAX_PAYLOAD_BYTES = "VLLM_KEEPALIVE_MAX_PAYLOAD_BYTES"
ADDITIONAL_CONFIG_INTERVAL = "keepalive_interval_s"
TRANSPORTS = ("device", "cpu")

#: torch.distributed's defaults (torch/distributed/constants.py: default_pg_timeout and
#: default_pg_nccl_timeout).
TORCH_GLOO_TIMEOUT_S = 1800.0
TORCH_NCCL_TIMEOUT_S = 600.0
MAX_DEFAULT_INTERVAL_S = 30.0


class KeepaliveConfigError(ValueError):
    """A keepalive setting is invalid; the message names it, its value and the fix."""


@dataclass(frozen=True)
class KeepaliveSettings:
    """What the driver runs with."""

    transport: str
    interval_s: float
    timeout_s: float
    interval_source: str
    timeout_source: str
    inline_bytes: int
    max_payload_bytes: int

    def describe(self) -> str:
        """The one start-up log line."""
        return (
            f"keepalive executor: transport={self.transport}, "
            f"interval={self.interval_s:g}s ({self.interval_source}), "
            f"timeout={self.timeout_s:g}s ({self.timeout_source}), "
            f"inline={self.inline_bytes}B"
        )


def parse_interval(raw: Any, source: str) -> float:
    """Turn a user-supplied interval into seconds or raise naming ``source``."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise KeepaliveConfigError(
            f"{source}={raw!r} is not a number: set it to a positive number of seconds, "
            "e.g. 5"
        ) from None
    if isinstance(raw, bool) or not math.isfinite(value):
        raise KeepaliveConfigError(
            f"{source}={raw!r} is not a finite number of seconds: set it to e.g. 5"
        )
    return value


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


def group_timeout_s(transport: str, parallel_config: Any, dist_backend: str) -> tuple[float, str]:
    """The timeout governing the group the channel runs on, and where it came from."""
    if transport == "cpu":
        seconds = parallel_config.cpu_distributed_timeout_seconds
        if seconds is not None:
            return float(seconds), "--cpu-distributed-timeout-seconds"
        return TORCH_GLOO_TIMEOUT_S, "torch's gloo default"
    seconds = parallel_config.distributed_timeout_seconds
    if seconds is not None:
        return float(seconds), "--distributed-timeout-seconds"
    if dist_backend in ("nccl", "xccl", "hccl"):
        return TORCH_NCCL_TIMEOUT_S, f"torch's {dist_backend} default"
    return TORCH_GLOO_TIMEOUT_S, f"torch's {dist_backend} default"


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
        transport, vllm_config.parallel_config, dist_backend
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
    return KeepaliveSettings(
        transport=transport,
        interval_s=interval,
        timeout_s=timeout,
        interval_source=source,
        timeout_source=timeout_source,
        inline_bytes=_parse_bytes(env, ENV_INLINE_BYTES, DEFAULT_INLINE_BYTES),
        max_payload_bytes=_parse_bytes(env, ENV_MAX_PAYLOAD_BYTES, DEFAULT_MAX_PAYLOAD_BYTES),
    )


def check_parallel_layout(parallel_config: Any) -> None:
    """Reject layouts this executor does not run yet, naming the flag to change."""
    problems = []
    if parallel_config.pipeline_parallel_size > 1:
        problems.append(
            f"--pipeline-parallel-size={parallel_config.pipeline_parallel_size} "
            "(pipeline parallelism is not supported: use 1)"
        )
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
