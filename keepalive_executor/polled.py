"""Model steps the engine can poll while they run (vLLM 0.34's busy loop).

vLLM 0.34's ``EngineCoreProc._wait_for_output`` takes new requests and aborts into the
scheduler while a step runs, when the step's future has ``poll()`` and ``wait_briefly()``
(mp's ``FutureWrapper``); otherwise it blocks in ``result()`` and takes them after the step.
Without a step of its own in flight, ``execute_model(non_block=True)`` would run the whole
step on the engine's thread and hand back a finished future: correct, but the engine's
thread is then busy for the step, as on vLLM 0.32.

So, on a release whose engine polls (``compat``) and with one batch at a time
(``max_concurrent_batches == 1``: no pipeline, no async scheduling, whose engine loop
interleaves calls), the executor hands each such step to :class:`StepCaller`'s one thread,
``keepalive-engine-step``, and returns a :class:`PolledStep` at once. That thread makes the
call exactly as the engine's thread would have (owner lock, lifecycle entry, the
driver's thread: ``steps.py``); the engine's next call to the executor (``sample_tokens``,
``take_draft_token_ids``, a ``collective_rpc``) comes only after ``result()``, which vLLM
calls before anything else of the step's. A failure, a give-up, or shutdown resolves the
future with the step's error, as the blocking call would have raised it.

What runs beside the step: the engine's thread takes in ``ADD``, ``ABORT``,
``EXECUTOR_FAILED`` and ``WAKEUP`` (``_INPUTS_HANDLED_DURING_STEP``; anything else waits
for the step) and builds the grammar bitmask, while the step thread encodes the scheduler
output and rank 0 runs on it. mp's workers read copies; rank 0 reads the engine's own
object. Read in 0.34's scheduler: ``add_request`` appends to its queues and
``finish_requests`` frees the request's blocks and moves it between its sets; neither writes
into a ``SchedulerOutput`` already built (its new requests share only the prompt's token ids
and sampling parameters with the engine's ``Request``, which neither changes), so both read
a stable object. That is a reading of the source, not a run: no 0.34 engine runs here.

``wait_briefly`` does not spin: it sleeps on the future in slices of
:data:`WAIT_SLICE_S`, looking at the engine's input queue between slices, until the step
is done, an input is pending or the engine's deadline passes (the engine bounds that
window itself, 1 s in 0.34, then blocks in ``result()``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sized
from concurrent.futures import Future
from typing import Any

__all__ = ["PolledStep", "StepCaller", "WAIT_SLICE_S"]

#: How long ``wait_briefly`` sleeps between looks at the engine's input queue.
WAIT_SLICE_S = 0.0005


class PolledStep(Future):
    """A step's future with mp's ``FutureWrapper`` polling interface."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._settled = threading.Event()
        self.add_done_callback(lambda _: self._settled.set())

    def poll(self) -> bool:
        """Whether ``result()`` would return without waiting."""
        return self.done()

    def wait_briefly(self, pending: Sized, deadline: float) -> None:
        """Wait until the step is done, ``pending`` is non-empty, or ``clock()`` reaches
        ``deadline`` (vLLM's ``time.monotonic`` deadline)."""
        while not self._settled.is_set() and not pending:
            left = deadline - self._clock()
            if left <= 0:
                return
            self._settled.wait(min(left, WAIT_SLICE_S))


_STOP = object()


class StepCaller:
    """One thread, ``keepalive-engine-step``, that makes the engine's polled calls in order.
    Started by its owner (the executor) on first use; stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, call: Callable[[], Any]) -> PolledStep:
        """Make ``call`` on the step thread; its outcome through the returned future."""
        future = PolledStep()
        with self._lock:
            if self._stopped:
                future.set_exception(RuntimeError("keepalive executor is shut down"))
                return future
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="keepalive-engine-step",
                                                daemon=True)
                self._thread.start()
            self._calls.put((future, call))
        return future

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is _STOP:
                return
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                future.set_exception(e)

    def stop(self, timeout: float) -> None:
        """No new calls; the thread ends after the one it is making (bounded wait)."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._calls.put(_STOP)
            thread.join(timeout)
