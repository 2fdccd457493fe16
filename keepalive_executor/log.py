"""The project's loggers: every one lives under vLLM's ``vllm.`` namespace, so that vLLM's
logging configuration (format, level, ``VLLM_LOGGING_CONFIG_PATH``) applies to our lines too.
And the stack dump every rank registers."""

from __future__ import annotations

import faulthandler
import logging
import signal

__all__ = ["get_logger", "register_stack_dump", "STACK_DUMP_SIGNAL"]

#: A rank given this signal writes every thread's Python stack to its stderr (the server's
#: log) and goes on: rank 0 sends it to its workers when a step outlives its timeout.
STACK_DUMP_SIGNAL = signal.SIGUSR1


def get_logger(module_name: str) -> logging.Logger:
    """The logger for ``module_name`` (pass ``__name__``), under ``vllm.``."""
    return logging.getLogger("vllm." + module_name)


def register_stack_dump() -> None:
    """Let :data:`STACK_DUMP_SIGNAL` dump this process's stacks (``faulthandler``: written
    from the signal handler in C, so it works while every Python thread is stuck)."""
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)
