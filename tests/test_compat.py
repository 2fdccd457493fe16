"""The vLLM releases the executor supports, and the executor held against the installed
release's contract. No engine starts: these run on every supported release (scripts/test.sh
runs them on 0.32, the CPU build, and on 0.33 and 0.34 in venvs of their own).

The contract tests read the installed vLLM itself (its ``Executor``, its ``EngineCore``), so a
release that changes what an executor must do fails here before it fails a user's start-up.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.executor.abstract import Executor

from keepalive_executor import compat
from keepalive_executor.config import KeepaliveConfigError
from keepalive_executor.executor import KeepaliveExecutor

pytestmark = pytest.mark.fast


# -- the version gate (pure) ---------------------------------------------------------
@pytest.mark.parametrize("text, parsed", [
    ("0.32.0", (0, 32, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.33.1rc1", (0, 33, 1)),
    ("0.34.0.dev5+gabc123", (0, 34, 0)), ("v0.34.2", (0, 34, 2)), ("1.0", (1, 0, 0)),
    ("dev", None), ("", None),
])
def test_parse_version(text, parsed):
    assert compat.parse_version(text) == parsed


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.34.0", "0.34.5rc1"])
def test_supported_releases_pass_the_gate(version):
    assert compat.check_version(version, env={}) is True


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0", "dev"])
def test_other_releases_are_refused_naming_the_version_and_the_range(version):
    with pytest.raises(KeepaliveConfigError) as e:
        compat.check_version(version, env={})
    msg = str(e.value)
    assert f"the installed vLLM is {version}" in msg
    assert "0.32.x, 0.33.x and 0.34.x" in msg
    assert compat.ENV_ALLOW_UNSUPPORTED in msg


def test_the_escape_hatch_starts_an_unsupported_release_with_a_warning_flag():
    assert compat.check_version("0.35.0", env={compat.ENV_ALLOW_UNSUPPORTED: "1"}) is False
    # only "1" opens it
    with pytest.raises(KeepaliveConfigError):
        compat.check_version("0.35.0", env={compat.ENV_ALLOW_UNSUPPORTED: "yes"})


def test_the_installed_vllm_is_a_supported_release():
    """Read from the modules, not package metadata (setup.sh installs a metadata-only alias)."""
    from vllm.version import __version__

    assert compat.installed_version() == __version__
    assert compat.release().supported, __version__


def test_what_each_release_needs():
    assert compat.release("0.32.0+cpu").pipeline_buffer_fix
    assert compat.release("0.33.0").pipeline_buffer_fix
    assert not compat.release("0.34.0").pipeline_buffer_fix
    assert not compat.release("0.33.0").engine_polls_step_futures
    assert compat.release("0.34.0").engine_polls_step_futures


# -- features refused on every release -------------------------------------------------
def _config(**parallel):
    return SimpleNamespace(parallel_config=SimpleNamespace(**parallel),
                           model_config=SimpleNamespace())


def test_fault_tolerance_is_refused_naming_the_flag():
    with pytest.raises(KeepaliveConfigError, match="--enable-fault-tolerance"):
        compat.check_features(_config(enable_fault_tolerance=True))
    compat.check_features(_config(enable_fault_tolerance=False))


def test_checkpoint_on_startup_is_refused_naming_the_flag():
    cfg = _config()
    cfg.model_config.checkpoint_prepare_on_startup = True
    with pytest.raises(KeepaliveConfigError, match="--checkpoint-prepare-on-startup"):
        compat.check_features(cfg)


def test_elastic_ep_is_refused_naming_the_flag():
    """Elastic EP scales data parallelism by rebuilding vLLM's process groups in place
    (``reinitialize_distributed``, which the executor does not implement) and launches its
    new engines with VLLM_ELASTIC_EP_SCALE_UP_LAUNCH, under which the engine skips the warm-up
    (so the keepalive start-up would never end there): refused at start-up instead."""
    with pytest.raises(KeepaliveConfigError, match="--enable-elastic-ep") as e:
        compat.check_features(_config(enable_elastic_ep=True))
    assert "--distributed-executor-backend mp" in str(e.value)
    compat.check_features(_config(enable_elastic_ep=False))


def test_the_elastic_ep_scale_up_launch_skips_the_warm_up_on_this_release():
    """Why elastic EP is refused rather than followed: this release's engine skips the
    warm-up under the scale-up launch (its _initialize_kv_caches reads the variable right
    before compile_or_warm_up_model), and its base executor has no group rebuild."""
    from vllm.v1.engine.core import EngineCore

    source = inspect.getsource(EngineCore._initialize_kv_caches)
    assert "if not envs.VLLM_ELASTIC_EP_SCALE_UP_LAUNCH:" in source
    skipped = source.split("if not envs.VLLM_ELASTIC_EP_SCALE_UP_LAUNCH:")[-1]
    assert skipped.lstrip().startswith("compilation_times = self.model_executor."
                                       "compile_or_warm_up_model()") or \
        skipped.lstrip().startswith("self.model_executor.compile_or_warm_up_model()")
    assert "reinitialize_distributed" not in vars(KeepaliveExecutor)


def _sleep_config(enable_sleep_mode: bool):
    cfg = _config()
    cfg.model_config.enable_sleep_mode = enable_sleep_mode
    return cfg


def test_sleep_mode_is_not_refused():
    """On 0.34 sleep mode also mounts POST /checkpoint/prepare, which the engine refuses
    first (the replays below): sleep mode itself stays usable on every release."""
    compat.check_features(_sleep_config(False))
    compat.check_features(_sleep_config(True))


def test_this_releases_front_end_mounts_the_checkpoint_endpoint_as_compat_says():
    """The contract behind the replays below: the front end of this release mounts
    /checkpoint/prepare exactly when compat says, and with sleep mode."""
    try:
        from vllm.entrypoints.launchers.api_server import routers
    except ImportError:  # 0.32, 0.33: no such module, no endpoint
        assert not compat.release().sleep_mode_mounts_checkpoints
        return
    source = inspect.getsource(routers)
    mounted = "serve.checkpoint.api_router" in source
    assert mounted == compat.release().sleep_mode_mounts_checkpoints
    if mounted:
        assert "model_config.enable_sleep_mode" in source


def _checkpoint_engine(calls: list[str]) -> Any:
    """This release's EngineCoreProc, bare, around the keepalive executor with its calls
    recorded, and a scheduler that records its pauses."""
    from recording_executor import recording_executor
    from vllm.v1.engine import core

    config = SimpleNamespace(parallel_config=SimpleNamespace(),
                             model_config=SimpleNamespace(enable_sleep_mode=True))

    class Scheduler:
        pause_state = core.PauseState.UNPAUSED

        def set_pause_state(self, state):
            calls.append(f"<scheduler {state.name}>")
            self.pause_state = state

        def has_requests(self) -> bool:
            return False

        has_unfinished_requests = has_requests

        def reset_prefix_cache(self, *args) -> bool:
            return True

        def reset_encoder_cache(self) -> None:
            pass

    engine = object.__new__(core.EngineCoreProc)
    engine.vllm_config = config
    engine.model_executor = recording_executor(config, calls)
    engine.scheduler = Scheduler()
    engine.batch_queue = None
    engine.engines_running = False
    engine._idle_state_callbacks = []
    engine.mm_receiver_cache = None
    engine.reject_new_requests = False
    return engine


def _has_checkpoints() -> Any:
    from vllm.v1.engine import core

    if not hasattr(core.EngineCoreProc, "checkpoint_prepare"):
        pytest.skip(f"vLLM {compat.installed_version()} has no process checkpoints")
    return core


def test_unguarded_a_checkpoint_prepare_reaches_the_executor_only_after_the_engine_paused():
    """Why the engine must refuse first (the control of the test below): this release's own
    engine sequence for POST /checkpoint/prepare (EngineCoreProc.checkpoint_prepare, as
    vLLM ships it) pauses, synchronizes the device and discards the KV cache, and only then
    asks the executor, whose refusal leaves the checkpoint FAILED and the engine unable to
    resume: every later request is rejected while /health says 200."""
    core = _has_checkpoints()
    calls: list[str] = []
    engine = _checkpoint_engine(calls)
    prepare = getattr(core.EngineCoreProc.checkpoint_prepare, "__wrapped__",
                      core.EngineCoreProc.checkpoint_prepare)  # vLLM's own
    assert prepare(engine, "wait") is None  # accepted: nothing is refused here
    state, error = engine.checkpoint_state()
    assert state == core.CheckpointState.FAILED, (state, calls)
    assert "process checkpoints are not supported" in error
    paused = calls.index("<scheduler PAUSED_NEW>")
    assert paused < calls.index("discard"), calls  # the KV cache went first
    assert "checkpoint_prepare" not in calls, calls  # refused before anything was sent
    assert engine.reject_new_requests
    with pytest.raises(RuntimeError, match="Cannot resume"):
        engine.resume_scheduler()
    print(" -> ".join(calls), "-> refused:", error)


def test_the_engine_refuses_a_checkpoint_prepare_before_it_pauses_anything():
    """With the keepalive executor in it, the engine's own preconditions refuse POST
    /checkpoint/prepare first (compat.refuse_checkpoints_first, which the executor applies
    in its engine process): the endpoint answers 400 with the reason, nothing is paused or
    discarded, the checkpoint state stays RUNNING, and the engine serves on."""
    core = _has_checkpoints()
    assert compat.refuse_checkpoints_first() and compat.refuse_checkpoints_first()
    calls: list[str] = []
    engine = _checkpoint_engine(calls)
    refusal = engine.checkpoint_prepare("wait")
    assert "process checkpoints are not supported by the keepalive executor" in refusal
    assert calls == [], calls
    assert engine.checkpoint_state() == (core.CheckpointState.RUNNING, None)
    assert not engine.reject_new_requests
    other = _checkpoint_engine(calls)  # an engine whose executor does not refuse: vLLM's path
    other.model_executor.refuses_process_checkpoints = False
    assert other.checkpoint_prepare("wait") is None and "<scheduler PAUSED_NEW>" in calls


def test_the_refused_flags_exist_under_those_names_in_this_vllm():
    """The messages name flags the user typed: they must be this release's flags."""
    from vllm.engine.arg_utils import EngineArgs

    fields = set(EngineArgs.__dataclass_fields__)
    assert {"enable_fault_tolerance", "enable_elastic_ep", "enable_sleep_mode"} <= fields
    if compat.release().engine_polls_step_futures:  # 0.34: process checkpoints
        assert "checkpoint_prepare_on_startup" in fields


def test_checkpoint_rpcs_are_refused_before_anything_is_sent():
    assert "process checkpoints are not supported" in compat.refused_rpc("checkpoint_prepare")
    assert compat.refused_rpc("checkpoint_restore") is not None
    assert compat.refused_rpc("check_health") is None
    assert compat.refused_rpc(len) is None


# -- NUMA binding of the spawned workers -----------------------------------------------
def _parallel(backend: str = "mp", **fields):
    """A real ParallelConfig of this release (TP=2), under BACKEND."""
    from vllm.config import ParallelConfig

    config = ParallelConfig(tensor_parallel_size=2, **fields)
    config.distributed_executor_backend = backend
    return config


@pytest.fixture
def numa_host(monkeypatch):
    """What vLLM's automatic NUMA binding probes, answered as on a host where it binds: two
    GPUs (on NUMA node 0 here, the one node this machine has: vLLM reads its CPU list),
    numactl installed, the spawn start method, an unbound process. The decision code is the
    release's own."""
    import shutil

    from vllm import envs
    from vllm.platforms import current_platform
    from vllm.utils import numa_utils

    monkeypatch.setattr(envs, "VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    monkeypatch.setattr(numa_utils, "_is_auto_numa_available", lambda *a, **k: True)
    monkeypatch.setattr(numa_utils, "get_auto_numa_nodes", lambda: [0, 0])
    monkeypatch.setattr(numa_utils, "_probe_numactl_args", lambda args: True)
    monkeypatch.setattr(current_platform, "device_count", lambda *a, **k: 2, raising=False)
    monkeypatch.setattr(compat, "_numa_noted", False, raising=False)
    return numa_utils


def test_vllm_binds_numa_automatically_only_under_mp_and_uni(numa_host):
    """The resolution keepalive's workers meet: on a release where binding is automatic
    (0.34: ``--numa-bind`` defaults to None), vLLM decides it only for its mp and uni
    executors; under keepalive it resolves to off on a host where mp's workers are bound.
    Before 0.34 it is opt-in (default False) for every executor."""
    if not compat.release().binds_numa_automatically:
        assert _parallel().numa_bind is False
        return
    assert _parallel().numa_bind is None
    assert numa_host._can_auto_bind(_parallel("mp"), 1) is True
    assert numa_host._can_auto_bind(_parallel("keepalive"), 1) is False
    keepalive = _parallel("keepalive")
    with numa_host.configure_subprocess(SimpleNamespace(parallel_config=keepalive), 1):
        pass
    assert keepalive.numa_bind is False  # resolved: unbound


def test_with_numa_bind_given_a_keepalive_worker_starts_under_vllms_numactl_wrapper(numa_host):
    """``--numa-bind`` (here with ``--numa-bind-nodes``, as on any release): the spawned
    worker's start is wrapped in vLLM's numactl wrapper with the arguments mp's worker of the
    same local rank gets, and the start method is given back after it."""
    import multiprocessing.spawn
    import os

    config = SimpleNamespace(parallel_config=_parallel("keepalive", numa_bind=True,
                                                       numa_bind_nodes=[0, 0]))
    expected = numa_host._get_numactl_worker_args(
        _parallel("mp", numa_bind=True, numa_bind_nodes=[0, 0]), 1)
    before = multiprocessing.spawn.get_executable()
    with compat.worker_numa_binding(config, 1):
        assert os.environ[numa_host._NUMACTL_ARGS_ENV] == expected
        assert os.fsdecode(multiprocessing.spawn.get_executable()).endswith("numa_wrapper.sh")
    assert multiprocessing.spawn.get_executable() == before


def test_workers_left_unbound_where_mp_would_bind_them_are_noted_naming_the_flag(numa_host,
                                                                                caplog):
    """Where vLLM would bind mp's workers automatically and keepalive's start unbound, the
    first worker's start says so once, naming --numa-bind; not where --numa-bind was given,
    and not on a release whose binding is opt-in (0.32, 0.33)."""
    import logging

    unset = None if compat.release().binds_numa_automatically else False
    def notes() -> list[str]:
        return [r.getMessage() for r in caplog.records if "--numa-bind" in r.getMessage()
                and r.name.startswith("vllm.keepalive_executor")]

    with caplog.at_level(logging.INFO, logger="vllm"):
        bound = SimpleNamespace(parallel_config=_parallel("keepalive", numa_bind=True,
                                                          numa_bind_nodes=[0, 0]))
        with compat.worker_numa_binding(bound, 1):
            pass
        assert notes() == []
        for rank in (1, 2):
            config = SimpleNamespace(parallel_config=_parallel("keepalive", numa_bind=unset))
            with compat.worker_numa_binding(config, rank):
                pass
    notes = notes()
    if not compat.release().binds_numa_automatically:
        assert notes == [], notes
        return
    assert len(notes) == 1, notes
    assert "start without NUMA binding" in notes[0] and "mp" in notes[0], notes[0]


def test_no_note_where_mp_would_not_bind_either(caplog):
    """This machine (one NUMA node, no GPU): mp's workers would start unbound too."""
    import logging

    with caplog.at_level(logging.INFO, logger="vllm"):
        with compat.worker_numa_binding(SimpleNamespace(parallel_config=_parallel(
                "keepalive", numa_bind=None if compat.release().binds_numa_automatically
                else False)), 1):
            pass
    assert not [r for r in caplog.records if "--numa-bind" in r.getMessage()
                and r.name.startswith("vllm.keepalive_executor")]


# -- the executor against the installed release's contract ----------------------------
def test_every_abstract_method_of_this_releases_executor_is_implemented():
    assert not getattr(KeepaliveExecutor, "__abstractmethods__", frozenset())


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


OVERRIDES = sorted(
    name for name, value in vars(KeepaliveExecutor).items()
    if callable(value) and not name.startswith("_") and hasattr(Executor, name)
)


@pytest.mark.parametrize("name", OVERRIDES)
def test_each_override_takes_what_this_releases_engine_passes(name):
    """Every parameter of vLLM's method is accepted by ours under the same name, in the same
    position and with the same default (the engine passes some by keyword, some by
    position); ours may add keyword parameters with defaults."""
    theirs = _params(getattr(Executor, name))
    ours = _params(getattr(KeepaliveExecutor, name))
    assert ours[:len(theirs)] == theirs, (name, ours, theirs)
    for _, kind, default in ours[len(theirs):]:
        assert default is not inspect.Parameter.empty or kind in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD), name


class _Times:
    """A stand-in for vLLM 0.34's ``CompilationTimes`` (what the base method reads)."""

    def __init__(self, language_model: float, encoder: float) -> None:
        self.language_model, self.encoder = language_model, encoder


def _warm_up_executor(pp: int = 1):
    """An executor object with only what compile_or_warm_up_model touches."""
    ex = object.__new__(KeepaliveExecutor)
    ex._pp = pp > 1
    ex._pieces = SimpleNamespace(end_startup=lambda: None)  # no ranks to tell
    ex.vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(compilation_time=0.0, encoder_compilation_time=0.0),
        cache_config=SimpleNamespace(enable_extensible_kv_cache=False), kv_transfer_config=None)
    ex.calls = []

    def collective_rpc(method, *args, **kwargs):
        ex.calls.append(method)
        return [_Times(1.5, 0.25), _Times(2.5, 0.5)] if method == "compile_or_warm_up_model" \
            else [False, True]

    ex.collective_rpc = collective_rpc
    return ex


def test_compile_or_warm_up_model_returns_what_this_releases_base_returns():
    """vLLM 0.34's EngineCore iterates this value (finalize_extensible_kv_cache, on by
    default on CUDA/ROCm); returning None crashed start-up there after warm-up."""
    theirs = Executor.compile_or_warm_up_model(_warm_up_executor())
    ex = _warm_up_executor()
    ours = KeepaliveExecutor.compile_or_warm_up_model(ex)
    assert ours == theirs if theirs is None else [t.__dict__ for t in ours] == \
        [t.__dict__ for t in theirs]
    assert ex.calls == ["compile_or_warm_up_model"]
    if inspect.signature(Executor.compile_or_warm_up_model).return_annotation not in (
            None, "None"):
        assert ours is not None and len(ours) == 2
        assert ex.vllm_config.compilation_config.compilation_time == 2.5


def test_the_pipeline_buffer_fix_runs_only_where_the_release_needs_it():
    ex = _warm_up_executor(pp=2)
    KeepaliveExecutor.compile_or_warm_up_model(ex)
    fix_ran = len(ex.calls) == 2
    assert fix_ran == compat.release().pipeline_buffer_fix


def test_the_failure_callback_is_readable_where_vllm_reads_it():
    """vLLM 0.34's fault-tolerance sentinel and CUDA checkpoint executor read and clear
    ``executor.failure_callback`` (mp's attribute)."""
    from keepalive_executor.pieces import Pieces

    ex = object.__new__(KeepaliveExecutor)
    ex._pieces = Pieces(parallel_config=None)
    assert ex.failure_callback is None
    calls = []
    ex.register_failure_callback(lambda: calls.append(1))
    assert ex.failure_callback is not None
    ex.failure_callback()
    assert calls == [1]
    ex.failure_callback = None
    assert ex._pieces.failure_callback is None
