"""OutputReceiver (pipeline parallelism's output link, rank 0's side) with a fake link: no
vLLM, no process groups. The engine-level counterparts are in tests/test_pipeline.py."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from keepalive_executor.lifecycle import ExecutorFailedError
from keepalive_executor.outputs import OutputReceiver
from keepalive_executor.rpc import RpcReply, WorkerRpcError


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
