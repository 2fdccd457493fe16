"""`vllm serve ... --distributed-executor-backend keepalive` as a real server, real clients. One
server serves every scenario of this module, in file order, the one that ends it last: mp's
answers, an idle period and an engine loop stalled outside any step (both several collective
timeouts long), a load with disconnects, then a worker killed while idle, after which `vllm
serve` exits 1. The negative control (no pacer, no failure record) dies of the idle, and its
`vllm serve` exits 0, as under mp. A clean shutdown by signal: tests/test_faults.py."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator

import lanes
import psutil
import pytest
from procs import left_after
from run_engine import HERE
from serve_scripts import LOAD_ARGS, ask, run_wave, texts, workload
from servers import Server, assert_control_failed, by_title
from test_faults import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.serial]

TIMEOUT = "5"  # --distributed-timeout-seconds: the device group's timeout (default transport)
IDLE_S = 10.0  # two timeouts: without keepalives rank 1 would have timed out a timeout ago
STALL_S = "10"  # two timeouts, in the engine loop, outside any step
# Worker SIGKILL while idle -> /health fails: README's "at once". Observed 0.16 s (the
# sentinel monitor fires at once; this module runs alone, marked serial); fails on anything
# like a grace period or a health-check poll.
IDLE_DETECT_BOUND_S = 1.0
DETECT_BOUND_S = 15.0  # then vLLM's own shutdown after unhealthy


def _server(tiny_model: str, tmp_path, name: str, backend: str = "keepalive") -> Server:
    faults = tmp_path / f"faults-{name}"
    faults.mkdir()
    server = Server(tiny_model, tmp_path / f"{name}.log", backend=backend, extra_args=[
        "--distributed-timeout-seconds", TIMEOUT,
        "--scheduler-cls", "fault_injection.StallingScheduler", *LOAD_ARGS], extra_env={
        "KEEPALIVE_FAULT_DIR": str(faults),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])})
    server.fault_dir = faults
    return server


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """The keepalive server, and the negative control beside it: the same without the pacer
    and the failure record (controls.NoKeepalivesNoSupervision), both started at once
    (their start-up collectives run under the start-up timeout, not the 5 s:
    startup_timeouts.py)."""
    from concurrent.futures import ThreadPoolExecutor

    tmp_path = tmp_path_factory.mktemp("serve")
    started: dict[str, Server] = {}
    trees: list[psutil.Process] = []
    try:
        started["keepalive"] = _server(tiny_model, tmp_path, "serve")
        started["control"] = _server(tiny_model, tmp_path, "serve-nopacer",
                                     "controls.NoKeepalivesNoSupervision")
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(Server.wait_ready, started.values()))
        trees = [p for s in started.values() for p in s.tree()]
        yield started
    finally:
        for server in started.values():
            server.stop()
    assert left_after(trees, 10) == []


@pytest.mark.overlappable
def test_answers_like_mp_survive_idle_and_a_stalled_loop_negative_control_dies(servers,
                                                                              reference):
    """Both servers idle for the same two collective timeouts: keepalive's answers are mp's
    before and after, and it survives its engine loop stalling for two timeouts
    outside any step (a slow scheduler); the negative control must fail. Both an idle engine
    and a stalled one leave the workers without any broadcast but the pacer's, so one
    control shows what the pacer does for both."""
    server, control = servers["keepalive"], servers["control"]
    client = server.client()
    before = ask(client)
    assert texts(before) == reference("serve_tp2")  # mp's answers to the same questions
    assert before["stream_chunks"] > 1
    try:
        # Without the pacer the worker's wait has been running since start-up, so on a slow
        # machine even this first request may already find it dead: also a failure of the
        # same scenario.
        ask(control.client())
    except Exception:  # noqa: BLE001
        pass
    lanes.idle(IDLE_S)
    assert server.health() == 200
    assert texts(ask(client)) == texts(before)
    assert "keepalive executor: transport=device, interval=1.25s" in server.log()
    # the engine loop stalls in its next schedule(), outside any step; the request that woke
    # it is answered after the stall, the same answer
    (server.fault_dir / "stall_schedule").write_text(STALL_S)
    answers: dict = {}
    asking = threading.Thread(target=lambda: answers.update(after=ask(client)))
    t0 = time.monotonic()
    asking.start()
    asking.join(120)
    assert not (server.fault_dir / "stall_schedule").exists(), "the stall never fired"
    assert time.monotonic() - t0 >= float(STALL_S)
    assert texts(answers["after"]) == texts(before)
    assert server.health() == 200
    # the control failed for the reason under test: rank 1's idle wait on the channel timed
    # out (gloo's own message, on the line naming the wait), and the request got an error
    assert_control_failed(control, lambda: ask(control.client()))


def metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        body = r.read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*\}} (\S+)$", body, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


#: what the wave delivered (engine outputs the front end processed, requests it finished)
DELIVERY_METRICS = ("vllm:generation_tokens_total", "vllm:request_success_total")


#: a disconnecting client asks for this many tokens, its prompt cut to ABORT_WORDS words (at
#: most 22 tokens, inside --max-model-len 256), so its abort has about 200 engine steps after
#: its second chunk to land before it finishes: a margin no scheduling delay of the front end
#: or of the client on a loaded machine comes near. (With serve_scripts.workload's 4 to 64
#: tokens a CI run saw disconnected requests finish first.) Only the requests that are not
#: aborted are compared with mp, so the reference (serve_scripts.load_answers) is unchanged.
ABORT_MAX_TOKENS, ABORT_WORDS = 200, 8


def load_requests() -> list[dict]:
    """serve_scripts.workload, each disconnecting client asking for ABORT_MAX_TOKENS."""
    return [dict(r, prompt=" ".join(r["prompt"].split()[:ABORT_WORDS]),
                 max_tokens=ABORT_MAX_TOKENS) if r["abort"] else r for r in workload()]


def assert_disconnects_were_aborts(server: Server, reqs: list[dict], before: dict) -> None:
    """The clients that went away were aborted in the engine: every request runs with
    ignore_eos, so a completed one generated exactly its max_tokens, and a disconnected one
    that was not aborted would have too (and would count as a success). What the
    disconnected ones got instead is a few tokens each, before their abort landed."""
    after = {name: metric(server.base_url, name) for name in DELIVERY_METRICS}
    generated, succeeded = (after[n] - before[n] for n in DELIVERY_METRICS)
    left = [r for r in reqs if r["abort"]]
    full = sum(r["max_tokens"] for r in reqs if not r["abort"])
    if_not_aborted = sum(r["max_tokens"] for r in left)
    # a disconnected request is cut after two chunks: a few tokens before its abort lands;
    # not aborted, all 5000 tokens of the 25 would have been generated
    assert generated - full < if_not_aborted / 2, (generated, full, if_not_aborted)
    # and none of them finished: only the requests that were not cut succeeded
    assert succeeded == len(reqs) - len(left), (succeeded, len(reqs) - len(left))


@pytest.mark.overlappable
def test_load_with_disconnects_frees_everything_and_matches_mp(servers, reference):
    """256 streaming requests at concurrency 32, prompts of 2 to 60 words, 4 to 64 output
    tokens, every tenth client asking for ABORT_MAX_TOKENS and closing its stream after two
    chunks (load_requests): the server stays
    healthy, the aborted requests give back their slots and KV blocks, a second wave
    completes, and every completed greedy answer is mp's to the same request
    (serve_scripts.load_answers, float32 on both sides)."""
    server = servers["keepalive"]
    reqs = load_requests()
    before = {name: metric(server.base_url, name) for name in DELIVERY_METRICS}
    done = asyncio.run(run_wave(server.base_url, reqs))
    assert server.health() == 200
    assert_disconnects_were_aborts(server, reqs, before)
    assert metric(server.base_url, "vllm:num_requests_running") == 0
    assert metric(server.base_url, "vllm:num_requests_waiting") == 0
    assert metric(server.base_url, "vllm:kv_cache_usage_perc") == 0
    second = asyncio.run(run_wave(server.base_url, [dict(r, abort=False) for r in workload()[:32]]))
    assert len(second) == 32
    expected = [r for r in reqs if not r["abort"]]
    assert sorted(done) == [r["i"] for r in expected]
    ref = {int(i): text for i, text in reference("load_tp2").items()}
    assert sorted(ref) == sorted(done)
    mismatches = [i for i in done if done[i] != ref[i]]
    assert mismatches == [], f"{len(mismatches)} answers differ from mp: {mismatches[:10]}"


def test_worker_killed_while_idle_fails_the_server_at_once(servers):
    """Last: it ends the server. Before the kill, what the tree listens on."""
    server = servers["keepalive"]
    tree = server.tree()
    [worker] = by_title(server, "KeepaliveWorker_TP1")
    [engine] = by_title(server, "EngineCore")
    # security: nothing of the tree listens beyond loopback, and the ranks rendezvous through
    # the file store the docs promise, not a TCP store on loopback: gloo keeps one listening
    # socket per process group on each rank, and both ranks are in the same groups, so rank
    # 0's process (the engine core) listens on exactly as many sockets as rank 1's; a TCP
    # store, hosted by rank 0, would be one more there
    listening = {p.pid: [c.laddr for c in p.net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN] for p in tree}
    for p in tree:
        assert all(a.ip in ("127.0.0.1", "::1") for a in listening[p.pid]), \
            (p.name(), listening[p.pid])
    assert listening[worker.pid], "rank 1 listens on nothing: no gloo listener to compare"
    assert len(listening[engine.pid]) == len(listening[worker.pid]), listening
    worker.kill()
    took = wait_until(lambda: server.proc.poll() is not None or server.health() != 200,
                       IDLE_DETECT_BOUND_S)
    assert took is not None, f"server still healthy {IDLE_DETECT_BOUND_S}s after a worker died"
    # vLLM's API server then shuts itself down, and `vllm serve` exits 1 (0 under mp and
    # under the control, below): a supervisor's Restart=on-failure restarts it
    assert server.proc.wait(DETECT_BOUND_S) == 1
    assert "keepalive executor failed (worker rank 1" in server.log()
    assert "exiting with status 1" in server.log()
    assert "worker rank 1" in server.log() and "died unexpectedly" in server.log()
    assert left_after(tree, 10) == []


def test_the_control_that_died_of_its_idle_exits_0_as_under_mp(servers):
    """The negative control of the exit status: its executor failed (the idle, above), and
    without the failure record its `vllm serve` exits 0, as vLLM's front end does after any
    engine death."""
    control = servers["control"]
    code = control.proc.wait(DETECT_BOUND_S)
    assert "keepalive executor failed:" in control.log()
    assert code == 0
