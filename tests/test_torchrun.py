"""torchrun mode against real torchrun agents, real vLLM servers, real clients.

One node: ``torchrun --nproc-per-node 2 -m keepalive_executor serve``. Several nodes: two
agents on this machine (``--nnodes 2 --nproc-per-node 1``), rendezvous on loopback; each
agent gets its own CPU binding, as each machine would.
"""

import signal
import subprocess
import time

import pytest
from netns import VethPair
from procs import left_after
from servers import Server, TorchrunServer, by_title
from test_serve import ask, texts

TIMEOUT = "5"  # --distributed-timeout-seconds; the keepalive interval is then 1.25 s
SIGTERM_EXIT = 1  # torchrun's code when it is stopped by SIGTERM (SignalException)
IDLE_S = 16.0  # more than three times the timeout
ARGS = ["--distributed-timeout-seconds", TIMEOUT]
# Node 1's only rank (local rank 0) takes CPU 1: vLLM indexes the list by local rank.
TWO_NODES = [{"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, {"VLLM_CPU_OMP_THREADS_BIND": "1|0"}]


def spawned_answers(model: str, tmp_path) -> dict:
    """The same questions to the executor-spawned mode (`vllm serve`), for comparison."""
    server = Server(model, tmp_path / "spawned.log", extra_args=ARGS)
    try:
        server.wait_ready()
        return ask(server.client())
    finally:
        server.stop()


def assert_stopped_by_sigterm(server: TorchrunServer, code: int | None) -> None:
    """Every agent left on the SIGTERM of ``server.stop()`` by itself, none needed SIGKILL,
    each with torchrun's code for a stop by signal."""
    print(f"torchrun agents after SIGTERM: codes {server.stop_codes}, SIGKILLed "
          f"{server.sigkilled}")
    assert server.sigkilled == [], server.logs()[-4000:]
    assert code == server.stop_codes[0]
    assert all(c == SIGTERM_EXIT for c in server.stop_codes), server.stop_codes


def wait_unhealthy(server: TorchrunServer, within: float) -> float:
    """Seconds until /health stops answering 200 (fails the test after ``within``)."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        if server.health() != 200:
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"still healthy {within}s after the fault:\n{server.logs()[-6000:]}")


@pytest.mark.slow
def test_one_node_serves_like_spawned_mode_survives_idle_and_stops(tiny_model, tmp_path):
    expected = spawned_answers(tiny_model, tmp_path)
    server = TorchrunServer(tiny_model, tmp_path, extra_args=ARGS)
    try:
        server.wait_ready()
        procs = server.tree()
        titles = sorted(p.name() for p in procs)
        assert any("KeepaliveWorker_TP1" in t for t in titles), titles
        client = server.client()
        before = ask(client)
        assert texts(before) == texts(expected)  # greedy answers equal the spawned mode's
        assert before["stream_chunks"] > 1
        time.sleep(IDLE_S)
        assert server.health() == 200
        assert texts(ask(client)) == texts(before)
        log = server.log()
        assert "keepalive torchrun mode: configuration published for ranks 1..1" in log
        assert "rank 1 of 2 (local rank 1) follows the driver" in log
        # SIGTERM to torchrun, as a job scheduler stops it: every rank exits, torchrun returns.
        t0 = time.monotonic()
        server.agents[0].send_signal(signal.SIGTERM)
        codes = server.wait_agents(60)
        took = time.monotonic() - t0
        left = left_after(procs, 10)
        log = server.log()
    finally:
        server.stop()
    assert codes[0] is not None, "torchrun did not return within 60 s of SIGTERM"
    assert left == [], f"processes left after torchrun returned: {left}"
    assert took < 30, took  # below torchrun's own 30 s SIGKILL escalation
    # Rank 1 stopped as asked, not as a failure: no error from its loop, no failure report.
    assert "keepalive worker rank 1 stops" not in log
    assert "ChildFailedError" not in log


@pytest.mark.slow
def test_one_node_negative_control_without_keepalive_the_follower_times_out(tiny_model, tmp_path):
    """Same launch and idle with the pacer off (test-only switch): the ranks must fail."""
    server = TorchrunServer(tiny_model, tmp_path, extra_args=ARGS,
                            extra_env={"_KEEPALIVE_EXECUTOR_TEST_ONLY_DISABLE_PACER": "1"})
    try:
        procs = server.tree()
        try:
            # Without the pacer the follower's wait runs from its last start-up call on, so
            # on a slow machine the server may already be going down here: also the failure.
            server.wait_ready()
            procs = server.tree()
        except AssertionError:
            pass
        codes = server.wait_agents(IDLE_S + 30)
        left = left_after(procs, 10)
        log = server.log()
    finally:
        server.stop()
    assert codes[0] not in (None, 0), f"torchrun still up or exited 0 without keepalives: {codes}"
    assert "Timed out waiting 5000ms" in log
    assert left == []


# What docs/torchrun.md claims: a frozen rank fails the server after more than the liveness
# timeout minus one beat (timeout/6: the last beat may have come up to one beat before the
# freeze) and within the timeout plus two beats (one poll to see the last beat, one to see
# the counter still past the timeout). 1.5 s on one node, 5 s across nodes (the defaults);
# the upper bound has 0.5 s more for /health to follow on a loaded 2-core machine
# (measured here: 1.65 to 1.84 s on one node, 4.83 to 6.01 s across the veth pair).
ONE_NODE_LIVENESS_S = 1.5
TWO_NODE_LIVENESS_S = 5.0


def liveness_window(timeout: float) -> tuple[float, float]:
    """(earliest, latest) seconds from the freeze to an unhealthy server."""
    beat = timeout / 6
    return timeout - beat, timeout + 2 * beat + 0.5


LIVENESS_BOUND_S = liveness_window(ONE_NODE_LIVENESS_S)[1]


@pytest.mark.slow
@pytest.mark.parametrize("liveness", [True, False], ids=["heartbeat", "negative-control"])
def test_one_node_a_frozen_rank1_is_noticed_by_its_heartbeat(tiny_model, tmp_path, liveness):
    """SIGSTOP: rank 1 neither answers nor closes its sockets, as a hung process or a lost
    node does, so no transport error reaches the driver (with NCCL not even a send fails).
    The heartbeat on torchrun's store notices; without it (test-only switch) nothing does
    for as long as the keepalive broadcast can wait (the 20 s collective timeout here)."""
    extra = {} if liveness else {"_KEEPALIVE_EXECUTOR_TEST_ONLY_DISABLE_LIVENESS": "1"}
    server = TorchrunServer(tiny_model, tmp_path, extra_args=[
        "--distributed-timeout-seconds", "20"], extra_env=extra)
    rank1 = None
    try:
        server.wait_ready()
        procs = server.tree()
        ask(server.client())
        [rank1] = by_title(server, "KeepaliveWorker_TP1")
        rank1.suspend()
        if liveness:
            unhealthy_after = wait_unhealthy(server, 30)
            print(f"SIGSTOP of rank 1 -> unhealthy after {unhealthy_after:.2f}s")
            log = server.log()
            earliest, latest = liveness_window(ONE_NODE_LIVENESS_S)
            assert earliest <= unhealthy_after < latest, unhealthy_after
            assert "rank 1 sent no heartbeat for" in log, log[-4000:]
            rank1.kill()
            codes = server.wait_agents(60)
            assert codes[0] not in (None, 0), codes
        else:
            time.sleep(LIVENESS_BOUND_S + 2)
            assert server.health() == 200  # nobody noticed the frozen rank
            rank1.kill()
    finally:
        if rank1 is not None and rank1.is_running():
            rank1.kill()
        server.stop()
    assert left_after(procs, 10) == []


@pytest.mark.slow
def test_one_node_engine_crash_ends_every_rank_and_torchrun(tiny_model, tmp_path):
    """Rank 0's engine process is killed outright: rank 1 loses the driver unasked and
    exits 1, torchrun stops what is left and returns non-zero, nothing is left behind."""
    server = TorchrunServer(tiny_model, tmp_path, extra_args=ARGS)
    try:
        server.wait_ready()
        procs = server.tree()
        ask(server.client())
        [engine] = by_title(server, "EngineCore")
        engine.kill()
        wait_unhealthy(server, 30)
        codes = server.wait_agents(60)
        left = left_after(procs, 10)
        log = server.log()
    finally:
        server.stop()
    assert codes[0] not in (None, 0), codes
    assert "keepalive worker rank 1 stops" in log  # it lost the driver without a stop request
    assert left == []


@pytest.mark.slow
def test_one_node_max_restarts_brings_the_server_back_after_rank1_dies(tiny_model, tmp_path):
    """torchrun --max-restarts 1: the whole world restarts on a fresh attempt and serves the
    same answers. (With the default 0, the same death fails torchrun: the test above.)"""
    server = TorchrunServer(tiny_model, tmp_path, extra_args=ARGS,
                            launch_args=["--max-restarts", "1"])
    try:
        server.wait_ready()
        before = ask(server.client())
        [rank1] = by_title(server, "KeepaliveWorker_TP1")
        rank1.kill()
        wait_unhealthy(server, 30)
        server.wait_ready(timeout=180)
        after = ask(server.client())
        log = server.log()
        procs = server.tree()
        code = server.stop()
        left = left_after(procs, 10)
    finally:
        server.stop()
    assert texts(after) == texts(before)
    # Attempt 1 met on its own keys (the store is torchrun's, kept across restarts).
    assert log.count("keepalive torchrun mode: configuration published") == 2
    assert_stopped_by_sigterm(server, code)
    assert left == []


@pytest.mark.parametrize("bad, message", [
    (["-tp", "1"], "torchrun started WORLD_SIZE=2 ranks but vLLM's configuration needs 1"),
    (["-tp", "2", "--distributed-executor-backend", "mp"],
     "under torchrun the executor is keepalive"),
])
def test_bad_launch_is_a_clear_error_on_every_rank(tiny_model, tmp_path, bad, message):
    server = TorchrunServer(tiny_model, tmp_path, extra_args=[*ARGS, *bad])
    # The last -tp wins in vLLM's parser, so "-tp 1" overrides the helper's "-tp 2".
    try:
        procs = server.tree()
        codes = server.wait_agents(120)
        left = left_after(procs, 10)
        log = server.log()
    finally:
        server.stop()
    assert codes[0] not in (None, 0), codes
    assert message in log
    assert "rank 1 not starting: rank 0 reported" in log  # the other rank says why, too
    assert "Starting to load model" not in log  # refused before any weights load
    assert left == []


@pytest.mark.slow
def test_two_nodes_serve_then_losing_node1_fails_the_server(tiny_model, tmp_path):
    """Two agents on loopback. (The idle period across two hosts is in the veth test.)"""
    server = TorchrunServer(tiny_model, tmp_path, nnodes=2, nproc=1, extra_args=ARGS,
                            node_env=TWO_NODES)
    try:
        server.wait_ready()
        procs = server.tree()
        client = server.client()
        before = ask(client)
        assert before["stream_chunks"] > 1
        assert texts(ask(client)) == texts(before)
        assert "rank 1 of 2 (local rank 0) follows the driver" in server.log(1)
        assert "bound to CPUs [1]" in server.log(1)
        # The second machine goes away: its agent is killed outright.
        server.agents[1].kill()
        unhealthy_after = wait_unhealthy(server, 30)
        print(f"node 1's agent SIGKILLed -> unhealthy after {unhealthy_after:.2f}s")
        codes = server.wait_agents(60)
        left = left_after(procs, 10)
        log0 = server.log(0)
    finally:
        server.stop()
    # measured 1.43 s: rank 1 dies with its agent (PDEATHSIG) and the driver's next keepalive
    # (every 1.25 s here) fails; the bound leaves room for a loaded machine
    assert unhealthy_after < 4.0, unhealthy_after
    assert codes[0] not in (None, 0), codes  # node 0's torchrun reports the failure
    assert "keepalive executor failed" in log0 and "rank 0 exits 1" in log0
    assert left == [], f"left after node 1 was lost: {left}"


@pytest.mark.slow
def test_two_nodes_stopping_the_driver_node_in_drain_mode_ends_node1_cleanly(tiny_model,
                                                                            tmp_path):
    """SIGTERM to node 0's agent only, drain mode: the driver's SHUTDOWN reaches node 1,
    whose rank exits 0, so node 1's torchrun returns 0 and nothing is left on either."""
    server = TorchrunServer(tiny_model, tmp_path, nnodes=2, nproc=1,
                            extra_args=[*ARGS, "--shutdown-timeout", "10"], node_env=TWO_NODES)
    try:
        server.wait_ready()
        procs = server.tree()
        assert ask(server.client())["completion"]
        server.agents[0].send_signal(signal.SIGTERM)
        codes = server.wait_agents(60)
        left = left_after(procs, 10)
        log1 = server.log(1)
    finally:
        server.stop()
    assert codes[1] == 0, (codes, log1[-4000:])
    assert "rank 1: SHUTDOWN from the driver" in log1
    assert left == []


@pytest.mark.slow
def test_two_nodes_c10d_rendezvous_serves(tiny_model, tmp_path):
    """torchrun's dynamic (c10d) rendezvous: rank 0, hence the server, may be on either."""
    server = TorchrunServer(tiny_model, tmp_path, nnodes=2, nproc=1, extra_args=ARGS,
                            node_env=TWO_NODES, rdzv="c10d")
    try:
        server.wait_ready()
        procs = server.tree()
        answers = ask(server.client())
        code = server.stop()
        left = left_after(procs, 10)
    finally:
        server.stop()
    assert answers["completion"] and answers["stream_chunks"] > 1
    assert_stopped_by_sigterm(server, code)
    assert left == []


@pytest.fixture
def second_host():
    """A network namespace as node 1's host; skipped where namespaces cannot be made."""
    pair = VethPair()
    try:
        pair.up()
    except (OSError, subprocess.CalledProcessError) as e:
        pair.down()
        msg = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"no network namespace for a second host (needs root, iproute2): {msg}")
    yield pair
    pair.down()


@pytest.mark.slow
def test_two_hosts_over_veth_one_pipeline_stage_each_serve_idle_then_losing_host1_fails(
        tiny_model, tmp_path, second_host):
    """TP inside a node, PP across nodes: one pipeline stage per "host", node 1 in its own
    network namespace, so the rendezvous, the channel and the last stage's outputs cross a
    veth link. Serve (the same answers as the spawned mode's PP), idle past the timeout, then
    node 1 freezes (its heartbeat stops), then its agent dies."""
    pair = second_host
    pp_args = [*ARGS, "--dtype", "float32"]
    # the reference first, alone: a cold start beside another on 2 cores can starve a rank
    # past the short timeout inside vLLM's own start-up collectives
    reference = Server(tiny_model, tmp_path / "spawned-pp.log", tp=1, pp=2, extra_args=pp_args)
    try:
        reference.wait_ready()
        expected = ask(reference.client())
    finally:
        reference.stop()
    server = TorchrunServer(
        tiny_model, tmp_path, nnodes=2, nproc=1, tp=1, pp=2, extra_args=pp_args,
        master_addr=pair.here_ip, node_prefix=[[], pair.prefix],
        node_env=[{**TWO_NODES[0], "GLOO_SOCKET_IFNAME": pair.here_if},
                  {**TWO_NODES[1], "GLOO_SOCKET_IFNAME": pair.there_if}])
    try:
        server.wait_ready()
        procs = server.tree()
        client = server.client()
        before = ask(client)
        assert texts(before) == texts(expected)
        assert before["stream_chunks"] > 1
        time.sleep(IDLE_S)
        assert server.health() == 200
        assert texts(ask(client)) == texts(before)
        log1 = server.log(1)
        assert f"follows the driver (torchrun's store at {pair.here_ip}:" in log1
        # node 1 freezes (no socket closes): its heartbeat across the link stops
        [rank1] = by_title(server, "KeepaliveWorker_PP1_TP0")
        rank1.suspend()
        unhealthy_after = wait_unhealthy(server, 30)
        print(f"two hosts: SIGSTOP of rank 1 -> unhealthy after {unhealthy_after:.2f}s")
        earliest, latest = liveness_window(TWO_NODE_LIVENESS_S)  # the multi-node default
        assert earliest <= unhealthy_after < latest, unhealthy_after
        assert "rank 1 sent no heartbeat for" in server.log(0)
        server.agents[1].kill()  # then node 1 goes away for good
        codes = server.wait_agents(60)
        left = left_after(procs, 10)
        log0 = server.log(0)
    finally:
        server.stop()
    assert codes[0] not in (None, 0), codes
    assert "keepalive executor failed" in log0
    assert left == []


@pytest.mark.slow
def test_one_node_pipeline_two_stages_serves_like_spawned_mode(tiny_model, tmp_path):
    """`torchrun --nproc-per-node 2 -m keepalive_executor serve -tp 1 -pp 2`: the same answers
    as the spawned mode's PP. (Idle under torchrun: the tests above; the reference starts
    only once the torchrun server is up: a cold start beside another on 2 cores can starve a
    rank past the short timeout inside vLLM's own start-up collectives.)"""
    pp_args = [*ARGS, "--dtype", "float32"]
    server = TorchrunServer(tiny_model, tmp_path, tp=1, pp=2, extra_args=pp_args)
    reference = None
    try:
        server.wait_ready()
        reference = Server(tiny_model, tmp_path / "spawned-pp.log", tp=1, pp=2,
                           extra_args=pp_args)
        reference.wait_ready()
        procs = server.tree()
        assert texts(ask(server.client())) == texts(ask(reference.client()))
        assert by_title(server, "KeepaliveWorker_PP1_TP0")
    finally:
        if reference is not None:
            reference.stop()
        code = server.stop()
    assert_stopped_by_sigterm(server, code)
    assert left_after(procs, 10) == []
