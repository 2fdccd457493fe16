"""vLLM plugin registration: make the bare backend name ``keepalive`` resolve to our executor.

vLLM loads every ``vllm.general_plugins`` entry point in every process it starts (front end,
engine core, workers), so :func:`register` must be idempotent. vLLM's ``Executor.get_class``
knows only its built-in names and dotted import paths; we wrap it so that exactly the name
``keepalive`` maps to :class:`~keepalive_executor.executor.KeepaliveExecutor` (after the
start-up checks, so a bad setting fails in the front end before any model loads) and every
other value takes vLLM's own path unchanged.

It also installs what the process that starts the engines needs, wherever the plugin loads
(each is idempotent and cheap, and harmless in a process that never serves):
keepalive's ``/metrics`` collector (collector.py) and ``vllm serve``'s exit status
(supervision.py). A process that resolves the keepalive executor claims a run directory for
the engines it starts (run_dir.py), unless it already belongs to one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND_NAME", "register", "is_registered"]

BACKEND_NAME = "keepalive"
_MARK = "_keepalive_executor_wrapped"


def is_registered() -> bool:
    """Whether ``Executor.get_class`` already knows ``keepalive`` in this process."""
    from vllm.v1.executor.abstract import Executor

    return getattr(Executor.get_class, _MARK, False)


def keepalive_class(backend: Any) -> type | None:
    """The executor class ``backend`` names if it is the keepalive executor: ``keepalive``,
    or a subclass of it, as a class or by qualified name (vLLM resolves such a name itself:
    a test's negative control is one, tests/controls.py); otherwise None."""
    from keepalive_executor.executor import KeepaliveExecutor

    if backend == BACKEND_NAME:
        return KeepaliveExecutor
    if isinstance(backend, str) and "." in backend:
        from vllm.utils.import_utils import resolve_obj_by_qualname

        try:
            backend = resolve_obj_by_qualname(backend)
        except (ImportError, AttributeError, ValueError):
            return None  # not ours; vLLM says what is wrong with it
    if isinstance(backend, type) and issubclass(backend, KeepaliveExecutor):
        return backend
    return None


def register() -> None:
    """Entry point of the ``keepalive`` plugin; safe to call any number of times."""
    from vllm.v1.executor.abstract import Executor

    if is_registered():
        return
    vllm_get_class = Executor.get_class

    def get_class(vllm_config: Any) -> type[Executor]:
        backend = vllm_config.parallel_config.distributed_executor_backend
        from keepalive_executor.torchrun import in_torchrun_mode

        executor_class = keepalive_class(backend)
        if in_torchrun_mode() and executor_class is None:
            from keepalive_executor.config import KeepaliveConfigError

            raise KeepaliveConfigError(
                f"distributed_executor_backend={backend!r} under `python -m "
                "keepalive_executor serve`: the ranks are torchrun's processes, which only "
                "the keepalive executor can drive; remove the setting"
            )
        if executor_class is not None:
            executor_class.validate(vllm_config)
            from keepalive_executor import run_dir

            run_dir.claim(force=False)  # before the engine processes start: they inherit it
            return executor_class
        return vllm_get_class(vllm_config)

    get_class.__doc__ = vllm_get_class.__doc__
    setattr(get_class, _MARK, True)
    Executor.get_class = staticmethod(get_class)  # type: ignore[method-assign]
    _let_the_name_carry_supports_pp()
    _install_front_end()


def _install_front_end() -> None:
    """keepalive's /metrics collector, and `vllm serve`'s exit status (never fatal)."""
    from keepalive_executor import collector, supervision
    from keepalive_executor.log import get_logger

    try:
        collector.install()
        supervision.install_exit_status()
    except Exception:  # noqa: BLE001 - neither is a reason not to serve
        get_logger(__name__).warning("keepalive: /metrics or exit status not installed",
                                     exc_info=True)


def _let_the_name_carry_supports_pp() -> None:
    """vLLM's front end allows ``--pipeline-parallel-size > 1`` only for its own backend
    names or for a backend *object* with ``supports_pp`` (``EngineArgs._check_feature_
    supported``); a name from the command line is a string. For the name ``keepalive``, or
    the qualified name of a subclass, the check sees the class the name stands for."""
    from vllm.engine.arg_utils import EngineArgs

    vllm_check = EngineArgs._check_feature_supported

    def check(self: Any) -> None:
        name = self.distributed_executor_backend
        executor_class = keepalive_class(name)
        if executor_class is None:
            return vllm_check(self)
        self.distributed_executor_backend = executor_class
        try:
            return vllm_check(self)
        finally:
            self.distributed_executor_backend = name

    EngineArgs._check_feature_supported = check  # type: ignore[method-assign]
