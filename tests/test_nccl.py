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


def test_the_abort_leaves_gloo_groups_and_torchs_group_table_alone(tmp_path):
    """The pacer and the output thread may still hold gloo groups when a step is given up:
    the abort must not pull them from under those threads (torch's ``_abort_process_group()``
    aborts every group, gloo ones too, and empties torch's group table). A one-rank gloo world
    in this process; on this CPU-only torch no group has an NCCL backend, so nothing is
    aborted and every group still works afterwards."""
    import contextlib

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    try:
        sub = dist.new_group([0], backend="gloo")
        nccl.abort_groups(wait_s=10).join(10)
        assert dist.is_initialized()
        for group in (None, sub):
            t = torch.ones(2)
            dist.broadcast(t, src=0, group=group)
            dist.all_reduce(t, group=group)
            assert t.tolist() == [1.0, 1.0]
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class FakeBackend:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def _group_start(self) -> None:
        self.calls.append("group_start")

    def _group_end(self) -> None:
        self.calls.append("group_end")

    def abort(self) -> None:
        self.calls.append(f"abort {self.name}")


def test_only_the_nccl_backends_are_aborted_newest_first_inside_one_nccl_group():
    """What torch's abort does to NCCL (one ncclGroupStart/End around every communicator's
    abort, pytorch#119797), without its gloo side: a mixed group (vLLM's world: cuda:nccl,
    cpu:gloo) loses its NCCL backend only; a gloo group is not touched; a backend shared by
    two group objects is aborted once."""
    calls: list[str] = []
    world, tp, channel = (FakeBackend(n, calls) for n in ("world", "tp", "channel"))
    groups = ["world", "world-cpu", "tp", "tp-cpu", "channel", "alias-of-tp"]
    nccl_of = {"world": world, "tp": tp, "channel": channel, "alias-of-tp": tp}
    assert nccl.abort_nccl_backends(groups, nccl_of.get) == 3
    assert calls == ["group_start", "abort tp", "abort channel", "abort world", "group_end"]
    calls.clear()
    assert nccl.abort_nccl_backends(["world-cpu", "tp-cpu"], nccl_of.get) == 0
    assert calls == []


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
