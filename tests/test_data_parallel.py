"""Data parallelism: `vllm serve -dp 2 -tp 2` and `-dp 2 -tp 1` with the keepalive backend
answer as vLLM's mp does at the same -dp/-tp (tests/dp_scripts.py, the mp side cached in
tests/references/), a replica idle for two collective timeouts while the other is busy stays
alive, and a rank of one replica killed under load ends the server as it does under mp. A
mixture-of-experts model (one torch world across the replicas, DP waves) answers as mp does
through a wave and idle periods, and its negative control (the same without keepalives)
fails. That one control serves both idle checks: a dense replica's executor is an ordinary
TP=2 executor whose engine core is idle, the very scenario of test_serve.py's control, and
the MoE server is the one where replicas interact. Offline LLM(data_parallel_size=2) is
refused by vLLM itself. (The refusals in the front end and in torchrun mode:
test_bad_config.py, test_config.py, test_torchrun*.py.)"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import lanes
import pytest
from dp_scripts import (
    dp_server,
    kill_replica_rank,
    replica_rank,
    requests_per_engine,
    wave,
    wave_requests,
)
from procs import left_after
from servers import Server, assert_control_failed, env
from test_metrics import scrape
from test_metrics import value as sample

#: the collective timeout of the idle tests, and the idle period: two timeouts (a rank whose
#: last broadcast came before it would have timed out a full timeout ago)
TIMEOUT = 5
IDLE_S = 2 * TIMEOUT
#: the start of 8 streams whose first step SIGKILLs replica 1's rank 1 -> the server process
#: gone. mp and keepalive both end the whole server (the engine core fails, the API server
#: follows); the bound leaves room for a loaded machine and fails on a hang
EXIT_BOUND_S = 15.0


def pinned(server: Server, replica: int, reqs: list[dict]) -> dict[str, str]:
    """Each request's greedy text from replica REPLICA (vLLM's X-data-parallel-rank header),
    one at a time."""
    client = server.client()
    out = {}
    for r in reqs:
        c = client.completions.create(
            model="tiny", prompt=r["prompt"], max_tokens=r["max_tokens"], temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers={"X-data-parallel-rank": str(replica)})
        out[str(r["i"])] = c.choices[0].text
    return out


def keep_busy(server: Server, replica: int, stop: threading.Event, done: list) -> threading.Thread:
    """Requests to REPLICA back to back until STOP; DONE collects each one's outcome."""
    def run() -> None:
        client = server.client()
        while not stop.is_set():
            try:
                client.completions.create(
                    model="tiny", prompt="The quick brown fox", max_tokens=32, temperature=0,
                    extra_body={"ignore_eos": True},
                    extra_headers={"X-data-parallel-rank": str(replica)})
                done.append("ok")
            except Exception as e:  # noqa: BLE001 - the control's failure is an outcome
                done.append(f"{type(e).__name__}")
                time.sleep(0.5)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.overlappable
@pytest.mark.slow
@pytest.mark.serial
def test_dp2_tp2_answers_like_mp_idle_replica_survives_dead_rank_ends_server_as_mp(
        tiny_model, tmp_path, reference):
    ref = reference("dp2_tp2_mp")
    timeout_args = ["--distributed-timeout-seconds", str(TIMEOUT)]
    ka = dp_server(tiny_model, tmp_path / "ka.log", "keepalive", 2, 2, tmp_path / "faults",
                   extra_args=timeout_args)
    try:
        ka.wait_ready()
        tree = ka.tree()
        # each replica's engine core has its own rank 1 (rank 0 is in the engine core)
        ranks1 = [replica_rank(ka, i, "KeepaliveWorker_TP1") for i in (0, 1)]
        assert ranks1[0].pid != ranks1[1].pid
        assert wave(ka) == ref["answers"]
        assert ref["engines_served"] == ["0", "1"]
        served = requests_per_engine(ka)
        assert set(served) == {"0", "1"} and min(served.values()) > 0, served
        # /metrics (vLLM's multiprocess mode: two API servers): each replica's executor
        # under its own engine label, its steps its own
        found = scrape(ka.base_url)
        for engine in ("0", "1"):
            assert sample(found, "vllm_keepalive_executor_state", engine=engine,
                          state="running") == 1
            assert [sample(found, "vllm_keepalive_rank_up", engine=engine, rank=r)
                    for r in "01"] == [1, 1]
            assert sample(found, "vllm_keepalive_steps_total", engine=engine,
                          kind="execute") > 0

        # replica 0 busy, replica 1 idle, for two collective timeouts
        stop = threading.Event()
        busy: list = []
        loader = keep_busy(ka, 0, stop, busy)
        lanes.idle(IDLE_S)
        stop.set()
        loader.join(60)
        assert busy and set(busy) == {"ok"}, busy[-5:]
        assert ka.health() == 200
        first = wave_requests(16)
        assert pinned(ka, 1, first) == {k: ref["answers"][k] for k in (str(r["i"]) for r in first)}

        # replica 1's rank 1 killed in the first step of 8 streams: the same outcome as mp's
        with lanes.alone():  # the kill and the exit bound
            killed = kill_replica_rank(ka, "KeepaliveWorker_TP1", tmp_path / "faults")
            timings = {k: killed.pop(k) for k in ("last_client_s", "exit_s")}
            mp_killed = dict(ref["kill_replica1_rank1"])
            # the one difference from mp, on purpose: `vllm serve` says its executor failed
            # (supervision.py); mp's exits 0 after the same death
            assert (killed.pop("exit_code"), mp_killed.pop("exit_code")) == (1, 0)
            assert killed == mp_killed, (killed, mp_killed)
            assert killed["clients"] == ["error"] and killed["server_exited"], killed
            assert timings["exit_s"] < EXIT_BOUND_S, timings
            log = ka.log()
            assert "worker rank 1" in log and "died unexpectedly" in log, log[-3000:]
    finally:
        ka.stop()
    assert left_after(tree, 10) == []


@pytest.mark.slow
def test_dp2_tp1_answers_like_mp(tiny_model, tmp_path, reference):
    """Two replicas of one rank each: each engine core holds its rank in-process."""
    ref = reference("dp2_tp1_mp")
    ka = dp_server(tiny_model, tmp_path / "ka.log", "keepalive", 2, 1, tmp_path / "faults")
    try:
        ka.wait_ready()
        tree = ka.tree()
        assert wave(ka) == ref["answers"]
        served = requests_per_engine(ka)
        assert ref["engines_served"] == ["0", "1"]
        assert set(served) == {"0", "1"} and min(served.values()) > 0, served
        log = ka.log()
        for i in (0, 1):  # each replica's engine core built a keepalive executor
            assert f"(EngineCore_DP{i} pid=" in log and any(
                line.startswith(f"(EngineCore_DP{i} ") and "keepalive executor: transport=" in line
                for line in log.splitlines()), log[-3000:]
    finally:
        ka.stop()
    assert not ka.leftovers and left_after(tree, 10) == []


def test_offline_llm_with_data_parallelism_is_refused_by_vllm(tiny_model):
    """vLLM's LLM refuses data_parallel_size > 1 for every backend but external_launcher,
    before any engine starts: for mp and for keepalive alike, with its own message."""
    code = (
        "import sys\n"
        "from vllm import LLM\n"
        "for backend in ('mp', 'keepalive'):\n"
        "    try:\n"
        "        LLM(sys.argv[1], data_parallel_size=2, distributed_executor_backend=backend,\n"
        "            enforce_eager=True)\n"
        "        print(backend, 'ACCEPTED')\n"
        "    except ValueError as e:\n"
        "        print(backend, 'REFUSED', e)\n")
    proc = subprocess.run([sys.executable, "-c", code, tiny_model], env=env(),
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("mp ", "keepalive "))]
    assert len(lines) == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    for line in lines:
        assert "REFUSED LLM(data_parallel_size=2) is not supported for single-process" in line


@pytest.mark.slow  # not serial: no time bound, and its 5 s bound serving, not start-up
def test_moe_dp2_tp2_answers_like_mp_through_a_dp_wave_and_idle_periods(
        tiny_model, tmp_path, reference):
    """A mixture-of-experts model (tests/tiny_moe.py): vLLM runs its replicas in one torch
    world of 4 ranks with collectives between them every step, and keepalive makes each
    replica's channel and reply groups replica-local groups inside it. Both executors run on
    tests/cpu_moe_dp's stand-in for the gather/scatter vLLM's CPU build lacks.

    Answers equal mp's. Replica 0 busy for two collective timeouts while replica 1 has no
    request is a DP wave: replica 1 runs a dummy batch every step, sent on its own channel (had
    one not reached its rank 1, replica 0's step would hang in the expert collectives, which
    span the replicas). Then every replica idle for two timeouts, then both answer as
    before. Negative control, on the same server (tests/controls.py's KeepalivesUntilArmed:
    the keepalive executor until the test arms it, then the same without keepalives): after
    the checks above, its keepalives stop, and the next idle of two timeouts fails it (a
    second 4-rank server would cost about a minute of start-up). It runs beside other tests:
    the 5 s timeout bounds serving only, its start-up collectives (the one world's rendezvous
    across replicas included, which once timed out here at 5 s with two such servers starting
    at once) run under the start-up timeout (startup_timeouts.py)."""
    ref = reference("moe_dp2_tp2_mp")
    assert ref["engines_served"] == ["0", "1"]
    timeout_args = ["--distributed-timeout-seconds", str(TIMEOUT)]
    faults = tmp_path / "faults-keepalive"
    ka = dp_server(tiny_model, tmp_path / "keepalive.log", "controls.KeepalivesUntilArmed",
                   2, 2, faults, extra_args=timeout_args, moe=True)
    try:
        ka.wait_ready()
        tree = ka.tree()
        assert wave(ka) == ref["answers"]
        served = requests_per_engine(ka)
        assert set(served) == {"0", "1"} and min(served.values()) > 0, served
        stop = threading.Event()
        busy: list = []
        loader = keep_busy(ka, 0, stop, busy)
        time.sleep(IDLE_S)
        stop.set()
        loader.join(60)
        assert busy and set(busy) == {"ok"}, busy[-5:]
        time.sleep(IDLE_S)  # every replica idle
        assert ka.health() == 200
        first = wave_requests(8)
        expected = {k: ref["answers"][k] for k in (str(r["i"]) for r in first)}
        assert pinned(ka, 0, first) == expected
        assert pinned(ka, 1, first) == expected

        # the negative control: the same server, its keepalives stopped, idle again
        (faults / "stop_keepalives").write_text("1")
        time.sleep(2 * TIMEOUT)  # idle: its ranks' waits time out
        log = ka.log()
        assert log.count("keepalives stopped") == 2, log[-3000:]  # both replicas' executors
        assert_control_failed(ka, lambda: pinned(ka, 1, first[:1]))
    finally:
        ka.stop()
    assert left_after(tree, 10) == []


def test_replica_ranks_follow_vllms_numbering_of_a_world_across_replicas():
    """vLLM's init_distributed_environment gives replica r the global ranks r*world_size ...
    (world_size = tp x pp) when the world spans replicas; otherwise there is nothing to split."""
    from types import SimpleNamespace

    from keepalive_executor.groups import replica_ranks

    assert replica_ranks(None) == []
    assert replica_ranks(SimpleNamespace(data_parallel_size=1, world_size=4)) == []
    assert replica_ranks(SimpleNamespace(data_parallel_size=2, world_size=2)) == [[0, 1], [2, 3]]
    assert replica_ranks(SimpleNamespace(data_parallel_size=3, world_size=1)) == [[0], [1], [2]]
