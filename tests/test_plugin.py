"""Registration through vLLM's own plugin machinery: idempotent, and inert for other names."""

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml


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
    # vLLM's own names still resolve (the next test: every other value reaches vLLM unchanged)
    assert Executor.get_class(cfg("mp")) is MultiprocExecutor
    assert Executor.get_class(cfg("uni")) is UniProcExecutor


class _Unknown(Exception):
    pass


def test_every_other_backend_takes_vllms_own_get_class_unchanged(monkeypatch):
    """For every value but ``keepalive`` and the keepalive executor's own classes (by name or
    as a class: the next test), the wrapped ``Executor.get_class`` is the one vLLM had:
    called once with the same config, its class or its very error handed back. vLLM's
    function is replaced by a recording stand-in, so the wrapper's answer can only be vLLM's
    if it really came from vLLM's function."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.abstract import Executor

    from keepalive_executor import register
    from keepalive_executor.executor import KeepaliveExecutor

    seen: list = []
    unknown = _Unknown("vllm: unknown backend")

    def vllm_get_class(vllm_config):
        seen.append(vllm_config)
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend == "no_such_backend":
            raise unknown
        return ("vllm's answer for", backend)

    monkeypatch.setattr(Executor, "get_class", staticmethod(vllm_get_class))
    # register() wraps this check too; put vLLM's (or the last wrapper) back afterwards
    monkeypatch.setattr(EngineArgs, "_check_feature_supported",
                        EngineArgs._check_feature_supported)
    register()
    assert Executor.get_class is not vllm_get_class
    for backend in ["mp", "uni", "ray", "external_launcher", "Keepalive", "keepalive ",
                    "vllm.v1.executor.uniproc_executor.UniProcExecutor", "no.such.Class",
                    None]:
        seen.clear()
        config = cfg(backend)
        assert Executor.get_class(config) == ("vllm's answer for", backend)
        assert seen == [config] and seen[0] is config
    seen.clear()
    with pytest.raises(_Unknown) as raised:
        Executor.get_class(cfg("no_such_backend"))
    assert raised.value is unknown and len(seen) == 1
    seen.clear()
    for name in ("keepalive", "keepalive_executor.executor.KeepaliveExecutor",
                 KeepaliveExecutor):
        assert Executor.get_class(cfg(name)) is KeepaliveExecutor
    assert seen == []  # the names vLLM never sees


def test_a_negative_controls_executor_is_the_keepalive_executor_with_one_protection_off(
        monkeypatch):
    """tests/controls.py: each control turns exactly the protection it is listed under off,
    every protection has one, and the production executor has every one on. The plugin
    resolves a control by its qualified name (validating the configuration, as for
    ``keepalive``); torchrun mode refuses any other executor."""
    import dataclasses

    import controls
    from vllm.v1.executor.abstract import Executor

    from keepalive_executor import register
    from keepalive_executor.config import KeepaliveConfigError
    from keepalive_executor.executor import KeepaliveExecutor
    from keepalive_executor.plugin import keepalive_class
    from keepalive_executor.protections import Protections

    names = {f.name for f in dataclasses.fields(Protections)}
    assert KeepaliveExecutor.protections == Protections() and Protections().off() == []
    assert set(controls.BY_PROTECTION) == names
    for name, control in controls.BY_PROTECTION.items():
        assert issubclass(control, KeepaliveExecutor)
        assert name in control.protections.off()
        qualname = f"controls.{control.__name__}"
        assert keepalive_class(qualname) is control
    # the torchrun control turns off the pacer too (the idle half of its scenario), and the
    # alive wait's the start-up timeouts (either alone saves its scenario)
    assert controls.NoKeepalivesNoLiveness.protections.off() == ["keepalives", "liveness"]
    assert controls.NoAliveWaitNoStartupTimeouts.protections.off() == ["alive_wait",
                                                                       "startup_timeouts"]
    # two controls serve a check per protection each (test_supervision's, test_serve's)
    assert controls.NoSupervisionNoMetrics.protections.off() == ["metrics", "supervision"]
    assert controls.NoKeepalivesNoSupervision.protections.off() == ["keepalives",
                                                                    "supervision"]
    assert keepalive_class("controls.NoKeepalivesNoSupervision") is \
        controls.NoKeepalivesNoSupervision
    assert [c.protections.off() for c in controls.BY_PROTECTION.values()
            if c not in controls.SEVERAL] == [
        [n] for n, c in controls.BY_PROTECTION.items() if c not in controls.SEVERAL]
    assert keepalive_class("mp") is None
    assert keepalive_class("vllm.v1.executor.multiproc_executor.MultiprocExecutor") is None
    assert keepalive_class("no.such.Class") is None

    register()
    assert Executor.get_class(cfg("controls.NoKeepalives")) is controls.NoKeepalives
    # torchrun mode (its acceptance of a control: test_torchrun.py's negative controls, which
    # run under torchrun; here validation would ask for torchrun's variables)
    monkeypatch.setenv("KEEPALIVE_EXECUTOR_LAUNCHER", "torchrun")
    with pytest.raises(KeepaliveConfigError, match="only the keepalive executor can drive"):
        Executor.get_class(cfg("vllm.v1.executor.multiproc_executor.MultiprocExecutor"))
