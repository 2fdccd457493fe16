"""What travels on the channel for an engine call, and how replies come back.

A call is one :class:`RpcRequest` broadcast on the channel. Every rank runs it. If the call
wants replies (``reply=True``: every ``collective_rpc`` but the per-step hot path), each rank
then contributes one :class:`RpcReply` to :func:`gather_replies`, a gather to the driver over
the world **CPU** group (gloo), so a result never has to live on a GPU:

1. ``all_gather`` of each rank's reply length (int64), so every rank knows the largest;
2. ``gather`` of the replies, zero-padded to that length, to the driver.

``execute_model``, ``sample_tokens`` and ``take_draft_token_ids`` use ``reply=False``: only the
driver's own result is needed (it runs the same step in-process), so the step costs one
broadcast and nothing more. A worker that fails such a step cannot tell the driver in-band;
it exits non-zero instead, and the executor's process monitor reports the dead rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from keepalive_executor.channel import serialize

__all__ = ["RpcRequest", "RpcReply", "WorkerRpcError", "gather_replies"]


@dataclass(frozen=True)
class RpcRequest:
    """One engine call: a worker method name or a callable taking the worker first."""

    method: str | Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    reply: bool = True

    @property
    def name(self) -> str:
        """Readable name of the method, for errors and logs."""
        if isinstance(self.method, str):
            return self.method
        return getattr(self.method, "__qualname__", repr(self.method))


@dataclass(frozen=True)
class RpcReply:
    """One rank's outcome: a value, or the error's type, message and traceback."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    traceback: str = ""


class WorkerRpcError(RuntimeError):
    """A ``collective_rpc`` failed on some rank; ``rank`` says which (the lowest failing)."""

    def __init__(self, method: str, reply: RpcReply) -> None:
        self.rank = reply.rank
        self.method = method
        self.remote_traceback = reply.traceback
        super().__init__(
            f"collective_rpc({method!r}) failed on rank {reply.rank}: {reply.error}"
        )


def _encode(reply: RpcReply) -> bytes:
    try:
        return serialize(reply)
    except Exception as e:  # noqa: BLE001 - an unsendable result becomes an error reply
        return pickle.dumps(
            RpcReply(
                rank=reply.rank,
                ok=False,
                error=f"result of type {type(reply.value).__name__} cannot be sent: {e}",
            ),
            protocol=5,
        )


def _wait(work: dist.Work | None, timeout_s: float | None) -> None:
    if work is None:
        return
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=max(timeout_s, 0.001)))


def gather_replies(
    reply: RpcReply,
    group: dist.ProcessGroup,
    *,
    dst: int,
    world_size: int,
    timeout_s: float | None = None,
) -> list[RpcReply] | None:
    """Collective: every rank passes its reply; rank ``dst`` gets all of them in rank order."""
    data = _encode(reply)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    _wait(dist.all_gather(lengths, length, group=group, async_op=True), timeout_s)
    longest = max(int(t.item()) for t in lengths)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    is_dst = dist.get_rank() == dst
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)] if is_dst else None
    _wait(dist.gather(buf, out, dst=dst, group=group, async_op=True), timeout_s)
    if not is_dst:
        return None
    assert out is not None
    return [
        pickle.loads(out[r][: int(lengths[r].item())].numpy().tobytes())
        for r in range(world_size)
    ]
