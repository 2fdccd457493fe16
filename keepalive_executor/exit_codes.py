"""Every exit code a keepalive process chooses, in one place.

=====  ==================  ============================================================
code   name                meaning
=====  ==================  ============================================================
0      ``OK``              a rank left its loop after the driver's SHUTDOWN, or after the
                           driver went away once this rank had been asked to stop
1      ``FAILED``          a rank's channel broke unasked (driver died, collective timed
                           out), it could not run a model step, or it could not start;
                           rank 0 under torchrun: the executor recorded a failure
2      ``ORPHANED``        a spawned worker's parent (the engine process) went away
                           outside a shutdown (its death pipe closed)
2      ``USAGE``           ``python -m keepalive_executor`` was started wrongly (not under
                           torchrun, bad arguments): nothing ran
=====  ==================  ============================================================

``ORPHANED`` and ``USAGE`` share a value on purpose: both are "started or left in a way
that is not a run", and each comes from a different program (a worker, the CLI). The
executor itself never ends a process (see :mod:`keepalive_executor.driver`).
"""

from __future__ import annotations

__all__ = ["OK", "FAILED", "ORPHANED", "USAGE"]

OK = 0
FAILED = 1
ORPHANED = 2
USAGE = 2
