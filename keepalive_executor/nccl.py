"""What the executor relies on from NCCL/RCCL and torch's ``ProcessGroupNCCL``, in one place.

Nothing here ran on a GPU; every rule below is built to the sources named in docs/design.md
("Failure semantics on NCCL/RCCL", "What an idle receiver holds") and tested with fakes.

* **Error handling** (:func:`apply_error_handling`). torch reads
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` when it builds each NCCL process group; its default, 3,
  makes the watchdog thread rethrow a timed-out or failed collective's error, which ends the
  process with SIGABRT. The executor's failure model has every failure reported as an error
  (rank 0: the executor fails, vLLM's error path ends the engine; ranks 1..N-1: exit code 1),
  so each process sets ``2`` (abort the communicators, keep the process: the pending waits
  raise) before its first NCCL group exists, unless the user chose a mode. The modes and
  what each does to a process are here (:data:`NCCL_ERROR_HANDLING_MODES`); the settings
  check reads the variable through :func:`error_handling_mode`.
* **Abort** (:func:`abort_groups`). A step given up after a failure leaves kernels waiting
  on the GPU for a dead peer: the NCCL backends of torch's process groups are aborted
  (``ncclCommAbort``), so that *their* kernels end and no watchdog later times out on them.
  Gloo groups and torch's group table are left alone (threads may still hold them). vLLM's
  custom all-reduce (and its quick/symmetric-memory all-reduces, and its own pynccl
  communicators) are not torch's groups: their kernels run until the process exits.
  Off the calling thread, bounded.
* **The channel's own communicator** (:func:`channel_group`). On NCCL/RCCL with
  ``VLLM_KEEPALIVE_TRANSPORT=device``, the channel broadcasts on a communicator of its own,
  limited to ``CHANNEL_MAX_CTAS`` CTA (``ncclConfig_t.maxCTAs``, torch's
  ``ProcessGroupNCCL.Options().config.max_ctas``): a pending receive is a resident kernel,
  and it must leave the SMs to the model's own kernels.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from datetime import timedelta
from typing import Any

from keepalive_executor.errors import KeepaliveConfigError
from keepalive_executor.log import get_logger

__all__ = ["CHANNEL_MAX_CTAS", "ENV_NCCL_ERROR_HANDLING", "KEEPALIVE_NCCL_ERROR_HANDLING",
           "NCCL_ERROR_HANDLING_MODES", "error_handling_mode", "apply_error_handling",
           "abort_groups", "abort_nccl_backends", "channel_group", "channel_group_options"]

logger = get_logger(__name__)

ENV_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
#: torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING (ProcessGroupNCCL's constructor: 3,
#: SkipCleanUp) and what the executor sets when it is unset (2, CleanUpOnly); what each means
#: for a process is in docs/design.md, "Failure semantics on NCCL/RCCL".
TORCH_NCCL_ERROR_HANDLING_DEFAULT = 3
KEEPALIVE_NCCL_ERROR_HANDLING = 2
NCCL_ERROR_HANDLING_MODES = {
    0: "no handling: errors surface only in a wait",
    1: "abort the communicators, then end the process (SIGABRT)",
    2: "abort the communicators; the process stays and the waits raise",
    3: "end the process (SIGABRT) without aborting the communicators",
}

#: CTAs the channel's broadcast may occupy (one SM at most while it waits for a frame).
CHANNEL_MAX_CTAS = 1
#: how long a receiver leaving on an error waits for the abort before its own clean-up
ABORT_WAIT_S = 10.0


def error_handling_mode(env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING`` as torch will read it: ``(mode, "set by you")``,
    or ``(None, "unset")``. Anything but 0-3 raises naming it."""
    env = os.environ if env is None else env
    raw = env.get(ENV_NCCL_ERROR_HANDLING, "")
    if raw.strip() == "":
        return None, "unset"
    try:
        mode = int(raw)
    except ValueError:
        mode = -1
    if mode not in NCCL_ERROR_HANDLING_MODES:
        raise KeepaliveConfigError(
            f"{ENV_NCCL_ERROR_HANDLING}={raw!r} is not one of torch's modes 0-3: unset it "
            f"(the executor then sets {KEEPALIVE_NCCL_ERROR_HANDLING}: abort the "
            "communicators, keep the process) or see docs/design.md"
        )
    return mode, "set by you"


def apply_error_handling(dist_backend: str,
                         env: MutableMapping[str, str] | None = None) -> int | None:
    """Before this process's first NCCL group: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless
    the user set it (a mode that ends the process is kept, with a warning). Returns the mode
    in force on NCCL/RCCL, None elsewhere."""
    env = os.environ if env is None else env
    if dist_backend != "nccl":
        return None
    mode, _ = error_handling_mode(env)
    if mode is None:
        env[ENV_NCCL_ERROR_HANDLING] = str(KEEPALIVE_NCCL_ERROR_HANDLING)
        return KEEPALIVE_NCCL_ERROR_HANDLING
    if mode in (1, 3):
        logger.warning(
            "%s=%d (%s): a timed-out or failed NCCL collective ends this process by SIGABRT "
            "instead of the error the keepalive executor reports (docs/design.md). Unset it "
            "to let the executor set %d.", ENV_NCCL_ERROR_HANDLING, mode,
            NCCL_ERROR_HANDLING_MODES[mode], KEEPALIVE_NCCL_ERROR_HANDLING)
    return mode


def _nccl_backend(group: Any) -> Any:
    """``group``'s NCCL/RCCL backend, or None (a gloo group, or a torch without NCCL)."""
    import torch
    from torch.distributed import distributed_c10d

    if not distributed_c10d.is_nccl_available():
        return None
    try:
        backend = group._get_backend(torch.device("cuda"))
    except RuntimeError:
        return None
    return backend if isinstance(backend, distributed_c10d.ProcessGroupNCCL) else None


def abort_nccl_backends(groups: Iterable[Any],
                        nccl_backend: Callable[[Any], Any] = _nccl_backend) -> int:
    """Abort the NCCL backend of each of ``groups`` (newest first, each backend once), inside
    one ncclGroupStart/End as torch's ``_abort_process_group()`` does so that the aborts
    cannot deadlock each other (pytorch#119797); return how many were aborted.

    Unlike torch's, nothing else is touched: a gloo group, or the gloo side of a mixed group,
    keeps working (the pacer and the output thread may still hold one), and torch's group
    table is left as it is (torch's empties it, and every later use of a group raises)."""
    backends: list[Any] = []
    for group in reversed(list(groups)):
        backend = nccl_backend(group)
        if backend is not None and all(backend is not b for b in backends):
            backends.append(backend)
    if not backends:
        return 0
    backends[0]._group_start()
    try:
        for backend in backends:
            backend.abort()
    finally:
        backends[0]._group_end()
    return len(backends)


def _abort_nccl_groups() -> None:
    """Every NCCL group of this process (torch's group table, in creation order)."""
    from torch.distributed import distributed_c10d

    abort_nccl_backends(list(distributed_c10d._world.pg_map))


def abort_groups(wait_s: float = 0.0, abort: Callable[[], object] = _abort_nccl_groups,
                 ) -> threading.Thread:
    """Abort this process's NCCL groups (:func:`abort_nccl_backends`) on the thread
    ``keepalive-abort-groups`` (torch's abort may block up to the group timeout); wait for it
    at most ``wait_s``. An abort that raises is logged: this is already a failure path."""

    def run() -> None:
        try:
            abort()
            logger.warning("keepalive: torch's NCCL communicators aborted (their kernels end; "
                           "vLLM's custom all-reduce kernels run until the process exits)")
        except Exception:  # noqa: BLE001 - best effort on a failure path
            logger.exception("keepalive: aborting the NCCL process groups failed")

    thread = threading.Thread(target=run, name="keepalive-abort-groups", daemon=True)
    thread.start()
    if wait_s > 0:
        thread.join(wait_s)
    return thread


def channel_group_options(options_cls: Any = None) -> Any:
    """``ProcessGroupNCCL.Options`` with ``config.max_ctas = CHANNEL_MAX_CTAS`` (and
    ``min_ctas`` 1), or None if this torch/NCCL has no communicator config (NCCL < 2.17)."""
    if options_cls is None:
        from torch.distributed import ProcessGroupNCCL

        options_cls = ProcessGroupNCCL.Options
    options = options_cls()
    config = getattr(options, "config", None)
    if config is None or not hasattr(config, "max_ctas"):
        return None
    config.min_ctas = 1
    config.max_ctas = CHANNEL_MAX_CTAS
    return options


def channel_group(ranks: Sequence[int], timeout_s: float | None,
                  new_group: Callable[..., Any] | None = None,
                  options_cls: Any = None) -> Any:
    """The channel's own NCCL group over ``ranks`` (every rank of the world calls this, in
    the same order, as ``new_group`` requires), with the CTA limit; None if the options are
    not available (the caller then uses the world's device group, and says so)."""
    options = channel_group_options(options_cls)
    if options is None:
        logger.warning("keepalive: this torch/NCCL has no communicator config (NCCL < 2.17): "
                       "the channel shares the world's device group, without a CTA limit")
        return None
    if new_group is None:
        import torch.distributed as dist

        new_group = dist.new_group
    kwargs: dict[str, Any] = {"ranks": list(ranks), "backend": "nccl", "pg_options": options}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    return new_group(**kwargs)
