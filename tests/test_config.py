"""Start-up validation of the keepalive settings (pure: a stand-in config object)."""

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keepalive_executor.config import (
    ENV_INTERVAL,
    ENV_TRANSPORT,
    KeepaliveConfigError,
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


def test_nccl_default_timeout():
    s = settings_from_vllm_config(cfg(), env={}, dist_backend="nccl")
    assert s.timeout_s == 600.0


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
    [({"pp": 2}, "--pipeline-parallel-size=2"), ({"dp": 2}, "--data-parallel-size=2"),
     ({"nnodes": 2}, "--nnodes=2"), ({"pcp": 2}, "--prefill-context-parallel-size=2")],
)
def test_unsupported_layouts_name_the_flag(kw, flag):
    with pytest.raises(KeepaliveConfigError, match=flag):
        check_parallel_layout(cfg(**kw).parallel_config)
    check_parallel_layout(cfg().parallel_config)
