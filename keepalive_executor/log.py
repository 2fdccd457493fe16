"""The project's loggers: every one lives under vLLM's ``vllm.`` namespace, so that vLLM's
logging configuration (format, level, ``VLLM_LOGGING_CONFIG_PATH``) applies to our lines too."""

from __future__ import annotations

import logging

__all__ = ["get_logger"]


def get_logger(module_name: str) -> logging.Logger:
    """The logger for ``module_name`` (pass ``__name__``), under ``vllm.``."""
    return logging.getLogger("vllm." + module_name)
