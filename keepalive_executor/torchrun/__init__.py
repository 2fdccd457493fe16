"""torchrun mode: every rank is a process of an external launcher (torchrun, or Slurm's srun,
or Open MPI's mpirun); rank 0 serves, the others follow.

* :mod:`~keepalive_executor.torchrun.launchers`  srun's and mpirun's variables as torchrun's
* :mod:`~keepalive_executor.torchrun.env`        what torchrun tells each rank; node-local set-up
* :mod:`~keepalive_executor.torchrun.bootstrap`  rank 0's signed configuration on the store
* :mod:`~keepalive_executor.torchrun.liveness`   heartbeats on the store: death detection
* :mod:`~keepalive_executor.torchrun.ranks`      the executor's view of torchrun's ranks
* :mod:`~keepalive_executor.torchrun.cli`        ``python -m keepalive_executor serve``
"""

from keepalive_executor.torchrun.env import (
    LAUNCHER_ENV,
    TorchrunEnv,
    TorchrunError,
    check_features,
    check_world_size,
    in_torchrun_mode,
    with_keepalive_backend,
)

__all__ = [
    "LAUNCHER_ENV",
    "TorchrunEnv",
    "TorchrunError",
    "check_world_size",
    "check_features",
    "in_torchrun_mode",
    "with_keepalive_backend",
    "record_failure",
    "main",
]


def record_failure(reason: str) -> None:
    """Note an executor failure for rank 0's exit code (see :mod:`.cli`)."""
    from keepalive_executor.torchrun.cli import record_failure as _record

    _record(reason)


def main() -> int:
    """The torchrun entry point (see :mod:`.cli`)."""
    from keepalive_executor.torchrun.cli import main as _main

    return _main()
