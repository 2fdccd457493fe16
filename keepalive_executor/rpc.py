"""What travels on the channel for an engine call, and how replies come back.

A call is one :class:`RpcRequest`, encoded as an **envelope** and broadcast on the channel::

    offset  size  field
    0       1     replies      Replies: 0 driver only, 1 every rank, 2 a model step whose
                               connector outputs every rank reports, 3 the output rank's
                               result (pipeline parallelism, see outputs.py)
    1       2     name_len     length of the call's name (utf-8)
    3       ...   name         e.g. "execute_model", or a callable's qualified name
    3+n     ...   body         pickle (cloudpickle for what pickle refuses) of
                               (method, args, kwargs); a callable method travels as
                               :class:`ByValue` bytes when it lives in ``__main__``

A callable defined in the calling script or a notebook (module ``__main__``) would pickle
by reference to a module the other ranks do not have; like vLLM's ``mp`` executor (which
cloudpickles every callable), such a callable is cloudpickled *by value*. Callables from
importable modules (every hot-path step) stay plain pickles by reference: same result,
without cloudpickle's cost on every step.

The name and the reply mode are readable without unpickling anything, so a rank that cannot
decode the body (a class that exists only in the driver's process, say) still knows which
call failed and whether the driver waits for its reply: it answers with an error reply, the
ranks stay in step, and the engine stays usable, as with vLLM's ``mp`` executor. A model step
(no replies) that a rank cannot decode cannot be run there: that rank fails.

If a call wants replies (``Replies.ALL``: every ``collective_rpc`` but the per-step hot path),
each rank then contributes one :class:`RpcReply` to :func:`gather_replies`, a gather to the
driver over the world **CPU** group (gloo), so a result never has to live on a GPU:

1. ``all_gather`` of each rank's reply length (int64), so every rank knows the largest;
2. ``gather`` of the replies, zero-padded to that length, to the driver.

Both are bounded by the CPU group's timeout (``--cpu-distributed-timeout-seconds``; until the
engine's start-up is over, the start-up timeout where that is longer: startup_timeouts.py),
not by the call's own ``timeout``: a rank that finishes the call first waits there for the last, so
ranks that finish one call further apart than that timeout (model loading or warm-up on a
slow file system) fail it, and with it the executor, where vLLM's ``mp`` would wait. The
receivers cannot know the call's timeout (it is not in the envelope), and an unbounded wait
would leave a receiver waiting forever on a driver that froze; the error names the setting
instead.

``execute_model``, ``sample_tokens`` and ``take_draft_token_ids`` use ``Replies.DRIVER``:
only the driver's own result is needed (it runs the same step in-process), so the step costs
one broadcast and nothing more. A worker that fails such a step cannot tell the driver
in-band; it exits non-zero instead, and the executor's death detection reports the rank.
"""

from __future__ import annotations

import enum
import pickle
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from keepalive_executor import startup_timeouts

__all__ = [
    "Replies",
    "RpcRequest",
    "RpcReply",
    "RequestDecodeError",
    "ByValue",
    "RpcSerializationError",
    "WorkerRpcError",
    "ReplyGatherError",
    "encode_request",
    "decode_request",
    "serialize",
    "deserialize",
    "gather_replies",
]

_ENVELOPE = struct.Struct("<BH")


class Replies(enum.IntEnum):
    """Which ranks answer a call."""

    DRIVER = 0
    """Only the driver's own result counts (model steps): no reply collective."""
    ALL = 1
    """Every rank replies; the replies are gathered to the driver."""
    STEP = 2
    """A model step with a KV/EC connector: every rank replies with its connector outputs
    (see :mod:`keepalive_executor.connectors`); an error is fatal, as for DRIVER."""
    OUTPUT = 3
    """Pipeline parallelism: the output rank (last stage) sends its result to rank 0 over
    the output group (see :mod:`keepalive_executor.outputs`); an error is fatal elsewhere."""


class RpcSerializationError(ValueError):
    """The driver could not serialize a call; nothing was sent."""


class RequestDecodeError(RuntimeError):
    """A rank received a call it could not decode (the envelope or its body)."""


def serialize(obj: Any) -> bytes:
    """Pickle ``obj``; fall back to cloudpickle for what plain pickle refuses."""
    try:
        return pickle.dumps(obj, protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError) as first:
        try:
            import cloudpickle

            return cloudpickle.dumps(obj, protocol=5)
        except Exception as e:  # noqa: BLE001 - report both failures to the caller
            raise RpcSerializationError(
                f"cannot serialize {type(obj).__name__} for the broadcast channel: "
                f"pickle said {first!r}; cloudpickle said {e!r}"
            ) from e


def deserialize(data: bytes | memoryview) -> Any:
    """Inverse of :func:`serialize`."""
    return pickle.loads(data)


@dataclass(frozen=True)
class ByValue:
    """A callable cloudpickled by value (its code travels, not a module reference)."""

    blob: bytes

    def load(self) -> Callable[..., Any]:
        """The callable again (on the receiving rank)."""
        return pickle.loads(self.blob)


def _by_value(method: Callable[..., Any]) -> bool:
    """Whether pickle would send ``method`` by reference to a module the other ranks cannot
    import: the calling script's or a notebook's ``__main__`` (what cloudpickle itself
    pickles by value)."""
    module = getattr(method, "__module__", None)
    return module == "__main__" or module is None


def _method_for_wire(method: str | Callable[..., Any]) -> Any:
    if isinstance(method, str) or not _by_value(method):
        return method
    import cloudpickle

    try:
        return ByValue(cloudpickle.dumps(method, protocol=5))
    except Exception as e:  # noqa: BLE001 - the caller's error, nothing was sent
        raise RpcSerializationError(
            f"cannot serialize {getattr(method, '__qualname__', method)!r} by value for the "
            f"broadcast channel: cloudpickle said {e!r}"
        ) from e


@dataclass(frozen=True)
class RpcRequest:
    """One engine call: a worker method name or a callable taking the worker first."""

    method: str | Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    replies: Replies = Replies.ALL

    @property
    def name(self) -> str:
        """Readable name of the method, for errors and logs."""
        if isinstance(self.method, str):
            return self.method
        return getattr(self.method, "__qualname__", repr(self.method))


def encode_request(req: RpcRequest) -> bytes:
    """The envelope of ``req`` (raises RpcSerializationError if the body cannot be pickled)."""
    name = req.name.encode("utf-8", "replace")[:0xFFFF]
    body = serialize((_method_for_wire(req.method), req.args, req.kwargs))
    return _ENVELOPE.pack(int(req.replies), len(name)) + name + body


@dataclass(frozen=True)
class DecodedRequest:
    """An envelope read on a receiving rank: the header always, the call if it decoded."""

    replies: Replies
    name: str
    request: RpcRequest | None
    error: str = ""


def decode_request(data: bytes | memoryview) -> DecodedRequest:
    """Read an envelope. Raises RequestDecodeError only if even the header is unreadable;
    a body that does not unpickle is reported in ``error`` with ``request=None``."""
    view = memoryview(data)
    try:
        mode, name_len = _ENVELOPE.unpack_from(view, 0)
        replies = Replies(mode)
        start = _ENVELOPE.size
        name = bytes(view[start : start + name_len]).decode("utf-8", "replace")
        body = view[start + name_len :]
    except (struct.error, ValueError) as e:
        raise RequestDecodeError(f"unreadable call envelope: {e}") from e
    try:
        method, args, kwargs = deserialize(body)
        if isinstance(method, ByValue):
            method = method.load()
    except Exception as e:  # noqa: BLE001 - any unpickling error is this call's failure
        return DecodedRequest(replies, name, None, f"{type(e).__name__}: {e}")
    return DecodedRequest(replies, name, RpcRequest(method, tuple(args), kwargs or {}, replies))


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


class ReplyGatherError(RuntimeError):
    """The reply gather failed: a rank was lost, or the CPU group's timeout ran out while
    this rank waited for another to finish the call (the message says which setting)."""


#: gloo's timer may fire a hair before the caller's window ends
_TIMER_SLACK_S = 0.05


def gather_replies(
    reply: RpcReply,
    group: dist.ProcessGroup,
    *,
    dst: int,
    world_size: int,
    timeout_s: float | None = None,
) -> list[RpcReply] | None:
    """Collective: every rank passes its reply; rank ``dst`` gets all of them in rank order.

    ``timeout_s`` bounds this rank's wait (rank 0's call window); when it runs out the
    transport's error is raised as it is, for the caller who chose the window. Any other
    failure is a :class:`ReplyGatherError`. The gather itself is bounded by the CPU group's
    timeout (``--cpu-distributed-timeout-seconds``, or the start-up timeout standing in for it
    until the engine's start-up is over), whatever the call's own: ranks that finish a call further
    apart than that fail it, and the error names the one that ran out (docs/usage.md)."""
    start = time.monotonic()
    try:
        return _gather(reply, group, dst, world_size, timeout_s)
    except Exception as e:
        if timeout_s is not None and time.monotonic() - start >= timeout_s - _TIMER_SLACK_S:
            raise
        hint = ""
        if "timed out" in str(e).lower():
            hint = (" (this rank waited longer than the CPU group's timeout, "
                    f"{startup_timeouts.cpu_timeout_setting()}, for another rank to finish "
                    "the call: the ranks finished it further apart than that; raise it if "
                    "they may, e.g. while loading or warming up the model)")
        raise ReplyGatherError(f"the reply gather on the CPU group failed: {e}{hint}") from e


def _gather(reply: RpcReply, group: dist.ProcessGroup, dst: int, world_size: int,
            timeout_s: float | None) -> list[RpcReply] | None:
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
