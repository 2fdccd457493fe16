"""vLLM's start-up collectives under the start-up timeout, the user's timeouts after it.

``--distributed-timeout-seconds`` and ``--cpu-distributed-timeout-seconds`` are the timeouts
vLLM gives every process group it creates in ``init_device``: its world, its TP/PP/DP/EP
groups (device and CPU), and with them the groups the channel and the reply gathers run on.
They therefore also bound every collective of vLLM's own start-up: the rendezvous, the
groups' creation, the ranks' replies to loading, profiling, the KV cache's allocation, the
warm-up and (vLLM 0.34) the KV cache's commit after it. Ranks that reach one of these further
apart than the timeout fail the start-up, which a short timeout on a busy machine does (two
servers starting at once on 2 CPUs, a replica whose ranks start late). Once the engine has
started, the timeout is what the user chose it for: how long a rank may wait for the others,
with the pacer's keepalives covering idle periods.

So each rank joins the groups with those two timeouts raised to the start-up timeout
(``VLLM_KEEPALIVE_STARTUP_TIMEOUT_S``, default 600 s) where the user set them lower
(:func:`during_startup`, around ``init_device`` and the channel's groups; in launcher mode
also around a follower's join of the default group; the configuration itself is given back
its values at once). When the engine's start-up is over (its last start-up call has returned:
the warm-up, or on vLLM 0.34 what follows it, ``compat.VllmRelease.last_startup_call``),
rank 0 has every rank set each of those groups back to the user's timeout (:func:`restore`,
through one collective RPC: every rank is at the same point then, so no rank waits on a group
whose peer still has the longer timeout). An unset timeout is left to torch's default (gloo
30 min, NCCL 10 min) throughout.

Not raised, and not needed: groups created with a timeout of their own (the NCCL channel
communicator, the pipeline's output link). Not raised either: groups created after
``init_device`` (while the model loads, by a model's or a KV connector's own code, with a
``GroupCoordinator`` or without): vLLM reads the timeouts from the configuration as it creates
a group, and the configuration has the user's values back by then, so such a group has the
user's timeouts from the start. Setting a group's timeout uses torch's
``distributed_c10d._set_pg_timeout`` (gloo and NCCL backends), which applies to the
collectives issued after it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from keepalive_executor.log import get_logger

__all__ = ["FIELDS", "raised_values", "during_startup", "note_cpu_group", "restore", "pending",
           "cpu_timeout_setting"]

logger = get_logger(__name__)

#: the ParallelConfig fields start-up raises: the device groups' timeout, the CPU groups'
FIELDS = ("distributed_timeout_seconds", "cpu_distributed_timeout_seconds")

#: this process's raised fields and the user's values, until :func:`restore`
_users: dict[str, int] = {}
#: what those fields were raised to (the start-up timeout, whole seconds), as long
_raised: dict[str, int] = {}
#: groups the executor itself created with the (raised) CPU timeout (a replica's reply group)
_cpu_groups: list[Any] = []


def raised_values(parallel_config: Any, startup_s: float | None) -> dict[str, int]:
    """The fields start-up raises, and to what: each one the user set below ``startup_s``,
    to ``startup_s`` rounded up (vLLM's fields are whole seconds). None: nothing raised."""
    if startup_s is None:
        return {}
    target = math.ceil(startup_s)
    return {f: target for f in FIELDS
            if (v := getattr(parallel_config, f, None)) is not None and v < target}


@contextlib.contextmanager
def during_startup(parallel_config: Any, startup_s: float | None) -> Iterator[dict[str, int]]:
    """Around this rank's ``init_device`` and the channel's groups: the timeouts of
    :func:`raised_values` raised in ``parallel_config`` (so vLLM creates its groups with
    them), the user's values put back on the way out, and remembered for :func:`restore`.
    Yields what was raised."""
    _users.clear()  # an earlier start-up in this process that failed before its restore
    _raised.clear()
    _cpu_groups.clear()
    raised = raised_values(parallel_config, startup_s)
    users = {f: getattr(parallel_config, f) for f in raised}
    for f, v in raised.items():
        setattr(parallel_config, f, v)
    try:
        yield raised
    finally:
        for f, v in users.items():
            setattr(parallel_config, f, v)
    if raised:
        _users.update(users)
        _raised.update(raised)
        logger.info("keepalive: start-up collectives with %s raised to %ss "
                    "(VLLM_KEEPALIVE_STARTUP_TIMEOUT_S) until the engine's start-up is over",
                    " and ".join(f"--{f.replace('_', '-')}={users[f]}" for f in raised),
                    next(iter(raised.values())))


def note_cpu_group(group: Any) -> None:
    """A CPU group the executor created with the CPU timeout during start-up."""
    _cpu_groups.append(group)


def pending() -> dict[str, int]:
    """The user's values of the fields raised in this process and not yet restored."""
    return dict(_users)


def cpu_timeout_setting() -> str:
    """What bounds a collective on the CPU groups now, in the user's terms: the start-up
    timeout while it stands in for a shorter ``--cpu-distributed-timeout-seconds`` (until
    :func:`restore`), else that flag (for an error that says which setting ran out)."""
    raised = _raised.get("cpu_distributed_timeout_seconds")
    if raised is None or "cpu_distributed_timeout_seconds" not in _users:
        return "--cpu-distributed-timeout-seconds"
    return (f"the start-up timeout, VLLM_KEEPALIVE_STARTUP_TIMEOUT_S ({raised}s, in place of "
            f"--cpu-distributed-timeout-seconds={_users['cpu_distributed_timeout_seconds']} "
            "until the engine's start-up is over)")


def restore() -> int:
    """Give every group start-up raised its user timeout back: the default group and every
    ``GroupCoordinator``'s device group (``--distributed-timeout-seconds``), their CPU groups
    and the executor's own (``--cpu-distributed-timeout-seconds``). Returns how many groups
    were set; 0 if nothing was raised in this process."""
    if not _users:
        return 0
    from torch.distributed import distributed_c10d as c10d
    from vllm.distributed import parallel_state

    device_s = _users.get("distributed_timeout_seconds")
    cpu_s = _users.get("cpu_distributed_timeout_seconds")
    targets: list[tuple[Any, int]] = []
    if device_s is not None and c10d.is_initialized():
        targets.append((c10d._get_default_group(), device_s))
    for ref in list(parallel_state._groups.values()):
        coordinator = ref()
        if coordinator is None:
            continue
        if device_s is not None:
            targets.append((getattr(coordinator, "device_group", None), device_s))
        if cpu_s is not None:
            targets.append((getattr(coordinator, "cpu_group", None), cpu_s))
    if cpu_s is not None:
        targets += [(g, cpu_s) for g in _cpu_groups]
    done: set[int] = set()
    for group, seconds in targets:
        if not isinstance(group, c10d.ProcessGroup) or id(group) in done:
            continue
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)
        done.add(id(group))
    logger.info("keepalive: start-up over; %d process groups back to the user's timeouts (%s)",
                len(done), ", ".join(f"--{f.replace('_', '-')}={v}" for f, v in _users.items()))
    _users.clear()
    _raised.clear()
    _cpu_groups.clear()
    return len(done)
