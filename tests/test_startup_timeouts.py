"""vLLM's start-up collectives under the start-up timeout, the user's timeouts after the
warm-up (keepalive_executor/startup_timeouts.py): the decision, on vLLM's own groups in two
real gloo processes, and through an engine whose rank 1 reaches the profile run late."""

from __future__ import annotations

from types import SimpleNamespace

import lanes
import pytest
from recording_executor import END_PIECES, END_TIMEOUTS, KvSpec, recording_executor
from run_engine import HERE, run_script

from keepalive_executor import startup_timeouts

#: the user's collective timeouts in the scenarios below, and how late rank 1 is: later than
#: the timeout, far inside the start-up timeout
USER_S = 1
LATE_S = 3.5


class _Config:
    def __init__(self, device, cpu) -> None:
        self.distributed_timeout_seconds = device
        self.cpu_distributed_timeout_seconds = cpu


@pytest.mark.fast
@pytest.mark.parametrize("device,cpu,startup,raised", [
    (5, 5, 600.0, {"distributed_timeout_seconds": 600,
                   "cpu_distributed_timeout_seconds": 600}),
    (5, None, 600.0, {"distributed_timeout_seconds": 600}),  # unset: torch's default
    (None, 30, 600.0, {"cpu_distributed_timeout_seconds": 600}),
    (600, 1200, 600.0, {}),  # at or above the start-up timeout: as the user set them
    (5, 5, 10.5, {"distributed_timeout_seconds": 11, "cpu_distributed_timeout_seconds": 11}),
    (5, 5, None, {}),  # the protection off (a negative control's executor)
])
def test_only_timeouts_the_user_set_below_the_start_up_timeout_are_raised(device, cpu, startup,
                                                                         raised):
    assert startup_timeouts.raised_values(_Config(device, cpu), startup) == raised


@pytest.mark.fast
def test_the_configuration_gets_the_users_values_back_at_once_and_restore_is_remembered():
    config = _Config(5, 7)
    with startup_timeouts.during_startup(config, 600.0) as raised:
        assert (config.distributed_timeout_seconds, config.cpu_distributed_timeout_seconds) \
            == (600, 600) == tuple(raised.values())
    assert (config.distributed_timeout_seconds, config.cpu_distributed_timeout_seconds) == (5, 7)
    assert startup_timeouts.pending() == {"distributed_timeout_seconds": 5,
                                          "cpu_distributed_timeout_seconds": 7}
    # a start-up that fails inside: the values come back, nothing is left to restore
    with pytest.raises(RuntimeError), startup_timeouts.during_startup(config, 600.0):
        raise RuntimeError("init_device failed")
    assert (config.distributed_timeout_seconds, config.cpu_distributed_timeout_seconds) == (5, 7)
    assert startup_timeouts.pending() == {}
    with startup_timeouts.during_startup(config, None) as raised:
        assert raised == {} and config.distributed_timeout_seconds == 5
    assert startup_timeouts.pending() == {} and startup_timeouts.restore() == 0


@pytest.mark.fast
def test_the_installed_vllm_has_what_start_up_and_restore_use():
    """The contract with the installed release (the no-engine tier runs this on 0.33 and 0.34
    as well): both configuration fields, the registry of GroupCoordinators with a device and a
    CPU group each, and torch's setter of a group's timeout."""
    import dataclasses
    import inspect

    from torch.distributed import distributed_c10d
    from vllm.config import ParallelConfig
    from vllm.distributed import parallel_state

    assert set(startup_timeouts.FIELDS) <= {f.name for f in dataclasses.fields(ParallelConfig)}
    assert isinstance(parallel_state._groups, dict)
    init = inspect.getsource(parallel_state.GroupCoordinator.__init__)
    assert "self.device_group" in init and "self.cpu_group" in init
    assert "timeout" in inspect.signature(distributed_c10d._set_pg_timeout).parameters


@pytest.mark.fast
def test_a_group_created_after_init_device_gets_the_users_timeouts_at_once():
    """What the module's docstring says of groups created later in the start-up (while the
    model loads, by a model's or a KV connector's own code): vLLM gives a new group the
    timeouts its configuration holds at that moment (``get_distributed_timeout_or_none``,
    ``get_cpu_distributed_timeout_or_none``, read at creation), and the configuration has the
    user's values back as soon as ``init_device`` and the channel's groups are done. Such a
    group has the user's timeouts from the start, not the start-up timeout."""
    from datetime import timedelta

    from vllm.config import ParallelConfig, set_current_vllm_config
    from vllm.distributed.utils import (
        get_cpu_distributed_timeout_or_none,
        get_distributed_timeout_or_none,
    )

    pc = ParallelConfig(distributed_timeout_seconds=5, cpu_distributed_timeout_seconds=7)
    # only the parallel configuration is read (a whole VllmConfig needs a platform, which the
    # no-engine tier on 0.33 and 0.34 does not have)
    try:
        with set_current_vllm_config(SimpleNamespace(parallel_config=pc)):
            with startup_timeouts.during_startup(pc, 600.0):  # init_device: raised
                assert get_distributed_timeout_or_none() == timedelta(seconds=600)
                assert get_cpu_distributed_timeout_or_none() == timedelta(seconds=600)
            # loading the model, profiling, the warm-up: a group created now
            assert get_distributed_timeout_or_none() == timedelta(seconds=5)
            assert get_cpu_distributed_timeout_or_none() == timedelta(seconds=7)
    finally:
        startup_timeouts._users.clear()


# -- where the start-up ends: each release's own _initialize_kv_caches, replayed -------------
def _engine_config(*, extensible: bool, offload: bool, shrinks: bool):
    """What _initialize_kv_caches reads of the configuration, on every release: the
    extensible KV cache on or off (0.34's default on CUDA), SimpleCPUOffloadConnector with
    prefix caching, and whether the KV cache's size shrinks max_model_len after the warm-up."""
    kv_transfer = None if not offload else SimpleNamespace(
        has_connector=lambda name: name == "SimpleCPUOffloadConnector")
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=4096),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
        cache_config=SimpleNamespace(enable_prefix_caching=True, enable_extensible_kv_cache=
                                     extensible, kv_cache_layout="NHD", num_gpu_blocks=None,
                                     block_size=16, simple_cpu_offload_num_blocks=None),
        parallel_config=SimpleNamespace(cp_kv_cache_interleave_size=1,
                                        distributed_timeout_seconds=5,
                                        cpu_distributed_timeout_seconds=5),
        compilation_config=SimpleNamespace(compilation_time=0.0, encoder_compilation_time=0.0),
        kv_transfer_config=kv_transfer,
        adjust_dcp_kv_cache_interleave_size=lambda groups: None,
        validate_block_size=lambda: None,
    )
    config.shrinks = shrinks
    return config


@pytest.fixture
def kv_sizing(monkeypatch):
    """vLLM's KV cache sizing, which decides numbers, not which executor calls the engine
    makes or in which order: answered by stand-ins in the engine module's namespace."""
    from vllm.v1.engine import core

    group = SimpleNamespace(kv_cache_spec=KvSpec())

    def kv_configs(vllm_config, specs, memory, *args):
        return [SimpleNamespace(kv_cache_layout=None) for _ in specs]

    def finalize(vllm_config, *args):
        if vllm_config.shrinks:  # the measured cache holds fewer tokens than reserved
            vllm_config.model_config.max_model_len = 2048
        return 128

    stand_ins = {
        "register_all_kvcache_specs": lambda vllm_config: None,
        "resolve_kv_cache_layout": lambda *args: SimpleNamespace(name="NHD"),
        "get_global_kv_cache_groups": lambda *args: [group],
        "get_kv_cache_configs": kv_configs,
        "generate_scheduler_kv_cache_config": lambda configs: SimpleNamespace(
            num_blocks=256, kv_cache_groups=[group]),
        "update_kv_cache_capacity": lambda *args: None,
        "resolve_kv_cache_block_sizes": lambda *args: (16, 16),
        "resolve_cache_hit_alignment_tokens": lambda *args: 16,
        "finalize_extensible_kv_cache": finalize,
    }
    for name, stand_in in stand_ins.items():
        monkeypatch.setattr(core, name, stand_in, raising=False)
    monkeypatch.setattr(core.envs, "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH", False)
    return core


@pytest.mark.fast
@pytest.mark.parametrize("extensible,offload,shrinks,refused", [
    (False, False, False, False), (True, False, False, False), (True, False, True, False),
    (True, False, False, True), (False, True, False, False), (True, True, True, False)],
    ids=["plain", "extensible", "extensible-shrinks", "extensible-refused", "cpu-offload",
         "all"])
def test_the_start_up_ends_after_this_releases_last_start_up_call(kv_sizing, extensible,
                                                                  offload, shrinks, refused):
    """The installed release's own ``EngineCore._initialize_kv_caches``, run against the
    keepalive executor with its calls recorded: every rank gets the user's timeouts back, and
    the pieces (the ranks' liveness) hear that the start-up is over, after the last engine
    call of the start-up and not before. On 0.34 the warm-up is followed by the extensible KV
    cache's commit (extend_kv_cache: it commits the KV memory and may run dummy passes, on
    every rank), a max_model_len update and SimpleCPUOffload's block count; on 0.32 and 0.33
    the warm-up is last (the no-engine tier runs this on each)."""
    calls: list[str] = []
    config = _engine_config(extensible=extensible, offload=offload, shrinks=shrinks)
    engine = SimpleNamespace(available_gpu_memory_for_kv_cache=-1)
    replies = {"extensible_kv_cache_unsupported_reason": [
        "no virtual memory management" if refused else None, None]}
    engine.model_executor = recording_executor(config, calls, replies)
    engine.collective_rpc = lambda method, timeout=None, args=(), kwargs=None: (
        engine.model_executor.collective_rpc(method, timeout, args, kwargs))
    with startup_timeouts.during_startup(config.parallel_config, 600.0):
        pass  # init_device: the user's 5 s raised; restore() is pending
    try:
        kv_sizing.EngineCore._initialize_kv_caches(engine, config)
    finally:
        startup_timeouts._users.clear()
    order = " -> ".join(calls)
    assert "compile_or_warm_up_model" in calls, order
    assert calls.count(END_TIMEOUTS) == 1 and calls.count(END_PIECES) == 1, order
    # the end, once every start-up call has returned, in this order: timeouts, then pieces
    assert calls[-2:] == [END_TIMEOUTS, END_PIECES], order
    print(order)


@pytest.mark.fast
def test_a_start_up_whose_last_call_never_comes_ends_at_the_first_model_step():
    """A release whose engine skips the call after which the start-up was to end (one this
    executor was not written for): the first model step ends it, before the step."""
    calls: list[str] = []
    config = _engine_config(extensible=True, offload=False, shrinks=False)
    ex = recording_executor(config, calls)
    ex._startup_ends_after = "extend_kv_cache"
    ex.execute_dummy_batch()
    ex.execute_dummy_batch()
    assert calls == [END_PIECES, "execute_dummy_batch", "execute_dummy_batch"], calls


@pytest.mark.serial
@pytest.mark.parametrize("startup_s", [30.0, None], ids=["raised", "negative-control"])
def test_vllms_groups_wait_past_the_users_timeout_in_start_up_and_not_after(ranks, startup_s):
    """Two processes join vLLM's groups as a worker's init_device does, both timeouts 1 s;
    rank 1 is 3.5 s late to a barrier on the TP CPU group and to an all-reduce on the TP device
    group. Raised to the 30 s start-up timeout, rank 0 waits for it; after restore(), the
    same lateness times rank 0's wait out (the user's 2 s again). Control: not raised, the
    first wait already times out."""
    res = ranks("startup_timeouts_on_vllms_groups", 2, timeout_s=USER_S, wall_s=120,
                joins_groups=True, user_s=USER_S, startup_s=startup_s, late_s=LATE_S)
    assert set(res) == {0, 1}, res
    r0 = res[0]
    assert "error" not in r0, r0.get("traceback")
    assert r0["config_after"] == [USER_S, USER_S]  # the configuration: the user's at once
    if startup_s is None:
        assert r0["raised"] == {}
        assert "timed out" in r0["startup_cpu"].lower(), r0
        return
    assert r0["raised"] == {"distributed_timeout_seconds": 30,
                            "cpu_distributed_timeout_seconds": 30}
    assert r0["startup_cpu"] == "ok" and r0["startup_device"] == "ok", r0
    assert r0["startup_cpu_s"] >= LATE_S - 1 and r0["startup_device_s"] >= LATE_S - 1, r0
    # the world's, TP's, PP's, DP's, EP's ... device and CPU groups, and the default group
    assert r0["restored"] >= 5, r0
    assert "timed out" in r0["after_cpu"].lower(), r0


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("backend", [
    # overlappable but for what its script measures (lanes.start_up_in_region); the control's
    # claim is its start-up: alone
    pytest.param("keepalive", marks=pytest.mark.overlappable, id="raised"),
    pytest.param("controls.ShortStartupTimeouts", id="negative-control")])
def test_a_rank_later_than_the_timeout_to_the_profile_run_starts_and_the_timeout_holds_after(
        tiny_model, tmp_path, backend):
    """An engine (TP=2, in-process) with both collective timeouts at 5 s whose rank 1 reaches
    the engine's profile run 8 s after rank 0 (rank 0 waits in the reply gather on the CPU
    group): it starts. After the warm-up the 5 s hold again: rank 1 stalling 10 s where rank
    0 waits for it fails that call well before the stall ends. That is inside a step where
    TP's all-reduce runs on the device group (vLLM's AVX2 CPU build), inside a collective_rpc
    where it runs in vLLM's shared-memory communicator, which has no timeout (the AVX512
    builds; startup_scripts.py). Negative control, the same start-up under the user's
    timeouts (controls.ShortStartupTimeouts): it fails."""
    faults = tmp_path / "faults"
    faults.mkdir()

    def run(env: dict[str, str]) -> dict:
        return run_script(
            "slow_profile_then_stall", script="startup_scripts.py", model=tiny_model,
            timeout_s=5, stall_s=10.0, fault_dir=str(faults), backend=backend,
            extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KEEPALIVE_FAULT_DIR": str(faults),
                       "KEEPALIVE_SLOW_PROFILE_S": "8", "PYTHONPATH": str(HERE), **env})

    # In the serial phase's lanes the start-up that must succeed may run beside the other
    # lane's start-ups (it runs under the start-up timeout; load only makes it harder), and the
    # 5 s bound after it is measured alone. The control's whole claim is its start-up: alone.
    res = lanes.start_up_in_region(run) if backend == "keepalive" else run({})
    if backend != "keepalive":
        assert not res["started"], res
        assert "timed out" in res["error"].lower(), res
        return
    assert res["started"] and res["tokens"] == 4, res
    assert res["still_raised"] == {}, res  # restored on rank 0 at the end of the warm-up
    assert res["stall_fired"] and res["stall_error"] is not None, res
    assert "timed out" in res["stall_error"].lower(), res
    assert res["stall_s"] < 10.0, res  # the 5 s, not the stall's end
    print(f"TP all-reduce in the {res['tp_all_reduce']}; the stall failed after "
          f"{res['stall_s']:.2f}s: {res['stall_error'][:200]}")


#: how late rank 0 is to the process groups, against a 5 s collective timeout (the same as
#: test_torchrun.py's follower test)
LATE_RANK0_S = 8


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("backend", [
    # overlappable: its one claim is a start-up under the start-up timeout, which load only
    # makes harder; the control's claim is its start-up: alone
    pytest.param("keepalive", marks=pytest.mark.overlappable, id="raised"),
    pytest.param("controls.ShortStartupTimeouts", id="negative-control")])
def test_spawned_ranks_wait_for_rank0_later_than_the_timeout_to_the_rendezvous(tiny_model,
                                                                              backend):
    """The spawned mode with torchrun mode's lateness (test_torchrun.py): an engine (TP=2,
    in-process) with a 5 s collective timeout whose rank 0 joins the process groups 8 s
    after rank 1 said ALIVE and went on into its own init_device. Rank 1 waits under the
    start-up timeout: the engine starts and generates. Negative control, the same under the
    user's timeout (controls.ShortStartupTimeouts): it fails."""
    res = run_script("slow_start", model=tiny_model, timeout_s=5, backend=backend, extra_env={
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(HERE),
        "KEEPALIVE_LATE_RANK0_S": str(LATE_RANK0_S)})
    if backend != "keepalive":
        assert not res["started"], res
        # rank 1's wait for rank 0 timed out, and the rank with it
        assert "worker rank 1" in res["error"] and "died" in res["error"], res
        return
    assert res["started"] and res["tokens"] == 4, res
    assert res["elapsed_s"] > LATE_RANK0_S, res  # the hook acted
