"""What torchrun tells each rank, and the node-local set-up each rank does for itself."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keepalive_executor.errors import KeepaliveConfigError
from keepalive_executor.log import get_logger
from keepalive_executor.torchrun.launchers import (
    ENV_LAUNCHER,
    ENV_RESTART_COUNT,
    ENV_RUN_ID,
    MPIRUN,
    SRUN,
    TORCHRUN,
)

__all__ = [
    "LAUNCHER_ENV",
    "ENV_TORCHRUN_LOCAL_WORLD_SIZE",
    "TorchrunEnv",
    "TorchrunError",
    "in_torchrun_mode",
    "check_world_size",
    "check_features",
    "with_keepalive_backend",
    "default_gloo_interface",
    "set_parent_death_signal",
    "torchrun_local_world_size",
]

logger = get_logger(__name__)

#: Set by the CLI on rank 0: the executor in this process tree is in torchrun mode (its ranks
#: started by torchrun, srun or mpirun; the value is "torchrun" for all three).
LAUNCHER_ENV = "KEEPALIVE_EXECUTOR_LAUNCHER"
#: How to give a launcher the number of ranks vLLM needs, in its own options.
_WORLD_HINT = {
    TORCHRUN: "give torchrun --nnodes x --nproc-per-node = {need}",
    SRUN: "give srun --ntasks {need} (or --nodes x --ntasks-per-node = {need})",
    MPIRUN: "give mpirun -np {need}",
}
#: torchrun's own LOCAL_WORLD_SIZE, saved by ``python -m keepalive_executor`` before vLLM
#: runs: vLLM's CPU platform overwrites LOCAL_WORLD_SIZE with the TP size in its config check
#: (vllm/platforms/cpu.py, 0.32), which made TP across two nodes look like one node.
ENV_TORCHRUN_LOCAL_WORLD_SIZE = "_KEEPALIVE_TORCHRUN_LOCAL_WORLD_SIZE"


def torchrun_local_world_size(env: Mapping[str, str]) -> str | None:
    """torchrun's LOCAL_WORLD_SIZE as torchrun set it: the value the CLI saved before vLLM
    rewrote the variable (see ENV_TORCHRUN_LOCAL_WORLD_SIZE), else the variable itself."""
    return env.get(ENV_TORCHRUN_LOCAL_WORLD_SIZE) or env.get("LOCAL_WORLD_SIZE")
_REQUIRED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_BACKEND_FLAGS = ("--distributed-executor-backend", "--distributed_executor_backend")


class TorchrunError(RuntimeError):
    """torchrun mode cannot start: the message names what is wrong and how to fix it."""


@dataclass(frozen=True)
class TorchrunEnv:
    """What the launcher tells each rank through the environment, under torchrun's names
    (srun's and mpirun's own variables are mapped to them first, see
    :mod:`keepalive_executor.torchrun.launchers`)."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    run_id: str = "none"
    restart_count: int = 0
    local_world_size: int | None = None
    #: which launcher started the ranks: torchrun, srun or mpirun
    launcher: str = TORCHRUN

    @property
    def hosts_store(self) -> bool:
        """Rank 0 hosts the store (no torchrun agent to host it)."""
        return self.launcher != TORCHRUN

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv:
        """Read and check torchrun's variables; raise :class:`TorchrunError` if unusable."""
        env = os.environ if environ is None else environ
        missing = [k for k in _REQUIRED if not env.get(k)]
        if missing:
            raise TorchrunError(
                f"python -m keepalive_executor serve must run under torchrun (or srun, or "
                f"mpirun); {', '.join(missing)} not set. Start it as: torchrun "
                "--nproc-per-node N -m keepalive_executor serve MODEL -tp N [vllm serve "
                "options], or `srun --ntasks N --kill-on-bad-exit=1 python -m "
                "keepalive_executor serve ...`, or `mpirun -np N python -m keepalive_executor "
                "serve ...` (or use `vllm serve ... --distributed-executor-backend "
                "keepalive`, which starts the ranks itself)"
            )
        try:
            local_world = torchrun_local_world_size(env)  # torchrun's, not vLLM's rewrite
            parsed = cls(
                rank=int(env["RANK"]),
                local_rank=int(env["LOCAL_RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
                run_id=env.get(ENV_RUN_ID) or env.get("TORCHELASTIC_RUN_ID", "none"),
                restart_count=int(env.get(ENV_RESTART_COUNT)
                                  or env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                local_world_size=int(local_world) if local_world else None,
                launcher=env.get(ENV_LAUNCHER) or TORCHRUN,
            )
        except ValueError as e:
            raise TorchrunError(f"torchrun's environment is malformed: {e}") from None
        if not 0 <= parsed.rank < parsed.world_size:
            raise TorchrunError(f"RANK={parsed.rank} is outside WORLD_SIZE={parsed.world_size}")
        if not parsed.hosts_store and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise TorchrunError(
                "keepalive's torchrun mode receives its configuration over torchrun's agent "
                "store, but TORCHELASTIC_USE_AGENT_STORE is not True (was the process "
                "started by something other than torchrun, or with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1?). Launch with torchrun and leave "
                "the store shared."
            )
        return parsed

    @property
    def one_node(self) -> bool:
        """Every rank runs on this node (torchrun's LOCAL_WORLD_SIZE equals WORLD_SIZE)."""
        return self.local_world_size == self.world_size

    @property
    def address(self) -> str:
        """``host:port`` of torchrun's store."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"

    def group_label(self) -> str:
        """What vLLM gets as ``distributed_init_method`` (the group is already up, see
        :func:`~keepalive_executor.torchrun.bootstrap.init_world_process_group`, so vLLM only
        logs it). Its text after the last ``:`` names vLLM's CPU shared-memory segments, so
        it is unique per attempt: a restarted world must not meet the segments its killed
        predecessor left behind."""
        token = f"ka{self.restart_count}-{uuid.uuid4().hex[:12]}"
        return f"torchrun://{self.address}:{token}"

    def key(self, name: str) -> str:
        """A store key private to this run and restart attempt."""
        return f"keepalive_executor/{self.run_id}/{self.restart_count}/{name}"


def in_torchrun_mode(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process tree was started by ``python -m keepalive_executor serve``."""
    env = os.environ if environ is None else environ
    return env.get(LAUNCHER_ENV) == "torchrun"


def check_world_size(parallel_config: Any, environ: Mapping[str, str] | None = None) -> None:
    """In torchrun mode, torchrun's WORLD_SIZE must be exactly the ranks vLLM asks for."""
    dp = getattr(parallel_config, "data_parallel_size", 1)
    if dp > 1:
        raise KeepaliveConfigError(
            f"--data-parallel-size={dp} is not supported in keepalive's torchrun mode: "
            "vLLM's data-parallel front end starts every replica's engine core as a child of "
            "its own process, while here each replica's rank 0 would have to be the torchrun "
            "rank that leads that replica's other ranks; run one torchrun per replica, each "
            "serving on its own port, behind your load balancer, or use the spawned mode "
            "(vllm serve MODEL -dp N -tp M --distributed-executor-backend keepalive)"
        )
    env = TorchrunEnv.from_environ(environ)
    need = parallel_config.world_size
    hint = _WORLD_HINT.get(env.launcher, _WORLD_HINT[TORCHRUN])
    if env.world_size != need:
        raise KeepaliveConfigError(
            f"{env.launcher} started WORLD_SIZE={env.world_size} ranks but vLLM's "
            f"configuration needs {need} (--tensor-parallel-size="
            f"{parallel_config.tensor_parallel_size} x --pipeline-parallel-size="
            f"{parallel_config.pipeline_parallel_size}); pass -tp and -pp whose product is "
            f"{env.world_size}, or {hint.format(need=need)}"
        )


def check_features(vllm_config: Any) -> None:
    """What torchrun mode cannot do that the spawned mode can, refused naming the flag.

    ``--mm-processor-cache-type shm``: vLLM's multimodal shared-memory cache needs one lock
    shared by every rank's process (``shared_worker_lock``), which a process can only hand to
    its own children; torchrun's ranks are not rank 0's children."""
    mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
    if mm is not None and getattr(mm, "mm_processor_cache_type", None) == "shm":
        raise KeepaliveConfigError(
            "--mm-processor-cache-type shm is not supported in keepalive's torchrun mode "
            "(its shared-memory cache needs a lock shared by every rank's process, and "
            "torchrun's ranks are not rank 0's children): use --mm-processor-cache-type lru "
            "(vLLM's default), or the spawned mode (vllm serve ... "
            "--distributed-executor-backend keepalive)"
        )


def with_keepalive_backend(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--distributed-executor-backend keepalive``; reject any other backend
    name (a qualified class name passes here: the plugin accepts a subclass of the keepalive
    executor, as a negative control's, and refuses anything else, plugin.py)."""
    out = list(argv)
    for i, arg in enumerate(out):
        for flag in _BACKEND_FLAGS:
            value = None
            if arg == flag:
                value = out[i + 1] if i + 1 < len(out) else ""
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            if value is None:
                continue
            if value != "keepalive" and "." not in value:
                raise TorchrunError(
                    f"{flag} {value!r}: under torchrun the executor is keepalive (the ranks "
                    "are torchrun's processes); drop the flag or set it to keepalive"
                )
            return out
    return [*out, "--distributed-executor-backend", "keepalive"]


def default_gloo_interface(env: TorchrunEnv) -> None:
    """Keep gloo on loopback when the rendezvous is on loopback (one machine)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(env.master_addr))
    except (OSError, ValueError):
        return
    if addr.is_loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def set_parent_death_signal(sig: int) -> None:
    """Receive ``sig`` when the parent (torchrun's agent) dies; Linux only."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:  # the agent died before the prctl took effect
        os.kill(os.getpid(), sig)


def pid_space() -> str:
    """Which process-id space this process lives in: the host's boot id and this process's
    pid namespace. Two processes whose ``pid_space()`` agree can name each other by pid
    (one node, one container); any other pair cannot, whatever their hostnames say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # no such files (not Linux): never the same space
    return f"{boot}/{namespace}"
