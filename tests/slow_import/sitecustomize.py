"""Test-only (tests/test_torchrun.py, the bad launches): a directory put on PYTHONPATH so that
Python imports this module at start-up. On the torchrun rank named by
KEEPALIVE_TEST_SLOW_VLLM_IMPORT_RANK, the first ``import vllm`` takes
KEEPALIVE_TEST_SLOW_VLLM_IMPORT_S seconds longer, as it does on a loaded machine; every other
process is untouched."""

import os
import sys
import time

_RANK = os.environ.get("KEEPALIVE_TEST_SLOW_VLLM_IMPORT_RANK")


class _SlowVllmImport:
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's
        if name == "vllm":
            sys.meta_path.remove(self)
            delay = float(os.environ.get("KEEPALIVE_TEST_SLOW_VLLM_IMPORT_S", "15"))
            print(f"slow_import: rank {_RANK}'s import of vllm delayed by {delay:g} s",
                  file=sys.stderr, flush=True)
            time.sleep(delay)
        return None


if _RANK is not None and os.environ.get("RANK") == _RANK:
    sys.meta_path.insert(0, _SlowVllmImport())
