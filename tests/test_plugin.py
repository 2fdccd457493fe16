"""Registration through vLLM's own plugin machinery: idempotent, and inert for other names."""

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest


def cfg(backend):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            distributed_executor_backend=backend, distributed_timeout_seconds=None,
            cpu_distributed_timeout_seconds=None, pipeline_parallel_size=1,
            data_parallel_size=1, nnodes=1, prefill_context_parallel_size=1),
        additional_config={},
    )


def test_entry_point_is_declared_in_vllm_general_plugins():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("keepalive") == "keepalive_executor:register"


def test_vllm_loads_the_plugin_and_resolves_the_bare_name_idempotently():
    from vllm.plugins import load_general_plugins
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from keepalive_executor import register
    from keepalive_executor.executor import KeepaliveExecutor
    from keepalive_executor.plugin import is_registered

    load_general_plugins()
    assert is_registered()
    wrapped = Executor.get_class
    register()
    register()
    assert Executor.get_class is wrapped  # no second layer of wrapping
    assert Executor.get_class(cfg("keepalive")) is KeepaliveExecutor
    # the dotted path works through vLLM's own resolution
    assert Executor.get_class(cfg("keepalive_executor.executor.KeepaliveExecutor")) \
        is KeepaliveExecutor
    # every other backend name behaves exactly as before
    assert Executor.get_class(cfg("mp")) is MultiprocExecutor
    assert Executor.get_class(cfg("uni")) is UniProcExecutor
    with pytest.raises(Exception):  # noqa: B017 - vLLM's own error for an unknown name
        Executor.get_class(cfg("no_such_backend"))
