"""Chaos: the tiny model served by ``torchrun --max-restarts`` (one node, TP=2) under a client
load whose answers are known, while a seeded random schedule of faults hits it; every answer
is checked token by token, every fault's detection and recovery timed, every invariant of
benchmarks/chaos_schedule.py judged. Exit status 0 only when every invariant held.

    flock /tmp/keepalive-engines.lock python benchmarks/chaos.py --minutes 30 --seed N \\
        --json benchmarks/results/chaos-30min.json --png docs/images/chaos-30min.png

The faults: SIGKILL of rank 0's API server, its engine process or rank 1 (while serving,
while idle amid the keepalives, or during the next attempt's start-up); SIGSTOP of a rank
below the liveness timeout and of rank 1 past it; idle gaps past the collective timeout
(``--distributed-timeout-seconds 5``, some at once after a restart); bursts of 32 requests;
clients that close their streams mid-way; SIGTERM of the whole job at the end. The schedule
comes from the seed alone (and ``--minutes``, ``--kinds``), is printed up front, and the
same seed replays it.

``--backend controls.X`` runs a negative control's executor (tests/controls.py): with
``controls.NoKeepalivesNoLiveness`` a frozen rank goes unnoticed and the run fails naming
``undetected``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(HERE.parent / "scripts"))

import psutil  # noqa: E402
from chaos_load import Known, Load, client_for, pool, record  # noqa: E402
from chaos_schedule import (  # noqa: E402
    CLIENT_WAIT_BOUND_S,
    COLLECTIVE_TIMEOUT_S,
    DETECTION_BOUND_S,
    INVARIANTS,
    RECOVERY_BOUND_S,
    SIGTERM_BOUND_S,
    SURVIVED_RECOVERY_S,
    Fault,
    action,
    describe,
    fault_table,
    judge,
    make_schedule,
    restarts_needed,
)
from procs import name_of, tagged_processes  # noqa: E402
from serve_scripts import LOAD_ARGS  # noqa: E402
from servers import TorchrunServer  # noqa: E402

#: log lines that say a fault was noticed, by whom (the first after an injection is its
#: detection)
DETECTIONS = (
    ("heartbeat", "sent no heartbeat for"),
    ("store", "torchrun's store has not answered"),
    ("collective-timeout", "Timed out waiting"),
    ("executor-failed", "keepalive executor failed"),
    ("driver-lost", "keepalive worker rank 1 stops"),
    ("engine-dead", "output_handler failed"),
    ("engine-dead", "died unexpectedly"),
    ("torchrun", "closing signal SIGTERM"),
    ("torchrun", "failed (exitcode"),
)
#: rank 0's engine publishes this once per attempt
ATTEMPT = "keepalive torchrun mode: configuration published"
LABEL = re.compile(r"joining the process groups at torchrun://\S+?:(ka\d+-[0-9a-f]+)")
#: torchrun gave up on a rank's SIGTERM and killed it (30 s after the SIGTERM)
ESCALATED = "forcefully exiting via 9"
#: vLLM's drain mode, as a deployment that wants clean stops runs (docs/torchrun.md): on
#: SIGTERM the requests in flight finish and the driver sends SHUTDOWN. With the default 0,
#: vLLM's API server waits for the open streams' connections after it killed its engine
#: (mp's `vllm serve` too: still running 60 s after SIGTERM with 4 streams open, measured here)
SHUTDOWN_TIMEOUT_S = 10
#: restarts beyond the ones the schedule may use
SPARE_RESTARTS = 2
CLIENT_TIMEOUT_S = CLIENT_WAIT_BOUND_S + 5.0


class LogFollower:
    """Reads agent 0's log as it grows and stamps every line with the time it was read
    (time.monotonic()): the detections, the attempts."""

    def __init__(self, path: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, args=(path,), daemon=True,
                                        name="chaos-log")
        self._thread.start()

    def _follow(self, path: Path) -> None:
        with open(path, errors="replace") as f:
            part = ""
            while not self._stop.is_set():
                chunk = f.readline()
                if not chunk:
                    time.sleep(0.02)
                    continue
                part += chunk
                if part.endswith("\n"):
                    with self._lock:
                        self.lines.append((time.monotonic(), part.rstrip("\n")))
                    part = ""

    def stop(self) -> None:
        time.sleep(0.1)
        self._stop.set()
        self._thread.join(2)

    def first(self, since: float, needles: tuple[tuple[str, str], ...] = DETECTIONS
              ) -> tuple[float, str, str] | None:
        """The first line read at or after ``since`` holding one of ``needles``:
        (time, name, line)."""
        with self._lock:
            lines = list(self.lines)
        for t, line in lines:
            if t >= since:
                for name, needle in needles:
                    if needle in line:
                        return t, name, line.strip()[:300]
        return None

    def attempts(self) -> list[float]:
        """When each attempt published its configuration."""
        with self._lock:
            return [t for t, line in self.lines if ATTEMPT in line]

    def times(self, needle: str) -> list[float]:
        """When each line holding ``needle`` was read."""
        with self._lock:
            return [t for t, line in self.lines if needle in line]

    def labels(self) -> set[str]:
        with self._lock:
            return {m.group(1) for _, line in self.lines for m in [LABEL.search(line)] if m}


def _mp_texts(model: str, given: str | None) -> tuple[dict[str, str] | None, str]:
    """mp's answers to the workload (``load_tp2``): from ``--expected-texts`` or the cached
    reference when its key matches this machine; where it came from."""
    if given:
        return json.loads(Path(given).read_text()), f"mp's answers from {given}"
    from reference_calls import REFERENCES
    from run_engine import Reference, reference_call

    with tempfile.TemporaryDirectory(prefix="chaos-ref-") as work:
        ref = Reference.look_up("load_tp2", reference_call(REFERENCES["load_tp2"], model,
                                                           Path(work)), model)
    if ref.cached is None:
        return None, ("mp's answers not cached for this machine (" + ", ".join(ref.mismatch)
                      + "): the known answers are the first healthy pass's alone")
    return ref.cached, "mp's answers: the cached reference load_tp2"


class Chaos:
    def __init__(self, args: argparse.Namespace, seed: int, schedule: list[Fault]) -> None:
        self.args, self.seed, self.schedule = args, seed, schedule
        self.out = Path(args.out or tempfile.mkdtemp(prefix="chaos-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.faults: list[dict[str, Any]] = []
        self.unexplained: list[dict[str, Any]] = []
        self.end: dict[str, Any] = {}
        self.notes: list[str] = []
        self.serving_again: list[float] = []
        self.load: Load | None = None
        self.seen: dict[int, psutil.Process] = {}

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.t0, 3)

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:8.2f}] {msg}", flush=True)

    # ------------------------------------------------------------------ the server

    def start(self) -> None:
        a = self.args
        extra_env = {"PYTHONPATH": os.pathsep.join(
            p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)}
        backend = ["--distributed-executor-backend", a.backend] if a.backend != "keepalive" \
            else []
        self.max_restarts = restarts_needed(self.schedule) + SPARE_RESTARTS
        self.shm_before = set(os.listdir("/dev/shm"))
        self.server = TorchrunServer(
            a.model, self.out,
            extra_args=["--distributed-timeout-seconds", str(int(COLLECTIVE_TIMEOUT_S)),
                        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), *LOAD_ARGS, *backend],
            launch_args=["--max-restarts", str(self.max_restarts)], extra_env=extra_env,
            log_prefix="chaos")
        self.log = LogFollower(self.server.log_paths[0])
        self.say(f"torchrun --max-restarts {self.max_restarts}; log {self.server.log_paths[0]}")
        self.server.wait_ready(timeout=300)
        self.t_ready = time.monotonic()
        self.say("serving")

    def health(self) -> int | None:
        return self.server.health()

    def job_ended(self) -> bool:
        return self.server.proc.poll() is not None

    def processes(self) -> list[psutil.Process]:
        return self.server.tree()

    def target(self, name: str, newer_than: float | None = None,
               wait_s: float = 0.0) -> psutil.Process | None:
        """The process a fault's target names, of the running attempt (with ``newer_than``,
        started after that wall-clock time): rank 0 and rank 1 are the agent's children with
        RANK 0 and 1 in their environment, or rank 1 by its title (setting a long title
        overwrites the environment's memory, and the title comes only late in a start-up);
        rank 0's engine is the process titled EngineCore."""
        deadline = time.monotonic() + wait_s
        while True:
            for p in self.processes():
                try:
                    if newer_than is not None and p.create_time() < newer_than:
                        continue
                    title = name_of(p)
                    if name == "rank0-engine":
                        if "EngineCore" in title:
                            return p
                        continue
                    if p.ppid() != self.server.proc.pid:
                        continue
                    rank = "1" if "KeepaliveWorker" in title else p.environ().get("RANK")
                    if rank == name[-1]:
                        return p
                except psutil.Error:
                    continue
            if time.monotonic() >= deadline or self.job_ended():
                return None
            time.sleep(0.05)

    def probe(self) -> bool:
        """One known request, not streamed: answered correctly?"""
        return self.load.ask(self._probe_client, "probe", self.known.requests[0]["i"],
                             False, None) == "ok"

    def wait_serving(self, deadline: float, after_attempt: int | None) -> float | None:
        """When the server answered a probe correctly (of an attempt later than
        ``after_attempt`` if given); None if the job ended or the deadline passed."""
        while time.monotonic() < deadline and not self.job_ended():
            if after_attempt is not None and len(self.log.attempts()) <= after_attempt:
                time.sleep(0.1)
                continue
            self.remember()
            if self.health() == 200 and self.probe():
                return time.monotonic()
            time.sleep(0.1)
        return None

    def remember(self) -> set[int]:
        """Note every process of the job now (its agent and the agent's descendants): the
        pids now."""
        try:
            root = psutil.Process(self.server.proc.pid)
            now = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            now = []
        for p in now:
            self.seen.setdefault(p.pid, p)
        return {p.pid for p in now}

    def orphans(self, kill: bool = False) -> list[str]:
        """Processes of this run that are no longer the agent's descendants: left by an
        attempt that ended. Those seen in the job before (a rank's title overwrites the
        environment's memory) and those that still carry the run's tag. With ``kill``,
        each is named, then SIGKILLed (the run records a leftover, and leaves none)."""
        ours = self.remember()
        left: dict[int, psutil.Process] = {}
        for p in [*self.seen.values(), *tagged_processes(self.server.tag)]:
            try:
                if (p.pid not in ours and p.is_running()
                        and p.status() != psutil.STATUS_ZOMBIE):
                    left[p.pid] = p
            except psutil.Error:
                pass
        names = sorted(f"{p.pid} {name_of(p)}" for p in left.values())
        if kill:
            for p in left.values():
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(list(left.values()), timeout=10)
        return names

    def engine_requests(self) -> list[str]:
        """With no request open, the engine must hold none: its running and waiting counts
        on /metrics reach 0 within 3 s, or the leak is named."""
        import urllib.request

        last = ""
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.server.base_url + "/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError as e:
                return [f"/metrics did not answer: {e}"]
            held = {}
            for line in text.splitlines():
                for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                    if line.startswith(name + "{") or line.startswith(name + " "):
                        held[name] = held.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            if not any(held.values()):
                return []
            last = ", ".join(f"{k.split(':')[1]} {v:g}" for k, v in held.items())
            time.sleep(0.1)
        return [f"the engine still holds requests with no client waiting: {last}"]

    # ------------------------------------------------------------------ one fault

    def inject(self, f: Fault, prev: dict[str, Any] | None, next_f: Fault | None
               ) -> dict[str, Any]:
        rec: dict[str, Any] = {**f.to_json(), "what": action(f)}
        load = self.load
        load.fault = f.index
        # ---- when
        if f.phase == "serving":
            time.sleep(f.delay_s)
        elif f.phase == "idle":
            load.pause(CLIENT_TIMEOUT_S)
            time.sleep(f.delay_s)
        newer_than = None
        if f.phase == "startup":
            at = (prev or {}).get("_detected_at") or time.monotonic()
            time.sleep(max(0.0, at + f.delay_s - time.monotonic()))
            newer_than = time.time() - (time.monotonic() - at)
            if self.health() == 200:
                rec["note"] = "the attempt was serving already: a kill while serving"
        attempts_before = len(self.log.attempts())
        rec["attempts_before"] = attempts_before
        self.remember()
        if self.job_ended():
            rec["skipped"] = "the job had ended"
            return rec
        # ---- what
        t_end = None
        if f.kind in ("sigkill", "sigstop_short", "sigstop_long"):
            # a restart may wait 30 s for torchrun to SIGKILL a rank of the attempt before
            proc = self.target(f.target, newer_than, wait_s=45.0 if f.phase == "startup"
                               else 5.0)
            if proc is None:
                rec["skipped"] = f"no {f.target} process found"
                self.say(f"fault #{f.index}: {rec['skipped']}")
                if f.phase == "idle":
                    load.resume()
                return rec
            rec["pid"] = proc.pid
            t_inject = time.monotonic()
            try:
                if f.kind == "sigkill":
                    proc.send_signal(signal.SIGKILL)
                else:
                    proc.send_signal(signal.SIGSTOP)
                    time.sleep(f.duration_s)
                    proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                rec["note"] = "the target ended before the signal"
            t_end = time.monotonic()
            if f.phase == "idle":
                load.resume()
        elif f.kind == "idle_gap":
            load.pause(CLIENT_TIMEOUT_S)
            t_inject = time.monotonic()
            leaks = self.engine_requests()
            if leaks:
                rec["engine_requests_while_idle"] = leaks
            time.sleep(max(0.0, f.duration_s - (time.monotonic() - t_inject)))
            t_end = time.monotonic()
            load.resume()
        elif f.kind == "burst":
            t_inject = time.monotonic()
            load.burst(f.size, random.Random(self.seed * 7919 + f.index))
            t_end = time.monotonic()
        elif f.kind == "disconnect":
            t_inject = time.monotonic()
            load.disconnects(f.chunks, random.Random(self.seed * 7919 + f.index))
            t_end = time.monotonic()
        else:
            raise AssertionError(f.kind)
        rec["t_inject"], rec["t_end"] = self.rel(t_inject), self.rel(t_end)
        rec["_t_inject"] = t_inject
        self.say(f"fault #{f.index}: {rec['what']} (pid {rec.get('pid', '-')})")
        # ---- detection: within the bound, or late (recorded), or none
        if f.expect == "restart":
            wait_until = t_inject + DETECTION_BOUND_S + 12.0
            while time.monotonic() < wait_until and self.log.first(t_inject) is None:
                if self.args.stop_on_breach and time.monotonic() > t_inject + DETECTION_BOUND_S + 1:
                    break
                time.sleep(0.05)
        else:
            time.sleep(0.5)  # a line the fault caused, if any, is in the log by then
        hit = self.log.first(t_inject)
        if hit is not None and (f.expect == "restart" or hit[0] <= t_end + SURVIVED_RECOVERY_S):
            rec["detected_s"] = round(hit[0] - t_inject, 3)
            rec["detection"] = f"{hit[1]}: {hit[2]}"
            rec["_detected_at"] = hit[0]
        ended_expected = f.expect == "restart" or hit is not None
        if f.expect == "restart" and self.args.stop_on_breach and hit is None:
            self.say(f"fault #{f.index}: not detected within {DETECTION_BOUND_S}s; stopping")
            rec["stopped"] = True
            return rec
        # ---- serving again
        rec.update(_t_end=t_end, _attempts_before=attempts_before,
                   _ended_expected=ended_expected)
        if next_f is not None and next_f.phase == "startup" and ended_expected:
            rec["superseded"] = next_f.index
            return rec
        return self.serving_again_after(rec)

    def serving_again_after(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Wait for the server's next correct answer after the fault ``rec`` (within its
        bound and then some, to measure a late one), and fill in the fault's outcome."""
        t_inject, t_end = rec["_t_inject"], rec["_t_end"]
        attempts_before, ended_expected = rec["_attempts_before"], rec["_ended_expected"]
        if rec["expect"] == "restart":
            back = self.wait_serving(t_inject + RECOVERY_BOUND_S + 30.0,
                                     after_attempt=attempts_before)
        else:  # survived, or (a breach) restarting: the failed engine answers no probe
            back = self.wait_serving(
                (t_inject + RECOVERY_BOUND_S if ended_expected else t_end + SURVIVED_RECOVERY_S)
                + 30.0, after_attempt=None)
        rec["attempts_after"] = len(self.log.attempts())
        rec["restarted"] = rec["attempts_after"] > attempts_before
        if back is not None:
            rec["recovered_s"] = round(back - t_inject, 3)
            rec["recovered_after_end_s"] = round(back - t_end, 3)
            rec["_t_recovered"] = back
            if rec["restarted"]:
                self.serving_again.append(back)
        if self.job_ended():
            rec.update(self.job_end_record())
            return rec
        if back is None:  # no server to fault any more: the run ends here
            rec["gave_up"] = True
            self.say(f"fault #{rec['index']}: no correct answer within the bound; the run "
                     "ends")
        orphans = self.orphans()
        if orphans:
            time.sleep(5)  # one that is on its way out is no leftover
            orphans = self.orphans(kill=True)
            if orphans:
                rec["orphans"] = orphans
                self.say(f"fault #{rec['index']}: left by an earlier attempt (killed): "
                         f"{orphans}")
        rec["t_recovered"] = self.rel(rec.get("_t_recovered"))
        self.say(f"fault #{rec['index']}: detected {rec.get('detected_s')} s "
                 f"({rec.get('detection', '-')[:60]}), serving again after "
                 f"{rec.get('recovered_s')} s, restarted {rec['restarted']}")
        return rec

    def job_end_record(self) -> dict[str, Any]:
        """The job ended by itself (restarts spent): its code, and what is left."""
        try:
            self.server.proc.wait(SIGTERM_BOUND_S)
        except subprocess.TimeoutExpired:
            pass
        psutil.wait_procs([p for p in self.seen.values() if p.is_running()], timeout=5)
        return {"job_ended": True, "exit_code": self.server.proc.poll(),
                "left": self.orphans(kill=True)}

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        a = self.args
        self.start()
        requests = pool(a.pool)
        t = time.monotonic()
        self.known: Known = record(self.server.base_url, requests, CLIENT_TIMEOUT_S)
        self.say(f"known answers: {len(requests)} requests recorded in "
                 f"{time.monotonic() - t:.1f}s")
        mp, source = _mp_texts(a.model, a.expected_texts)
        self.notes.append(source)
        self.say(source)
        mp_differs = []
        if mp is not None:
            mp_differs = [i for i in self.known.texts
                          if str(i) in mp and mp[str(i)] != self.known.texts[i]]
        self.load = Load(self.server.base_url, self.known, a.clients, self.t0, CLIENT_TIMEOUT_S,
                         seed=self.seed)
        self._probe_client = client_for(self.server.base_url, CLIENT_TIMEOUT_S)
        for i in mp_differs:
            self.load.wrong.append({"client": "record", "t": 0, "fault": None, "detail": (
                f"request {i}: the first healthy pass answered {self.known.texts[i]!r}, "
                f"mp answers {mp[str(i)]!r}")})
        self.load.start()
        prev: dict[str, Any] | None = None
        for k, f in enumerate(self.schedule):
            if self.job_ended():
                break
            nxt = self.schedule[k + 1] if k + 1 < len(self.schedule) else None
            rec = self.inject(f, prev, nxt)
            if rec.get("skipped") and prev is not None and prev.get("superseded") is not None:
                # the start-up it was to hit never came: the fault before is measured alone
                prev.pop("superseded")
                self.serving_again_after(prev)
                if prev.get("gave_up") or prev.get("job_ended"):
                    self.faults.append(rec)
                    break
            self.faults.append(rec)
            prev = rec
            if rec.get("stopped") or rec.get("job_ended") or rec.get("gave_up"):
                break
            if a.stop_on_breach and not judge(self.record(partial=True)).ok:
                self.say("a breach: stopping (--stop-on-breach)")
                break
        self.finish()
        return self.record()

    def finish(self) -> None:
        """SIGTERM to the job (unless it ended), then what is left; the load stops."""
        if not self.job_ended():
            procs = self.processes()
            self.load.fault = None
            t = time.monotonic()
            self.say("final SIGTERM to torchrun")
            self.server.proc.send_signal(signal.SIGTERM)
            try:
                self.server.proc.wait(SIGTERM_BOUND_S + 15)
                took = round(time.monotonic() - t, 3)
            except subprocess.TimeoutExpired:
                took = None
            psutil.wait_procs([p for p in procs if p.is_running()], timeout=5)
            left = [f"{p.pid} {name_of(p)}" for p in procs if p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE]
            left = sorted(set(left) | set(self.orphans(kill=True)))
            self.end = {"how": "sigterm", "exit_code": self.server.proc.poll(),
                        "exit_s": took, "left": left, "t": self.rel(t),
                        "torchrun_sigkills": len([x for x in self.log.times(ESCALATED)
                                                  if x >= t])}
        else:
            last = self.faults[-1] if self.faults else {}
            self.end = {"how": "ended", "exit_code": self.server.proc.poll(),
                        "left": last.get("left", [f"{p.pid} {name_of(p)}"
                                                  for p in self.processes()])}
        self.say(f"job ended: {self.end}")
        self.load.stop(CLIENT_TIMEOUT_S + 10)
        self.log.stop()
        self.server.stop(timeout=10)  # kills whatever is left, if anything
        new = set(os.listdir("/dev/shm")) - self.shm_before
        labels = self.log.labels()
        ours = sorted(n for n in new if any(n.startswith(lb) for lb in labels))
        # vLLM's force-kill leaves its CPU all-reduce segments behind (docs/torchrun.md), for
        # mp too: counted, then removed, so that a long run does not fill /dev/shm
        self.end["shm_segments_left_by_vllm"] = len(ours)
        for n in ours:
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except OSError:
                pass

    # ------------------------------------------------------------------ the record

    def record(self, partial: bool = False) -> dict[str, Any]:
        load = self.load
        faults = [{k: v for k, v in f.items() if not k.startswith("_")} for f in self.faults]
        starts = [f.get("_t_inject") for f in self.faults]
        escalations = self.log.times(ESCALATED) if hasattr(self, "log") else []
        done = list(load.done) if load else []
        for k, f in enumerate(faults):
            if starts[k] is None:
                continue
            lo = starts[k] - self.t0
            # to the next fault, or to the final SIGTERM (whose failures are its own)
            hi = next((s - self.t0 for s in starts[k + 1:] if s is not None),
                      self.end.get("t", float("inf")))
            mine = [d for d in done if lo <= d.end < hi and d.client != "probe"]
            f["failed_requests"] = sum(d.outcome == "error" for d in mine)
            f["succeeded_requests"] = sum(d.outcome == "ok" for d in mine)
            f["errors"] = sorted({d.error.split(":")[0] for d in mine if d.outcome == "error"})
            f["torchrun_sigkills"] = sum(lo <= t - self.t0 < hi for t in escalations)
        first = next((s - self.t0 for s in starts if s is not None), float("inf"))
        before = [d for d in done if d.end < first and d.outcome == "error"
                  and d.client != "probe"]
        unexplained = list(self.unexplained)
        if before:
            unexplained.append({"fault": None, "detail": f"{len(before)} requests failed "
                                f"before any fault ({before[0].error})"})
        # a restart between one fault's recovery and the next fault
        for k in range(len(self.faults) - 1):
            a, b = self.faults[k], self.faults[k + 1]
            if "attempts_after" in a and b.get("attempts_before", 0) > a["attempts_after"]:
                unexplained.append({"fault": a["index"], "detail": (
                    f"an attempt ended after fault #{a['index']} had recovered and before "
                    f"fault #{b['index']}")})
        # the longest wait of every client (one-off clients by fault), and every open one
        longest: dict[str, dict[str, Any]] = {}
        now = time.monotonic()
        for d in done:
            key = d.client.split("-")[0]
            if d.longest_wait > longest.get(key, {}).get("wait_s", -1):
                longest[key] = {"client": key, "wait_s": round(d.longest_wait, 3),
                                "what": f"{d.what}, {d.outcome}", "t": round(d.start, 2)}
        for o in (load.open_requests() if load else []):
            w = max(o.longest, now - o.last)
            key = o.client.split("-")[0]
            if not partial and w > longest.get(key, {}).get("wait_s", -1):
                longest[key] = {"client": key, "wait_s": round(w, 3),
                                "what": f"{o.what}, still open at the end",
                                "t": round(o.start - self.t0, 2)}
        outcomes: dict[str, int] = {}
        for d in done:
            outcomes[d.outcome] = outcomes.get(d.outcome, 0) + 1
        horizon = int(max([d.end for d in done] + [0])) + 1
        return {
            "seed": self.seed,
            "minutes": self.args.minutes,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "backend": self.args.backend,
            "machine": _machine(),
            "bounds": {"detection_s": DETECTION_BOUND_S, "client_wait_s": CLIENT_WAIT_BOUND_S,
                       "recovery_s": RECOVERY_BOUND_S,
                       "survived_recovery_s": SURVIVED_RECOVERY_S,
                       "sigterm_s": SIGTERM_BOUND_S,
                       "collective_timeout_s": COLLECTIVE_TIMEOUT_S},
            "invariants": INVARIANTS,
            "max_restarts": getattr(self, "max_restarts", None),
            "first_ready_s": self.rel(getattr(self, "t_ready", None)),
            "notes": self.notes,
            "schedule": [f.to_json() for f in self.schedule],
            "faults": faults,
            "unexplained_restarts": unexplained,
            "requests": {
                "outcomes": outcomes,
                "wrong": list(load.wrong) if load else [],
                "longest_waits": sorted(longest.values(), key=lambda r: -r["wait_s"]),
            },
            "timeline": {
                "tokens_per_s": [load.tokens_by_s.get(s, 0) for s in range(horizon)]
                if load else [],
                "errors_per_s": [load.errors_by_s.get(s, 0) for s in range(horizon)]
                if load else [],
                "attempt_starts": [self.rel(t) for t in self.log.attempts()]
                if hasattr(self, "log") else [],
                "serving_again": [self.rel(t) for t in self.serving_again],
            },
            "end": self.end,
        }


def _machine() -> dict[str, str]:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    from importlib.metadata import version

    return {"cpu": model, "cores": str(os.cpu_count()), "python": platform.python_version(),
            "vllm": version("vllm"), "torch": version("torch"),
            "date": datetime.date.today().isoformat()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: "
                   "random, printed)")
    p.add_argument("--minutes", type=float, default=3.0,
                   help="how long the schedule runs, about, past the first start-up")
    p.add_argument("--kinds", default=",".join(__import__("chaos_schedule").KINDS),
                   help="the fault kinds to draw from, comma-separated")
    p.add_argument("--backend", default="keepalive", help="the executor: keepalive, or a "
                   "negative control's (tests/controls.py), e.g. controls.NoKeepalivesNoLiveness")
    p.add_argument("--model", default=None, help="the model (default: the tiny model of "
                   "scripts/tiny_model.py)")
    p.add_argument("--clients", type=int, default=4, help="background clients")
    p.add_argument("--pool", type=int, default=64, help="known requests to draw from")
    p.add_argument("--expected-texts", default=None, help="mp's answers (JSON, workload "
                   "index to text; default: the cached reference load_tp2)")
    p.add_argument("--json", default=None, help="write the record here")
    p.add_argument("--png", default=None, help="draw the timeline here")
    p.add_argument("--out", default=None, help="where the logs go (default: a temp dir)")
    p.add_argument("--stop-on-breach", action="store_true",
                   help="end the run at the first breach (the negative control)")
    p.add_argument("--print-schedule", action="store_true",
                   help="print the schedule and exit")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    schedule = make_schedule(seed, args.minutes, kinds)
    print(f"chaos: seed {seed} (replay: --seed {seed} --minutes {args.minutes:g}"
          f"{'' if args.kinds == p.get_default('kinds') else ' --kinds ' + args.kinds}); "
          f"{len(schedule)} faults:", flush=True)
    for f in schedule:
        print("  " + describe(f), flush=True)
    if args.print_schedule:
        return 0
    if args.model is None:
        from tiny_model import build_tiny_model

        args.model = str(build_tiny_model())
    chaos = Chaos(args, seed, schedule)
    try:
        rec = chaos.run()
    except BaseException:
        try:
            chaos.server.stop(timeout=10)
            chaos.orphans(kill=True)
        except Exception:  # noqa: BLE001 - the first error is the one to show
            pass
        raise
    verdict = judge(rec)
    rec["breaches"] = [b.__dict__ for b in verdict.breaches]
    rec["ok"] = verdict.ok
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
    if args.png:
        from chaos_plot import plot

        plot(rec, args.png)
    print(fault_table(rec["faults"]))
    waits = rec["requests"]["longest_waits"]
    print(f"requests: {rec['requests']['outcomes']}; longest wait "
          f"{waits[0]['wait_s'] if waits else '-'} s; end: {rec['end']}")
    for b in verdict.breaches:
        print(b.line(), flush=True)
    if verdict.ok:
        print(f"chaos: every invariant held (seed {seed})")
        return 0
    print(f"chaos: FAILED, invariants breached: {', '.join(verdict.names())} (seed {seed})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
