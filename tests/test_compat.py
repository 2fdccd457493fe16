"""The vLLM releases the executor supports, and the executor held against the installed
release's contract. No engine starts: these run on every supported release (scripts/test.sh
runs them on 0.32, the CPU build, and on 0.33 and 0.34 in venvs of their own).

The contract tests read the installed vLLM itself (its ``Executor``, its ``EngineCore``), so a
release that changes what an executor must do fails here before it fails a user's start-up.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

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


def test_the_refused_flags_exist_under_those_names_in_this_vllm():
    """The messages name flags the user typed: they must be this release's flags."""
    from vllm.engine.arg_utils import EngineArgs

    fields = set(EngineArgs.__dataclass_fields__)
    assert "enable_fault_tolerance" in fields
    if compat.release().engine_polls_step_futures:  # 0.34: process checkpoints
        assert "checkpoint_prepare_on_startup" in fields


def test_checkpoint_rpcs_are_refused_before_anything_is_sent():
    assert "process checkpoints are not supported" in compat.refused_rpc("checkpoint_prepare")
    assert compat.refused_rpc("checkpoint_restore") is not None
    assert compat.refused_rpc("check_health") is None
    assert compat.refused_rpc(len) is None


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
