"""Start-up validation of the keepalive settings (pure: a stand-in config object)."""

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keepalive_executor.config import (
    ENV_ASYNC_SCHEDULING,
    ENV_EXECUTE_TIMEOUT,
    ENV_FAILURE_GRACE,
    ENV_INTERVAL,
    ENV_LIVENESS_TIMEOUT,
    ENV_STARTUP_TIMEOUT,
    ENV_TRANSPORT,
    KeepaliveConfigError,
    async_scheduling_opt_in,
    check_features,
    check_parallel_layout,
    default_interval,
    settings_from_vllm_config,
)
from keepalive_executor.nccl import ENV_NCCL_ERROR_HANDLING, error_handling_mode

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml


def cfg(timeout=None, cpu_timeout=None, additional=None, pp=1, dp=1, nnodes=1, pcp=1,
        dp_local=None):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            distributed_timeout_seconds=timeout,
            cpu_distributed_timeout_seconds=cpu_timeout,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            # vLLM's default: every replica on this node (EngineArgs.create_engine_config)
            data_parallel_size_local=dp if dp_local is None else dp_local,
            nnodes=nnodes,
            prefill_context_parallel_size=pcp,
        ),
        additional_config=additional or {},
    )


def settings(env, **kw):
    return settings_from_vllm_config(cfg(**kw), env=env, dist_backend="gloo")


def test_defaults_follow_the_device_group_timeout():
    s = settings({})
    assert (s.transport, s.timeout_s, s.interval_s) == ("device", 1800.0, 30.0)
    s = settings({}, timeout=8)
    assert (s.timeout_s, s.interval_s) == (8.0, 2.0)
    assert "--distributed-timeout-seconds" in s.describe()


def test_cpu_transport_uses_the_cpu_timeout():
    s = settings({ENV_TRANSPORT: "cpu"}, timeout=8, cpu_timeout=20)
    assert (s.transport, s.timeout_s, s.interval_s) == ("cpu", 20.0, 5.0)


def test_nccl_interval_follows_the_group_timeout_not_the_watchdog_heartbeat():
    """TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC bounds a stuck watchdog thread, not an idle
    collective (ProcessGroupNCCL's watchdog bumps its heartbeat every loop): it must not
    shorten the interval. The old rule took the smaller of the two (480 s here)."""
    s = settings_from_vllm_config(cfg(), env={ENV_TRANSPORT: "device"}, dist_backend="nccl")
    assert (s.timeout_s, s.timeout_source) == (600.0, "torch's nccl default")
    assert s.interval_s == 30.0
    s = settings_from_vllm_config(cfg(timeout=100), env={
        ENV_TRANSPORT: "device", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "20", ENV_INTERVAL: "15"},
        dist_backend="nccl")
    assert (s.timeout_s, s.interval_s) == (100.0, 15.0)


def test_gpu_default_transport_is_the_cpu_group_and_device_stays_selectable():
    s = settings_from_vllm_config(cfg(timeout=100, cpu_timeout=60), env={},
                                  dist_backend="nccl")
    assert (s.transport, s.timeout_s) == ("cpu", 60.0)
    assert "transport from default on NCCL/RCCL" in s.describe()
    s = settings_from_vllm_config(cfg(timeout=100), env={ENV_TRANSPORT: "device"},
                                  dist_backend="nccl")
    assert (s.transport, s.timeout_s) == ("device", 100.0)
    assert "transport from VLLM_KEEPALIVE_TRANSPORT" in s.describe()
    # on CPU nothing changes: the device group (gloo) stays the default
    assert settings({}).transport == "device"
    assert "transport from" not in settings({}).describe()


def test_pipeline_parallelism_on_nccl_refuses_the_device_transport_naming_the_fix():
    with pytest.raises(KeepaliveConfigError,
                       match=r"VLLM_KEEPALIVE_TRANSPORT=device with --pipeline-parallel-size=2 "
                             r"on NCCL/RCCL is not supported.*set it to 'cpu'"):
        settings_from_vllm_config(cfg(pp=2), env={ENV_TRANSPORT: "device"},
                                  dist_backend="nccl")
    assert settings_from_vllm_config(cfg(pp=2), env={}, dist_backend="nccl").transport == "cpu"
    assert settings({ENV_TRANSPORT: "device"}, pp=2).transport == "device"  # gloo: shown safe


def test_async_scheduling_opt_in_is_validated_and_named_in_the_start_up_line():
    assert not settings({}).async_opt_in
    assert "async scheduling=off (opt in with VLLM_KEEPALIVE_ASYNC_SCHEDULING=1)" in \
        settings({}).describe()
    for raw in ("1", "true", " TRUE "):
        assert async_scheduling_opt_in({ENV_ASYNC_SCHEDULING: raw})
    for raw in ("", "0", "false"):
        assert not async_scheduling_opt_in({ENV_ASYNC_SCHEDULING: raw})
    with pytest.raises(KeepaliveConfigError, match="VLLM_KEEPALIVE_ASYNC_SCHEDULING='yes' is "
                                                   "not 0 or 1"):
        settings({ENV_ASYNC_SCHEDULING: "yes"})
    # opted in, but vLLM turned it off (the CPU platform always does)
    s = settings({ENV_ASYNC_SCHEDULING: "1"})
    assert s.async_opt_in and not s.async_scheduling
    assert "async scheduling=off (vLLM turned it off" in s.describe()
    # vLLM decided on (the front end had the opt-in) and this process agrees
    on = cfg()
    on.scheduler_config = SimpleNamespace(async_scheduling=True)
    s = settings_from_vllm_config(on, env={ENV_ASYNC_SCHEDULING: "1"}, dist_backend="gloo")
    assert s.async_scheduling and "async scheduling=on" in s.describe()
    # ... and a process without the opt-in refuses to run what it did not opt in to
    with pytest.raises(KeepaliveConfigError, match="set VLLM_KEEPALIVE_ASYNC_SCHEDULING=1 "
                                                   "where the engine runs too"):
        settings_from_vllm_config(on, env={}, dist_backend="gloo")


def test_nccl_error_handling_is_set_to_abort_without_teardown_unless_the_user_chose():
    s = settings_from_vllm_config(cfg(), env={}, dist_backend="nccl")
    assert (s.nccl_error_handling, s.nccl_error_handling_source) == (2, "set by keepalive")
    assert "NCCL errors: TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (set by keepalive" in s.describe()
    s = settings_from_vllm_config(cfg(), env={ENV_NCCL_ERROR_HANDLING: "3"},
                                  dist_backend="nccl")
    assert (s.nccl_error_handling, s.nccl_error_handling_source) == (3, "set by you")
    assert "end the process (SIGABRT)" in s.describe()
    with pytest.raises(KeepaliveConfigError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING='abort' "
                                                   "is not one of torch's modes 0-3"):
        settings_from_vllm_config(cfg(), env={ENV_NCCL_ERROR_HANDLING: "abort"},
                                  dist_backend="nccl")
    assert settings({}).nccl_error_handling is None  # gloo: not NCCL's business
    assert error_handling_mode({}) == (None, "unset")


@pytest.mark.parametrize("name, default", [
    (ENV_FAILURE_GRACE, 0.5), (ENV_STARTUP_TIMEOUT, 600.0), (ENV_LIVENESS_TIMEOUT, 1.5),
    (ENV_EXECUTE_TIMEOUT, 300.0),
])
def test_every_seconds_setting_is_validated_naming_itself(name, default):
    field = {ENV_FAILURE_GRACE: "failure_grace_s", ENV_STARTUP_TIMEOUT: "startup_timeout_s",
             ENV_LIVENESS_TIMEOUT: "liveness_timeout_s",
             ENV_EXECUTE_TIMEOUT: "execute_timeout_s"}[name]
    assert getattr(settings({}), field) == default
    assert getattr(settings({name: "2.5"}), field) == 2.5
    for raw, needle in [("abc", "not a number"), ("-5", "must be positive"),
                        ("0", "must be positive"), ("inf", "not a finite number")]:
        with pytest.raises(KeepaliveConfigError) as e:
            settings({name: raw})
        assert name in str(e.value) and needle in str(e.value) and raw in str(e.value)


def test_additional_config_wins_over_environment():
    s = settings({ENV_INTERVAL: "1"}, timeout=10, additional={"keepalive_interval_s": 2})
    assert s.interval_s == 2.0 and "additional-config" in s.interval_source


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("0", "must be positive"),
        ("-1", "must be positive"),
        ("abc", "not a number"),
        ("nan", "not a finite number"),
        ("inf", "not a finite number"),
        ("6", "at most half the timeout"),
    ],
)
def test_bad_interval_names_variable_value_timeout_and_fix(raw, needle):
    with pytest.raises(KeepaliveConfigError) as e:
        settings({ENV_INTERVAL: raw}, timeout=10)
    msg = str(e.value)
    assert needle in msg and ENV_INTERVAL in msg and raw in msg
    if needle == "at most half the timeout":
        assert "10s" in msg and "--distributed-timeout-seconds" in msg


@given(st.floats(min_value=0.001, max_value=1e6), st.floats(min_value=0.001, max_value=1e6))
def test_interval_rule_is_half_the_timeout(interval, timeout):
    env = {ENV_INTERVAL: repr(interval)}
    if interval <= timeout / 2:
        assert settings(env, timeout=timeout).interval_s == interval
    else:
        with pytest.raises(KeepaliveConfigError):
            settings(env, timeout=timeout)


@given(st.floats(min_value=0.01, max_value=1e7))
def test_default_interval_is_valid_for_any_timeout(timeout):
    assert 0 < default_interval(timeout) <= timeout / 2


def test_unknown_transport():
    with pytest.raises(KeepaliveConfigError, match="VLLM_KEEPALIVE_TRANSPORT='nccl'"):
        settings({ENV_TRANSPORT: "nccl"})


@pytest.mark.parametrize(
    "kw, flag",
    [({"nnodes": 2}, "--nnodes=2"), ({"pcp": 2}, "--prefill-context-parallel-size=2")],
)
def test_unsupported_layouts_name_the_flag(kw, flag):
    with pytest.raises(KeepaliveConfigError, match=flag):
        check_parallel_layout(cfg(**kw).parallel_config)
    check_parallel_layout(cfg().parallel_config)
    check_parallel_layout(cfg(pp=2).parallel_config)  # pipeline parallelism is supported


def test_data_parallelism_is_refused_only_for_moe_models_with_pipeline_parallelism():
    dense, moe = SimpleNamespace(is_moe=False), SimpleNamespace(is_moe=True)
    check_parallel_layout(cfg(dp=2).parallel_config, dense)
    check_parallel_layout(cfg(dp=2, pp=2).parallel_config, dense)
    check_parallel_layout(cfg(dp=2).parallel_config, moe)
    check_parallel_layout(cfg(dp=1, pp=2).parallel_config, moe)
    with pytest.raises(KeepaliveConfigError,
                       match=r"--data-parallel-size=2 with --pipeline-parallel-size=2 for a "
                             r"mixture-of-experts model"):
        check_parallel_layout(cfg(dp=2, pp=2).parallel_config, moe)


@pytest.mark.parametrize("dp_local", [1, 0])
def test_moe_data_parallelism_with_replicas_on_other_nodes_is_refused_naming_the_flag(dp_local):
    """A mixture-of-experts model's replicas share one torch world, in which every rank must
    build keepalive's replica-local groups in the same order. Replicas started on other nodes
    (``--data-parallel-size-local`` below ``--data-parallel-size``: vLLM's headless nodes, an
    API-server-only node with 0) are not this executor's to line up: start-up would hang
    until the timeout (issue 28, edge 6). Refused at start-up, naming the flag."""
    dense, moe = SimpleNamespace(is_moe=False), SimpleNamespace(is_moe=True)
    check_parallel_layout(cfg(dp=2).parallel_config, moe)  # every replica on this node
    check_parallel_layout(cfg(dp=2, dp_local=dp_local).parallel_config, dense)  # own worlds
    with pytest.raises(KeepaliveConfigError,
                       match=rf"--data-parallel-size-local={dp_local} with "
                             r"--data-parallel-size=2 for a mixture-of-experts model"):
        check_parallel_layout(cfg(dp=2, dp_local=dp_local).parallel_config, moe)


@pytest.mark.parametrize("field, flag", [("kv_transfer_config", "--kv-transfer-config"),
                                         ("ec_transfer_config", "--ec-transfer-config"),
                                         ("speculative_config", "--speculative-config")])
def test_features_not_combined_with_pipeline_parallelism_name_the_flags(field, flag):
    config = cfg(pp=2)
    check_features(config)  # neither set
    setattr(config, field, object())
    with pytest.raises(KeepaliveConfigError, match=f"pipeline-parallel-size=2.*{flag}"):
        check_features(config)
    config.parallel_config.pipeline_parallel_size = 1
    check_features(config)  # without PP both work (tests/test_parity.py)
