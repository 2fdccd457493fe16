"""The process groups the executor adds to vLLM's world, and the channel opened on them.

Every rank builds the same groups in the same order (``new_group`` is collective over the
world), right after vLLM's ``init_device``:

* the **channel's group**: vLLM's world device group (``VLLM_KEEPALIVE_TRANSPORT=device``; on
  NCCL/RCCL a CTA-limited communicator of its own, :func:`keepalive_executor.nccl.channel_group`)
  or its gloo CPU group (``cpu``);
* the **reply group**: the world's gloo CPU group, for the reply gathers (:mod:`.rpc`);
* when vLLM's world spans data-parallel replicas (a mixture-of-experts model under ``-dp``,
  :func:`replica_ranks`): both made replica-local, every replica's created on every rank, in
  replica order, so a keepalive of one replica never reaches another's ranks.

The pipeline's output group is built by :func:`keepalive_executor.outputs.open_output_link`.
What travels on the channel is :mod:`.channel`'s business, not this module's.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from keepalive_executor import nccl, startup_timeouts
from keepalive_executor.channel import BroadcastChannel, ChannelSpec
from keepalive_executor.config import group_timeout_s

__all__ = ["open_world_channel", "replica_ranks"]


def replica_ranks(parallel_config: Any) -> list[list[int]]:
    """The global ranks of each data-parallel replica when vLLM's world spans replicas,
    which vLLM 0.32 builds for a mixture-of-experts model under ``-dp > 1``
    (``init_distributed_environment`` numbers replica r's ranks from ``r * world_size``);
    otherwise none (a dense model's replicas each have a world of their own)."""
    dp = getattr(parallel_config, "data_parallel_size", 1)
    if dp <= 1:
        return []
    size = parallel_config.world_size
    return [list(range(r * size, (r + 1) * size)) for r in range(dp)]


def open_world_channel(spec: ChannelSpec,
                       parallel_config: Any = None) -> tuple[BroadcastChannel, Any]:
    """The channel on this replica's ranks (after ``init_device``) and the reply (CPU) group.

    Without data parallelism across one world that is vLLM's world group. When the world
    spans replicas (:func:`replica_ranks`), every rank creates every replica's groups, in
    replica order (``new_group`` is collective over the world), and keeps its own: a
    keepalive of one replica never reaches another's ranks."""
    from vllm.distributed.parallel_state import get_world_group

    world = get_world_group()
    replicas = replica_ranks(parallel_config)
    ranks, cpu_group, device_group = world.ranks, world.cpu_group, world.device_group
    if replicas:
        cpu_timeout, _ = group_timeout_s("cpu", parallel_config, "gloo")
        device_backend = dist.get_backend(world.device_group)
        device_timeout = spec.group_timeout_s
        me = dist.get_rank()
        for r in replicas:
            cpu = dist.new_group(r, backend="gloo", timeout=timedelta(seconds=cpu_timeout))
            startup_timeouts.note_cpu_group(cpu)  # its user timeout back after the warm-up
            # two groups, as vLLM's world has: the channel's broadcasts in flight never
            # share a group with the reply gathers
            dev = dist.new_group(r, backend=device_backend, timeout=None if device_timeout
                                 is None else timedelta(seconds=device_timeout))
            if me in r:
                ranks, cpu_group, device_group = r, cpu, dev
    if spec.transport == "cpu":
        group, device = cpu_group, torch.device("cpu")
    else:
        group, device = device_group, world.device
        if device.type == "cuda":  # NCCL/RCCL: a communicator of its own, CTA-limited
            own = None
            for r in replicas or [ranks]:  # every replica's, in order (see above)
                made = nccl.channel_group(r, spec.group_timeout_s)
                if r == ranks:
                    own = made
            group = own or group
    channel = BroadcastChannel(
        group, src=ranks[0], device=device, inline_bytes=spec.inline_bytes,
        max_payload_bytes=spec.max_payload_bytes,
    )
    return channel, cpu_group
