"""The keepalive executor with its engine calls recorded, for replaying a vLLM release's own
engine code against it without ranks (tests/test_startup_timeouts.py, tests/test_compat.py:
the no-engine tier runs both on 0.33 and 0.34 as well).

Rank 0 and the channel are a stand-in: ``_submit`` records each call's name and answers it
as two ranks would. Everything above it is the real thing: the executor's own methods, and
vLLM's base ``Executor`` methods over them (``extend_kv_cache``, ``discard``, ...), so a
recorded name is what the release's engine really sends."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from keepalive_executor.executor import KeepaliveExecutor

__all__ = ["END_TIMEOUTS", "END_PIECES", "KvSpec", "recording_executor"]

#: the marks for the start-up's end: the RPC that gives every rank's groups the user's
#: timeouts back, and the pieces told (the ranks' liveness, /metrics)
END_TIMEOUTS, END_PIECES = "<timeouts restored>", "<pieces told>"


class KvSpec:
    """A KV cache spec as the engine's loops over them read it (a full-attention layer)."""

    non_causal = False
    block_size = 16
    prefix_cacheable = True


def recording_executor(vllm_config: Any, calls: list[str],
                       replies: dict[str, list[Any]] | None = None) -> KeepaliveExecutor:
    """A KeepaliveExecutor on ``vllm_config`` that appends each call's name to ``calls``
    (the start-up's end as END_TIMEOUTS and END_PIECES) and answers it with ``replies[name]``
    (two ranks' replies; a few start-up calls have defaults, anything else [None, None])."""
    ex = object.__new__(KeepaliveExecutor)
    ex.vllm_config = vllm_config
    ex.parallel_config = vllm_config.parallel_config
    ex._pp = False
    ex.sleeping_tags = set()
    ex._pieces = SimpleNamespace(ranks=None, end_startup=lambda: calls.append(END_PIECES))
    answers = {
        "get_kv_cache_spec": [{"layer.0": KvSpec()}] * 2,
        "get_supported_kv_cache_layouts": [["NHD"]] * 2,
        "determine_available_memory": [1 << 30] * 2,
        "extensible_kv_cache_unsupported_reason": [None, None],
        "compile_or_warm_up_model": [SimpleNamespace(language_model=0.0, encoder=0.0)] * 2,
        "get_simple_cpu_offload_num_cpu_blocks": [64, 64],
        **(replies or {}),
    }

    def submit(step: Any) -> Future:
        calls.append(END_TIMEOUTS if step.name == "_end_startup_timeouts" else step.name)
        future: Future = Future()
        future.set_result(answers.get(step.name, [None, None]))
        return future

    ex._submit = submit  # type: ignore[method-assign]
    return ex
