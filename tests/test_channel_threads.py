"""The channel's thread and stream rule (docs/design.md, "Threads, devices and streams"):
every wait and copy of the channel runs inside its own stream's context, and a thread that
sends binds the device first. No GPU here: a one-rank gloo group in this process, a stand-in
for the stream's context, and works that check, when waited on, that they are inside it."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from keepalive_executor import channel as channel_mod
from keepalive_executor.channel import SEND_WINDOW, BroadcastChannel

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml


@pytest.fixture
def one_rank_group():
    path = os.path.join(tempfile.gettempdir(), f"ka_one_{uuid.uuid4().hex}")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):
            os.unlink(path)


class StreamWatch:
    """Stands in for the channel's CUDA stream context; records waits made outside it."""

    def __init__(self) -> None:
        self.depth = threading.local()
        self.outside: list[str] = []
        self.waits = 0

    @contextlib.contextmanager
    def context(self):
        self.depth.n = getattr(self.depth, "n", 0) + 1
        try:
            yield
        finally:
            self.depth.n -= 1

    def inside(self) -> bool:
        return getattr(self.depth, "n", 0) > 0


class CheckedWork:
    """A real work; ``wait`` checks that it is called inside the channel's stream context
    (on a GPU, ``work.wait()`` makes the *current* stream wait for the collective)."""

    def __init__(self, work, watch: StreamWatch) -> None:
        self._work, self._watch = work, watch

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, *args):
        self._watch.waits += 1
        if not self._watch.inside():
            self._watch.outside.append(threading.current_thread().name)
        return self._work.wait(*args)


def test_every_wait_of_the_sender_is_on_the_channels_stream_and_shutdown_binds(
        one_rank_group, monkeypatch):
    watch = StreamWatch()
    real_broadcast = dist.broadcast

    def broadcast(tensor, src, group=None, async_op=False):
        return CheckedWork(real_broadcast(tensor, src=src, group=group, async_op=True), watch)

    monkeypatch.setattr(channel_mod.dist, "broadcast", broadcast)
    ch = BroadcastChannel(None, src=0, inline_bytes=64)
    monkeypatch.setattr(ch, "_on_stream", watch.context)
    bound: list[str] = []
    monkeypatch.setattr(ch, "bind_thread", lambda: bound.append(
        threading.current_thread().name))
    # more frames than the window (the sender reaps, and waits for a free frame), and a
    # payload that takes a second broadcast
    for i in range(3 * SEND_WINDOW):
        ch.send(b"x" * (200 if i % 5 == 0 else 8))
    ch.flush()
    sender = threading.Thread(target=ch.send_shutdown, name="keepalive-send-shutdown")
    sender.start()
    sender.join(30)
    assert watch.waits >= 3 * SEND_WINDOW  # every broadcast was waited for
    assert watch.outside == [], f"waits outside the channel's stream on {set(watch.outside)}"
    # the thread that sends SHUTDOWN (not the driver's, not the pacer's) binds the device
    assert bound == ["keepalive-send-shutdown"]


class _TorchSeenFromTheChannel:
    """``torch`` as channel.py sees it, with ``zeros`` recording whether each call ran
    inside the channel's stream context (on a GPU a new tensor's zero fill is a kernel on
    the stream current at that moment)."""

    def __init__(self, watch: StreamWatch) -> None:
        self._watch = watch
        self.zeros_inside: list[bool] = []

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def zeros(self, *args, **kwargs):
        self.zeros_inside.append(self._watch.inside())
        return torch.zeros(*args, **kwargs)


def test_every_frame_the_channel_allocates_is_filled_on_the_channels_stream(
        one_rank_group, monkeypatch):
    """A frame allocated on the caller's stream is zero-filled there while the channel's
    stream copies the message into it: nothing orders the two, and the fill can land after
    the copy (a corrupt frame on a GPU, transport ``device``, while the send window grows;
    issue 28, edge 5). Every frame the channel allocates, in its constructor and as the
    window grows, must be allocated inside its stream's context."""
    watch = StreamWatch()
    monkeypatch.setattr(BroadcastChannel, "_on_stream", lambda self: watch.context())
    seen = _TorchSeenFromTheChannel(watch)
    monkeypatch.setattr(channel_mod, "torch", seen)
    real_broadcast = dist.broadcast
    # Broadcasts that look unfinished until waited for (receivers busy elsewhere), so the
    # window grows to its full size instead of reusing the first frame.
    monkeypatch.setattr(channel_mod.dist, "broadcast", lambda tensor, src, group=None,
                        async_op=False: _Unfinished(real_broadcast(tensor, src=src,
                                                                   group=group, async_op=True)))
    ch = BroadcastChannel(None, src=0, inline_bytes=64)
    for _ in range(3 * SEND_WINDOW):
        ch.send(b"x" * 8)
    ch.flush()
    # the constructor's frame (on CPU also the host frame), then one per frame of the window
    assert len(seen.zeros_inside) == 1 + SEND_WINDOW, seen.zeros_inside
    assert all(seen.zeros_inside), seen.zeros_inside


class _Unfinished:
    """A real work that says it is not completed until it has been waited for."""

    def __init__(self, work) -> None:
        self._work, self._waited = work, False

    def is_completed(self) -> bool:
        return self._waited

    def wait(self, *args):
        self._waited = True
        return self._work.wait(*args)
