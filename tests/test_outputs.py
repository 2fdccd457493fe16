"""OutputReceiver (pipeline parallelism's output link, rank 0's side) with a fake link: no
vLLM, no process groups; and, under async scheduling, what a receiving rank resolves and
the output rank's sender thread. The engine-level counterparts are in tests/test_pipeline.py."""

from __future__ import annotations

import pickle
import queue
import threading
import time

import pytest
from vllm.v1.outputs import AsyncModelRunnerOutput

from keepalive_executor.channel import Message, MessageKind
from keepalive_executor.lifecycle import ExecutorFailedError
from keepalive_executor.outputs import OutputLink, OutputReceiver, OutputSender
from keepalive_executor.rpc import Replies, RpcReply, RpcRequest, WorkerRpcError, encode_request

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml


class FakeLink:
    """What OutputReceiver needs of an OutputLink: ``src`` and a blocking ``recv()``."""

    def __init__(self, src: int = 1) -> None:
        self.src = src
        self.replies: queue.Queue = queue.Queue()
        self.received = 0

    def recv(self) -> RpcReply:
        reply = self.replies.get()
        if isinstance(reply, BaseException):
            raise reply
        self.received += 1
        return reply

    def send(self, value=None, *, ok: bool = True, error: str | None = None) -> None:
        """The output rank's side: one reply."""
        self.replies.put(RpcReply(rank=self.src, ok=ok, value=value, error=error))


def _receiver(executor_like: bool):
    """A started receiver; ``on_lost`` records its reasons and, like the executor's fail,
    optionally fails every expected future itself."""
    link = FakeLink()
    reasons: list[str] = []
    holder: dict = {}

    def on_lost(reason: str) -> None:
        reasons.append(reason)
        if executor_like:
            holder["r"].fail_all(ExecutorFailedError(f"keepalive executor failed: {reason}"))

    receiver = OutputReceiver(link, on_lost=on_lost)
    holder["r"] = receiver
    receiver.start()
    return receiver, link, reasons


@pytest.mark.parametrize("executor_like", [True, False], ids=["executor-fail", "recorder"])
def test_an_error_reply_fails_its_step_the_executor_and_every_later_step(executor_like):
    receiver, link, reasons = _receiver(executor_like)
    first = receiver.expect("execute_model")
    failing = receiver.expect("sample_tokens")
    later = receiver.expect("execute_model")
    link.send("tokens-1")
    link.send(ok=False, error="RuntimeError: injected on the last stage")
    link.send("tokens-3")  # what a pipeline out of step would pair with the wrong step
    assert first.result(5) == "tokens-1"
    with pytest.raises(WorkerRpcError, match=r"'sample_tokens'.*rank 1.*injected") as err:
        failing.result(5)
    assert err.value.rank == 1
    # the executor's fail, once, naming the step, the rank and the rank's error
    assert len(reasons) == 1, reasons
    assert "sample_tokens" in reasons[0] and "rank 1" in reasons[0], reasons
    assert "injected on the last stage" in reasons[0]
    with pytest.raises(ExecutorFailedError, match="sample_tokens failed on rank 1"):
        later.result(5)
    with pytest.raises(ExecutorFailedError, match="sample_tokens failed on rank 1"):
        receiver.expect("execute_model").result(5)  # and every step after it
    receiver._thread.join(5)
    assert not receiver._thread.is_alive()
    assert link.received == 2  # the reply meant for an earlier step was never paired


def test_a_lost_link_also_fails_the_later_steps_without_the_executor():
    receiver, link, reasons = _receiver(executor_like=False)
    waiting = [receiver.expect("execute_model"), receiver.expect("execute_model")]
    link.replies.put(RuntimeError("Connection closed by peer"))
    for f in waiting:
        with pytest.raises(ExecutorFailedError, match="did not arrive: Connection closed"):
            f.result(5)
    assert len(reasons) == 1 and "rank 1" in reasons[0]


def test_drain_waits_until_every_expected_output_arrived():
    receiver, link, reasons = _receiver(executor_like=True)
    futures = [receiver.expect("execute_model") for _ in range(3)]

    def last_stage() -> None:  # the outputs of batches still in flight, arriving late
        for i in range(3):
            time.sleep(0.2)
            link.send(i)

    threading.Thread(target=last_stage, daemon=True).start()
    t0 = time.monotonic()
    assert receiver.drain(5.0) is True
    assert time.monotonic() - t0 < 4.0  # woken by the last arrival, not by the bound
    assert [f.result(0) for f in futures] == [0, 1, 2]  # settled normally, not failed
    assert receiver.pending == 0 and reasons == []
    assert receiver.drain(0.0) is True  # nothing expected: at once


def test_drain_is_bounded_and_says_when_outputs_are_missing():
    receiver, link, reasons = _receiver(executor_like=True)
    first, stuck = receiver.expect("execute_model"), receiver.expect("execute_model")
    link.send("only one")
    t0 = time.monotonic()
    assert receiver.drain(0.5) is False
    assert 0.4 < time.monotonic() - t0 < 3.0
    assert first.result(0) == "only one" and not stuck.done()  # drain fails nothing itself
    receiver.fail_all(ExecutorFailedError("keepalive executor is shut down"))
    assert receiver.drain(5.0) is False  # failed: the missing output will never be paired


# ---------------------------------------------------------------- async scheduling, receivers


class LateOutput(AsyncModelRunnerOutput):
    """An output still being copied to the host (async scheduling); records who waited."""

    def __init__(self, value, *, late: bool = False, raises: bool = False) -> None:
        self.value, self.raises = value, raises
        self.release = threading.Event()
        if not late:
            self.release.set()
        self.waited_on: list[str] = []

    def get_output(self):
        self.waited_on.append(threading.current_thread().name)
        assert self.release.wait(10)
        if self.raises:
            raise RuntimeError(f"copy of {self.value} failed")
        return self.value

    def get_kv_connector_output(self):  # abstract since vLLM 0.33
        return None


class RecordingLink:
    """The output rank's OutputLink with its two gloo sends recorded (real serialization:
    OutputLink.send resolves, serializes, and sends length then bytes)."""

    def __init__(self, monkeypatch) -> None:
        import keepalive_executor.outputs as outputs

        self.sent: list[RpcReply] = []
        self.fail_next = False
        chunks: list = []

        def send(tensor, dst, group=None, tag=0):
            if self.fail_next:
                raise RuntimeError("gloo: connection closed by peer")
            chunks.append(tensor.clone())
            if len(chunks) == 2:
                self.sent.append(pickle.loads(chunks[1].numpy().tobytes()))
                chunks.clear()

        monkeypatch.setattr(outputs.dist, "send", send)
        self.link = OutputLink(group=None, src=1)


def test_the_output_link_resolves_the_output_it_sends_and_reports_a_failed_copy(monkeypatch):
    rec = RecordingLink(monkeypatch)
    ok, bad = LateOutput("tokens-1"), LateOutput("tokens-2", raises=True)
    rec.link.send(RpcReply(rank=1, ok=True, value=(None, ok)))  # a fused step's pair
    rec.link.send(RpcReply(rank=1, ok=True, value=bad))
    first, second = rec.sent
    assert first.ok and first.value == (None, "tokens-1")
    assert not second.ok and "copy of tokens-2 failed" in second.error


def test_the_output_sender_resolves_and_sends_in_order_off_the_receive_loop(monkeypatch):
    """mp's WorkerAsyncOutputCopy: the receive loop hands the output over and goes on at
    once; the thread waits for each copy, in step order, and sends."""
    rec = RecordingLink(monkeypatch)
    bound: list[str] = []
    sender = OutputSender(rec.link, bind_thread=lambda: bound.append(
        threading.current_thread().name))
    outs = [LateOutput(f"tokens-{i}", late=(i == 0)) for i in range(3)]
    began = time.monotonic()
    for out in outs:
        sender.send(RpcReply(rank=1, ok=True, value=out))
    assert time.monotonic() - began < 1.0  # the loop did not wait for the late copy
    assert rec.sent == []
    outs[0].release.set()
    sender.close(10)
    assert [r.value for r in rec.sent] == ["tokens-0", "tokens-1", "tokens-2"]
    assert {t for o in outs for t in o.waited_on} == {"keepalive-output-send"}
    assert bound == ["keepalive-output-send"]


def test_a_failed_send_stops_the_sender_and_the_receive_loop_learns_at_its_next_send(
        monkeypatch):
    rec = RecordingLink(monkeypatch)
    sender = OutputSender(rec.link)
    rec.fail_next = True
    sender.send(RpcReply(rank=1, ok=True, value="tokens-0"))
    deadline = time.monotonic() + 10
    while sender.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        sender.send(RpcReply(rank=1, ok=True, value="tokens-1"))


class OneShotChannel:
    """The messages a receiver gets: the given requests, then SHUTDOWN."""

    src = 0  # the sender's global rank (where replies are gathered)

    def __init__(self, requests: list[RpcRequest]) -> None:
        self.messages = [Message(MessageKind.PAYLOAD, i + 1, encode_request(r))
                         for i, r in enumerate(requests)]
        self.messages.append(Message(MessageKind.SHUTDOWN, len(requests) + 1))

    def recv(self) -> Message:
        return self.messages.pop(0)


def test_a_receiver_resolves_only_the_outputs_it_returns(monkeypatch):
    """mp's non-output ranks drop their async outputs; a call whose result goes back to
    rank 0 (collective_rpc, a connector's step reply) is resolved first."""
    import keepalive_executor.worker_loop as wl

    made: dict[str, LateOutput] = {}
    gathered: list[RpcReply] = []

    def run(worker, req):
        made[req.name] = LateOutput(f"out-of-{req.name}")
        return made[req.name]

    monkeypatch.setattr(wl, "gather_replies", lambda reply, *a, **k: gathered.append(reply))
    channel = OneShotChannel([RpcRequest("execute_model", (), {}, Replies.DRIVER),
                              RpcRequest("sample_tokens", (), {}, Replies.DRIVER),
                              RpcRequest("apply_model", (), {}, Replies.ALL)])
    wl.receive_loop(object(), channel, None, rank=1, world_size=2, run=run)
    assert made["execute_model"].waited_on == [] and made["sample_tokens"].waited_on == []
    assert made["apply_model"].waited_on == ["MainThread"]
    assert [r.value for r in gathered] == ["out-of-apply_model"]


def test_resolving_leaves_every_value_but_an_async_output_as_it_is():
    """A NamedTuple (vLLM returns some from collective_rpc at start-up) must come back as
    the same object; only a plain pair holding an async output is rebuilt."""
    from collections import namedtuple

    from keepalive_executor.outputs import resolve_output

    Pair = namedtuple("Pair", "language_model other")
    value = Pair(1, 2)
    assert resolve_output(value) is value
    plain = (None, "x")
    assert resolve_output(plain) is plain
    assert resolve_output((None, LateOutput("tokens"))) == (None, "tokens")
