"""The GPU path's reliance on NCCL/RCCL and torch (keepalive_executor/nccl.py), with fakes:
no NCCL runs here. What each rule rests on is in docs/design.md."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from keepalive_executor import exit_codes, nccl
from keepalive_executor.config import KeepaliveConfigError
from keepalive_executor.worker_loop import clean_up

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml


def test_error_handling_is_set_to_abort_without_teardown_before_the_first_group():
    env: dict[str, str] = {}
    assert nccl.apply_error_handling("nccl", env) == 2
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    # idempotent (a spawned worker inherits it), and the user's choice stands
    assert nccl.apply_error_handling("nccl", env) == 2
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert nccl.apply_error_handling("nccl", mine) == 3
    assert mine == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    # not NCCL: nothing is set
    gloo: dict[str, str] = {}
    assert nccl.apply_error_handling("gloo", gloo) is None and gloo == {}
    with pytest.raises(KeepaliveConfigError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        nccl.apply_error_handling("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "9"})


def test_abort_runs_on_a_thread_of_its_own_and_the_wait_for_it_is_bounded():
    release = threading.Event()
    ran: list[str] = []

    def stuck_abort() -> None:  # torch's abort may block up to the group's timeout
        ran.append(threading.current_thread().name)
        release.wait(30)

    began = time.monotonic()
    thread = nccl.abort_groups(wait_s=0.2, abort=stuck_abort)
    assert 0.15 < time.monotonic() - began < 5
    assert thread.is_alive() and thread.daemon and ran == ["keepalive-abort-groups"]
    release.set()
    thread.join(5)
    # an abort that raises is logged, not raised: this is already a failure path
    nccl.abort_groups(wait_s=5, abort=lambda: 1 / 0).join(5)


class FakeConfig:
    min_ctas = max_ctas = None


class FakeOptions:
    def __init__(self) -> None:
        self.config = FakeConfig()


def test_the_channel_gets_a_communicator_of_its_own_limited_to_one_cta():
    calls: list[dict] = []
    group = nccl.channel_group([0, 1, 2], 60.0, new_group=lambda **kw: calls.append(kw) or "g",
                               options_cls=FakeOptions)
    assert group == "g"
    [kw] = calls
    assert kw["ranks"] == [0, 1, 2] and kw["backend"] == "nccl"
    assert kw["timeout"] == timedelta(seconds=60)
    assert (kw["pg_options"].config.min_ctas, kw["pg_options"].config.max_ctas) == (1, 1)
    # a torch/NCCL without the communicator config: the world's device group is used
    assert nccl.channel_group([0, 1], 60.0, new_group=lambda **kw: calls.append(kw),
                              options_cls=lambda: SimpleNamespace()) is None
    assert len(calls) == 1


class FakeWrapper:
    def __init__(self, order: list[str]) -> None:
        self.worker = object()
        self.order = order

    def shutdown(self) -> None:
        self.order.append("shutdown")


def test_a_receiver_leaving_on_an_error_aborts_its_groups_before_its_shutdown(monkeypatch):
    """A kernel of the step that broke would hold vLLM's worker shutdown on the GPU; on a
    clean exit nothing is aborted and the groups are destroyed."""
    import vllm.distributed as vd

    order: list[str] = []
    monkeypatch.setattr(vd, "destroy_model_parallel", lambda: order.append("destroy"))
    monkeypatch.setattr(vd, "destroy_distributed_environment", lambda: None)

    def abort(wait_s: float) -> None:
        assert wait_s > 0  # bounded, and waited for before the shutdown
        order.append("abort")

    clean_up(FakeWrapper(order), exit_codes.FAILED, abort=abort)
    assert order == ["abort", "shutdown"]
    order.clear()
    clean_up(FakeWrapper(order), exit_codes.OK, abort=abort)
    assert order == ["shutdown", "destroy"]
    order.clear()
    clean_up(FakeWrapper(order), exit_codes.FAILED, abort=None)  # not NCCL: nothing aborted
    assert order == ["shutdown"]
