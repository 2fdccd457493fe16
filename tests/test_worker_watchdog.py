"""vLLM's stack-dump watchdog (0.33+, ``--watchdog-config``) in the workers' receive loop:
off while a worker waits for the next call, however long the engine idles; on while it runs
one, so a stuck call gets its stacks dumped (compat.start_worker_watchdog, worker_loop.py).
The real watchdog thread and the real receive loop; the channel is a stand-in that idles."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from keepalive_executor import compat
from keepalive_executor.channel import Message, MessageKind
from keepalive_executor.rpc import Replies, RpcRequest, encode_request

watch_dog = pytest.importorskip(
    "vllm.utils.watch_dog", reason="vLLM 0.32 has no watchdog (0.33 added it)")

pytestmark = pytest.mark.fast

IDLE_S = 3.5  # the engine idles this long: 3.5 watchdog timeouts
CALL_S = 3.5  # a call that runs this long is "stuck" for a 1 s watchdog


class IdleChannel:
    """One call after an idle period, then SHUTDOWN."""

    src = 0

    def __init__(self) -> None:
        self.messages = [Message(MessageKind.PAYLOAD, 1, encode_request(
            RpcRequest("slow_call", (), {}, Replies.DRIVER)))]
        self.messages.append(Message(MessageKind.SHUTDOWN, 2))

    def recv(self) -> Message:
        if len(self.messages) == 2:
            time.sleep(IDLE_S)  # waiting for the driver, as a real receiver would
        return self.messages.pop(0)


class AlwaysOn(compat.WorkerWatchdog):
    """The negative control: the watchdog left on while the worker waits."""

    def waiting(self):
        return contextlib.nullcontext()


@pytest.fixture
def watchdog(tmp_path):
    from vllm.config import WatchdogConfig

    config = type("Cfg", (), {})()
    config.watchdog_config = WatchdogConfig(timeout=1, check_interval=1,
                                            dump_dir=str(tmp_path))
    dog = compat.start_worker_watchdog(1, config)
    yield dog, tmp_path
    watch_dog.get_watch_dog().stop()
    watch_dog._watch_dog = watch_dog.NoopWatchDog()


def _run(watchdog_obj, dump_dir: Path) -> tuple[list[str], list[str]]:
    """Run the receive loop; the dump files seen when the call began, and at the end."""
    import keepalive_executor.worker_loop as wl

    seen_at_call: list[str] = []

    def run(worker, req):
        seen_at_call.extend(p.name for p in dump_dir.iterdir())
        time.sleep(CALL_S)

    wl.receive_loop(object(), IdleChannel(), None, rank=1, world_size=2, run=run,
                    watchdog=watchdog_obj)
    return seen_at_call, [p.name for p in dump_dir.iterdir()]


def test_an_idle_worker_is_not_stuck_and_a_stuck_call_is_dumped(watchdog):
    dog, dump_dir = watchdog
    at_call, at_end = _run(dog, dump_dir)
    assert at_call == [], "the watchdog fired while the worker waited for the driver"
    assert len(at_end) == 1 and "worker_1" in at_end[0], at_end
    assert (dump_dir / at_end[0]).stat().st_size > 0


def test_negative_control_a_watchdog_left_on_while_waiting_fires_during_idle(watchdog):
    dog, dump_dir = watchdog
    at_call, _ = _run(AlwaysOn(dog._dog), dump_dir)
    assert at_call, "an idle period of 3.5 watchdog timeouts went unnoticed"


def test_without_watchdog_config_nothing_starts_and_the_loop_is_given_no_watchdog():
    """vLLM's default (``dump_dir`` ""): no watchdog thread, and what the receive loop gets
    wraps no watchdog at all, so its wait and its calls cost nothing (vLLM's
    ``start_watch_dog`` returns its singleton either way: a ``NoopWatchDog`` here, which the
    loop must not be handed to feed and disable around every call)."""
    from vllm.config import WatchdogConfig

    config = type("Cfg", (), {})()
    config.watchdog_config = WatchdogConfig()  # dump_dir "": off, vLLM's default
    dog = compat.start_worker_watchdog(1, config)
    assert isinstance(watch_dog.get_watch_dog(), watch_dog.NoopWatchDog)  # no thread started
    assert dog._dog is None, dog._dog
    assert dog.waiting() is compat._NOT_WATCHED
