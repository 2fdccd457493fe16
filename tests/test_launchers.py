"""Serving under Slurm's srun and Open MPI's mpirun, as under torchrun.

The mapping of each launcher's variables to torchrun's (pure, ``fast``), rank 0's own store
on a real TCPStore, then real launches: a one-machine Slurm cluster (scripts/slurm_cluster.sh)
and ``srun --ntasks 2``, and ``mpirun -np 2``, each serving the tiny model: mp's answers, an
idle period of two collective timeouts, then rank 1 SIGKILLed ends the launcher non-zero with
nothing left; and a bad launch is a clear error on every rank.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import lanes
import psutil
import pytest
from launchers import LaunchedServer, mpirun_launch, require, slurm_cluster
from procs import left_after, name_of
from serve_scripts import LOAD_ARGS, ask, texts
from servers import free_port

from keepalive_executor.torchrun.bootstrap import host_store, load_secret
from keepalive_executor.torchrun.env import TorchrunEnv, TorchrunError, check_world_size
from keepalive_executor.torchrun.launchers import (
    PORT_BASE,
    PORT_SPAN,
    LaunchError,
    derived_port,
    expand_hostlist,
    expand_tasks_per_node,
    torchrun_variables,
)

fast = pytest.mark.fast
serial = pytest.mark.serial

# What `srun -n 2` set in each task on this machine's one-node cluster (rank 1's values; the
# run's own env dump, trimmed to what a rank reads), and what `mpirun -np 2` set.
SRUN_RANK1 = {
    "SLURM_JOB_ID": "1", "SLURM_JOBID": "1", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "vm",
    "SLURM_STEP_NODELIST": "vm", "SLURM_NNODES": "1",
}
MPIRUN_RANK1 = {
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_MCA_ess_base_jobid": "2031222785",
    "OMPI_MCA_orte_num_nodes": "1", "PMIX_RANK": "1",
}
# A batch script's shell (sbatch -n 2): SLURM_PROCID=0 but no job step.
SBATCH_SHELL = {"SLURM_JOB_ID": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2",
                "SLURM_JOB_NODELIST": "vm"}


# ---------------------------------------------------------------- Slurm's notations


HOSTLISTS = [
    ("vm", ["vm"]),
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a-b[1-2],x,node[1-3,5],n[9-11]",
     ["a-b1", "a-b2", "x", "node1", "node2", "node3", "node5", "n9", "n10", "n11"]),
]


@fast
@pytest.mark.parametrize(("expr", "hosts"), HOSTLISTS)
def test_node_lists_expand_as_slurm_writes_them(expr, hosts):
    assert expand_hostlist(expr) == hosts


@fast
def test_node_lists_expand_as_slurms_own_scontrol_does(tmp_path):
    """The same lists through `scontrol show hostnames` (Slurm's own parser; it reads a
    configuration but contacts no daemon)."""
    require("scontrol")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                    "PartitionName=p Nodes=localhost\n")
    for expr, _ in HOSTLISTS:
        out = subprocess.run(["scontrol", "show", "hostnames", expr], capture_output=True,
                             text=True, timeout=30, env={**os.environ, "SLURM_CONF": str(conf)})
        assert out.stdout.split() == expand_hostlist(expr), (expr, out.stderr)


@fast
@pytest.mark.parametrize("bad", ["node[3-1]", "node[a-b]", "node[1-", "", "a,,b[1"])
def test_unreadable_node_lists_are_refused_naming_them(bad):
    with pytest.raises(LaunchError, match="node list"):
        expand_hostlist(bad)


@fast
def test_tasks_per_node_expand_node_by_node():
    assert expand_tasks_per_node("2") == [2]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(LaunchError, match="tasks per node"):
        expand_tasks_per_node("2(3)")


@fast
def test_derived_ports_are_the_same_on_every_rank_and_below_the_ephemeral_range():
    ports = {derived_port(f"slurm-{job}.0") for job in range(2000)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN < 32768 for p in ports)
    assert len(ports) > 1500  # spread: two jobs rarely share one
    assert derived_port("slurm-7.0") == derived_port("slurm-7.0") != derived_port("slurm-7.1")


# ---------------------------------------------------------------- the mapping


@fast
def test_srun_one_node_reads_like_torchrun_with_rank_0_hosting_a_loopback_store():
    mapped = torchrun_variables(SRUN_RANK1)
    env = TorchrunEnv.from_environ({**SRUN_RANK1, **mapped})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (1, 1, 2, 2)
    assert env.one_node and env.hosts_store and env.launcher == "srun"
    assert env.master_addr == "127.0.0.1"  # one node: loopback, whatever the node's name
    assert env.master_port == derived_port("slurm-1.0")
    assert env.key("bootstrap") == "keepalive_executor/slurm-1.0/0/bootstrap"
    requeued = TorchrunEnv.from_environ(
        {**SRUN_RANK1, **torchrun_variables({**SRUN_RANK1, "SLURM_RESTART_COUNT": "3"})})
    assert requeued.key("bootstrap") == "keepalive_executor/slurm-1.0/3/bootstrap"


@fast
def test_srun_across_nodes_meets_at_the_first_host_and_needs_the_shared_secret():
    two_nodes = {**SRUN_RANK1, "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                 "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_NODES": "2",
                 "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
                 "SLURM_JOB_NODELIST": "gpu[07-08]"}
    env = TorchrunEnv.from_environ({**two_nodes, **torchrun_variables(two_nodes)})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert env.master_addr == "gpu07" and not env.one_node
    with pytest.raises(TorchrunError, match="several nodes.*VLLM_KEEPALIVE_SECRET"):
        load_secret(env, environ={})
    given = {**two_nodes, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}
    env = TorchrunEnv.from_environ({**given, **torchrun_variables(given)})
    assert env.address == "10.0.0.7:29511"


# rank 0 of `srun --nodes 2 --ntasks-per-node 1` on gpu07, with MASTER_ADDR left unset
SRUN_TWO_NODES_RANK0 = {**SRUN_RANK1, "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                        "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2",
                        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)",
                        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def _hosts_file(table):
    """socket's resolvers answering from TABLE (name -> address), as /etc/hosts would."""
    import socket

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], port or 0))]

    def gethostbyname(host):
        return getaddrinfo(host, None)[0][4][0]

    return getaddrinfo, gethostbyname


@fast
def test_srun_across_nodes_refuses_a_first_host_that_resolves_to_loopback(monkeypatch):
    """Debian's /etc/hosts maps a machine's own name to 127.0.1.1: on rank 0's node the first
    host of the node list, the store's address when MASTER_ADDR is unset, is then a loopback
    address, which rank 0's store would bind and no other node can reach (the remote ranks
    would time out on an error about reachability). Every rank that resolves it so refuses
    at once, naming MASTER_ADDR, and sets nothing to `lo` (gloo across nodes on loopback).
    The ranks are placed as the CLI places them: the mapping, then torchrun's variables,
    then gloo's interface."""
    import socket

    from keepalive_executor.torchrun.env import default_gloo_interface

    getaddrinfo, gethostbyname = _hosts_file({"gpu07": "127.0.1.1", "gpu08": "10.0.0.8"})
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostbyname", gethostbyname)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(LaunchError, match=r"MASTER_ADDR is not set.*first host gpu07 "
                                          r"resolves to 127\.0\.1\.1.*loopback.*set "
                                          r"MASTER_ADDR to rank 0's address"):
        mapped = torchrun_variables(SRUN_TWO_NODES_RANK0)
        default_gloo_interface(TorchrunEnv.from_environ({**SRUN_TWO_NODES_RANK0, **mapped}))
    assert "GLOO_SOCKET_IFNAME" not in os.environ


@fast
def test_the_first_hosts_address_is_asked_only_when_it_is_the_store_and_only_loopback_refused():
    """The resolver injected: 127.0.1.1 (and ::1) refused; a rank on another node, where the
    name resolves to the node's real address, meets at the name; a name that does not
    resolve here is left to the store's own error; MASTER_ADDR set, or one node, asks
    nothing."""
    asked = []

    def answering(addr):
        def resolve(host):
            asked.append(host)
            return addr
        return resolve

    for loopback in ("127.0.1.1", "::1"):
        with pytest.raises(LaunchError, match=f"resolves to {re.escape(loopback)} on this "
                                              "node.*set MASTER_ADDR"):
            torchrun_variables(SRUN_TWO_NODES_RANK0, resolve=answering(loopback))
    rank1 = {**SRUN_TWO_NODES_RANK0, "SLURM_PROCID": "1", "SLURM_NODEID": "1"}
    assert torchrun_variables(rank1, resolve=answering("10.0.0.7"))["MASTER_ADDR"] == "gpu07"
    assert torchrun_variables(rank1, resolve=answering(None))["MASTER_ADDR"] == "gpu07"
    assert asked == ["gpu07"] * 4
    given = {**SRUN_TWO_NODES_RANK0, "MASTER_ADDR": "10.0.0.7"}
    assert torchrun_variables(given, resolve=answering("127.0.1.1"))["MASTER_ADDR"] == "10.0.0.7"
    assert torchrun_variables(SRUN_RANK1, resolve=answering("127.0.1.1"))["MASTER_ADDR"] == \
        "127.0.0.1"  # one node: loopback by design
    assert asked == ["gpu07"] * 4


@fast
def test_mpirun_reads_like_torchrun_and_across_nodes_asks_for_master_addr():
    env = TorchrunEnv.from_environ({**MPIRUN_RANK1, **torchrun_variables(MPIRUN_RANK1)})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (1, 1, 2, 2)
    assert env.launcher == "mpirun" and env.hosts_store and env.master_addr == "127.0.0.1"
    assert env.master_port == derived_port("mpirun-2031222785")
    across = {**MPIRUN_RANK1, "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(LaunchError, match="several nodes and MASTER_ADDR is not set.*-x "
                                          "MASTER_ADDR"):
        torchrun_variables(across)
    mapped = torchrun_variables({**across, "MASTER_ADDR": "node1"})
    assert mapped["MASTER_ADDR"] == "node1" and mapped["LOCAL_WORLD_SIZE"] == "2"


@fast
def test_the_innermost_launcher_wins_and_a_batch_script_is_refused():
    # torchrun under srun (one agent per node): torchrun's variables, as they are
    torchrun = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "none"}
    assert torchrun_variables({**SRUN_RANK1, **torchrun}) == {}
    # mpirun inside a Slurm allocation: its daemons are a job step, its ranks are mpirun's
    inside = torchrun_variables({**SRUN_RANK1, "SLURM_PROCID": "0", **MPIRUN_RANK1})
    assert inside["RANK"] == "1" and inside["_KEEPALIVE_LAUNCHER"] == "mpirun"
    with pytest.raises(LaunchError, match="batch script, not a task of srun.*srun --ntasks"):
        torchrun_variables(SBATCH_SHELL)
    assert torchrun_variables({"PATH": "/bin"}) == {}  # no launcher: from_environ says so


@fast
def test_a_wrong_rank_count_names_the_launchers_own_option():
    class Parallel:
        data_parallel_size, world_size = 1, 1
        tensor_parallel_size, pipeline_parallel_size = 1, 1

    for env, hint in ((SRUN_RANK1, "give srun --ntasks 1"), (MPIRUN_RANK1, "mpirun -np 1")):
        with pytest.raises(Exception, match=r"started WORLD_SIZE=2 ranks .*" + re.escape(hint)):
            check_world_size(Parallel(), {**env, **torchrun_variables(env)})


# ---------------------------------------------------------------- rank 0's store


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@fast
def test_rank_0s_store_listens_on_loopback_only_and_a_taken_port_is_a_clear_error():
    from torch.distributed import TCPStore

    port = free_port()
    env = TorchrunEnv(rank=0, local_rank=0, world_size=2, master_addr="127.0.0.1",
                      master_port=port, local_world_size=2, launcher="srun")
    server = host_store(env)
    client = TCPStore("127.0.0.1", port, is_master=False,
                      timeout=datetime.timedelta(seconds=10))
    client.set("k", b"v")
    assert server.get("k") == b"v"
    assert _listening(port) == {"127.0.0.1"}  # torchrun's agent store: every interface
    with pytest.raises(TorchrunError, match="cannot host the rendezvous store at "
                       f"127.0.0.1:{port}.*set MASTER_PORT to a free port"):
        host_store(env)
    elsewhere = TorchrunEnv(rank=0, local_rank=0, world_size=2, master_addr="192.0.2.1",
                            master_port=free_port(), launcher="mpirun")
    with pytest.raises(TorchrunError, match="MASTER_ADDR must be an address of rank 0's own"):
        host_store(elsewhere)


# ---------------------------------------------------------------- real launches

TIMEOUT = "5"  # --distributed-timeout-seconds; the keepalive interval is then 1.25 s
IDLE_S = 10.0  # two timeouts
ARGS = ["--distributed-timeout-seconds", TIMEOUT]
#: from rank 1's SIGKILL to the launcher's exit: the liveness timeout (1.5 s on one node)
#: plus vLLM's shutdown of its front end, on a loaded 2-core machine
KILL_TO_EXIT_S = 10.0


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def _launch(name: str, request, extra: list[str] | None = None) -> tuple[list[str], dict]:
    if name == "srun":
        return ["srun", "--ntasks", "2", "--kill-on-bad-exit=1", *(extra or [])], \
            request.getfixturevalue("slurm")
    return mpirun_launch(2), {}


@pytest.mark.overlappable
@pytest.mark.slow
@serial
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_serves_like_mp_survives_idle_and_a_killed_rank_1_ends_the_job(
        launcher, request, tiny_model, tmp_path, reference):
    """mp's answers, an idle period of two collective timeouts and the same answers after it,
    rank 0's store on loopback only; then rank 1 is SIGKILLed: the launcher exits non-zero
    within KILL_TO_EXIT_S, and no rank, engine or job step is left."""
    launch, extra_env = _launch(launcher, request)
    server = LaunchedServer(tiny_model, tmp_path / f"{launcher}.log", launch,
                            extra_args=[*ARGS, *LOAD_ARGS], extra_env=extra_env)
    try:
        server.wait_ready()
        log = server.log()
        assert ("keepalive torchrun mode: configuration published for ranks 1..1 (one node, "
                "heartbeat liveness timeout 1.5s)") in log
        assert "rank 1 of 2 (local rank 1) follows the driver" in log
        port = int(re.search(r"joining the process groups at torchrun://127\.0\.0\.1:(\d+):",
                             log).group(1))
        assert _listening(port) == {"127.0.0.1"}, _listening(port)
        client = server.client()
        before = ask(client)
        assert texts(before) == reference("serve_tp2")  # mp's greedy answers
        lanes.idle(IDLE_S)
        assert server.health() == 200
        assert texts(ask(client)) == texts(before)
        procs = server.tree()
        with lanes.alone():  # the kill and the exit bound
            [rank1] = [p for p in procs if "KeepaliveWorker_TP1" in name_of(p)]
            killed_at = time.monotonic()
            rank1.kill()
            code = server.proc.wait(60)
            took = time.monotonic() - killed_at
            print(f"{launcher}: rank 1 SIGKILLed -> {launcher} exited {code} after {took:.2f}s")
            left = left_after(procs, 10)
            steps = [p.pid for p in server.step_daemons() if p.is_running()]
    finally:
        server.stop()
    assert code != 0, server.log()[-4000:]
    assert took < KILL_TO_EXIT_S, took
    assert left == [] and steps == [] and server.leftovers == [], (left, steps)


BAD = ["-tp", "1", "--distributed-timeout-seconds", "60"]


@pytest.mark.slow
@serial
@pytest.mark.overlappable
def test_a_bad_launch_is_a_clear_error_on_every_rank(request, tiny_model, tmp_path):
    """-tp 1 under two ranks, through both launchers at once: each refused before any weight
    loads, rank 0 naming the launcher's own option and rank 1 repeating rank 0's reason; the
    launchers exit non-zero with nothing left. No time bound: overlappable (tests/lanes.py),
    as torchrun's own bad launches run in phase 1 beside other tests."""
    launches = {name: _launch(name, request) for name in ("srun", "mpirun")}
    servers = {name: LaunchedServer(tiny_model, tmp_path / f"bad-{name}.log", launch,
                                    extra_args=BAD, extra_env=extra_env)
               for name, (launch, extra_env) in launches.items()}
    outcomes = {}
    try:
        for name, server in servers.items():
            code = server.proc.wait(180)
            procs = server.tree()
            outcomes[name] = (code, left_after(procs, 10), server.log())
    finally:
        for server in servers.values():
            server.stop()
    for name, hint in (("srun", "give srun --ntasks 1"), ("mpirun", "give mpirun -np 1")):
        code, left, log = outcomes[name]
        assert code not in (None, 0), (name, code)
        assert f"{name} started WORLD_SIZE=2 ranks but vLLM's configuration needs 1" in log, log
        assert hint in log
        assert "rank 1 not starting: rank 0 reported" in log, log[-4000:]
        assert "Starting to load model" not in log
        assert left == [], (name, left)


@fast
def test_serving_from_a_batch_script_without_srun_is_a_usage_error(tmp_path):
    """What a user gets who runs the command in an sbatch script's own shell (not a job
    step): exit 2 and how to start it, before anything imports vLLM."""
    proc = subprocess.run([sys.executable, "-m", "keepalive_executor", "serve", "m"],
                          env={"PATH": os.environ["PATH"], **SBATCH_SHELL},
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 2, proc.stderr
    assert "batch script, not a task of srun" in proc.stderr

