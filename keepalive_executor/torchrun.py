"""torchrun mode: every rank is a process of torchrun; rank 0 serves, the others follow.

``python -m keepalive_executor serve MODEL [vllm serve options]`` is the command torchrun
runs on every rank (see docs/torchrun.md)::

    rank 0                                        ranks 1..N-1
    ------                                        ------------
    vLLM's API server (``vllm serve`` argv)       ignore argv; wait on the agent's store
     `- EngineCore process
          KeepaliveExecutor (driver, rank 0):
            validate (WORLD_SIZE == TP) ------->  bootstrap key: an error, or the
            post {vllm_config, settings} ------>  driver's vllm_config and settings
            join the process groups (on torchrun's store, scoped to this attempt)
            broadcast steps and keepalives ---->  receive loop (worker_loop.run_worker)

The bootstrap goes through torchrun's own rendezvous store (the agent's TCPStore at
``MASTER_ADDR:MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``) under a key scoped by
``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``. Ranks other than 0 parse nothing
of vLLM's: the model, every engine option and the keepalive settings are the driver's. Only
node-local environment (thread binding, ``GLOO_SOCKET_IFNAME``) is read where the rank runs.

Exit codes (what torchrun aggregates):

* rank 0: vLLM's own code, except that it is 1 when the executor failed (a rank died, a
  collective broke), which the executor records in a status file this process reads on the
  way out (vLLM's front end itself exits 0 after its engine died);
* other ranks: 0 after the driver's SHUTDOWN, or after the driver went away once this rank
  was asked to stop (SIGTERM/SIGINT, as torchrun does to every rank); 1 when the driver went
  away unasked or a start-up error was reported; a rank whose torchrun agent dies is killed
  (``PR_SET_PDEATHSIG``), since torchrun starts workers in their own session.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LAUNCHER_ENV",
    "STATUS_FILE_ENV",
    "TorchrunEnv",
    "TorchrunError",
    "in_torchrun_mode",
    "check_world_size",
    "with_keepalive_backend",
    "record_failure",
    "post_bootstrap",
    "main",
]

logger = logging.getLogger("vllm." + __name__)

#: Set by :func:`main` on rank 0: the executor in this process tree is in torchrun mode.
LAUNCHER_ENV = "KEEPALIVE_EXECUTOR_LAUNCHER"
#: Set by :func:`main` on rank 0: where the executor records a failure for the exit code.
STATUS_FILE_ENV = "KEEPALIVE_EXECUTOR_STATUS_FILE"
BOOTSTRAP_VERSION = 1
#: How long ranks wait for each other at start-up (both modes).
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_KEEPALIVE_STARTUP_TIMEOUT_S", "600"))
#: How long rank 0 waits, after a start-up error, for the other ranks to have read it.
ERROR_ACK_WAIT_S = 20.0
_REQUIRED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_BACKEND_FLAGS = ("--distributed-executor-backend", "--distributed_executor_backend")


class TorchrunError(RuntimeError):
    """torchrun mode cannot start: the message names what is wrong and how to fix it."""


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells each rank through the environment."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    run_id: str = "none"
    restart_count: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv:
        """Read and check torchrun's variables; raise :class:`TorchrunError` if unusable."""
        env = os.environ if environ is None else environ
        missing = [k for k in _REQUIRED if not env.get(k)]
        if missing:
            raise TorchrunError(
                f"python -m keepalive_executor serve must run under torchrun; "
                f"{', '.join(missing)} not set. Start it as: torchrun --nproc-per-node N "
                "-m keepalive_executor serve MODEL -tp N [vllm serve options] "
                "(or use `vllm serve ... --distributed-executor-backend keepalive`, which "
                "starts the ranks itself)"
            )
        try:
            parsed = cls(
                rank=int(env["RANK"]),
                local_rank=int(env["LOCAL_RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
                run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
                restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            )
        except ValueError as e:
            raise TorchrunError(f"torchrun's environment is malformed: {e}") from None
        if not 0 <= parsed.rank < parsed.world_size:
            raise TorchrunError(f"RANK={parsed.rank} is outside WORLD_SIZE={parsed.world_size}")
        if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise TorchrunError(
                "keepalive's torchrun mode receives its configuration over torchrun's agent "
                "store, but TORCHELASTIC_USE_AGENT_STORE is not True (was the process "
                "started by something other than torchrun, or with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1?). Launch with torchrun and leave "
                "the store shared."
            )
        return parsed

    @property
    def address(self) -> str:
        """``host:port`` of torchrun's store."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"

    def group_label(self) -> str:
        """What vLLM gets as ``distributed_init_method`` (the group is already up, see
        :func:`init_world_process_group`, so vLLM only logs it). Its text after the last
        ``:`` names vLLM's CPU shared-memory segments, so it is unique per attempt: a
        restarted world must not meet the segments its killed predecessor left behind."""
        import uuid

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
    from keepalive_executor.config import KeepaliveConfigError

    env = TorchrunEnv.from_environ(environ)
    need = parallel_config.world_size
    if env.world_size != need:
        raise KeepaliveConfigError(
            f"torchrun started WORLD_SIZE={env.world_size} ranks but vLLM's configuration "
            f"needs {need} (--tensor-parallel-size={parallel_config.tensor_parallel_size}); "
            f"pass -tp {env.world_size}, or give torchrun --nnodes x --nproc-per-node = "
            f"{need}"
        )


def with_keepalive_backend(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--distributed-executor-backend keepalive``; reject any other backend."""
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
            if value != "keepalive":
                raise TorchrunError(
                    f"{flag} {value!r}: under torchrun the executor is keepalive (the ranks "
                    "are torchrun's processes); drop the flag or set it to keepalive"
                )
            return out
    return [*out, "--distributed-executor-backend", "keepalive"]


# ---------------------------------------------------------------------- store


def connect_store(env: TorchrunEnv, timeout_s: float = 60.0) -> Any:
    """A client of torchrun's agent store (the agent is up before any rank starts)."""
    from torch.distributed import TCPStore

    return TCPStore(
        env.master_addr,
        env.master_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_world_process_group(env: TorchrunEnv, vllm_config: Any) -> None:
    """Join torch's default process group on torchrun's store, scoped to this attempt.

    vLLM would join it itself from an ``init_method``, on the bare store; but torchrun's static
    rendezvous keeps one store across restarts (``--max-restarts``), and a restarted world
    would then read the previous attempt's addresses. With the group already up, vLLM's
    ``init_distributed_environment`` builds its groups on top of it.
    """
    import torch.distributed as dist
    from vllm.platforms import current_platform

    if dist.is_initialized():
        return
    seconds = vllm_config.parallel_config.distributed_timeout_seconds
    kwargs = {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}
    store = dist.PrefixStore(env.key("world") + "/", connect_store(env, STARTUP_TIMEOUT_S))
    dist.init_process_group(
        backend=current_platform.dist_backend, store=store, rank=env.rank,
        world_size=env.world_size, **kwargs,
    )


def post_bootstrap(store: Any, env: TorchrunEnv, payload: dict[str, Any]) -> bool:
    """Publish the bootstrap once per attempt; False if something was published already."""
    if store.add(env.key("bootstrap-claim"), 1) != 1:
        return False
    store.set(env.key("bootstrap"), pickle.dumps({"version": BOOTSTRAP_VERSION, **payload}))
    return True


def post_error(store: Any, env: TorchrunEnv, message: str, wait_s: float = 0.0) -> bool:
    """Tell every waiting rank that rank 0 will not start (first poster wins).

    With ``wait_s``, wait that long for every other rank to say it has read the error:
    torchrun stops the remaining ranks as soon as rank 0 exits, and each should have
    printed why first.
    """
    posted = post_bootstrap(store, env, {"error": message})
    if not posted:
        with contextlib.suppress(Exception):
            store.wait([env.key("bootstrap")], datetime.timedelta(seconds=5))
        if "error" not in pickle.loads(store.get(env.key("bootstrap"))):
            return False  # the configuration went out: the ranks learn of it otherwise
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if store.add(env.key("error-seen"), 0) >= env.world_size - 1:
            break
        time.sleep(0.1)
    return posted


def wait_bootstrap(store: Any, env: TorchrunEnv, timeout_s: float) -> dict[str, Any]:
    """Poll (so that signals are handled, and without the warning torch logs for every
    timed-out ``wait``) for rank 0's bootstrap."""
    key = env.key("bootstrap")
    deadline = time.monotonic() + timeout_s
    next_note = time.monotonic() + 30
    while True:
        try:
            if store.check([key]):
                break
        except Exception as e:  # noqa: BLE001 - the agent (and its store) went away
            raise TorchrunError(f"torchrun's store at {env.address} failed: {e}") from e
        time.sleep(0.1)
        now = time.monotonic()
        if now >= deadline:
            raise TorchrunError(
                f"rank {env.rank}: rank 0 published no configuration within {timeout_s:g}s "
                "(VLLM_KEEPALIVE_STARTUP_TIMEOUT_S); see rank 0's log"
            )
        if now >= next_note:
            logger.info("rank %d: still waiting for rank 0's engine to start", env.rank)
            next_note = now + 30
    boot = pickle.loads(store.get(key))
    if boot.get("version") != BOOTSTRAP_VERSION:
        raise TorchrunError(
            f"rank 0 sent bootstrap version {boot.get('version')}, this rank expects "
            f"{BOOTSTRAP_VERSION}: every node must run the same keepalive-executor"
        )
    return boot


# ---------------------------------------------------------------------- status file


def record_failure(reason: str) -> None:
    """Executor side: note a failure so that rank 0's exit code says so (no-op elsewhere)."""
    path = os.environ.get(STATUS_FILE_ENV)
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "a") as f:
        f.write(reason.replace("\n", " ") + "\n")


def _read_failures(path: str) -> list[str]:
    try:
        with open(path) as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []


# ---------------------------------------------------------------------- process


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


def default_gloo_interface(env: TorchrunEnv) -> None:
    """Keep gloo on loopback when the rendezvous is on loopback (one machine)."""
    import ipaddress
    import socket

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(env.master_addr))
    except (OSError, ValueError):
        return
    if addr.is_loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def _lead(env: TorchrunEnv, argv: list[str]) -> int:
    """Rank 0: run vLLM's ``serve`` in this process with the keepalive executor."""
    set_parent_death_signal(signal.SIGTERM)
    store = connect_store(env)
    fd, status_path = tempfile.mkstemp(prefix="keepalive-status-")
    os.close(fd)
    os.environ[LAUNCHER_ENV] = "torchrun"
    os.environ[STATUS_FILE_ENV] = status_path
    code: int = 1
    try:
        code = _run_vllm_cli(["serve", *with_keepalive_backend(argv)])
    except BaseException as e:
        post_error(store, env, f"rank 0 failed to start: {type(e).__name__}: {e}",
                   wait_s=ERROR_ACK_WAIT_S)
        _remove(status_path)
        raise
    if not store.check([env.key("bootstrap")]):
        post_error(store, env, f"rank 0 exited with code {code} before its engine started",
                   wait_s=ERROR_ACK_WAIT_S)
    failures = _read_failures(status_path)
    _remove(status_path)
    if failures:
        logger.error("keepalive executor failed (%s); rank 0 exits 1", "; ".join(failures))
        code = code or 1
    return code


def _run_vllm_cli(args: list[str]) -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    try:
        vllm_main()
    except SystemExit as e:
        if e.code is None:
            return 0
        return e.code if isinstance(e.code, int) else 1
    return 0


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _follow(env: TorchrunEnv) -> int:
    """Ranks 1..N-1: take the driver's configuration and follow its broadcasts."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    from keepalive_executor.worker_loop import bind_threads, name_process, run_worker

    # vLLM's default logging until the driver's own logging configuration arrives.
    configure_logging_if_needed(LoggingConfig())
    set_parent_death_signal(signal.SIGKILL)
    name_process(env.rank)

    stop_requested = threading.Event()
    following = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if not stop_requested.is_set():
            logger.info(
                "rank %d: %s; %s", env.rank, signal.Signals(signum).name,
                "following the driver until it shuts down" if following.is_set()
                else "stopping",
            )
        stop_requested.set()
        if not following.is_set():
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        store = connect_store(env)
        boot = wait_bootstrap(store, env, STARTUP_TIMEOUT_S)
    except TorchrunError as e:
        logger.error("%s", e)
        return 1
    except SystemExit as e:
        return int(e.code or 0)
    if boot.get("error"):
        with contextlib.suppress(Exception):
            store.add(env.key("error-seen"), 1)
        logger.error("rank %d not starting: rank 0 reported: %s", env.rank, boot["error"])
        return 1
    vllm_config, settings = boot["vllm_config"], boot["settings"]
    if vllm_config.parallel_config.world_size != env.world_size:
        logger.error(
            "rank %d not starting: the driver's world size is %d, torchrun's is %d",
            env.rank, vllm_config.parallel_config.world_size, env.world_size,
        )
        return 1
    logger.info(
        "rank %d of %d (local rank %d) follows the driver (torchrun's store at %s)",
        env.rank, env.world_size, env.local_rank, env.address,
    )
    bind_threads(vllm_config, env.local_rank)
    following.set()
    try:
        init_world_process_group(env, vllm_config)
    except Exception:  # noqa: BLE001 - logged; torchrun sees the exit code
        logger.exception("rank %d could not join the process group", env.rank)
        return 1
    return run_worker(
        vllm_config=vllm_config,
        rank=env.rank,
        local_rank=env.local_rank,
        distributed_init_method=settings["init_method"],
        transport=settings["transport"],
        inline_bytes=settings["inline_bytes"],
        max_payload_bytes=settings["max_payload_bytes"],
        shared_worker_lock=None,
        on_ready=lambda: None,
        stop_requested=stop_requested,
    )


USAGE = """\
usage: torchrun [torchrun options] -m keepalive_executor serve MODEL [vllm serve options]

Serve MODEL with vLLM, tensor-parallel over the ranks torchrun starts. Rank 0 runs vLLM's
API server and the engine (the keepalive executor's driver); every other rank follows the
driver. vllm serve options are read on rank 0 only; -tp must equal torchrun's world size.
See docs/torchrun.md.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m keepalive_executor``: the torchrun entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] != "serve":
        print(f"unknown command {args[0]!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    try:
        env = TorchrunEnv.from_environ()
    except TorchrunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    default_gloo_interface(env)
    if env.rank != 0:
        return _follow(env)
    try:
        return _lead(env, args[1:])
    except TorchrunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
