"""``python -m keepalive_executor serve MODEL ...``: what each rank torchrun starts does.

Under srun or mpirun the same: :func:`main` first maps their variables to torchrun's
(:mod:`keepalive_executor.torchrun.launchers`), and rank 0 hosts the store that torchrun's
agent would (:func:`~keepalive_executor.torchrun.bootstrap.host_store`), for as long as it runs.

::

    rank 0                                        ranks 1..N-1
    ------                                        ------------
    (one node, no secret set: create the
     per-run secret file)
    vLLM's API server (``vllm serve`` argv)       ignore argv; post a fresh nonce on the
                                                  agent's store, then wait there
     `- EngineCore process
          KeepaliveExecutor (driver, rank 0):
            validate (WORLD_SIZE == TP) ------->  bootstrap key: an error, or the
            wait for every follower's nonce,      driver's configuration; checked
            post {vllm_config, channel spec,      (HMAC, holds this rank's nonce)
                  liveness timeout}, signed ----> before it is unpickled
            join the process groups (on torchrun's store, scoped to this attempt)
            broadcast steps and keepalives ---->  receive loop (worker_loop.run_worker)
            watch heartbeats on the store <-----  heartbeat thread

Exit codes (what torchrun aggregates; :mod:`keepalive_executor.exit_codes`):

* rank 0: vLLM's own code, except that it is 1 when the executor failed (a rank died, a
  collective broke), which the executor records in a status file this process reads on the
  way out (vLLM's front end itself exits 0 after its engine died);
* other ranks: 0 after the driver's SHUTDOWN, or after the driver went away once this rank
  was asked to stop (SIGTERM/SIGINT, as torchrun does to every rank); 1 when the driver went
  away unasked, a start-up error was reported or the bootstrap failed authentication; a rank
  whose torchrun agent dies is killed (``PR_SET_PDEATHSIG``), since torchrun starts workers
  in their own session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any, TextIO

from keepalive_executor import exit_codes, startup_timeouts
from keepalive_executor.config import KeepaliveConfigError, startup_timeout_s
from keepalive_executor.log import get_logger, register_stack_dump
from keepalive_executor.torchrun.bootstrap import (
    ENV_SECRET,
    ENV_SECRET_FILE,
    connect_store,
    create_node_secret,
    host_store,
    init_world_process_group,
    load_secret,
    post_error,
    post_nonce,
    wait_bootstrap,
    watch_for_error,
)
from keepalive_executor.torchrun.env import (
    ENV_TORCHRUN_LOCAL_WORLD_SIZE,
    LAUNCHER_ENV,
    TorchrunEnv,
    TorchrunError,
    default_gloo_interface,
    set_parent_death_signal,
    with_keepalive_backend,
)
from keepalive_executor.torchrun.launchers import LaunchError, torchrun_variables
from keepalive_executor.torchrun.liveness import DriverWatch, Heartbeat

__all__ = ["STATUS_FILE_ENV", "record_failure", "StartErrorReport", "main", "USAGE"]

logger = get_logger(__name__)

#: Set on rank 0: where the executor records a failure for the exit code.
STATUS_FILE_ENV = "KEEPALIVE_EXECUTOR_STATUS_FILE"
#: How long rank 0 waits, after a start-up error, for the other ranks to have read it.
ERROR_ACK_WAIT_S = 60.0


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


def _remove(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


# ---------------------------------------------------------------------- rank 0


def _lead(env: TorchrunEnv, argv: list[str]) -> int:
    """Rank 0: run vLLM's ``serve`` in this process with the keepalive executor (and, under
    srun or mpirun, host the rendezvous store for every rank, for as long as it runs)."""
    set_parent_death_signal(signal.SIGTERM)
    store = host_store(env) if env.hosts_store else connect_store(env)
    secret_file = None
    if env.one_node and not os.environ.get(ENV_SECRET) and not os.environ.get(ENV_SECRET_FILE):
        secret_file = create_node_secret(env)
        os.environ[ENV_SECRET_FILE] = secret_file  # the engine process signs with it
    secret, _ = load_secret(env)
    fd, status_path = tempfile.mkstemp(prefix="keepalive-status-")
    os.close(fd)
    os.environ[LAUNCHER_ENV] = "torchrun"
    os.environ[STATUS_FILE_ENV] = status_path
    code: int = exit_codes.FAILED
    try:
        try:
            code = _run_vllm_cli(["serve", *with_keepalive_backend(argv)])
        except BaseException as e:
            # Say why first: the wait below can end in torchrun's SIGTERM (another rank
            # failed first, e.g. one whose nonce came too late for this error), and what is
            # printed after that is lost.
            if isinstance(e, TorchrunError):
                print(f"error: {e}", file=sys.stderr, flush=True)
            else:
                logger.error("rank 0 failed to start: %s: %s", type(e).__name__, e)
            post_error(store, env, f"rank 0 failed to start: {type(e).__name__}: {e}", secret,
                       wait_s=ERROR_ACK_WAIT_S)
            if isinstance(e, TorchrunError):
                return exit_codes.USAGE
            raise
        if not store.check([env.key("bootstrap")]):
            post_error(store, env, f"rank 0 exited with code {code} before its engine started",
                       secret, wait_s=ERROR_ACK_WAIT_S)
        failures = _read_failures(status_path)
        if failures:
            logger.error("keepalive executor failed (%s); rank 0 exits 1", "; ".join(failures))
            code = code or exit_codes.FAILED
        return code
    finally:
        _remove(status_path)
        _remove(secret_file)


def _run_vllm_cli(args: list[str]) -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    try:
        vllm_main()
    except SystemExit as e:
        if e.code is None:
            return exit_codes.OK
        return e.code if isinstance(e.code, int) else exit_codes.FAILED
    return exit_codes.OK


# ---------------------------------------------------------------------- ranks 1..N-1


class StartErrorReport:
    """A follower's report of rank 0's start-up error: printed, then acknowledged to rank 0,
    once, by whichever of its two readers (the watch thread during vLLM's import, the main
    thread after it) comes first.

    Print first: rank 0 exits once every follower has acknowledged, and torchrun then stops
    this rank (SIGTERM, whose default action kills a rank still importing vLLM); a line still
    to be printed after the acknowledgement waits for the GIL, which the main thread's import
    holds for long stretches on a loaded machine, and is lost. The second caller waits until
    the first is done: were it to return at once, the main thread would end the process (it
    exits 1) while the watch thread is still printing, and the line would be lost with the
    unfinished daemon thread.
    """

    def __init__(self, store: Any, env: TorchrunEnv, out: TextIO | None = None) -> None:
        self._store = store
        self._env = env
        self._out = out
        self._lock = threading.Lock()
        self._done = False

    def report(self, message: str) -> bool:
        """Print and acknowledge ``message``; False (once the first call is complete) if a
        call before this one already did."""
        with self._lock:
            if self._done:
                return False
            print(f"error: rank {self._env.rank} not starting: rank 0 reported: {message}",
                  file=sys.stderr if self._out is None else self._out, flush=True)
            with contextlib.suppress(Exception):
                self._store.add(self._env.key("error-seen"), 1)
            self._done = True
            return True


def _follow(env: TorchrunEnv) -> int:
    """Ranks 1..N-1: take the driver's configuration and follow its broadcasts."""
    # This rank's nonce goes out before anything slow (vLLM's import takes many seconds on a
    # busy machine): rank 0 signs it into the bootstrap, and when rank 0 is failing it waits
    # for the nonces only ERROR_NONCE_WAIT_S; a nonce later than that makes the error stale
    # to this rank, which then cannot say why rank 0 failed.
    set_parent_death_signal(signal.SIGKILL)
    register_stack_dump()  # SIGUSR1: this rank's stacks to its log (a step stuck on rank 0)
    try:
        store = connect_store(env)
        nonce = post_nonce(store, env)
    except Exception as e:  # noqa: BLE001 - torchrun's store is unreachable: say so, exit
        print(f"error: rank {env.rank} not starting: torchrun's store at {env.address}: "
              f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return exit_codes.FAILED
    # Rank 0 waits only ERROR_ACK_WAIT_S for the followers to say they read its error, and
    # vLLM's import below can take longer on a loaded machine: a watch reads an error as soon
    # as rank 0 posts it, says why, acknowledges and ends this process.
    read_bootstrap = threading.Event()
    start_error = StartErrorReport(store, env)

    def report_early(message: str) -> None:
        if start_error.report(message):
            os._exit(exit_codes.FAILED)

    threading.Thread(target=watch_for_error, name="keepalive-error-watch", daemon=True,
                     args=(store, env, nonce, report_early, read_bootstrap)).start()
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    from keepalive_executor.binding import bind_threads
    from keepalive_executor.worker_loop import name_process, run_worker

    # vLLM's default logging until the driver's own logging configuration arrives.
    configure_logging_if_needed(LoggingConfig())
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
            raise SystemExit(exit_codes.OK)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        timeout_s = startup_timeout_s()
        boot = _read_bootstrap(store, env, timeout_s, nonce)
    except (TorchrunError, KeepaliveConfigError) as e:
        logger.error("rank %d not starting: %s", env.rank, e)
        return exit_codes.FAILED
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        read_bootstrap.set()
    if boot.get("error"):
        start_error.report(boot["error"])  # unless the watch said it (then it waits for it)
        return exit_codes.FAILED
    vllm_config = boot["vllm_config"]
    if vllm_config.parallel_config.world_size != env.world_size:
        logger.error(
            "rank %d not starting: the driver's world size is %d, torchrun's is %d",
            env.rank, vllm_config.parallel_config.world_size, env.world_size,
        )
        return exit_codes.FAILED
    name_process(env.rank, vllm_config.parallel_config)
    logger.info(
        "rank %d of %d (local rank %d) follows the driver (torchrun's store at %s)",
        env.rank, env.world_size, env.local_rank, env.address,
    )
    heartbeat = Heartbeat(connect_store(env), env.key, env.rank, boot["liveness_timeout_s"])
    heartbeat.start()
    # a step's collective may never notice the driver's end (liveness.DriverWatch)
    DriverWatch.for_driver(boot.get("driver"), stop_requested)
    bind_threads(vllm_config, env.local_rank)
    following.set()
    try:
        try:
            # under the start-up timeout, as rank 0 joins it (and as spawned workers join
            # their groups): rank 0 comes only once it has built its worker, which on a busy
            # machine can take longer than the user's timeout (startup_timeouts.py)
            with startup_timeouts.during_startup(vllm_config.parallel_config,
                                                 boot["spec"].startup_timeout_s):
                init_world_process_group(env, vllm_config, timeout_s)
        except Exception:  # noqa: BLE001 - logged; torchrun sees the exit code
            logger.exception("rank %d could not join the process group", env.rank)
            return exit_codes.FAILED
        from vllm.utils.system_utils import get_mp_context

        return run_worker(
            vllm_config=vllm_config,
            rank=env.rank,
            local_rank=env.local_rank,
            distributed_init_method=boot["init_method"],
            spec=boot["spec"],
            shared_worker_lock=get_mp_context().Lock(),
            on_ready=lambda: None,
            stop_requested=stop_requested,
        )
    finally:
        heartbeat.stop()


def _read_bootstrap(store: Any, env: TorchrunEnv, timeout_s: float,
                    nonce: bytes) -> dict[str, Any]:
    # NONCE is what this rank posted: rank 0 signs the bootstrap only once it has every
    # follower's, and this rank accepts only a bootstrap that holds its own (no replay of a
    # recording from an earlier launch).
    # A one-node follower may start before rank 0 created the per-run secret file: wait for
    # it (it appears whole), within the start-up timeout.
    secret, _ = load_secret(env, wait_s=timeout_s)
    return wait_bootstrap(store, env, timeout_s, secret, nonce)


USAGE = """\
usage: torchrun [torchrun options] -m keepalive_executor serve MODEL [vllm serve options]
       srun --ntasks N --kill-on-bad-exit=1 python -m keepalive_executor serve MODEL ...
       mpirun -np N python -m keepalive_executor serve MODEL ...

Serve MODEL with vLLM, tensor-parallel over the ranks the launcher starts. Rank 0 runs vLLM's
API server and the engine (the keepalive executor's driver); every other rank follows the
driver. vllm serve options are read on rank 0 only; -tp x -pp must equal the world size.
Across several nodes, set VLLM_KEEPALIVE_SECRET to the same value on every node.
See docs/torchrun.md and docs/launchers.md.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m keepalive_executor``: the torchrun entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return exit_codes.OK if args else exit_codes.USAGE
    if args[0] != "serve":
        print(f"unknown command {args[0]!r}\n\n{USAGE}", end="", file=sys.stderr)
        return exit_codes.USAGE
    try:
        # srun's and mpirun's numbers under torchrun's names (none under torchrun): from here
        # on, and in rank 0's engine process, every launcher reads alike
        os.environ.update(torchrun_variables(os.environ))
        # before vLLM rewrites it (its CPU platform sets LOCAL_WORLD_SIZE to the TP size); the
        # engine process inherits the saved value, which decides one node or several there
        os.environ.setdefault(ENV_TORCHRUN_LOCAL_WORLD_SIZE,
                              os.environ.get("LOCAL_WORLD_SIZE", ""))
        env = TorchrunEnv.from_environ()
    except (TorchrunError, LaunchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    default_gloo_interface(env)
    if env.rank != 0:
        return _follow(env)
    try:
        return _lead(env, args[1:])
    except TorchrunError as e:
        print(f"error: {e}", file=sys.stderr)
        return exit_codes.USAGE
