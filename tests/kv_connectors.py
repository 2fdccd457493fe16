"""A KV connector for the executor-parity tests, loaded by vLLM through
``kv_connector_module_path="kv_connectors"``.

:class:`RankedExampleConnector` is vLLM's ``ExampleConnector`` (each rank saves its share of
the KV cache to files after a prefill, and loads it back when the same prompt comes again)
with three changes that make every rank's connector output matter:

* **one file per TP rank**: the stock connector names its files without the rank, so at TP>1
  both ranks write, and load, one file (wrong outputs under ``mp`` too);
* **finished sending is reported by every rank**: the scheduler side keeps every finished
  request's blocks (``request_finished`` returns True) until each rank's worker has reported
  the request in ``finished_sending``; vLLM's ``KVOutputAggregator`` counts those reports.
  An executor that passes on rank 0's output alone leaves the blocks allocated forever;
* **a load failure on rank 1 only**, when the file ``kv_fail_rank1`` exists in
  ``KEEPALIVE_FAULT_DIR``: rank 1 zeroes the slots it should have loaded and reports their
  blocks in ``get_block_ids_with_load_errors``. With ``kv_load_failure_policy="recompute"``
  the scheduler recomputes them, so the answer stays right; an executor that drops rank 1's
  report leaves rank 1 attending to zeros, and the answer changes.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

__all__ = ["RankedExampleConnector"]


def _take(name: str) -> bool:
    d = os.environ.get("KEEPALIVE_FAULT_DIR")
    if not d:
        return False
    try:
        os.unlink(os.path.join(d, name))
        return True
    except FileNotFoundError:
        return False


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class RankedExampleConnector(ExampleConnector):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load_errors: set[int] = set()

    # -- both sides ------------------------------------------------------------------
    def _generate_filename_debug(self, layer_name: str, token_ids: Any, mm_hashes: Any) -> str:
        folder = self._generate_foldername_debug(token_ids, mm_hashes=mm_hashes,
                                                 create_folder=True)
        return os.path.join(folder, f"{layer_name}.tp{_tp_rank()}.safetensors")

    # -- worker side -----------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if _tp_rank() == 1 and _take("kv_fail_rank1"):
            self._fail_loads(forward_context)
            return
        super().start_load_kv(forward_context, **kwargs)

    def _fail_loads(self, forward_context: Any) -> None:
        metadata = self._get_connector_metadata()
        for request in metadata.requests:
            if request.is_store:
                continue
            slots = request.slot_mapping
            blocks, offsets = slots // self._block_size, slots % self._block_size
            self._load_errors |= {int(b) for b in blocks.tolist()}
            for layer in forward_context.no_compile_layers.values():
                kv = getattr(layer, "kv_cache", None)
                if kv is not None:
                    kv[blocks.to(kv.device), :, offsets.to(kv.device)] = 0

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        return (set(finished_req_ids) or None), None

    # -- scheduler side ----------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        return True, None
