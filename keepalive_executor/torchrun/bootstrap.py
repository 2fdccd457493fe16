"""Rank 0's configuration for the other ranks, on torchrun's store, authenticated.

Rank 0 posts one **bootstrap** per run and restart attempt under a key scoped by
``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``: either the driver's
``vllm_config`` with what every rank needs to build the same channel, or rank 0's start-up
error. The first poster wins (an atomic ``add`` on a claim key).

torchrun's store listens on every interface, and the bootstrap is a pickle: unauthenticated,
whoever reaches the port first could run code on every rank. So every value rank 0 posts is
signed and checked **before anything is unpickled**::

    b"KAB3" | MAC (32 bytes) | n (4 bytes) | nonce of rank 1 .. rank n (16 bytes each) | body
    MAC = HMAC-SHA256(secret, len(key) || store key || n || nonces || body (pickle))

The store key is inside the MAC, so a value signed for one key (one attempt) cannot be
replayed under another. The key repeats from one launch to the next, though (torchrun's
static rendezvous has run id ``none``), so the key alone does not stop a bootstrap recorded
from an earlier launch being replayed into a later one under the same secret. Hence the
nonces: each follower first posts a fresh random nonce (:func:`post_nonce`, key
``nonce/<rank>`` of this attempt), rank 0 waits for every follower's and signs them in, and
each follower accepts only a value whose MAC holds *its* nonce, generated after it started,
which no earlier recording can contain. A nonce an attacker pre-posts or overwrites can only
make a follower refuse (denial of service, which whoever reaches the store can cause anyway).
A value without the prefix, whose MAC does not match, or without this follower's nonce, is
refused with a message naming the cause, and nothing of it is unpickled.

The secret (:func:`load_secret`): ``VLLM_KEEPALIVE_SECRET`` (at least 16 bytes), or the file
named by ``VLLM_KEEPALIVE_SECRET_FILE`` (not readable by group or others), the same on every
node. Without either, a **one-node** run (torchrun's ``LOCAL_WORLD_SIZE == WORLD_SIZE``) uses a
per-run secret that rank 0 creates in a directory only this user can enter
(``$XDG_RUNTIME_DIR``; if it is unset or names no directory on this node,
``/tmp/keepalive-executor-<uid>``; mode 0700, checked), named by
run, attempt and torchrun agent (the local ranks' common parent); several nodes without a
secret are refused on every rank, saying how to set one.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import os
import pickle
import secrets
import stat
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from keepalive_executor import nccl
from keepalive_executor.log import get_logger
from keepalive_executor.torchrun.env import TorchrunEnv, TorchrunError

__all__ = [
    "BOOTSTRAP_VERSION",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "load_secret",
    "create_node_secret",
    "sign",
    "verify",
    "NONCE_BYTES",
    "connect_store",
    "host_store",
    "init_world_process_group",
    "post_nonce",
    "wait_nonces",
    "post_bootstrap",
    "post_error",
    "wait_bootstrap",
    "watch_for_error",
    "ERROR_HINT",
]

logger = get_logger(__name__)

BOOTSTRAP_VERSION = 3
ENV_SECRET = "VLLM_KEEPALIVE_SECRET"
ENV_SECRET_FILE = "VLLM_KEEPALIVE_SECRET_FILE"
MIN_SECRET_BYTES = 16
_MAGIC = b"KAB3"
_MAC_BYTES = 32
_COUNT_BYTES = 4
NONCE_BYTES = 16
#: How long rank 0 waits for the followers' nonces before posting a start-up error: it is
#: already failing, so not the whole start-up timeout.
ERROR_NONCE_WAIT_S = 30.0
_HOW_TO_SET = (
    f"set {ENV_SECRET} to the same random value on every node, e.g. "
    f"`export {ENV_SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))')`, "
    f"or {ENV_SECRET_FILE} to a file holding it (mode 600)"
)


# ---------------------------------------------------------------------- the secret


#: the runtime directories already warned about (once per process, not once per lookup)
_WARNED_RUNTIME_DIRS: set[str] = set()


def _private_dir(environ: Mapping[str, str]) -> str:
    """``$XDG_RUNTIME_DIR``, else (unset, or naming nothing here) ``/tmp/keepalive-executor-<uid>``.

    srun exports the submitting shell's environment, so on a compute node XDG_RUNTIME_DIR
    may name the login node's directory, which does not exist here (or one removed with the
    user's last session): every local rank then falls back alike, rank 0 where it creates
    the secret and each follower where it looks for it, with a warning."""
    base = environ.get("XDG_RUNTIME_DIR")
    if base:
        try:
            os.lstat(base)
        except OSError as e:
            if base not in _WARNED_RUNTIME_DIRS:
                _WARNED_RUNTIME_DIRS.add(base)
                logger.warning(
                    "XDG_RUNTIME_DIR=%s does not exist on this node (%s; srun exports the "
                    "login shell's environment): the per-run secret goes to "
                    "/tmp/keepalive-executor-%d instead", base, e.strerror or e, os.getuid())
            base = None
    path = base if base else os.path.join("/tmp", f"keepalive-executor-{os.getuid()}")
    try:
        if not base:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as e:
        raise TorchrunError(
            f"cannot make {path} to hold the per-run secret of a one-node run: "
            f"{e.strerror or e}; {_HOW_TO_SET}"
        ) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise TorchrunError(
            f"{path} must be a directory owned by this user with mode 700 to hold the "
            f"per-run secret of a one-node run; fix or remove it, or {_HOW_TO_SET}"
        )
    return path


def node_secret_path(env: TorchrunEnv, environ: Mapping[str, str] | None = None,
                     agent_pid: int | None = None) -> str:
    """Where a one-node run keeps its per-run secret (the same path on every local rank)."""
    environ = os.environ if environ is None else environ
    agent = os.getppid() if agent_pid is None else agent_pid
    name = f"secret-{env.run_id}-{env.restart_count}-{agent}".replace("/", "_")
    return os.path.join(_private_dir(environ), name)


def create_node_secret(env: TorchrunEnv, environ: Mapping[str, str] | None = None) -> str:
    """Rank 0 of a one-node run: create the per-run secret file; return its path.

    The secret is written to a temporary file in the same private directory and renamed into
    place. The rename is atomic, so a follower polling for the path finds either no file or
    the whole secret: never an empty or partial one, which it would otherwise verify with
    (with an empty key, whoever posts first on the store could forge a bootstrap).
    """
    path = node_secret_path(env, environ)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale file of a recycled pid: never reuse a secret
    fd, tmp = tempfile.mkstemp(prefix=".secret-", suffix=".tmp", dir=os.path.dirname(path))
    try:  # mkstemp creates it 0600
        with os.fdopen(fd, "w") as f:
            _write_secret(f, secrets.token_hex(32))
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _write_secret(f: Any, value: str) -> None:
    """Write the per-run secret (a seam: the race test pauses here)."""
    f.write(value)


def _read_secret_file(path: str, source: str) -> bytes:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            value = f.read().strip()
    except OSError as e:
        raise TorchrunError(f"{source}={path!r} cannot be read: {e}") from None
    if st.st_mode & 0o077:
        raise TorchrunError(
            f"{source}={path!r} is readable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): `chmod 600 {path}`"
        )
    return value


def load_secret(env: TorchrunEnv, environ: Mapping[str, str] | None = None,
                wait_s: float = 0.0) -> tuple[bytes, str]:
    """The secret this rank signs or checks with, and where it came from.

    The per-run secret of a one-node run may not exist yet when a follower starts: with
    ``wait_s``, poll that long for rank 0 to create it (it appears whole, see
    :func:`create_node_secret`). Every source, the per-run file included, must hold at least
    ``MIN_SECRET_BYTES``.
    """
    environ = os.environ if environ is None else environ
    if environ.get(ENV_SECRET):
        value, source = environ[ENV_SECRET].encode(), ENV_SECRET
        fix = _HOW_TO_SET
    elif environ.get(ENV_SECRET_FILE):
        value = _read_secret_file(environ[ENV_SECRET_FILE], ENV_SECRET_FILE)
        source = f"{ENV_SECRET_FILE}={environ[ENV_SECRET_FILE]}"
        fix = _HOW_TO_SET
    elif env.one_node:
        path = _wait_for_file(node_secret_path(env, environ), wait_s)
        value = _read_secret_file(path, "the per-run secret file")
        source = f"the per-run secret file {path}"
        fix = (f"rank 0 writes {2 * 32} bytes there, so something else wrote or truncated it; "
               f"remove it and restart torchrun, or {_HOW_TO_SET}")
    else:
        raise TorchrunError(
            f"torchrun mode across several nodes (WORLD_SIZE={env.world_size}, "
            f"LOCAL_WORLD_SIZE={env.local_world_size}) needs a shared secret to authenticate "
            f"rank 0's configuration on torchrun's store: {_HOW_TO_SET}"
        )
    if len(value) < MIN_SECRET_BYTES:
        raise TorchrunError(
            f"{source} is {len(value)} bytes; it must be at least {MIN_SECRET_BYTES}: {fix}"
        )
    return value, source


def _wait_for_file(path: str, wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            raise TorchrunError(
                f"the per-run secret file {path} does not exist (rank 0 creates it when it "
                f"starts; waited {wait_s:g}s, VLLM_KEEPALIVE_STARTUP_TIMEOUT_S): is rank 0 "
                f"running on this node under the same torchrun agent? Or {_HOW_TO_SET}"
            )
        time.sleep(0.05)
    return path


def _mac(secret: bytes, key: str, count: bytes, block: bytes, body: bytes) -> bytes:
    k = key.encode()
    # the key's length first: no other (key, nonces) split yields the same MAC input
    return hmac.new(secret, len(k).to_bytes(4, "big") + k + count + block + body,
                    hashlib.sha256).digest()


def sign(secret: bytes, key: str, obj: Any, nonces: Sequence[bytes] = ()) -> bytes:
    """The signed value rank 0 posts under ``key``, bound to the followers' ``nonces``
    (rank 1's first; each ``NONCE_BYTES`` long)."""
    if any(len(n) != NONCE_BYTES for n in nonces):
        raise ValueError(f"every nonce must be {NONCE_BYTES} bytes")
    body = pickle.dumps(obj, protocol=5)
    count = len(nonces).to_bytes(_COUNT_BYTES, "big")
    block = b"".join(nonces)
    return _MAGIC + _mac(secret, key, count, block, body) + count + block + body


def _fields(raw: bytes) -> tuple[bytes, bytes, bytes, bytes] | None:
    """``(mac, count, nonce block, body)`` of a value laid out by :func:`sign`, or None if
    it does not start like one. Nothing is checked here but the layout's head."""
    head = len(_MAGIC) + _MAC_BYTES + _COUNT_BYTES
    if not raw.startswith(_MAGIC) or len(raw) < head:
        return None
    count = raw[len(_MAGIC) + _MAC_BYTES : head]
    end = head + int.from_bytes(count, "big") * NONCE_BYTES
    return raw[len(_MAGIC) : len(_MAGIC) + _MAC_BYTES], count, raw[head:end], raw[end:]


def _signed_count(nonces: Sequence[bytes]) -> int:
    """How many of ``nonces`` are a follower's (zeros stand for a rank that posted none in
    time): the ranks that can accept the value signed with them."""
    return sum(1 for n in nonces if n != bytes(NONCE_BYTES))


def verify(secret: bytes, key: str, raw: bytes, rank: int | None = None,
           nonce: bytes | None = None) -> Any:
    """Check ``raw`` (posted under ``key``) and only then unpickle it.

    With ``rank`` and ``nonce`` (a follower), the value must also hold that rank's nonce:
    otherwise it was signed for another launch, and is refused as replayed or stale.
    """
    fields = _fields(bytes(raw))
    if fields is None:
        raise TorchrunError(
            f"the bootstrap under {key!r} on torchrun's store is not signed: it was not "
            "posted by rank 0 of a keepalive-executor of this version; refusing it unread "
            "(is another program, or an older keepalive-executor, using this store?)"
        )
    mac, count, block, body = fields
    n = int.from_bytes(count, "big")
    if len(block) != n * NONCE_BYTES or not hmac.compare_digest(
            mac, _mac(secret, key, count, block, body)):
        raise TorchrunError(
            f"the bootstrap under {key!r} on torchrun's store failed authentication "
            "(HMAC mismatch): it was posted by something other than rank 0 of this "
            f"deployment, or {ENV_SECRET} differs between nodes; refusing it unread"
        )
    if nonce is not None:
        if rank is None:
            raise ValueError("a nonce is checked for a rank: pass rank too")
        mine = block[(rank - 1) * NONCE_BYTES : rank * NONCE_BYTES] if 1 <= rank <= n else b""
        if not hmac.compare_digest(mine, nonce):
            raise TorchrunError(
                f"the bootstrap under {key!r} on torchrun's store is authentic but does not "
                f"hold rank {rank}'s nonce of this launch: a replayed or stale bootstrap "
                "(recorded from an earlier launch, or signed before this rank's nonce was "
                "posted, e.g. over a nonce something else posted first); refusing it unread"
            )
    return pickle.loads(body)


# ---------------------------------------------------------------------- the store


def connect_store(env: TorchrunEnv, timeout_s: float = 60.0) -> Any:
    """A client of the rendezvous store: torchrun's agent's (up before any rank starts), or
    the one rank 0 hosts under srun and mpirun (:func:`host_store`; the client retries its
    connection until ``timeout_s`` while rank 0 starts)."""
    from torch.distributed import TCPStore

    return TCPStore(
        env.master_addr,
        env.master_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def host_store(env: TorchrunEnv) -> Any:
    """Rank 0 under a launcher without a store of its own (srun, mpirun): host the TCPStore
    the bootstrap and liveness use, at MASTER_ADDR:MASTER_PORT, listening on that address
    only: on one node that is 127.0.0.1, so nothing beyond this machine reaches it (unlike
    torchrun's agent store, which listens on every interface). Hosted by rank 0's first
    process, which outlives its engine; the socket is bound here and handed to the store,
    since TCPStore itself binds every interface."""
    import errno
    import socket

    from torch.distributed import TCPStore

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            env.master_addr, env.master_port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        fix = {
            errno.EADDRINUSE: "the port is taken: set MASTER_PORT to a free port on rank 0's "
                              "node (the same on every rank)",
            errno.EADDRNOTAVAIL: "MASTER_ADDR must be an address of rank 0's own node",
        }.get(e.errno or 0, "set MASTER_ADDR/MASTER_PORT to an address and free port of "
                            "rank 0's node")
        raise TorchrunError(
            f"rank 0 cannot host the rendezvous store at {env.address} "
            f"({env.launcher} mode: MASTER_ADDR={env.master_addr}, "
            f"MASTER_PORT={env.master_port}): {e.strerror or e}; {fix}"
        ) from None
    # the store's server owns the descriptor from here on (it closes it)
    return TCPStore(env.master_addr, env.master_port, is_master=True,
                    master_listen_fd=sock.detach(), wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=60))


def init_world_process_group(env: TorchrunEnv, vllm_config: Any, timeout_s: float) -> None:
    """Join torch's default process group on torchrun's store, scoped to this attempt.

    vLLM would join it itself from an ``init_method``, on the bare store; but torchrun's static
    rendezvous keeps one store across restarts (``--max-restarts``), and a restarted world
    would then read the previous attempt's addresses. With the group already up, vLLM's
    ``init_distributed_environment`` builds its groups on top of it.

    On NCCL/RCCL this is the process's first NCCL group, and torch reads
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` as it builds each one: the executor's mode is applied
    first (:func:`keepalive_executor.nccl.apply_error_handling`), as on rank 0 and in every
    spawned worker.
    """
    import torch.distributed as dist
    from vllm.platforms import current_platform

    if dist.is_initialized():
        return
    nccl.apply_error_handling(current_platform.dist_backend)
    seconds = vllm_config.parallel_config.distributed_timeout_seconds
    kwargs = {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}
    store = dist.PrefixStore(env.key("world") + "/", connect_store(env, timeout_s))
    dist.init_process_group(
        backend=current_platform.dist_backend, store=store, rank=env.rank,
        world_size=env.world_size, **kwargs,
    )


def post_nonce(store: Any, env: TorchrunEnv) -> bytes:
    """A follower: post a fresh random nonce for this attempt (before it reads the
    bootstrap), for rank 0 to sign in; return it. ``set`` overwrites anything posted there
    before this rank started."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    store.set(env.key(f"nonce/{env.rank}"), nonce)
    return nonce


def wait_nonces(store: Any, env: TorchrunEnv, timeout_s: float, *, partial: bool = False
                ) -> list[bytes]:
    """Rank 0: every follower's nonce (rank 1's first), polled for up to ``timeout_s``.

    Past the bound, raise naming the missing ranks, or with ``partial`` use zeros for them
    (for a start-up error: the ranks that posted still learn of it). A value that is not a
    nonce (wrong length, posted by something else) is signed as zeros: that follower refuses
    the bootstrap, as it would any not bound to its own nonce.
    """
    keys = {r: env.key(f"nonce/{r}") for r in range(1, env.world_size)}
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r, k in keys.items() if not store.check([k])]
        if not missing:
            break
        if time.monotonic() >= deadline:
            if partial:
                logger.warning("ranks %s posted no nonce within %gs; they will refuse the "
                               "start-up error as stale", missing, timeout_s)
                break
            raise TorchrunError(
                f"rank 0: ranks {missing} posted no nonce on torchrun's store at "
                f"{env.address} within {timeout_s:g}s (VLLM_KEEPALIVE_STARTUP_TIMEOUT_S): "
                "they did not start, or cannot reach the store; see their logs, or raise "
                "the timeout"
            )
        time.sleep(0.05)
    zero = bytes(NONCE_BYTES)
    out = []
    for r, k in keys.items():
        value = bytes(store.get(k)) if r not in missing else zero
        out.append(value if len(value) == NONCE_BYTES else zero)
    return out


def post_bootstrap(store: Any, env: TorchrunEnv, payload: dict[str, Any], secret: bytes,
                   nonce_wait_s: float = 0.0, *, partial: bool = False) -> bool:
    """Publish the signed bootstrap once per attempt; False if something was there first.

    Waits (up to ``nonce_wait_s``) for every follower's nonce first and signs them in; see
    :func:`wait_nonces` for ``partial``.
    """
    return _post_bootstrap(store, env, payload, secret, nonce_wait_s, partial=partial) is not None


def _post_bootstrap(store: Any, env: TorchrunEnv, payload: dict[str, Any], secret: bytes,
                    nonce_wait_s: float, *, partial: bool) -> int | None:
    """:func:`post_bootstrap`, returning None if something was there first, else the number
    of followers whose nonces were signed in (the ranks that can accept it)."""
    claim = env.key("bootstrap-claim")
    if store.check([claim]):
        return None  # rank 0's other process posted first: no nonce to wait for
    nonces = wait_nonces(store, env, nonce_wait_s, partial=partial)
    if store.add(claim, 1) != 1:
        return None
    key = env.key("bootstrap")
    store.set(key, sign(secret, key, {"version": BOOTSTRAP_VERSION, **payload}, nonces))
    return _signed_count(nonces)


def _signed_in(raw: bytes) -> int:
    """How many followers' nonces a posted value holds (zeros stand for a rank that posted
    none in time): the ranks that can read it. Only for a value :func:`verify` accepted."""
    fields = _fields(bytes(raw))
    assert fields is not None, "only for a value verify() accepted"
    block = fields[2]
    return _signed_count([block[i : i + NONCE_BYTES]
                          for i in range(0, len(block), NONCE_BYTES)])


def post_error(store: Any, env: TorchrunEnv, message: str, secret: bytes,
               wait_s: float = 0.0, nonce_wait_s: float = ERROR_NONCE_WAIT_S) -> bool:
    """Tell every waiting rank that rank 0 will not start (first poster wins).

    Signed like the configuration, with the followers' nonces (waiting up to
    ``nonce_wait_s`` for them; a rank that posted none by then refuses it as stale, and
    fails on its own). With ``wait_s``, wait that long for every rank signed in to say it
    has read the error: torchrun stops the remaining ranks as soon as rank 0 exits, and each
    should have printed why first.
    """
    signed = _post_bootstrap(store, env, {"error": message}, secret, nonce_wait_s,
                             partial=True)
    posted = signed is not None
    # who can read it: the followers signed into it, by this call or by rank 0's other
    # process (one whose nonce came later refuses the error as stale and fails on its own,
    # so it never acknowledges)
    readers = signed
    if readers is None:
        key = env.key("bootstrap")
        with contextlib.suppress(Exception):
            store.wait([key], datetime.timedelta(seconds=5))
        try:
            raw = store.get(key)
            boot = verify(secret, key, raw)
        except Exception:  # noqa: BLE001 - not ours: the followers refuse it themselves
            return False
        if "error" not in boot:
            return False  # the configuration went out: the ranks learn of it otherwise
        readers = _signed_in(raw)
    # a hint, unsigned: the bootstrap is an error (a follower still importing vLLM reads it
    # then, without unpickling a configuration; the error itself is checked as ever)
    store.set(env.key(ERROR_HINT), b"1")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if store.add(env.key("error-seen"), 0) >= readers:
            break
        time.sleep(0.1)
    return posted


#: store key (per attempt) rank 0 sets once the bootstrap it posted is an error
ERROR_HINT = "bootstrap-is-error"


def watch_for_error(store: Any, env: TorchrunEnv, nonce: bytes, report: Any, stop: Any,
                    poll_s: float = 0.1) -> None:
    """A follower's watch while it imports vLLM (many seconds on a loaded machine, longer
    than rank 0 waits for acknowledgements): once rank 0 hints that its bootstrap is an error,
    read and check it (with this rank's ``nonce``) and call ``report(message)``. Ends when
    ``stop`` is set (the main thread read the bootstrap) or on any error (the main thread's
    own read reports those)."""
    hint = env.key(ERROR_HINT)
    try:
        while not stop.is_set():
            if store.check([hint]):
                # rank 0 signed the error: its secret exists by now
                secret, _ = load_secret(env, wait_s=5.0)
                key = env.key("bootstrap")
                boot = verify(secret, key, store.get(key), env.rank, nonce)
                if isinstance(boot, dict) and boot.get("error"):
                    report(str(boot["error"]))
                return
            time.sleep(poll_s)
    except Exception as e:  # noqa: BLE001 - the main thread reads the bootstrap itself
        logger.debug("rank %d: early error watch ended: %s", env.rank, e)


def wait_bootstrap(store: Any, env: TorchrunEnv, timeout_s: float, secret: bytes,
                   nonce: bytes) -> dict[str, Any]:
    """Poll (so that signals are handled, and without the warning torch logs for every
    timed-out ``wait``) for rank 0's bootstrap; check it (MAC, and that it holds ``nonce``,
    what :func:`post_nonce` posted for this rank), then unpickle it."""
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
    boot = verify(secret, key, store.get(key), env.rank, nonce)
    if not isinstance(boot, dict) or boot.get("version") != BOOTSTRAP_VERSION:
        version = boot.get("version") if isinstance(boot, dict) else type(boot).__name__
        raise TorchrunError(
            f"rank 0 sent bootstrap version {version}, this rank expects "
            f"{BOOTSTRAP_VERSION}: every node must run the same keepalive-executor"
        )
    return boot
