"""torchrun mode's death detection: heartbeats on torchrun's store, not on the channel.

The executor cannot watch torchrun's processes (they are not its children, and may be on
other nodes), and a failing channel send is not a death signal it can rely on: with NCCL a
small broadcast can complete on the root without the receiver, and a step's collectives have
no timeout of their own. So every follower beats on the agent's store, a TCP service that
does not depend on the transport::

    follower (thread keepalive-heartbeat)      driver (thread keepalive-liveness)
    every timeout/6: add(alive/<rank>, 1)      every timeout/6: read alive/<rank> of each rank;
                                               a counter that has not moved for `timeout`
                                               seconds (driver's own clock: no clock skew
                                               between nodes matters) -> that rank is lost

A lost process, a lost node and a partition all stop the counter, so any of them is noticed
within ``timeout`` plus one poll (``VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S``, default 1.5 s, so
under 2 s). The decision is the pure :class:`LivenessCore` with an injectable clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from keepalive_executor.log import get_logger

__all__ = ["LivenessCore", "Heartbeat", "LivenessMonitor", "BEATS_PER_TIMEOUT"]

logger = get_logger(__name__)
BEATS_PER_TIMEOUT = 6


class LivenessCore:
    """Which ranks are lost, from observed counter values and the observer's clock."""

    def __init__(self, ranks: Iterable[int], timeout_s: float, now: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._seen: dict[int, tuple[int | None, float]] = {r: (None, now) for r in ranks}

    def observe(self, rank: int, value: int, now: float) -> None:
        """Rank ``rank``'s counter reads ``value`` at ``now``."""
        last, since = self._seen[rank]
        if value != last:
            self._seen[rank] = (value, now)

    def lost(self, now: float) -> list[tuple[int, float]]:
        """``(rank, seconds since its counter last moved)`` for each rank past the timeout."""
        return sorted(
            (r, now - since) for r, (_, since) in self._seen.items()
            if now - since > self.timeout_s
        )


def _key(key_of: Callable[[str], str], rank: int) -> str:
    return key_of(f"alive/{rank}")


class _Periodic:
    """A daemon thread running ``self._tick()`` every ``period`` until stop()."""

    def __init__(self, period: float, name: str) -> None:
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (once)."""
        self._thread.start()

    def stop(self) -> None:
        """No tick begins after this returns (one may still be inside a store call)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._tick():
                return
            self._stop.wait(self._period)

    def _tick(self) -> bool:
        raise NotImplementedError


class Heartbeat(_Periodic):
    """A follower's heartbeat thread (``keepalive-heartbeat``)."""

    def __init__(self, store: Any, key_of: Callable[[str], str], rank: int,
                 timeout_s: float) -> None:
        super().__init__(timeout_s / BEATS_PER_TIMEOUT, "keepalive-heartbeat")
        self._store = store
        self._key = _key(key_of, rank)

    def _tick(self) -> bool:
        try:
            self._store.add(self._key, 1)
        except Exception as e:  # noqa: BLE001 - the driver notices the silence
            logger.warning("heartbeat to torchrun's store failed; stopping it: %s", e)
            return False
        return True


class LivenessMonitor(_Periodic):
    """The driver's watch over followers' heartbeats (thread ``keepalive-liveness``).

    ``on_lost(reason)`` is called once, for the first rank lost (or if the store is lost);
    the thread then ends. stop() ends it too.
    """

    def __init__(self, store: Any, key_of: Callable[[str], str], ranks: Iterable[int],
                 timeout_s: float, on_lost: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(timeout_s / BEATS_PER_TIMEOUT, "keepalive-liveness")
        self._store = store
        self._key_of = key_of
        self._ranks = list(ranks)
        self._clock = clock
        self._core = LivenessCore(self._ranks, timeout_s, clock())
        self._on_lost = on_lost

    def _tick(self) -> bool:
        try:
            for r in self._ranks:
                self._core.observe(r, int(self._store.add(_key(self._key_of, r), 0)),
                                   self._clock())
        except Exception as e:  # noqa: BLE001 - the agent hosting the store is gone
            if not self._stop.is_set():
                self._on_lost(f"torchrun's store stopped answering ({e}); node 0's agent "
                              "is gone")
            return False
        lost = self._core.lost(self._clock())
        if lost and not self._stop.is_set():
            rank, silent = lost[0]
            self._on_lost(
                f"rank {rank} sent no heartbeat for {silent:.2f}s (torchrun mode, "
                f"{ENV_LIVENESS}={self._core.timeout_s:g}s): its process or node is lost"
            )
            return False
        return True


ENV_LIVENESS = "VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S"
