"""Start-up validation of the keepalive settings (pure: a stand-in config object)."""

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keepalive_executor.config import (
    ENV_EXECUTE_TIMEOUT,
    ENV_FAILURE_GRACE,
    ENV_INTERVAL,
    ENV_LIVENESS_TIMEOUT,
    ENV_NCCL_HEARTBEAT,
    ENV_STARTUP_TIMEOUT,
    ENV_TRANSPORT,
    KeepaliveConfigError,
    check_features,
    check_parallel_layout,
    default_interval,
    settings_from_vllm_config,
)


def cfg(timeout=None, cpu_timeout=None, additional=None, pp=1, dp=1, nnodes=1, pcp=1):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            distributed_timeout_seconds=timeout,
            cpu_distributed_timeout_seconds=cpu_timeout,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
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


def test_nccl_timeout_is_the_smaller_of_the_group_timeout_and_the_watchdog_heartbeat():
    # torch's NCCL defaults: 600 s group timeout, 480 s heartbeat timeout
    s = settings_from_vllm_config(cfg(), env={}, dist_backend="nccl")
    assert (s.timeout_s, s.timeout_source) == (480.0, ENV_NCCL_HEARTBEAT)
    s = settings_from_vllm_config(cfg(), env={ENV_NCCL_HEARTBEAT: "1000"}, dist_backend="nccl")
    assert s.timeout_s == 600.0
    s = settings_from_vllm_config(cfg(timeout=100), env={}, dist_backend="nccl")
    assert (s.timeout_s, s.timeout_source) == (100.0, "--distributed-timeout-seconds")
    with pytest.raises(KeepaliveConfigError, match="TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"):
        settings_from_vllm_config(cfg(timeout=100), env={ENV_NCCL_HEARTBEAT: "20",
                                                         ENV_INTERVAL: "15"},
                                  dist_backend="nccl")
    # gloo has no heartbeat: the variable is ignored
    assert settings({ENV_NCCL_HEARTBEAT: "1"}, timeout=8).timeout_s == 8.0


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
    [({"dp": 2}, "--data-parallel-size=2"),
     ({"nnodes": 2}, "--nnodes=2"), ({"pcp": 2}, "--prefill-context-parallel-size=2")],
)
def test_unsupported_layouts_name_the_flag(kw, flag):
    with pytest.raises(KeepaliveConfigError, match=flag):
        check_parallel_layout(cfg(**kw).parallel_config)
    check_parallel_layout(cfg().parallel_config)
    check_parallel_layout(cfg(pp=2).parallel_config)  # pipeline parallelism is supported


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
