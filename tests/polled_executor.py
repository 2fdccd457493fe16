"""The keepalive executor with the step path vLLM 0.34's engine gets (polled.py), for an
end-to-end run on vLLM 0.32, whose engine calls ``result()`` on the step's future at once.
Used as ``distributed_executor_backend="polled_executor.PolledKeepaliveExecutor"`` (tests/ is
on every engine process's path: run_engine.PYTHONPATH)."""

from keepalive_executor.executor import KeepaliveExecutor


class PolledKeepaliveExecutor(KeepaliveExecutor):
    """Every non-blocking model step on the step thread, as under an engine that polls."""

    poll_steps = True
