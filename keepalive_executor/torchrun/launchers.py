"""Where each launcher keeps a rank's numbers: torchrun, Slurm's ``srun``, Open MPI's ``mpirun``.

The rest of the external-launcher mode (bootstrap, liveness, the executor's ranks) reads one
set of variables, torchrun's. A rank started by another launcher gets them from
:func:`torchrun_variables`, a pure mapping of that launcher's own variables, before anything
else runs; the launchers then differ only in where the numbers come from, and in who hosts
the store (torchrun's agent; otherwise rank 0, see
:func:`keepalive_executor.torchrun.bootstrap.host_store`)::

    variable          torchrun (as is)    srun                       mpirun (Open MPI)
    RANK              RANK                SLURM_PROCID               OMPI_COMM_WORLD_RANK
    WORLD_SIZE        WORLD_SIZE          SLURM_STEP_NUM_TASKS       OMPI_COMM_WORLD_SIZE
                                          (else SLURM_NTASKS)
    LOCAL_RANK        LOCAL_RANK          SLURM_LOCALID              ..._LOCAL_RANK
    LOCAL_WORLD_SIZE  LOCAL_WORLD_SIZE    this node's entry of       ..._LOCAL_SIZE
                                          SLURM_STEP_TASKS_PER_NODE
    MASTER_ADDR       MASTER_ADDR         MASTER_ADDR if set; one    MASTER_ADDR if set; one
                                          node: 127.0.0.1; else the  node: 127.0.0.1; else
                                          first host of              required
                                          SLURM_STEP_NODELIST
                                          (refused if loopback)
    MASTER_PORT       MASTER_PORT         MASTER_PORT if set, else   MASTER_PORT if set, else
                                          derived from job and step  derived from the job id
    run id, attempt   TORCHELASTIC_RUN_ID slurm-<job>.<step>,        mpirun-<job id>, 0
                      .._RESTART_COUNT    SLURM_RESTART_COUNT
    store hosted by   torchrun's agent    rank 0                     rank 0

Several nodes under srun without MASTER_ADDR: the first host's name is resolved where each
rank runs, and a loopback answer is refused naming MASTER_ADDR. Debian's ``/etc/hosts`` maps a
machine's own name to ``127.0.1.1``: rank 0 would bind its store there, out of the other
nodes' reach, and keep gloo on loopback, and the remote ranks would only time out.

Which launcher: torchrun's variables first (torchrun may itself run under srun or mpirun),
then Open MPI's (``mpirun`` inside a Slurm allocation starts its daemons with srun), then a
Slurm job step's (``SLURM_STEP_ID``: a batch script's own shell has ``SLURM_PROCID=0`` too,
but is no step, and serving from it would wait for ranks that never start).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import zlib
from collections.abc import Callable, Mapping

__all__ = [
    "ENV_LAUNCHER",
    "ENV_RUN_ID",
    "ENV_RESTART_COUNT",
    "TORCHRUN",
    "SRUN",
    "MPIRUN",
    "LaunchError",
    "expand_hostlist",
    "expand_tasks_per_node",
    "derived_port",
    "resolve_host",
    "torchrun_variables",
]

#: Which launcher started this rank, as :func:`torchrun_variables` found it (unset: torchrun).
ENV_LAUNCHER = "_KEEPALIVE_LAUNCHER"
#: The run id and attempt the store keys are scoped by, for launchers other than torchrun.
ENV_RUN_ID = "_KEEPALIVE_RUN_ID"
ENV_RESTART_COUNT = "_KEEPALIVE_RESTART_COUNT"
TORCHRUN, SRUN, MPIRUN = "torchrun", "srun", "mpirun"
#: Derived rendezvous ports: below Linux's ephemeral range (32768-60999), above most services.
PORT_BASE, PORT_SPAN = 20000, 10000
_TORCHRUN_MARKS = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE")


class LaunchError(RuntimeError):
    """The launcher's variables cannot place this rank: the message says which and how to fix."""


# ---------------------------------------------------------------------- Slurm's notations


_HOST = re.compile(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)")


def expand_hostlist(expr: str) -> list[str]:
    """Slurm's node list (``SLURM_JOB_NODELIST``), host by host, in Slurm's order.

    ``node[1-3,5]`` is node1 node2 node3 node5; zero padding is kept (``gpu[08-10]``: gpu08
    gpu09 gpu10); ``a,b[1-2],c`` lists several. One bracket per host name, as Slurm writes
    them for the lists it sets (``scontrol show hostnames`` expands the same way)."""
    hosts: list[str] = []
    pos = 0
    expr = expr.strip()
    while pos < len(expr):
        m = _HOST.match(expr, pos)
        if m is None or m.end() == pos:
            raise LaunchError(f"cannot read Slurm's node list {expr!r} at {expr[pos:]!r}")
        prefix, ranges, suffix = m.group(1), m.group(2), m.group(3)
        if ranges is None:
            if prefix + suffix:
                hosts.append(prefix + suffix)
        else:
            hosts += [f"{prefix}{n}{suffix}" for n in _expand_ranges(ranges, expr)]
        pos = m.end()
        if pos < len(expr):
            if expr[pos] != ",":
                raise LaunchError(f"cannot read Slurm's node list {expr!r} at {expr[pos:]!r}")
            pos += 1
    if not hosts:
        raise LaunchError(f"Slurm's node list {expr!r} names no host")
    return hosts


def _expand_ranges(ranges: str, expr: str) -> list[str]:
    out: list[str] = []
    for part in ranges.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaunchError(f"cannot read the range {part!r} in Slurm's node list {expr!r}")
        if not sep:
            out.append(lo)
            continue
        width = len(lo)
        if int(hi) < int(lo):
            raise LaunchError(f"the range {part!r} in Slurm's node list {expr!r} is empty")
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(expr: str) -> list[int]:
    """Slurm's tasks per node (``SLURM_STEP_TASKS_PER_NODE``), node by node: ``2(x3),1`` is
    2 2 2 1."""
    out: list[int] = []
    for part in expr.split(","):
        m = _TASKS.match(part.strip())
        if m is None:
            raise LaunchError(f"cannot read Slurm's tasks per node {expr!r} at {part!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def derived_port(seed: str) -> int:
    """The rendezvous port every rank derives alike from ``seed`` (a job's ids) when
    MASTER_PORT is not set: in ``PORT_BASE .. PORT_BASE + PORT_SPAN - 1``."""
    return PORT_BASE + zlib.crc32(seed.encode()) % PORT_SPAN


# ---------------------------------------------------------------------- the mapping


def _int(env: Mapping[str, str], *names: str) -> int:
    for name in names:
        raw = env.get(name)
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise LaunchError(f"{name}={raw!r} is not an integer") from None
    raise LaunchError(f"{' or '.join(names)} is not set: is this a rank the launcher started?")


def _address(env: Mapping[str, str], one_node: bool, many_nodes_addr: str | None,
             launcher: str, how: str) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if one_node:
        return "127.0.0.1"  # one node: rank 0's store and gloo stay on loopback
    if many_nodes_addr:
        return many_nodes_addr
    raise LaunchError(
        f"{launcher} started ranks on several nodes and MASTER_ADDR is not set: set it to "
        f"the address of rank 0's node, which hosts the rendezvous store ({how})")


def resolve_host(host: str) -> str | None:
    """The address ``host`` resolves to on this node: getaddrinfo's first answer, the one
    rank 0's store binds (:func:`keepalive_executor.torchrun.bootstrap.host_store`); None if
    it does not resolve here (the store reports that itself)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return None


def _is_loopback(addr: str | None) -> bool:
    try:
        return addr is not None and ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def _first_host_address(first: str, nodelist: str, resolve: Callable[[str], str | None]
                        ) -> str:
    """Several nodes, MASTER_ADDR unset: the first host, unless it resolves to loopback on
    this node (then no other node could reach rank 0's store there)."""
    addr = resolve(first)
    if _is_loopback(addr):
        raise LaunchError(
            f"srun started ranks on several nodes and MASTER_ADDR is not set: rank 0's "
            f"rendezvous store would be at the first host of the node list ({nodelist}), but "
            f"the first host {first} resolves to {addr} on this node, a loopback address the "
            f"other nodes cannot reach (Debian and Ubuntu map a machine's own name to "
            f"127.0.1.1 in /etc/hosts): set MASTER_ADDR to rank 0's address on the network "
            f"the nodes share, the same on every rank (e.g. exported in the batch script, "
            f"which runs on the first node)")
    return first


def _port(env: Mapping[str, str], seed: str) -> str:
    return env.get("MASTER_PORT") or str(derived_port(seed))


def _from_slurm(env: Mapping[str, str], resolve: Callable[[str], str | None]
                ) -> dict[str, str]:
    job, step = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID", "0"), _step(env)
    world = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    node = _int(env, "SLURM_NODEID")
    per_node_raw = (env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
                    or env.get("SLURM_NTASKS_PER_NODE"))
    if not per_node_raw:
        raise LaunchError("SLURM_STEP_TASKS_PER_NODE is not set: is this a task srun started?")
    per_node = expand_tasks_per_node(per_node_raw)
    # SLURM_NTASKS_PER_NODE alone (--ntasks-per-node K) is one K for every node
    local_world = per_node[node] if node < len(per_node) else per_node[-1]
    nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                or env.get("SLURM_NODELIST") or "")
    one_node = local_world == world
    first = expand_hostlist(nodelist)[0] if nodelist and not one_node else None
    if first is not None and not env.get("MASTER_ADDR"):
        first = _first_host_address(first, nodelist, resolve)
    return {
        "RANK": str(_int(env, "SLURM_PROCID")),
        "LOCAL_RANK": str(_int(env, "SLURM_LOCALID")),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": _address(env, one_node, first, SRUN, "e.g. the first host of "
                                "`scontrol show hostnames $SLURM_JOB_NODELIST`"),
        "MASTER_PORT": _port(env, f"slurm-{job}.{step}"),
        ENV_LAUNCHER: SRUN,
        ENV_RUN_ID: f"slurm-{job}.{step}",
        ENV_RESTART_COUNT: env.get("SLURM_RESTART_COUNT") or "0",
    }


def _step(env: Mapping[str, str]) -> str:
    return env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""


def _from_openmpi(env: Mapping[str, str]) -> dict[str, str]:
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or "0"
    return {
        "RANK": str(_int(env, "OMPI_COMM_WORLD_RANK")),
        "LOCAL_RANK": str(_int(env, "OMPI_COMM_WORLD_LOCAL_RANK")),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": _address(env, local_world == world, None, MPIRUN,
                                "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<port>"),
        "MASTER_PORT": _port(env, f"mpirun-{job}"),
        ENV_LAUNCHER: MPIRUN,
        ENV_RUN_ID: f"mpirun-{job}",
        ENV_RESTART_COUNT: "0",
    }


def torchrun_variables(env: Mapping[str, str],
                       resolve: Callable[[str], str | None] = resolve_host) -> dict[str, str]:
    """The variables to set so that this rank reads like a torchrun rank: none under torchrun
    (or under no launcher: the caller then reports what is missing), else the launcher's
    numbers under torchrun's names, plus which launcher, the run id and the attempt.

    Raises :class:`LaunchError` when the launcher's variables cannot place this rank (a Slurm
    batch script's shell rather than a task of ``srun``; several nodes without an address, or
    whose derived address ``resolve`` answers with a loopback address on this node)."""
    if any(env.get(k) for k in _TORCHRUN_MARKS):
        return {}
    if env.get("OMPI_COMM_WORLD_RANK"):
        return _from_openmpi(env)
    if env.get("SLURM_PROCID") is not None and env.get("SLURM_JOB_ID", env.get("SLURM_JOBID")):
        if not _step(env):
            raise LaunchError(
                "this is a Slurm job's batch script, not a task of srun (SLURM_STEP_ID is "
                "not set): start every rank with srun, e.g. `srun --ntasks N "
                "--kill-on-bad-exit=1 python -m keepalive_executor serve MODEL -tp N`")
        return _from_slurm(env, resolve)
    return {}
