"""The broadcast channel: one sender (the driver) and N-1 receivers on one process group.

The channel moves **bytes**: what they mean (an engine call, see :mod:`keepalive_executor.rpc`)
is decoded by the receive loop, so that a message a receiver cannot decode is that call's
problem, not a broken channel.

Wire format
===========

Every message is one **frame**: a fixed-size ``uint8`` tensor of ``FRAME = HEADER + inline``
bytes, broadcast from the source rank with ``torch.distributed.broadcast``. Because the size is
fixed, receivers can post the broadcast before they know what is coming, and a small message
costs exactly one collective::

    offset  size  field
    0       4     magic        b"KAch"
    4       2     version      FORMAT_VERSION (receivers reject any other)
    6       2     kind         MessageKind: 1 payload, 2 keepalive, 3 shutdown
    8       8     seq          1, 2, 3, ...  (per channel, every kind counts)
    16      8     length       payload length in bytes
    24      4     header_crc   zlib.crc32 of bytes 0..23
    28      4     (zero)
    32      ...   inline payload: the first min(length, inline) bytes of the payload

If ``length > inline`` the *whole* payload follows in a second broadcast of exactly ``length``
bytes (the receiver allocates it from the header), so a large message costs two collectives
and the first frame's inline bytes are unused. Keepalive and shutdown frames have length 0.

Receivers check, in this order: magic, version, header CRC, kind, ``length <= max_payload``,
and ``seq == previous + 1``. Any failure raises :class:`ChannelProtocolError` (a subclass of
:class:`ChannelError`); nothing is silently skipped. The payload itself is covered by the
transport (TCP for gloo, NCCL's own integrity), not by a checksum of ours: a checksum would
cost a pass over every large payload on the hot path. The size check happens on the sender
*before* the first collective, so a message that cannot be sent leaves every receiver
untouched and the channel in sync.

Concurrency: :meth:`BroadcastChannel.send` (and the keepalive/shutdown variants) take one
lock, :attr:`BroadcastChannel.send_lock`, so messages from several sender threads are totally
ordered and their frames never interleave. The pacer takes the same lock around its
"is a step in flight? no: send a keepalive" decision (see :mod:`keepalive_executor.pacer`),
and reads there :attr:`BroadcastChannel.last_sent_at`, the time of the last frame sent.

The sender does not wait for a broadcast to complete: a root's broadcast completes only when
every receiver has posted its own, and a receiver busy with an earlier step (the last stage of a
pipeline, say) would hold the sender, and with it the whole pipeline, until it is done. So
:meth:`~BroadcastChannel.send` issues the broadcast asynchronously into one of
``SEND_WINDOW`` frames and returns; a frame is reused only after its broadcast completed, and
a broadcast that failed raises at the next send (or :meth:`~BroadcastChannel.flush`), after
which the channel is closed. Receivers still take messages one at a time, in order.

Devices. On CPU (gloo) the frame is the host buffer and a receiver's wait sleeps inside gloo.
On a GPU (NCCL/RCCL) the channel owns **one CUDA stream**: every copy and broadcast of the
channel is issued on it, whichever thread sends (rank 0's driver thread, the pacer thread), so a
frame copy can never overtake a keepalive still in flight on the same buffer; each thread that
uses the channel calls :meth:`BroadcastChannel.bind_thread` first (it sets the device). A
receiver does not block in a device-to-host copy while idle (with CUDA's default scheduling
that spins a core): it posts the broadcast asynchronously and polls the work object
(:class:`PollSchedule`): right after a step (a PAYLOAD frame) it looks every ``POLL_MIN_S``
for up to ``SPIN_S``, because while the engine serves the next step comes within
milliseconds and rank 0's first all-reduce of that step waits for the slowest receiver;
after that, and after a keepalive (the engine is idle), it backs off from ``POLL_MIN_S``
doubling to ``POLL_MAX_S``, so an idle receiver sleeps, at the price of up to
``POLL_MAX_S`` extra latency on the first message after an idle spell. The polling wait is
transport-agnostic and is tested and measured on gloo (``wait="poll"``,
benchmarks/bench_wait.py); nothing here ran on a GPU.

Trust: receivers act on what the source rank sends. Every rank therefore trusts the source
rank and whoever can join the process group (see docs/reliability.md).
"""

from __future__ import annotations

import collections
import enum
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "DEFAULT_INLINE_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "TRANSPORTS",
    "POLL_MAX_S",
    "SPIN_S",
    "PollSchedule",
    "ChannelSpec",
    "MessageKind",
    "Message",
    "FrameHeader",
    "ChannelError",
    "ChannelProtocolError",
    "ChannelTransportError",
    "PayloadTooLargeError",
    "encode_header",
    "decode_header",
    "SequenceChecker",
    "BroadcastChannel",
]

MAGIC = b"KAch"
#: 2: payloads are rpc envelopes (bytes the receive loop decodes), no longer bare pickles.
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sHHQQ")  # magic, version, kind, seq, length -> 24 bytes
_CRC = struct.Struct("<II")  # header_crc, zero pad
HEADER_SIZE = _HEADER.size + _CRC.size  # 32

#: Inline capacity. 16 KiB holds a decode step's pickled SchedulerOutput for the batch
#: sizes we measured, and a 16 KiB gloo broadcast costs about the same as a 64 B one on
#: loopback (docs/benchmarks.md), so most messages cost one collective.
DEFAULT_INLINE_BYTES = 16 * 1024
#: Largest payload the sender accepts; larger messages are rejected before any collective.
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
#: ``device``: vLLM's world device group (NCCL/RCCL on GPUs, gloo on CPU); ``cpu``: its gloo
#: CPU group.
TRANSPORTS = ("device", "cpu")
#: Broadcasts the sender may have in flight (each with its own frame) before it waits.
SEND_WINDOW = 8
#: Polling wait (receivers on a GPU): the backoff starts at POLL_MIN_S and doubles up to this.
POLL_MAX_S = 0.005
POLL_MIN_S = 0.00002
#: Polling wait: how long a receiver keeps looking every POLL_MIN_S after a step before it
#: backs off (see PollSchedule; the figures behind it are in docs/benchmarks.md).
SPIN_S = 0.05


@dataclass(frozen=True)
class ChannelSpec:
    """Everything every rank must agree on to build the same channel; built once by the
    driver (from the settings) and handed to every other rank."""

    transport: str = "device"
    inline_bytes: int = DEFAULT_INLINE_BYTES
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    #: pipeline parallelism: how long a step's output may take to come back to rank 0
    output_timeout_s: float = 300.0
    #: the timeout of the channel's own NCCL group (``device`` on NCCL/RCCL): the validated
    #: timeout of the world's device group, which the interval was checked against
    group_timeout_s: float | None = None
    #: the timeout every rank joins vLLM's process groups with, where the user's is shorter,
    #: until the warm-up is over (startup_timeouts.py); None: the user's from the start
    startup_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.inline_bytes < 0 or self.max_payload_bytes < 0:
            raise ValueError(f"byte sizes must be >= 0: {self}")


class MessageKind(enum.IntEnum):
    """What a frame means to the receiver's loop."""

    PAYLOAD = 1
    """Work: bytes follow (inline or in a second broadcast)."""
    KEEPALIVE = 2
    """Nothing to do: the driver is idle and keeps the collective from timing out."""
    SHUTDOWN = 3
    """The last frame of the channel: receivers leave their loop."""


@dataclass(frozen=True)
class Message:
    """One received message. ``data`` is ``None`` unless ``kind`` is PAYLOAD; it may be a
    view of the channel's buffer, valid until the next :meth:`BroadcastChannel.recv`."""

    kind: MessageKind
    seq: int
    data: memoryview | bytes | None = None


@dataclass(frozen=True)
class FrameHeader:
    """The decoded fixed header of one frame."""

    kind: MessageKind
    seq: int
    length: int
    version: int = FORMAT_VERSION


class ChannelError(RuntimeError):
    """Base class of every error the channel raises."""


class ChannelProtocolError(ChannelError):
    """A frame that breaks the wire format: bad magic, version, CRC, kind or sequence."""


class PayloadTooLargeError(ChannelError):
    """The payload exceeds ``max_payload_bytes``; nothing was sent."""


class ChannelTransportError(ChannelError):
    """The collective itself failed: a peer died, the group timed out, or it was aborted."""


def encode_header(header: FrameHeader) -> bytes:
    """Return the HEADER_SIZE bytes that start a frame."""
    head = _HEADER.pack(MAGIC, header.version, int(header.kind), header.seq, header.length)
    return head + _CRC.pack(zlib.crc32(head), 0)


def decode_header(frame: bytes | memoryview, max_payload_bytes: int) -> FrameHeader:
    """Parse and validate a frame's header. Raises ChannelProtocolError on anything odd."""
    if len(frame) < HEADER_SIZE:
        raise ChannelProtocolError(
            f"truncated frame: {len(frame)} bytes, a header needs {HEADER_SIZE}"
        )
    head = bytes(frame[: _HEADER.size])
    magic, version, kind, seq, length = _HEADER.unpack(head)
    if magic != MAGIC:
        raise ChannelProtocolError(f"bad frame magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise ChannelProtocolError(
            f"frame format version {version}, this receiver speaks {FORMAT_VERSION}: "
            "every rank must run the same keepalive-executor version"
        )
    crc, _pad = _CRC.unpack(bytes(frame[_HEADER.size : HEADER_SIZE]))
    if crc != zlib.crc32(head):
        raise ChannelProtocolError("frame header checksum mismatch (corrupt frame)")
    try:
        mkind = MessageKind(kind)
    except ValueError:
        raise ChannelProtocolError(f"unknown message kind {kind}") from None
    if length > max_payload_bytes:
        raise ChannelProtocolError(
            f"frame announces {length} payload bytes, above the limit {max_payload_bytes}"
        )
    if mkind is not MessageKind.PAYLOAD and length != 0:
        raise ChannelProtocolError(f"{mkind.name} frame with a {length}-byte payload")
    return FrameHeader(kind=mkind, seq=seq, length=length, version=version)


class SequenceChecker:
    """Receiver-side sequence check: every frame must carry exactly previous + 1."""

    def __init__(self) -> None:
        self.last_seq = 0

    def check(self, seq: int) -> None:
        """Accept ``seq`` or raise ChannelProtocolError naming the gap or repeat."""
        expected = self.last_seq + 1
        if seq != expected:
            what = "repeated" if seq <= self.last_seq else "gap in"
            raise ChannelProtocolError(
                f"{what} sequence: got frame {seq}, expected {expected}"
            )
        self.last_seq = seq


class PollSchedule:
    """How long a polling wait sleeps before each look at its pending broadcast.

    A wait that follows a step (:meth:`note`: the last frame was a PAYLOAD) "spins" for its
    first ``spin_s``: it looks every ``poll_min_s``, so a step that follows within
    ``spin_s`` is seen at most ``poll_min_s`` (plus the timer's slack) late. After
    ``spin_s``, and in any wait that follows a keepalive or starts the channel (the engine
    is idle), the sleep doubles from ``poll_min_s`` up to ``poll_max_s``: an idle receiver
    looks ~1/poll_max_s times a second, and a frame is seen at most ``poll_max_s`` late.
    (It sleeps between looks rather than yielding: with fewer free cores than spinning
    threads, gloo's own thread, which completes the receive, was starved by a yielding
    spinner; docs/benchmarks.md, "The receive wait".) Pure: the caller passes the time
    already waited.
    """

    def __init__(self, spin_s: float = SPIN_S, poll_min_s: float = POLL_MIN_S,
                 poll_max_s: float = POLL_MAX_S) -> None:
        self.spin_s = spin_s
        self.poll_min_s = poll_min_s
        self.poll_max_s = poll_max_s
        self.after_step = False

    def note(self, kind: MessageKind) -> None:
        """The frame just received: a step re-arms the spin, anything else disarms it."""
        self.after_step = kind is MessageKind.PAYLOAD

    def delay(self, waited_s: float, previous: float | None) -> float:
        """The sleep before the next look, ``waited_s`` into this wait (``previous``: the
        sleep before the last look, None at the start)."""
        if previous is None or (self.after_step and waited_s < self.spin_s):
            return self.poll_min_s
        return min(previous * 2, self.poll_max_s)


def _wait_polling(work: Any, schedule: PollSchedule) -> None:
    """Wait for ``work`` by polling it on ``schedule``: the thread sleeps between looks
    instead of blocking in a device synchronisation that may spin a core."""
    start = time.monotonic()
    delay: float | None = None
    while not work.is_completed():
        delay = schedule.delay(time.monotonic() - start, delay)
        time.sleep(delay)
    work.wait()  # raises the collective's error, if any; orders the stream after it


class BroadcastChannel:
    """Driver-to-all broadcast of byte messages over a torch.distributed process group.

    The same object is built on every rank of ``group``; the rank equal to ``src`` (a global
    rank) may call the ``send*`` methods, every other rank calls :meth:`recv`.
    ``device`` is where frames live: ``cpu`` for gloo, the rank's CUDA device for NCCL/RCCL.
    ``wait`` is how a receiver waits: ``block`` (inside the collective; gloo sleeps there) or
    ``poll`` (asynchronous collective polled on a :class:`PollSchedule`: every
    ``POLL_MIN_S`` for ``spin_s`` after each step, then a backoff up to ``poll_max_s``);
    default: ``poll`` on a GPU, ``block`` on CPU.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        src: int = 0,
        *,
        device: torch.device | str = "cpu",
        inline_bytes: int = DEFAULT_INLINE_BYTES,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        wait: str | None = None,
        poll_max_s: float = POLL_MAX_S,
        spin_s: float = SPIN_S,
    ) -> None:
        if inline_bytes < 0:
            raise ValueError(f"inline_bytes must be >= 0, got {inline_bytes}")
        if max_payload_bytes < 0:
            raise ValueError(f"max_payload_bytes must be >= 0, got {max_payload_bytes}")
        self.group = group
        self.src = src
        self.device = torch.device(device)
        self.inline_bytes = inline_bytes
        self.max_payload_bytes = max_payload_bytes
        self.frame_bytes = HEADER_SIZE + inline_bytes
        self.rank = dist.get_rank()
        self.is_sender = self.rank == src
        self.send_lock = threading.RLock()
        on_gpu = self.device.type == "cuda"
        if wait is None:
            wait = "poll" if on_gpu else "block"
        if wait not in ("block", "poll"):
            raise ValueError(f"wait must be 'block' or 'poll', got {wait!r}")
        self.wait = wait
        self._schedule = PollSchedule(spin_s=spin_s, poll_max_s=poll_max_s)
        #: the sender's wait for a free frame: a backoff, no spin
        self._reap_schedule = PollSchedule(spin_s=0.0, poll_max_s=poll_max_s)
        # One stream for every copy and broadcast of the channel, whichever thread sends.
        self._stream = torch.cuda.Stream(device=self.device) if on_gpu else None
        with self._on_stream():  # a frame's zero fill runs on the stream that uses it
            self._frame = torch.zeros(self.frame_bytes, dtype=torch.uint8, device=self.device)
            if self.device.type == "cpu":
                self._host_frame = self._frame
            else:
                self._host_frame = torch.zeros(
                    self.frame_bytes, dtype=torch.uint8, pin_memory=on_gpu
                )
        self._host_np = self._host_frame.numpy()  # one view, reused by every message
        self._next_seq = 1
        #: when the sender's last frame (of any kind) went out, on ``time.monotonic``: what
        #: the pacer measures idleness from
        self.last_sent_at = time.monotonic()
        self._seq_check = SequenceChecker()
        self._closed = False
        # sender: the window of frames, and the broadcasts in flight, oldest first
        self._frames: list[torch.Tensor] = []
        self._free: list[int] = []
        self._inflight: collections.deque[_InFlight] = collections.deque()

    def bind_thread(self) -> None:
        """Call once in every thread that uses the channel (sets the CUDA device there)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with ctx:
            yield

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if self.is_sender or self.wait == "block":
            work = dist.broadcast(tensor, src=self.src, group=self.group, async_op=True)
            work.wait()
        else:
            work = dist.broadcast(tensor, src=self.src, group=self.group, async_op=True)
            _wait_polling(work, self._schedule)

    # ------------------------------------------------------------------ sender side
    def send(self, data: bytes | bytearray | memoryview) -> int:
        """Broadcast ``data`` as a PAYLOAD message; return its sequence number."""
        if len(data) > self.max_payload_bytes:
            raise PayloadTooLargeError(
                f"message of {len(data)} bytes exceeds the channel limit of "
                f"{self.max_payload_bytes} bytes; nothing was sent"
            )
        return self._send(MessageKind.PAYLOAD, data)

    def send_keepalive(self) -> int:
        """Broadcast a no-op keepalive frame."""
        return self._send(MessageKind.KEEPALIVE, b"")

    def send_shutdown(self) -> int:
        """Broadcast the final frame and wait until it is out; further sends raise. Binds
        the calling thread first: shutdown sends from a thread of its own."""
        self.bind_thread()
        with self.send_lock:
            seq = self._send(MessageKind.SHUTDOWN, b"")
            self.flush()
            self._closed = True
            return seq

    def _send(self, kind: MessageKind, data: bytes | bytearray | memoryview) -> int:
        if not self.is_sender:
            raise ChannelError(f"rank {self.rank} is a receiver; only rank {self.src} sends")
        with self.send_lock:
            if self._closed:
                raise ChannelError("channel is shut down (or failed); nothing was sent")
            seq = self._next_seq
            try:
                index = self._take_frame()
                frame = self._frames[index]
                header = encode_header(FrameHeader(kind=kind, seq=seq, length=len(data)))
                host = self._host_np if self._stream is not None else frame.numpy()
                host[:HEADER_SIZE] = memoryview(header)
                if 0 < len(data) <= self.inline_bytes:
                    host[HEADER_SIZE : HEADER_SIZE + len(data)] = memoryview(data)
                with self._on_stream():
                    if self._stream is not None:
                        # synchronous w.r.t. the host: the staging buffer is rewritten next
                        frame.copy_(self._host_frame)
                    works = [dist.broadcast(frame, src=self.src, group=self.group,
                                            async_op=True)]
                    big = None
                    if len(data) > self.inline_bytes:
                        big = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                        big = big.to(self.device)
                        works.append(dist.broadcast(big, src=self.src, group=self.group,
                                                    async_op=True))
                self._inflight.append(_InFlight(seq, kind, index, works, big))
            except ChannelTransportError:
                self._closed = True
                raise
            except Exception as e:
                # A frame may be half-delivered: the channel can no longer be trusted.
                self._closed = True
                raise ChannelTransportError(
                    f"broadcast of frame {seq} ({kind.name}) from rank {self.src} failed: {e}"
                ) from e
            self._next_seq = seq + 1
            self.last_sent_at = time.monotonic()
            return seq

    def _take_frame(self) -> int:
        """A free frame of the window; reaps completed broadcasts, waits if all are in use."""
        self._reap(block=False)
        if not self._free and len(self._frames) < SEND_WINDOW:
            # On the channel's stream: its zero fill then comes before the copy into it,
            # which runs there too (on the caller's stream nothing would order the two).
            with self._on_stream():
                self._frames.append(torch.zeros(self.frame_bytes, dtype=torch.uint8,
                                                device=self.device))
            return len(self._frames) - 1
        while not self._free:
            self._reap(block=True)
        return self._free.pop()

    def _reap(self, block: bool) -> None:
        """Retire completed broadcasts, oldest first (with ``block``: at least the oldest).
        A failed one closes the channel and raises ChannelTransportError."""
        while self._inflight:
            oldest = self._inflight[0]
            if not block and not all(w.is_completed() for w in oldest.works):
                return
            try:
                with self._on_stream():  # a wait orders the current stream: ours
                    for work in oldest.works:
                        if self.device.type == "cpu":
                            work.wait()
                        else:
                            _wait_polling(work, self._reap_schedule)
            except Exception as e:
                self._closed = True
                raise ChannelTransportError(
                    f"broadcast of frame {oldest.seq} ({oldest.kind.name}) from rank "
                    f"{self.src} failed: {e}"
                ) from e
            self._inflight.popleft()
            self._free.append(oldest.frame)
            block = False

    def flush(self) -> None:
        """Wait until every broadcast issued so far has completed (raises as send does)."""
        with self.send_lock:
            while self._inflight:
                self._reap(block=True)

    # ---------------------------------------------------------------- receiver side
    def recv(self) -> Message:
        """Wait (for as long as the group's timeout allows) for the next message."""
        if self.is_sender:
            raise ChannelError(f"rank {self.rank} is the sender; it cannot recv")
        if self._closed:
            raise ChannelError("channel already received SHUTDOWN (or failed)")
        try:
            with self._on_stream():
                self._broadcast(self._frame)
                if self._frame is not self._host_frame:
                    self._host_frame.copy_(self._frame)
                raw = self._host_np
                header = decode_header(raw[:HEADER_SIZE].tobytes(), self.max_payload_bytes)
                self._seq_check.check(header.seq)
                self._schedule.note(header.kind)
                data: memoryview | None = None
                if header.kind is MessageKind.PAYLOAD:
                    # the caller reads straight from the frame (or the payload tensor)
                    if header.length <= self.inline_bytes:
                        data = memoryview(raw)[HEADER_SIZE : HEADER_SIZE + header.length]
                    else:
                        big = torch.empty(header.length, dtype=torch.uint8, device=self.device)
                        self._broadcast(big)
                        data = memoryview(big.cpu().numpy())
                elif header.kind is MessageKind.SHUTDOWN:
                    self._closed = True
            return Message(kind=header.kind, seq=header.seq, data=data)
        except ChannelError:
            self._closed = True
            raise
        except Exception as e:
            self._closed = True
            raise ChannelTransportError(
                f"rank {self.rank}: waiting for the broadcast from rank {self.src} failed: {e}"
            ) from e

    def close(self) -> None:
        """Refuse every later send/recv (the executor gave the channel up)."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """True after SHUTDOWN was sent/received, a failure broke the channel, or close()."""
        return self._closed


@dataclass
class _InFlight:
    """A broadcast the sender issued and has not seen complete."""

    seq: int
    kind: MessageKind
    frame: int
    works: list[Any]
    big: torch.Tensor | None  # the payload tensor of a two-collective message, kept alive

