"""Callables that tests send to every rank (collective_rpc, apply_model). They live in an
importable module so that they pickle by reference under every executor (vLLM's ``mp``
pickles ``apply_model``'s function with plain pickle)."""

from __future__ import annotations

import os
from typing import Any


def whoami(worker: Any) -> tuple[int, int]:
    """collective_rpc: (rank, pid) of the process it runs in."""
    return (worker.rank, os.getpid())


def model_info(model: Any) -> tuple[str, int]:
    """apply_model: the model's class and this rank's parameter count."""
    return type(model).__name__, sum(p.numel() for p in model.parameters())
