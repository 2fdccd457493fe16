"""torchrun mode's pure parts: reading torchrun's environment, the backend flag, keys."""

import subprocess
import sys

import pytest

from keepalive_executor.config import KeepaliveConfigError
from keepalive_executor.torchrun import (
    TorchrunEnv,
    TorchrunError,
    check_world_size,
    in_torchrun_mode,
    with_keepalive_backend,
)

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml

GOOD = {
    "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "3",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def test_reads_torchrun_environment():
    env = TorchrunEnv.from_environ(GOOD)
    assert (env.rank, env.local_rank, env.world_size) == (1, 0, 2)
    assert env.address == "10.0.0.5:29500"
    # Keys are private to the run and the restart attempt.
    assert env.key("bootstrap") == "keepalive_executor/job7/3/bootstrap"
    assert TorchrunEnv.from_environ({**GOOD, "MASTER_ADDR": "fd00::1"}).address == "[fd00::1]:29500"


def test_group_label_is_unique_per_call_and_names_the_attempt():
    env = TorchrunEnv.from_environ(GOOD)
    a, b = env.group_label(), env.group_label()
    assert a != b
    assert a.startswith("torchrun://10.0.0.5:29500:ka3-")
    # vLLM's CPU worker names its shared memory after the text following the last ":".
    assert "/" not in a.split(":")[-1]


@pytest.mark.parametrize("drop", ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                  "MASTER_PORT"])
def test_missing_variable_names_it_and_says_how_to_launch(drop):
    env = {k: v for k, v in GOOD.items() if k != drop}
    with pytest.raises(TorchrunError, match=f"{drop} not set.*torchrun --nproc-per-node"):
        TorchrunEnv.from_environ(env)


@pytest.mark.parametrize("change, match", [
    ({"RANK": "2"}, "outside WORLD_SIZE=2"),
    ({"RANK": "x"}, "malformed"),
    ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, "agent store"),
])
def test_unusable_environment_is_refused(change, match):
    with pytest.raises(TorchrunError, match=match):
        TorchrunEnv.from_environ({**GOOD, **change})


def test_backend_flag_is_added_kept_or_refused():
    assert with_keepalive_backend(["m", "-tp", "2"])[-2:] == [
        "--distributed-executor-backend", "keepalive"]
    kept = ["m", "--distributed-executor-backend", "keepalive"]
    assert with_keepalive_backend(kept) == kept
    assert with_keepalive_backend(["m", "--distributed_executor_backend=keepalive"]) == [
        "m", "--distributed_executor_backend=keepalive"]
    # a qualified class name passes here; the plugin takes only the keepalive executor's
    # (a negative control's, tests/controls.py) and refuses any other (test_plugin.py)
    named = ["m", "--distributed-executor-backend", "controls.NoKeepalives"]
    assert with_keepalive_backend(named) == named
    for bad in (["m", "--distributed-executor-backend", "mp"],
                ["m", "--distributed-executor-backend=ray"]):
        with pytest.raises(TorchrunError, match="under torchrun the executor is keepalive"):
            with_keepalive_backend(bad)


class _Parallel:
    def __init__(self, tp, pp=1, dp=1):
        self.tensor_parallel_size = tp
        self.pipeline_parallel_size = pp
        self.data_parallel_size = dp
        self.world_size = tp * pp


def test_world_size_must_equal_tp_times_pp():
    check_world_size(_Parallel(2), GOOD)
    check_world_size(_Parallel(1, 2), GOOD)
    with pytest.raises(KeepaliveConfigError,
                       match=r"WORLD_SIZE=2 ranks but .* needs 4 \(--tensor-parallel-size=2 x "
                             r"--pipeline-parallel-size=2\); pass -tp and -pp whose product is 2"):
        check_world_size(_Parallel(2, 2), GOOD)


def test_data_parallelism_is_refused_in_torchrun_mode_naming_the_flag_and_the_way_out():
    with pytest.raises(KeepaliveConfigError,
                       match=r"--data-parallel-size=2 is not supported in keepalive's torchrun "
                             r"mode: .* one torchrun per replica"):
        check_world_size(_Parallel(1, dp=2), GOOD)  # even where tp x pp x dp = WORLD_SIZE


def test_mode_marker():
    assert in_torchrun_mode({"KEEPALIVE_EXECUTOR_LAUNCHER": "torchrun"})
    assert not in_torchrun_mode({})


def test_entry_point_outside_torchrun_is_a_clear_usage_error():
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "keepalive_executor", "serve", "m"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "must run under torchrun (or srun, or mpirun); RANK, LOCAL_RANK" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "keepalive_executor", "bogus"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown command 'bogus'" in bad.stderr


# ---------------------------------------------------------------- bootstrap on a real store

SECRET = b"s" * 32


@pytest.fixture
def store_env(tcp_store):
    """The store server and a rank-1 view of torchrun's environment pointing at it."""
    server, port, _ = tcp_store
    env = TorchrunEnv.from_environ({**GOOD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return server, env


def test_bootstrap_first_poster_wins_and_round_trips(store_env):
    from keepalive_executor.torchrun.bootstrap import (
        connect_store,
        post_bootstrap,
        post_nonce,
        wait_bootstrap,
    )

    store, env = store_env
    client = connect_store(env, timeout_s=10)
    nonce = post_nonce(client, env)  # the follower (rank 1) first
    assert post_bootstrap(store, env, {"vllm_config": {"model": "m"}, "spec": 1}, SECRET)
    assert not post_bootstrap(store, env, {"error": "too late"}, SECRET)  # the first stays
    boot = wait_bootstrap(client, env, 5, SECRET, nonce)
    assert boot["vllm_config"] == {"model": "m"} and boot["spec"] == 1


def test_bootstrap_wait_times_out_with_a_clear_error(store_env):
    from keepalive_executor.torchrun.bootstrap import wait_bootstrap

    store, env = store_env
    with pytest.raises(TorchrunError, match="rank 0 published no configuration within 1.5s"):
        wait_bootstrap(store, env, 1.5, SECRET, bytes(16))


def test_bootstrap_from_another_version_is_refused(store_env):
    from keepalive_executor.torchrun.bootstrap import post_nonce, sign, wait_bootstrap

    store, env = store_env
    key = env.key("bootstrap")
    nonce = post_nonce(store, env)
    store.set(key, sign(SECRET, key, {"version": 99, "error": None}, [nonce]))
    with pytest.raises(TorchrunError, match="bootstrap version 99.*same keepalive-executor"):
        wait_bootstrap(store, env, 5, SECRET, nonce)


class _Payload:
    """Unpickling this runs code: it creates the file named at construction."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("forgery", ["unsigned", "other-secret", "other-key"])
def test_a_forged_bootstrap_is_refused_before_anything_is_unpickled(store_env, tmp_path,
                                                                    forgery):
    import os
    import pickle

    from keepalive_executor.torchrun.bootstrap import (
        BOOTSTRAP_VERSION,
        post_nonce,
        sign,
        wait_bootstrap,
    )

    store, env = store_env
    marker = tmp_path / "pwned"
    key = env.key("bootstrap")
    nonce = post_nonce(store, env)
    evil = {"version": BOOTSTRAP_VERSION, "vllm_config": _Payload(str(marker))}
    raw = {"unsigned": pickle.dumps(evil),
           "other-secret": sign(b"x" * 32, key, evil, [nonce]),
           # a value really signed by this deployment, but for another attempt's key
           "other-key": sign(SECRET, env.key("bootstrap") + "-old", evil, [nonce])}[forgery]
    store.set(key, raw)
    needle = "not signed" if forgery == "unsigned" else "failed authentication"
    with pytest.raises(TorchrunError, match=needle):
        wait_bootstrap(store, env, 5, SECRET, nonce)
    assert not os.path.exists(marker), "the forged bootstrap ran code"
    # negative control: the same payload, unpickled without the check, does run code
    pickle.loads(pickle.dumps(evil))
    assert os.path.exists(marker)


def test_secret_sources_and_their_errors(tmp_path, monkeypatch):
    from keepalive_executor.torchrun.bootstrap import (
        create_node_secret,
        load_secret,
        node_secret_path,
    )

    two_nodes = TorchrunEnv.from_environ({**GOOD, "LOCAL_WORLD_SIZE": "1"})
    one_node = TorchrunEnv.from_environ({**GOOD, "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(TorchrunError, match="several nodes .* needs a shared secret.*"
                                            "VLLM_KEEPALIVE_SECRET"):
        load_secret(two_nodes, {})
    assert load_secret(two_nodes, {"VLLM_KEEPALIVE_SECRET": "k" * 16})[0] == b"k" * 16
    with pytest.raises(TorchrunError, match="at least 16"):
        load_secret(two_nodes, {"VLLM_KEEPALIVE_SECRET": "short"})
    f = tmp_path / "key"
    f.write_text("f" * 40 + "\n")
    f.chmod(0o644)
    with pytest.raises(TorchrunError, match="readable by group or others.*chmod 600"):
        load_secret(two_nodes, {"VLLM_KEEPALIVE_SECRET_FILE": str(f)})
    f.chmod(0o600)
    assert load_secret(two_nodes, {"VLLM_KEEPALIVE_SECRET_FILE": str(f)})[0] == b"f" * 40
    # one node, nothing set: the per-run secret rank 0 creates in a private directory
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    environ = {"XDG_RUNTIME_DIR": str(runtime)}
    path = create_node_secret(one_node, environ)
    assert path == node_secret_path(one_node, environ)
    assert oct(os_mode(path)) == oct(0o600)
    secret, source = load_secret(one_node, environ)
    assert len(secret) == 64 and "per-run secret" in source
    runtime.chmod(0o755)  # a directory others can enter is refused
    with pytest.raises(TorchrunError, match="mode 700"):
        load_secret(one_node, environ)


def test_a_runtime_dir_that_does_not_exist_falls_back_to_tmp_with_a_warning(tmp_path,
                                                                            caplog):
    """srun exports the login shell's environment, so XDG_RUNTIME_DIR on a compute node can
    name a directory that only exists on the login node (or is gone with the last session
    there). The per-run secret of a one-node run then goes to the /tmp directory, with one
    warning naming the variable, on rank 0 and on the followers alike: never a traceback."""
    import logging
    import os

    from keepalive_executor.torchrun.bootstrap import create_node_secret, load_secret

    one_node = TorchrunEnv.from_environ({**GOOD, "LOCAL_WORLD_SIZE": "2",
                                         "TORCHELASTIC_RUN_ID": f"xdg-{tmp_path.name}"})
    environ = {"XDG_RUNTIME_DIR": str(tmp_path / "run" / "user" / "1000")}
    with caplog.at_level(logging.WARNING, logger="vllm.keepalive_executor"):
        path = create_node_secret(one_node, environ)
        try:
            assert os.path.dirname(path) == f"/tmp/keepalive-executor-{os.getuid()}"
            secret, source = load_secret(one_node, environ)
            assert len(secret) == 64 and path in source
        finally:
            os.unlink(path)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and all("XDG_RUNTIME_DIR" in m and "does not exist" in m for m in warned)
    assert len(warned[0].splitlines()) == 1, warned


def os_mode(path):
    import os
    import stat

    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_follower_prints_rank_0s_error_before_it_acknowledges_it(store_env):
    """Rank 0 exits once the error is acknowledged and torchrun then kills this rank: the
    line must be written by then. The stream reads the store's acknowledgement count at the
    moment the line is written; with the acknowledgement first (one way a CI run could have
    lost the line: the print then waited for the GIL an importing main thread held) it reads
    1, and this test fails (seen, with the two statements swapped)."""
    from keepalive_executor.torchrun.cli import StartErrorReport

    store, env = store_env
    key = env.key("error-seen")
    written = []

    class Stream:
        def write(self, text):
            if text.strip():
                written.append((text, store.add(key, 0)))
            return len(text)

        def flush(self):
            pass

    assert StartErrorReport(store, env, out=Stream()).report("boom")
    assert written == [("error: rank 1 not starting: rank 0 reported: boom", 0)]
    assert store.add(key, 0) == 1  # and then acknowledged


def test_the_second_reader_of_rank_0s_error_returns_only_after_the_first_has_said_it(
        store_env):
    """A follower reads rank 0's error on two threads (the watch during vLLM's import, the
    main thread after it). The main thread exits the process once it returns, so it must not
    return while the watch is still printing. Here the watch's write blocks until released:
    the main thread's call is still waiting 0.5 s later, then returns False once the line is
    out, and the line and the acknowledgement each happened once. Negative control (seen):
    with the first-come lock taken without blocking, as before, the second call returned at
    once and this test failed."""
    import threading

    from keepalive_executor.torchrun.cli import StartErrorReport

    store, env = store_env
    key = env.key("error-seen")
    writing, release = threading.Event(), threading.Event()
    lines = []

    class Stream:
        def write(self, text):
            if text.strip():
                writing.set()
                assert release.wait(10)
                lines.append(text)
            return len(text)

        def flush(self):
            pass

    report = StartErrorReport(store, env, out=Stream())
    first: list = []
    watch = threading.Thread(target=lambda: first.append(report.report("boom")))
    watch.start()
    assert writing.wait(10)  # the watch is inside its print
    second: list = []
    main = threading.Thread(target=lambda: second.append(report.report("boom")))
    main.start()
    main.join(0.5)
    assert main.is_alive() and second == []  # still waiting for the watch's line
    release.set()
    watch.join(10)
    main.join(10)
    assert first == [True] and second == [False]
    assert lines == ["error: rank 1 not starting: rank 0 reported: boom"]
    assert store.add(key, 0) == 1


@pytest.mark.parametrize("nonce_posted", [False, True], ids=["no-nonce", "control-nonce"])
def test_an_error_waits_for_no_acknowledgement_from_a_rank_that_cannot_read_it(store_env,
                                                                              nonce_posted):
    """A follower whose nonce was not there when the error was signed refuses the error as
    stale and never acknowledges it: rank 0 does not wait for it (it used to wait the whole
    bound). Control: the same rank with its nonce posted, which does not acknowledge either,
    is waited for until the bound."""
    import time

    from keepalive_executor.torchrun.bootstrap import post_error, post_nonce

    store, env = store_env
    if nonce_posted:
        post_nonce(store, env)
    t0 = time.monotonic()
    assert post_error(store, env, "boom", SECRET, wait_s=3, nonce_wait_s=0.2)
    waited = time.monotonic() - t0
    if nonce_posted:
        assert waited >= 3
    else:
        assert waited < 2


@pytest.mark.parametrize("acknowledged", [True, False], ids=["acknowledged", "control-silent"])
def test_rank_0s_second_error_post_waits_only_for_the_ranks_the_first_signed_in(store_env,
                                                                                 acknowledged):
    """Rank 0 has two posters: the engine process (`tell_error`, no wait for readers) and
    then the launcher (`_lead`, which waits for the acknowledgements). With rank 2's nonce
    never posted, the launcher used to wait for that nonce again, before finding the claim
    taken, then for rank 2's acknowledgement of an error it cannot read (the bounds here are
    6 s each; 30 s and 60 s in production). Control: rank 1, signed in, does not acknowledge,
    and is waited for until the bound."""
    import time

    from keepalive_executor.torchrun.bootstrap import post_error, post_nonce

    store, env1 = store_env
    world = {**GOOD, "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(env1.master_port)}
    rank1, rank0 = (TorchrunEnv.from_environ({**world, "RANK": r}) for r in ("1", "0"))
    post_nonce(store, rank1)  # rank 2 never posts one
    assert post_error(store, rank0, "engine: boom", SECRET, nonce_wait_s=0.2)  # the engine
    if acknowledged:
        store.add(rank1.key("error-seen"), 1)  # rank 1 read it
    t0 = time.monotonic()
    assert not post_error(store, rank0, "launcher: boom", SECRET,
                          wait_s=6 if acknowledged else 3, nonce_wait_s=6)
    waited = time.monotonic() - t0
    if acknowledged:
        assert waited < 2
    else:
        assert 3 <= waited < 5


def test_error_post_waits_for_the_other_ranks_to_have_read_it(store_env):
    import threading
    import time

    from keepalive_executor.torchrun.bootstrap import (
        post_bootstrap,
        post_error,
        post_nonce,
        wait_bootstrap,
    )

    store, env = store_env
    seen = {}

    def follower():
        time.sleep(0.3)  # rank 0 is first here: the error waits for this rank's nonce
        boot = wait_bootstrap(store, env, 10, SECRET, post_nonce(store, env))
        time.sleep(0.5)  # a slow reader: rank 0 must still be there when it acknowledges
        store.add(env.key("error-seen"), 1)
        seen["error"] = boot["error"]

    t = threading.Thread(target=follower)
    t.start()
    t0 = time.monotonic()
    assert post_error(store, env, "boom", SECRET, wait_s=10)
    waited = time.monotonic() - t0
    t.join(10)
    assert seen == {"error": "boom"}
    assert 0.4 < waited < 9  # waited for the acknowledgement, not for the whole bound
    # After the configuration went out, a later error does not wait for acknowledgements.
    store2_env = TorchrunEnv.from_environ({**GOOD, "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": str(env.master_port),
                                           "TORCHELASTIC_RESTART_COUNT": "4"})
    post_nonce(store, store2_env)
    post_bootstrap(store, store2_env, {"vllm_config": {}, "spec": None}, SECRET)
    t0 = time.monotonic()
    assert not post_error(store, store2_env, "late", SECRET, wait_s=10)
    assert time.monotonic() - t0 < 2


def test_a_follower_process_refuses_a_forged_bootstrap_and_runs_nothing(store_env, tmp_path):
    """The real follower (`python -m keepalive_executor serve` as rank 1) finds a bootstrap
    on torchrun's store that another secret signed: it exits 1 naming the cause, and the
    payload, which would create a file if unpickled, never ran."""
    import os

    from keepalive_executor.torchrun.bootstrap import sign

    store, env = store_env
    marker = tmp_path / "pwned"
    key = env.key("bootstrap")
    store.set(key, sign(b"x" * 32, key, {"version": 3, "vllm_config": _Payload(str(marker))},
                        [bytes(16)]))
    child_env = {**GOOD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(env.master_port),
                 "VLLM_KEEPALIVE_SECRET": SECRET.decode(), "PATH": os.environ["PATH"],
                 "VLLM_KEEPALIVE_STARTUP_TIMEOUT_S": "20"}
    proc = subprocess.run([sys.executable, "-m", "keepalive_executor", "serve", "m"],
                          env=child_env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "rank 1 not starting" in out and "failed authentication (HMAC mismatch)" in out
    assert not marker.exists()


def test_multimodal_shm_cache_is_refused_in_torchrun_mode_naming_the_flag():
    from types import SimpleNamespace

    from keepalive_executor.torchrun import check_features

    def cfg(cache_type):
        mm = None if cache_type is None else SimpleNamespace(mm_processor_cache_type=cache_type)
        return SimpleNamespace(model_config=SimpleNamespace(multimodal_config=mm))

    check_features(cfg(None))  # a text model: nothing to refuse
    check_features(cfg("lru"))
    with pytest.raises(KeepaliveConfigError, match="--mm-processor-cache-type shm.*lru"):
        check_features(cfg("shm"))


# ---------------------------------------------------------------- the per-run secret file


def _old_create_node_secret(env, environ):
    """The scheme before issue 14 (kept here for the negative control): the file is created
    at its final path, then written."""
    import contextlib
    import os
    import secrets

    from keepalive_executor.torchrun import bootstrap

    path = bootstrap.node_secret_path(env, environ)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        bootstrap._write_secret(f, secrets.token_hex(32))
    return path


@pytest.mark.parametrize("scheme", ["atomic", "negative-control-old-create-then-write"])
def test_a_follower_racing_the_secret_writer_never_sees_a_short_key(tmp_path, monkeypatch,
                                                                   scheme):
    """Rank 0 pauses between creating the secret file and writing it; a follower polls for
    the file meanwhile. With the rename it finds the whole secret; with the old scheme the
    file exists, empty, during the pause (and the old follower verified with that empty key)."""
    import os
    import threading
    import time

    from keepalive_executor.torchrun import bootstrap

    one_node = TorchrunEnv.from_environ({**GOOD, "LOCAL_WORLD_SIZE": "2"})
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    environ = {"XDG_RUNTIME_DIR": str(runtime)}
    path = bootstrap.node_secret_path(one_node, environ)
    created = threading.Event()
    real_write = bootstrap._write_secret

    def slow_write(f, value):
        created.set()
        time.sleep(0.5)  # the window between create and write
        real_write(f, value)

    monkeypatch.setattr(bootstrap, "_write_secret", slow_write)
    create = bootstrap.create_node_secret if scheme == "atomic" else _old_create_node_secret
    writer = threading.Thread(target=create, args=(one_node, environ))
    writer.start()
    assert created.wait(5)
    # what a follower reading during the window gets
    raw_in_window = open(path, "rb").read() if os.path.exists(path) else None
    try:
        secret = bootstrap.load_secret(one_node, environ, wait_s=5)[0]
        refused = None
    except TorchrunError as e:
        secret, refused = None, str(e)
    writer.join(5)
    if scheme == "atomic":
        assert raw_in_window is None  # nothing at the path until it is complete
        assert secret == open(path, "rb").read().strip() and len(secret) == 64
        assert not [p for p in os.listdir(runtime) if p.endswith(".tmp")]  # no leftovers
    else:
        assert raw_in_window == b""  # the old scheme exposed an empty key
        # and the length check, now on every source, refuses it rather than verify with it
        assert refused and "is 0 bytes; it must be at least 16" in refused


def test_a_short_or_missing_per_run_secret_file_is_refused_clearly(tmp_path):
    import os

    from keepalive_executor.torchrun.bootstrap import load_secret, node_secret_path

    one_node = TorchrunEnv.from_environ({**GOOD, "LOCAL_WORLD_SIZE": "2"})
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    environ = {"XDG_RUNTIME_DIR": str(runtime)}
    with pytest.raises(TorchrunError, match=r"per-run secret file .* does not exist .*waited "
                                            r"0.2s, VLLM_KEEPALIVE_STARTUP_TIMEOUT_S"):
        load_secret(one_node, environ, wait_s=0.2)
    path = node_secret_path(one_node, environ)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"abc\n")
    os.close(fd)
    with pytest.raises(TorchrunError, match=r"the per-run secret file .* is 3 bytes; it must "
                                            r"be at least 16: .*remove it and restart"):
        load_secret(one_node, environ, wait_s=5)


# ---------------------------------------------------------------- bootstraps bound to a launch


def _store_server():
    """Another real TCPStore server on loopback: a later launch's torchrun agent."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TCPStore("127.0.0.1", port, is_master=True,
                    timeout=datetime.timedelta(seconds=10)), port


def _follower(port: int) -> subprocess.Popen:
    """The real rank 1 (`python -m keepalive_executor serve`) of a launch on that store."""
    import os

    child_env = {**GOOD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "VLLM_KEEPALIVE_SECRET": SECRET.decode(), "PATH": os.environ["PATH"],
                 "VLLM_KEEPALIVE_STARTUP_TIMEOUT_S": "60"}
    return subprocess.Popen([sys.executable, "-m", "keepalive_executor", "serve", "m"],
                            env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_a_bootstrap_recorded_from_one_launch_is_refused_in_a_later_one(store_env, tmp_path):
    """Launch 1: a real follower posts its nonce, rank 0 (this test) signs a bootstrap with
    it, the follower accepts it (and, as the payload shows, unpickles it). The value is
    recorded. Launch 2, a fresh store as a new torchrun's, the same run id ``none``-style key
    and the same secret: the recording is posted first, and the new real follower refuses it
    as replayed before unpickling anything. Negative control: the same recording, checked
    against launch 1's nonce (which is all the old scheme had: nothing new per launch),
    passes and runs the payload."""
    from keepalive_executor.torchrun.bootstrap import post_bootstrap, verify

    store1, env = store_env
    marker = tmp_path / "pwned"
    key = env.key("bootstrap")
    proc = _follower(env.master_port)
    try:
        assert post_bootstrap(store1, env, {"error": _Payload(str(marker))}, SECRET,
                              nonce_wait_s=120)
        out1, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "rank 1 not starting: rank 0 reported" in out1, out1[-3000:]
    assert marker.exists()  # launch 1 accepted the value and unpickled it: a genuine one
    recorded = bytes(store1.get(key))
    nonce1 = bytes(store1.get(env.key("nonce/1")))
    marker.unlink()

    store2, port2 = _store_server()  # launch 2
    store2.set(key, recorded)  # the attacker posts the recording first
    proc = _follower(port2)
    try:
        out2, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 1, out2[-3000:]
    assert "rank 1 not starting" in out2 and "replayed or stale bootstrap" in out2, out2[-3000:]
    assert not marker.exists(), "the replayed bootstrap was unpickled"
    # negative control: without a fresh nonce the recording checks out, and runs
    verify(SECRET, key, recorded, 1, nonce1)
    assert marker.exists()


def test_rank0_waits_for_every_follower_nonce_and_names_the_missing_ranks(store_env):
    import time

    from keepalive_executor.torchrun.bootstrap import post_bootstrap, post_nonce

    store, env1 = store_env
    three = {**GOOD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(env1.master_port),
             "WORLD_SIZE": "3", "RANK": "1"}
    rank1 = TorchrunEnv.from_environ(three)
    post_nonce(store, rank1)  # rank 2 never posts
    t0 = time.monotonic()
    with pytest.raises(TorchrunError, match=r"ranks \[2\] posted no nonce .* within 0.5s "
                                            r"\(VLLM_KEEPALIVE_STARTUP_TIMEOUT_S\)"):
        post_bootstrap(store, rank1, {"vllm_config": {}}, SECRET, nonce_wait_s=0.5)
    assert 0.4 < time.monotonic() - t0 < 5
    assert not store.check([rank1.key("bootstrap")])  # nothing was posted or claimed
    assert store.add(rank1.key("bootstrap-claim"), 0) == 0


def test_a_nonce_posted_by_someone_else_cannot_make_a_follower_accept_a_replay(store_env):
    """An attacker pre-posts rank 1's nonce. If the follower's own comes after it (set
    overwrites), rank 0 signs the follower's: accepted. If rank 0 signs the attacker's, the
    follower refuses: at worst a denial of service, never an accepted stale value."""
    from keepalive_executor.torchrun.bootstrap import post_bootstrap, post_nonce, wait_bootstrap

    store, env = store_env
    store.set(env.key("nonce/1"), b"A" * 16)
    nonce = post_nonce(store, env)
    assert post_bootstrap(store, env, {"vllm_config": {"m": 1}}, SECRET)
    assert wait_bootstrap(store, env, 5, SECRET, nonce)["vllm_config"] == {"m": 1}
    # the next attempt: rank 0 signs before the follower's nonce overwrote the attacker's
    later = TorchrunEnv.from_environ({**GOOD, "MASTER_ADDR": "127.0.0.1",
                                      "MASTER_PORT": str(env.master_port),
                                      "TORCHELASTIC_RESTART_COUNT": "4"})
    store.set(later.key("nonce/1"), b"A" * 16)
    assert post_bootstrap(store, later, {"vllm_config": {"m": 2}}, SECRET)
    with pytest.raises(TorchrunError, match="replayed or stale bootstrap"):
        wait_bootstrap(store, later, 5, SECRET, post_nonce(store, later))


@pytest.mark.parametrize("backend, mine, expected", [
    ("nccl", None, "2"),  # the executor's mode: abort the communicators, keep the process
    ("nccl", "3", "3"),  # the user's choice stands
    ("gloo", None, None),  # not NCCL: nothing set
])
def test_a_follower_sets_nccls_error_handling_before_it_builds_the_world_group(
        monkeypatch, backend, mine, expected):
    """torch reads TORCH_NCCL_ASYNC_ERROR_HANDLING when it builds each NCCL group, the default
    group included: a torchrun follower's must be built under the executor's mode, as rank
    0's and every spawned worker's are (issue 28, edge 2: it was set only later, in
    run_worker, so the follower's world group kept torch's mode 3, SIGABRT on a timeout)."""
    import os
    from types import SimpleNamespace

    import torch.distributed as dist
    from vllm.platforms import current_platform

    from keepalive_executor import nccl
    from keepalive_executor.torchrun import bootstrap

    if mine is None:
        monkeypatch.delenv(nccl.ENV_NCCL_ERROR_HANDLING, raising=False)
    else:
        monkeypatch.setenv(nccl.ENV_NCCL_ERROR_HANDLING, mine)
    monkeypatch.setattr(current_platform, "dist_backend", backend)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(bootstrap, "connect_store", lambda env, timeout_s=None: dist.HashStore())
    built: list[tuple[str, str | None]] = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: built.append(
        (kw["backend"], os.environ.get(nccl.ENV_NCCL_ERROR_HANDLING))))
    config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_timeout_seconds=None))
    bootstrap.init_world_process_group(TorchrunEnv.from_environ(GOOD), config, 5.0)
    assert built == [(backend, expected)]
