"""The error every start-up check raises, below every module that checks something.

Settings (:mod:`.config`), NCCL's error-handling mode (:mod:`.nccl`) and torchrun's
environment (:mod:`.torchrun.env`) each refuse what the user set with it, so it lives in no
one of them.
"""

__all__ = ["KeepaliveConfigError"]


class KeepaliveConfigError(ValueError):
    """A keepalive setting is invalid; the message names it, its value and the fix."""
