"""Test-only (tests/test_torchrun.py, the bad launches): a directory put on PYTHONPATH so that
Python imports this module at start-up. On the torchrun rank named by
KEEPALIVE_TEST_SLOW_VLLM_IMPORT_RANK, the first ``import vllm`` takes
KEEPALIVE_TEST_SLOW_VLLM_IMPORT_S seconds longer, as it does on a loaded machine; every other
process is untouched.

The delay holds the GIL, in stretches of HOLD_S with a short release between them, as an
import does while it loads and initialises extension modules (a plain ``time.sleep`` would
release it, and this process's other threads would run freely): a thread of this process
gets to run only between stretches. No CPU is used: the stretches are libc's ``usleep``
called through ``ctypes.PyDLL``, which keeps the GIL."""

import ctypes
import os
import sys
import time

_RANK = os.environ.get("KEEPALIVE_TEST_SLOW_VLLM_IMPORT_RANK")
#: one stretch with the GIL held (usleep takes at most a second)
HOLD_S = 0.9


def _hold_gil(seconds: float) -> None:
    usleep = ctypes.PyDLL(None).usleep
    usleep.argtypes = [ctypes.c_uint]
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        usleep(int(min(left, HOLD_S) * 1e6))
        time.sleep(0.01)  # the GIL's release: another thread may run until it blocks


class _SlowVllmImport:
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's
        if name == "vllm":
            sys.meta_path.remove(self)
            delay = float(os.environ.get("KEEPALIVE_TEST_SLOW_VLLM_IMPORT_S", "15"))
            print(f"slow_import: rank {_RANK}'s import of vllm delayed by {delay:g} s, "
                  f"holding the GIL in stretches of {HOLD_S:g} s", file=sys.stderr, flush=True)
            _hold_gil(delay)
        return None


if _RANK is not None and os.environ.get("RANK") == _RANK:
    sys.meta_path.insert(0, _SlowVllmImport())
