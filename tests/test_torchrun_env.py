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
    for bad in (["m", "--distributed-executor-backend", "mp"],
                ["m", "--distributed-executor-backend=ray"]):
        with pytest.raises(TorchrunError, match="under torchrun the executor is keepalive"):
            with_keepalive_backend(bad)


class _Parallel:
    def __init__(self, tp, pp=1):
        self.tensor_parallel_size = tp
        self.pipeline_parallel_size = pp
        self.world_size = tp * pp


def test_world_size_must_equal_tp_times_pp():
    check_world_size(_Parallel(2), GOOD)
    check_world_size(_Parallel(1, 2), GOOD)
    with pytest.raises(KeepaliveConfigError,
                       match=r"WORLD_SIZE=2 ranks but .* needs 4 \(--tensor-parallel-size=2 x "
                             r"--pipeline-parallel-size=2\); pass -tp and -pp whose product is 2"):
        check_world_size(_Parallel(2, 2), GOOD)


def test_mode_marker():
    assert in_torchrun_mode({"KEEPALIVE_EXECUTOR_LAUNCHER": "torchrun"})
    assert not in_torchrun_mode({})


def test_entry_point_outside_torchrun_is_a_clear_usage_error():
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "keepalive_executor", "serve", "m"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "must run under torchrun; RANK, LOCAL_RANK" in proc.stderr
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
        wait_bootstrap,
    )

    store, env = store_env
    client = connect_store(env, timeout_s=10)
    assert post_bootstrap(store, env, {"vllm_config": {"model": "m"}, "spec": 1}, SECRET)
    assert not post_bootstrap(store, env, {"error": "too late"}, SECRET)  # the first stays
    boot = wait_bootstrap(client, env, 5, SECRET)
    assert boot["vllm_config"] == {"model": "m"} and boot["spec"] == 1


def test_bootstrap_wait_times_out_with_a_clear_error(store_env):
    from keepalive_executor.torchrun.bootstrap import wait_bootstrap

    store, env = store_env
    with pytest.raises(TorchrunError, match="rank 0 published no configuration within 1.5s"):
        wait_bootstrap(store, env, 1.5, SECRET)


def test_bootstrap_from_another_version_is_refused(store_env):
    from keepalive_executor.torchrun.bootstrap import sign, wait_bootstrap

    store, env = store_env
    key = env.key("bootstrap")
    store.set(key, sign(SECRET, key, {"version": 99, "error": None}))
    with pytest.raises(TorchrunError, match="bootstrap version 99.*same keepalive-executor"):
        wait_bootstrap(store, env, 5, SECRET)


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

    from keepalive_executor.torchrun.bootstrap import sign, wait_bootstrap

    store, env = store_env
    marker = tmp_path / "pwned"
    key = env.key("bootstrap")
    evil = {"version": 2, "vllm_config": _Payload(str(marker))}
    raw = {"unsigned": pickle.dumps(evil),
           "other-secret": sign(b"x" * 32, key, evil),
           # a value really signed by this deployment, but for another attempt's key
           "other-key": sign(SECRET, env.key("bootstrap") + "-old", evil)}[forgery]
    store.set(key, raw)
    needle = "not signed" if forgery == "unsigned" else "failed authentication"
    with pytest.raises(TorchrunError, match=needle):
        wait_bootstrap(store, env, 5, SECRET)
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


def os_mode(path):
    import os
    import stat

    return stat.S_IMODE(os.stat(path).st_mode)


def test_error_post_waits_for_the_other_ranks_to_have_read_it(store_env):
    import threading
    import time

    from keepalive_executor.torchrun.bootstrap import post_bootstrap, post_error, wait_bootstrap

    store, env = store_env
    seen = {}

    def follower():
        boot = wait_bootstrap(store, env, 10, SECRET)
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
    store.set(key, sign(b"x" * 32, key, {"version": 2, "vllm_config": _Payload(str(marker))}))
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
