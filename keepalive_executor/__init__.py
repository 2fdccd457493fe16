"""keepalive-executor: a vLLM distributed executor whose idle ranks wait on a collective.

The driver (rank 0) runs in the engine process; ranks 1..N-1 wait indefinitely on the
driver's broadcast, and a pacer sends no-op keepalives while the engine is idle so the
collective never times out. Layout (one module, one role):

* :mod:`~keepalive_executor.plugin`      registration of the ``keepalive`` backend name
* :mod:`~keepalive_executor.config`      settings and their start-up validation
* :mod:`~keepalive_executor.compat`      what differs between the supported vLLM releases
* :mod:`~keepalive_executor.channel`     framing and the broadcast channel (wire format)
* :mod:`~keepalive_executor.groups`      the process groups the channel and the replies run on
* :mod:`~keepalive_executor.startup_timeouts` vLLM's start-up collectives under the start-up
  timeout, the user's timeouts back on every group after the warm-up
* :mod:`~keepalive_executor.rpc`         call envelopes, replies and the reply gather
* :mod:`~keepalive_executor.pacer`       the idle/busy state machine and its thread; it reads
  whether a step is in flight (lifecycle) and the channel's last frame, told nothing per step
* :mod:`~keepalive_executor.lifecycle`   the executor's states, the step rank 0 is inside, the
  steps in flight (their one owner) and the step watch
* :mod:`~keepalive_executor.steps`       one engine call, one Step: ``submit(step) -> Future``,
  the reply policies' rank-0 side, a step's life top-down (the executor builds the Steps)
* :mod:`~keepalive_executor.driver`      rank 0's worker, on a thread of its own
* :mod:`~keepalive_executor.binding`     which CPUs a rank's threads run on (rank 0 and workers)
* :mod:`~keepalive_executor.polled`      vLLM 0.34: model steps the engine polls while they run
* :mod:`~keepalive_executor.deferred`    async scheduling: rank 0's outputs, resolved lazily
* :mod:`~keepalive_executor.nccl`        what the GPU path relies on from NCCL/RCCL and torch
* :mod:`~keepalive_executor.outputs`     pipeline parallelism: the last stage's outputs
* :mod:`~keepalive_executor.connectors`  KV/EC connector outputs merged from every rank
* :mod:`~keepalive_executor.ranks`       where ranks 1..N-1 come from (one interface)
* :mod:`~keepalive_executor.launcher`    spawned worker processes: start, ready, watch, stop
* :mod:`~keepalive_executor.executor`    the vLLM ``Executor``: the engine's calls, a few lines each
* :mod:`~keepalive_executor.protections` what keeps a scenario alive, all on (a negative
  control's executor turns one off by subclassing)
* :mod:`~keepalive_executor.pieces`      rank 0's pieces wired: start-up, failure, shutdown
* :mod:`~keepalive_executor.run_dir`     the directory an engine shares with its front end
* :mod:`~keepalive_executor.metrics`     rank 0's /metrics counters and their snapshot writer
* :mod:`~keepalive_executor.collector`   the front end's /metrics collector of the snapshots
* :mod:`~keepalive_executor.supervision` what a supervisor sees: ``vllm serve``'s exit status,
  an engine that ends with its front end
* :mod:`~keepalive_executor.reporting`   rank 0's reports (metrics, failure, watch) wired
* :mod:`~keepalive_executor.worker_loop` the receive loop of ranks 1..N-1
* :mod:`~keepalive_executor.exit_codes`, :mod:`~keepalive_executor.log`,
  :mod:`~keepalive_executor.errors` (``KeepaliveConfigError``, every start-up check's)
* :mod:`~keepalive_executor.torchrun`    torchrun mode: env, signed bootstrap, liveness,
  ranks, CLI (``python -m keepalive_executor`` is :mod:`~keepalive_executor.__main__`)
"""

__version__ = "0.1.0"


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see :mod:`keepalive_executor.plugin`)."""
    from keepalive_executor.plugin import register as _register

    _register()
