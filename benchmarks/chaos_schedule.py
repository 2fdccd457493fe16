"""The chaos run's pure half: its bounds, the seeded schedule of faults, and the invariants
judged from a finished run's record. No process, thread, socket or clock here: the same seed
gives the same schedule, and tests/test_chaos.py checks every invariant on made-up records
(each must be able to fail) without starting a server.

Bounds, in seconds, for one node, TP=2, the tiny model, torchrun's ``--monitor-interval 0.2``
and ``--distributed-timeout-seconds 5`` (``COLLECTIVE_TIMEOUT_S``):

- ``DETECTION_BOUND_S`` = 3.0: a frozen follower is declared lost within the liveness
  timeout plus two beats, 2.0 s on one node (docs/torchrun.md; measured 1.63 to 1.84 s from
  SIGSTOP to the log line), and tests/test_torchrun.py allows 0.5 s more for a loaded 2-core
  machine (2.5 s); 0.5 s more for the log line to reach the file the run reads. A killed
  rank is seen sooner: torchrun's monitor polls every 0.2 s (measured 0.28 to 0.65 s to its
  ``closing signal`` line), a killed engine at once by its API server.
- ``RESTART_BOUND_S`` = 45.0: from the detection to a correct answer of the next attempt
  (torchrun stops what is left, starts every rank again, vLLM loads the model and warms up).
  Measured here 19.8 to 26.1 s per restart on an idle 2-core machine (docs/torchrun.md: about
  17 s); the bound is about 1.7 times the worst of those, for a loaded CI machine.
- ``CLIENT_WAIT_BOUND_S`` = detection + restart (48 s): the issue's bound on any client's
  wait without an answer or an error. Every client's HTTP timeout is above it, so a hang is
  measured as one, not cut short.
- ``RECOVERY_BOUND_S``: a fault that ends the attempt must be followed by a correct answer
  within detection + restart of the injection; a fault the server must survive, within
  ``SURVIVED_RECOVERY_S`` = 15 s of the fault's end (a burst's queue of 32 requests of up to
  64 tokens drains in a few seconds here).
- ``SIGTERM_BOUND_S`` = 30: torchrun escalates to SIGKILL 30 s after its SIGTERM; a job that
  ends later needed it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from statistics import median
from typing import Any

__all__ = ["KINDS", "FATAL_KINDS", "Fault", "make_schedule", "action", "describe", "judge",
           "INVARIANTS", "fault_table", "restarts_needed"]

COLLECTIVE_TIMEOUT_S = 5.0  # --distributed-timeout-seconds: the keepalive interval is 1.25 s
KEEPALIVE_INTERVAL_S = COLLECTIVE_TIMEOUT_S / 4
LIVENESS_TIMEOUT_S = 1.5  # the one-node default of VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S
BEAT_S = LIVENESS_TIMEOUT_S / 6
#: a follower's freeze shorter than this is tolerated by design (the timeout minus two
#: beats); between it and the timeout either outcome is allowed (docs/torchrun.md)
TOLERATED_STOP_S = LIVENESS_TIMEOUT_S - 2 * BEAT_S
DETECTION_BOUND_S = 3.0
RESTART_BOUND_S = 45.0
CLIENT_WAIT_BOUND_S = DETECTION_BOUND_S + RESTART_BOUND_S
RECOVERY_BOUND_S = DETECTION_BOUND_S + RESTART_BOUND_S
SURVIVED_RECOVERY_S = 15.0
SIGTERM_BOUND_S = 30.0
#: a burst: every request at once, twice the server's --max-num-seqs (16)
BURST_SIZE = 32

KINDS = ("sigkill", "sigstop_short", "sigstop_long", "idle_gap", "burst", "disconnect")
#: the kinds that must end the attempt (detected within DETECTION_BOUND_S, then a restart)
FATAL_KINDS = ("sigkill", "sigstop_long")
#: which process a fault's target names: rank 0's API server (torchrun's child for local
#: rank 0), its engine process (the keepalive driver), rank 1 (the follower)
TARGETS = ("rank0", "rank0-engine", "rank1")

#: a schedule's estimate of each kind's cost beyond its delay: what makes --minutes M come
#: out near M minutes (a restart about 25 s here, plus detection)
_RESTART_COST_S = 28.0


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule.

    ``phase`` says when it lands: ``serving`` (the load runs; ``delay_s`` after the server
    answered again after the previous fault), ``idle`` (the load is paused and the engine has
    been idle ``delay_s``: a kill amid the keepalive broadcasts), ``startup`` (``delay_s``
    after the previous fault's detection, while the next attempt starts: a kill during a
    restart's start-up), ``after_restart`` (an idle gap at once after a restart).
    ``expect``: ``restart`` (the attempt must end, detected in time, then serve again),
    ``survive`` (no restart, no failed request), ``either`` (a freeze between the tolerated
    length and the liveness timeout: the design allows both)."""

    index: int
    kind: str
    phase: str
    delay_s: float
    target: str = ""
    duration_s: float = 0.0
    size: int = 0
    chunks: tuple[int, ...] = ()
    expect: str = "survive"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = list(self.chunks)
        return d


def _draw(kind: str, index: int, rng: random.Random, prev: Fault | None) -> Fault:
    after_fatal = prev is not None and prev.expect == "restart"
    delay = round(rng.uniform(2.0, 8.0), 2)
    if kind == "sigkill":
        phases = ["serving", "serving", "idle"] + (["startup"] if after_fatal else [])
        phase = rng.choice(phases)
        if phase == "idle":  # past one keepalive interval: the kill lands amid keepalives
            delay = round(rng.uniform(KEEPALIVE_INTERVAL_S + 0.25, 4.0), 2)
        elif phase == "startup":  # the next attempt is loading (a restart takes ~20 s)
            delay = round(rng.uniform(1.0, 15.0), 2)
        return Fault(index, kind, phase, delay, target=rng.choice(TARGETS), expect="restart")
    if kind == "sigstop_short":
        # below the liveness timeout; a follower's freeze past the tolerated length may end
        # its attempt (a frozen rank 0 is no heartbeat matter: its followers' collective
        # timeout, 5 s, is far off)
        d = round(rng.uniform(0.2, LIVENESS_TIMEOUT_S - 0.05), 2)
        target = rng.choice(TARGETS)
        gray = target == "rank1" and d >= TOLERATED_STOP_S
        return Fault(index, kind, "serving", delay, target=target, duration_s=d,
                     expect="either" if gray else "survive")
    if kind == "sigstop_long":  # past the detection bound: it must be noticed while frozen
        d = round(rng.uniform(DETECTION_BOUND_S + 0.5, DETECTION_BOUND_S + 3.0), 2)
        return Fault(index, kind, "serving", delay, target="rank1", duration_s=d,
                     expect="restart")
    if kind == "idle_gap":
        d = round(rng.uniform(COLLECTIVE_TIMEOUT_S + 1.0, COLLECTIVE_TIMEOUT_S + 4.0), 2)
        phase = "after_restart" if after_fatal and rng.random() < 0.5 else "serving"
        return Fault(index, kind, phase, 0.0 if phase == "after_restart" else delay,
                     duration_s=d)
    if kind == "burst":
        return Fault(index, kind, "serving", delay, size=BURST_SIZE)
    if kind == "disconnect":
        n = rng.randint(2, 8)
        return Fault(index, kind, "serving", delay, size=n,
                     chunks=tuple(rng.randint(1, 4) for _ in range(n)))
    raise ValueError(f"unknown fault kind {kind!r}; the kinds are {', '.join(KINDS)}")


def _cost(f: Fault) -> float:
    if f.expect == "restart":
        return f.delay_s + _RESTART_COST_S
    return f.delay_s + f.duration_s + 3.0


def make_schedule(seed: int, minutes: float, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """The faults of a run of about ``minutes`` (past the first start-up), from ``seed``
    alone: rounds of every kind in ``kinds`` once, each round in a random order (so every
    kind comes about equally often), each fault's parameters drawn as it is placed. At least
    one fault."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"--kinds {','.join(kinds)}: unknown or none; the kinds are "
                         f"{', '.join(KINDS)}")
    rng = random.Random(seed)
    budget = minutes * 60.0
    faults: list[Fault] = []
    spent = 0.0
    while True:
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            f = _draw(kind, len(faults), rng, faults[-1] if faults else None)
            if faults and spent + _cost(f) > budget:
                return faults
            faults.append(f)
            spent += _cost(f)


def restarts_needed(schedule: list[Fault]) -> int:
    """The restarts the schedule may use: one per fault that must or may end the attempt."""
    return sum(f.expect in ("restart", "either") for f in schedule)


def action(f: Fault) -> str:
    """What the fault does, in words."""
    return {
        "sigkill": f"SIGKILL {f.target}",
        "sigstop_short": f"SIGSTOP {f.target} for {f.duration_s:.2f}s",
        "sigstop_long": f"SIGSTOP {f.target} for {f.duration_s:.2f}s",
        "idle_gap": f"no request for {f.duration_s:.2f}s",
        "burst": f"{f.size} requests at once",
        "disconnect": f"{f.size} streams closed after {','.join(map(str, f.chunks))} chunks",
    }[f.kind]


def describe(f: Fault) -> str:
    """One line of the printed schedule."""
    when = {"serving": f"{f.delay_s:.2f}s into serving",
            "idle": f"after {f.delay_s:.2f}s idle",
            "startup": f"{f.delay_s:.2f}s after the previous detection (start-up)",
            "after_restart": "right after the restart"}[f.phase]
    return f"#{f.index:3d} {f.kind:13s} {action(f)}, {when} (expect {f.expect})"


# ----------------------------------------------------------------------- the invariants

INVARIANTS = {
    "wrong-token": "every token any client received equals the known answer's at its place",
    "hung-client": f"no client waited longer than {CLIENT_WAIT_BOUND_S:.0f}s "
                   "(detection + restart bound) without an answer or an error",
    "undetected": f"every fault that must end the attempt was detected within "
                  f"{DETECTION_BOUND_S:.1f}s",
    "not-survived": "every fault the server must survive left the attempt running and "
                    "failed no request",
    "not-recovered": "every fault was followed within its bound by a correct answer (restarts "
                     "left) or by the job ending non-zero with nothing left",
    "leaked-request": "while no client had a request open, the engine held none",
    "left-behind": "no process of a finished attempt, and nothing after the job's end",
    "not-stopped": f"the final SIGTERM ended the job within {SIGTERM_BOUND_S:.0f}s, every "
                   "rank by itself (none killed by torchrun's escalation to SIGKILL)",
}


@dataclass
class Breach:
    invariant: str
    fault: int | None
    detail: str

    def line(self) -> str:
        at = f" (fault #{self.fault})" if self.fault is not None else ""
        return f"BREACH {self.invariant}{at}: {self.detail}"


@dataclass
class Verdict:
    breaches: list[Breach] = field(default_factory=list)

    def add(self, invariant: str, fault: int | None, detail: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.breaches.append(Breach(invariant, fault, detail))

    @property
    def ok(self) -> bool:
        return not self.breaches

    def names(self) -> list[str]:
        return sorted({b.invariant for b in self.breaches})


def judge(record: dict[str, Any]) -> Verdict:
    """The invariants over a finished run's record (chaos.py's JSON, ``faults``,
    ``requests``, ``end``). Every bound is this module's."""
    v = Verdict()
    for r in record["requests"]["wrong"]:
        v.add("wrong-token", r.get("fault"), r["detail"])
    for r in record["requests"]["longest_waits"]:
        if r["wait_s"] > CLIENT_WAIT_BOUND_S:
            v.add("hung-client", r.get("fault"),
                  f"client {r['client']} waited {r['wait_s']:.1f}s without an answer or an "
                  f"error ({r['what']})")
    for f in record["faults"]:
        i, expect = f["index"], f["expect"]
        if f.get("skipped"):
            continue
        ended = bool(f.get("restarted") or f.get("job_ended"))
        det = f.get("detected_s")
        if expect == "restart" and (det is None or det > DETECTION_BOUND_S):
            seen = "never" if det is None else f"only after {det:.2f}s"
            v.add("undetected", i, f"{f['what']}: detected {seen} (bound "
                  f"{DETECTION_BOUND_S:.1f}s)")
        if expect == "survive":
            if ended or det is not None:
                v.add("not-survived", i, f"{f['what']}: the attempt ended "
                      f"({f.get('detection', 'restarted')})")
            if f.get("failed_requests"):
                v.add("not-survived", i, f"{f['what']}: {f['failed_requests']} requests failed "
                      f"({', '.join(f.get('errors', [])[:3])})")
        for leak in f.get("engine_requests_while_idle", []):
            v.add("leaked-request", i, leak)
        if f.get("orphans"):
            v.add("left-behind", i, f"after {f['what']}: still running from an earlier "
                  f"attempt: {', '.join(f['orphans'])}")
        if f.get("superseded") is not None or f.get("stopped"):
            continue  # the next fault hit the restart: its recovery covers this one's
        if f.get("job_ended"):
            if f.get("exit_code") in (None, 0) or f.get("left"):
                v.add("not-recovered", i, f"{f['what']}: the job ended with code "
                      f"{f.get('exit_code')}, left {f.get('left')}")
            continue
        if ended or expect == "restart":
            rec, bound, since = f.get("recovered_s"), RECOVERY_BOUND_S, "the fault"
        else:
            rec, bound, since = f.get("recovered_after_end_s"), SURVIVED_RECOVERY_S, "its end"
        if rec is None or rec > bound:
            seen = "no correct answer" if rec is None else f"a correct answer {rec:.1f}s"
            v.add("not-recovered", i, f"{f['what']}: {seen} after {since} (bound {bound:.0f}s)")
    end = record["end"]
    if end.get("left"):
        v.add("left-behind", None, f"after the job's end: {', '.join(end['left'])}")
    if end.get("how") == "sigterm":
        took = end.get("exit_s")
        if took is None or took > SIGTERM_BOUND_S:
            v.add("not-stopped", None, f"the job ended only {took}s after SIGTERM"
                  if took else f"the job had not ended {SIGTERM_BOUND_S:.0f}s after SIGTERM")
        elif end.get("torchrun_sigkills"):
            v.add("not-stopped", None, f"torchrun had to SIGKILL {end['torchrun_sigkills']} "
                  f"rank(s) that ignored its SIGTERM (the job ended after {took}s)")
    for extra in record.get("unexplained_restarts", []):
        v.add("not-survived", extra.get("fault"), extra["detail"])
    return v


def fault_table(faults: list[dict[str, Any]]) -> str:
    """Markdown: faults by kind, how many, detection and recovery times (median, worst),
    requests failed and succeeded."""
    rows = ["| fault | count | ended the attempt | detection median / worst (s) | "
            "serving again median / worst (s) | requests failed / succeeded |",
            "|---|---|---|---|---|---|"]

    def mw(xs: list[float]) -> str:
        return f"{median(xs):.2f} / {max(xs):.2f}" if xs else "-"

    for kind in KINDS:
        fs = [f for f in faults if f["kind"] == kind]
        if not fs:
            continue
        det = [f["detected_s"] for f in fs if f.get("detected_s") is not None]
        rec = [f["recovered_s"] for f in fs if f.get("recovered_s") is not None]
        ended = sum(bool(f.get("restarted") or f.get("job_ended")) for f in fs)
        failed = sum(f.get("failed_requests", 0) for f in fs)
        ok = sum(f.get("succeeded_requests", 0) for f in fs)
        rows.append(f"| {kind} | {len(fs)} | {ended} | {mw(det)} | {mw(rec)} | {failed} / {ok} |")
    return "\n".join(rows)
