"""What a supervisor sees (keepalive_executor/supervision.py), and what an operator scrapes
(keepalive's /metrics series, metrics.py and collector.py) on a real `vllm serve`.

Without an engine: `vllm serve`'s command is wrapped where vLLM binds it, and the wrapper's
exit status follows the run's failure records; the front end's watch, between real
processes. With real `vllm serve` servers under a child subreaper (tests/subreaper.py, as
systemd or a container runtime is one): the API server SIGKILLed ends the engine process
(non-zero) and its ranks within a bound, and the negative control (controls.NoSupervision)
leaves them running; before that, the keepalive series on its /metrics follow what the
executor does, and the control (no snapshot) has none. The exit status after a worker's
death, and its control: test_serve.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import lanes
import psutil
import pytest
from run_engine import HERE
from servers import Server
from test_metrics import scrape

from keepalive_executor import exit_codes, run_dir
from keepalive_executor.supervision import FRONTEND_GONE_EXIT_S, serve_with_exit_status

#: API server SIGKILLed -> every process of the engine gone: the watch's reaction is a pidfd
#: wake-up, then FRONTEND_GONE_EXIT_S; seen 1.15 s here. A bound for a loaded machine.
GONE_BOUND_S = FRONTEND_GONE_EXIT_S + 9.0
#: the control: still running this long after its API server was killed
CONTROL_ALIVE_S = 15.0
#: --distributed-timeout-seconds of the pair: a keepalive interval of 1 s
TIMEOUT = "4"
INTERVAL_S = 1.0


@pytest.fixture
def run(tmp_path, monkeypatch):
    base = tmp_path / "rt"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.delenv(run_dir.FRONTEND_ENV, raising=False)


@pytest.mark.fast
def test_the_serve_command_exits_1_after_a_recorded_failure_and_0_after_a_clean_end(run):
    def failing() -> None:
        run_dir.record_failure("worker rank 1 (pid 7) died unexpectedly (exit code -9)")

    assert serve_with_exit_status(failing) == exit_codes.FAILED
    assert run_dir.failures(os.getpid()) == []  # the run directory is gone with the command
    assert serve_with_exit_status(lambda: None) == exit_codes.OK
    assert serve_with_exit_status(lambda: sys.exit(0)) == exit_codes.OK
    with pytest.raises(SystemExit) as e:  # vLLM's own non-zero exit is kept
        serve_with_exit_status(lambda: sys.exit(3))
    assert e.value.code == 3


@pytest.mark.fast
def test_vllms_cli_binds_the_wrapped_serve_command():
    """In a fresh process, as `vllm` does (vllm/entrypoints/cli/main.py): the plugin loads
    while the serve subcommand's parser is built, before the command is bound to it."""
    script = textwrap.dedent("""
        from vllm import platforms
        if platforms.current_platform.is_unspecified():  # 0.33/0.34's wheels beside CPU torch
            from vllm.platforms.cpu import CpuPlatform  # (as vLLM's own `vllm bench` does)
            platforms.current_platform = CpuPlatform()
        import vllm.entrypoints.cli.serve as serve
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = FlexibleArgumentParser()
        subparsers = parser.add_subparsers(dest="subparser")
        for cmd in serve.cmd_init():
            cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
        args = parser.parse_args(["serve", "some-model"])
        print(getattr(args.dispatch_function, "_keepalive_exit_status", False))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "True"


STOPPED = textwrap.dedent("""
    # an engine process asked to stop by a signal, whose rank then dies on its way down
    import os, signal, sys
    from keepalive_executor import run_dir
    from keepalive_executor.protections import Protections
    from keepalive_executor.reporting import Reporting
    run_dir.claim(force=True)
    seen = []
    signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))  # as vLLM's engine process
    report = Reporting(Protections())
    report.watch_frontend(on_gone=print, end_ranks=lambda: None)
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
    report.failed("worker rank 1 (pid 7) died unexpectedly (exit code 0)")
    print(seen == [signal.SIGTERM] or sys.argv[1] != "signal", len(run_dir.failures()))
""")


@pytest.mark.fast
def test_a_failure_after_a_stop_signal_is_not_recorded_and_the_previous_handler_runs(run):
    """A group-wide SIGTERM or Ctrl-C reaches the ranks too: the failure their going down
    causes is no failure of the run. Without the signal (the control) it is recorded."""
    outcomes = {}
    for how in ("signal", "none"):
        out = subprocess.run([sys.executable, "-c", STOPPED, how], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        outcomes[how] = out.stdout.split()[-2:]
    assert outcomes == {"signal": ["True", "0"], "none": ["True", "1"]}


WATCHED = textwrap.dedent("""
    # the engine process: watches its parent (the front end) as keepalive's engine does
    import os, sys, time
    from keepalive_executor.supervision import FrontendWatch
    out = sys.argv[1]
    def note(what):
        with open(out, "a") as f:
            f.write(what + "\\n")
    watch = FrontendWatch.for_this_engine(lambda reason: note("gone: " + reason),
                                          lambda: note("ranks ended"))
    watch.start()
    if sys.argv[2] == "stop":
        watch.stop()  # a shutdown began: the front end may end first
    note("watching")
    time.sleep(600)
""")
FRONT_END = textwrap.dedent("""
    import os, subprocess, sys, time
    from keepalive_executor import run_dir
    run_dir.claim(force=True)
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
    time.sleep(600)
""")


@contextlib.contextmanager
def _under_subreaper(status: Path, notes: Path, ready: str, timeout_s: float, *argv: str,
                     env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """``python -c ARGV...`` under tests/subreaper.py (each ended process's status to
    ``status``), once ``ready`` is in ``notes``; whatever is left is killed on the way out."""
    reaper = subprocess.Popen([sys.executable, str(HERE / "subreaper.py"), str(status), "--",
                               sys.executable, "-c", *argv], env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while ready not in (notes.read_text() if notes.exists() else ""):
            assert time.monotonic() < deadline and reaper.poll() is None
            time.sleep(0.05)
        yield reaper
    finally:
        if reaper.poll() is None:
            for p in psutil.Process(reaper.pid).children(recursive=True):
                p.kill()
            reaper.kill()


def _ended(status: Path) -> dict[int, dict]:
    """The subreaper's status lines, by pid."""
    return {line["pid"]: line for line in map(json.loads, status.read_text().splitlines())}


@pytest.mark.fast
@pytest.mark.parametrize("stopped", [False, True], ids=["watching", "stopped-control"])
def test_the_engine_ends_with_its_front_end_unless_its_shutdown_began(tmp_path, run, stopped):
    notes = tmp_path / "notes"
    status = tmp_path / "status"
    with _under_subreaper(status, notes, "watching", 60, FRONT_END, WATCHED, str(notes),
                          "stop" if stopped else "go") as reaper:
        [front_end] = psutil.Process(reaper.pid).children()
        [engine] = front_end.children()
        front_end.kill()
        t0 = time.time()
        if stopped:  # the control: nothing happens
            time.sleep(FRONTEND_GONE_EXIT_S + 2)
            assert engine.is_running() and notes.read_text() == "watching\n"
            engine.kill()
        reaper.wait(30)
        ended = _ended(status)
        if not stopped:
            assert ended[engine.pid]["code"] == exit_codes.ORPHANED, ended
            assert ended[engine.pid]["at"] - t0 < FRONTEND_GONE_EXIT_S + 5
            assert notes.read_text().splitlines()[1:] == [
                f"gone: the process that started this engine (pid {front_end.pid}, vLLM's "
                "front end) is gone; this engine and its ranks end with it", "ranks ended"]


ENGINE_STARTER = textwrap.dedent("""
    # a front end that starts its engine process as vLLM's does, then waits
    import multiprocessing, sys, time
    from keepalive_executor import run_dir
    method, notes, claim = sys.argv[1:4]
    if claim == "claim":  # what keepalive's plugin does in vLLM's front end
        run_dir.claim(force=True)
    import keepalive_executor.supervision  # loaded with the plugin, in every front end
    from engine_start import engine_process
    executor_class = None
    if method == "spawn":  # the class travels pickled, by name, as vLLM passes it
        from keepalive_executor.executor import KeepaliveExecutor as executor_class
    ctx = multiprocessing.get_context(method)
    ctx.Process(target=engine_process, args=(notes, executor_class)).start()
    time.sleep(600)
""")


@pytest.mark.fast
@pytest.mark.parametrize("method,claim", [("spawn", "claim"), ("fork", "claim"),
                                          ("spawn", "no-claim")],
                         ids=["spawned", "forked", "no-run-control"])
def test_an_engine_process_ends_with_its_front_end_before_any_executor_exists(
        tmp_path, run, method, claim):
    """A front end killed while its engine process starts (before vLLM builds the executor:
    vLLM's handshake would wait five minutes for it): the engine process ends within
    FRONTEND_GONE_EXIT_S, exit code ORPHANED. The control starts it outside a keepalive run
    (no front end pid exported, as under mp): it outlives its front end."""
    notes = tmp_path / "notes"
    status = tmp_path / "status"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE),
                                                         os.environ.get("PYTHONPATH", "")])}
    with _under_subreaper(status, notes, "started", 120, ENGINE_STARTER, method, str(notes),
                          claim, env=env) as reaper:
        [front_end] = psutil.Process(reaper.pid).children()
        engine = next(p for p in front_end.children()
                      if "resource_tracker" not in " ".join(p.cmdline()))
        front_end.kill()
        t0 = time.time()
        if claim == "no-claim":
            time.sleep(FRONTEND_GONE_EXIT_S + 3)
            assert engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE
            engine.kill()
        reaper.wait(60)
        ended = _ended(status)
        if claim == "claim":
            assert ended[engine.pid]["code"] == exit_codes.ORPHANED, ended
            assert ended[engine.pid]["at"] - t0 < GONE_BOUND_S, ended


@pytest.mark.fast
def test_a_process_that_only_inherited_a_dead_front_ends_pid_is_left_alone(run):
    """The early watch acts on a dead front end only in a process that multiprocessing is
    spawning (its engine, killed with it while it imported): any other process that carries
    the pid of a front end long gone (a stale environment) starts normally and stays, its
    executor's watch included."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = ("import time, keepalive_executor.supervision as s\n"
            "w = s.FrontendWatch.for_this_engine(print, print)  # as an executor asks\n"
            "w and w.start()\n"
            "time.sleep(s.FRONTEND_GONE_EXIT_S + 1.5)\n"
            "print('alive', s._early_watch, w)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, run_dir.FRONTEND_ENV: str(gone.pid)}, timeout=120)
    assert (out.returncode, out.stdout.strip()) == (0, "alive None None"), out.stderr[-2000:]


# ---------------------------------------------------------------------- real servers


def _server(tiny_model: str, tmp_path: Path, name: str, backend: str) -> Server:
    server = Server(tiny_model, tmp_path / f"{name}.log", backend=backend,
                    extra_args=["--distributed-timeout-seconds", TIMEOUT],
                    wrapper=[sys.executable, str(HERE / "subreaper.py"),
                             str(tmp_path / f"{name}.status"), "--"],
                    extra_env={"PYTHONPATH": os.pathsep.join(
                        [str(HERE), os.environ.get("PYTHONPATH", "")])})
    server.status_path = tmp_path / f"{name}.status"
    return server


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """A keepalive server and the negative control, started at once."""
    from concurrent.futures import ThreadPoolExecutor

    tmp_path = tmp_path_factory.mktemp("supervision")
    servers: dict[str, Server] = {}
    try:
        servers["keepalive"] = _server(tiny_model, tmp_path, "ka", "keepalive")
        servers["control"] = _server(tiny_model, tmp_path, "control",
                                     "controls.NoSupervisionNoMetrics")
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(Server.wait_ready, servers.values()))
        yield servers
    finally:
        for server in servers.values():
            for p in server.tree():
                p.kill()
            server.stop()


def _engine_tree(server: Server) -> tuple[psutil.Process, list[psutil.Process]]:
    """The API server (the subreaper's child) and the processes it started."""
    [api] = psutil.Process(server.proc.pid).children()
    return api, api.children(recursive=True)


def _sample(found: dict, name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in found.items()
            if n == name and all(dict(ls).get(k) == w for k, w in labels.items())]
    assert len(hits) == 1, (name, labels, sorted(found)[:20])
    return hits[0]


def _fresh(server: Server, since: float, bound: float = 15.0) -> dict:
    """A scrape whose snapshot was written after ``since`` (wall time)."""
    deadline = time.monotonic() + bound
    while True:
        found = scrape(server.base_url)
        if _sample(found, "vllm_keepalive_snapshot_timestamp_seconds") > since:
            return found
        assert time.monotonic() < deadline, "no snapshot newer than that"
        time.sleep(0.1)


def _ask(server: Server, max_tokens: int = 16) -> None:
    server.client().completions.create(model="tiny", prompt="Hello, my name is",
                                       max_tokens=max_tokens, temperature=0)


def check_state_ranks_and_info(server: Server) -> None:
    found = scrape(server.base_url)
    assert _sample(found, "vllm_keepalive_executor_state", state="running",
                   model_name="tiny", engine="0") == 1
    assert _sample(found, "vllm_keepalive_executor_state", state="failed") == 0
    assert [_sample(found, "vllm_keepalive_rank_up", rank=r) for r in "01"] == [1, 1]
    import vllm

    import keepalive_executor
    assert _sample(found, "vllm_keepalive_info", version=keepalive_executor.__version__,
                   vllm_version=vllm.__version__.split("+")[0], launcher="spawned",
                   world_size="2", interval_seconds=f"{INTERVAL_S:g}") == 1


def check_steps_and_bytes_grow_with_requests(server: Server) -> None:
    before = _fresh(server, time.time())
    for _ in range(3):
        _ask(server)
    after = _fresh(server, time.time())
    for name, kind in (("vllm_keepalive_steps_total", "execute"),
                       ("vllm_keepalive_broadcast_bytes_total", "step")):
        assert _sample(after, name, kind=kind) >= _sample(before, name, kind=kind) + 3 * 16
    assert (_sample(after, "vllm_keepalive_step_dispatch_seconds_count") >
            _sample(before, "vllm_keepalive_step_dispatch_seconds_count"))
    assert _sample(after, "vllm_keepalive_last_broadcast_timestamp_seconds",
                   kind="step") > _sample(before, "vllm_keepalive_snapshot_timestamp_seconds")


def check_keepalives_grow_while_idle(server: Server) -> None:
    """Three intervals and more of idleness: three keepalives at least."""
    before = _fresh(server, time.time())
    lanes.idle(4.5 * INTERVAL_S)
    after = _fresh(server, time.time())
    grew = (_sample(after, "vllm_keepalive_keepalives_sent_total")
            - _sample(before, "vllm_keepalive_keepalives_sent_total"))
    assert grew >= 3, grew


def check_no_keepalive_during_a_burst(server: Server) -> None:
    """Requests back to back from 8 clients: steps every few milliseconds, so never an
    interval without a frame; two snapshots written during the burst, 2 s apart, show steps
    and no keepalive between them."""
    import threading

    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            _ask(server, 32)

    with lanes.alone():
        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            first = _fresh(server, time.time())
            time.sleep(2.0)
            second = _fresh(server, time.time())
        finally:
            stop.set()
            for t in threads:
                t.join(60)
    assert (_sample(second, "vllm_keepalive_steps_total", kind="execute") >
            _sample(first, "vllm_keepalive_steps_total", kind="execute") + 20)
    assert (_sample(second, "vllm_keepalive_keepalives_sent_total") ==
            _sample(first, "vllm_keepalive_keepalives_sent_total"))


METRICS_CHECKS = (check_state_ranks_and_info, check_steps_and_bytes_grow_with_requests,
                  check_keepalives_grow_while_idle, check_no_keepalive_during_a_burst)


@pytest.mark.slow
@pytest.mark.serial
def test_the_keepalive_series_follow_the_executor_control_without_snapshots_has_none(pair):
    """On /metrics over HTTP: the executor running, both ranks up, the versions; steps and
    bytes that grow with requests; keepalives that grow while idle and not while busy. Each
    check fails on the control, whose executor writes no snapshot."""
    for check in METRICS_CHECKS:
        check(pair["keepalive"])
    for check in METRICS_CHECKS:
        with pytest.raises(AssertionError):
            check(pair["control"])


@pytest.mark.slow
@pytest.mark.serial
def test_a_killed_api_server_takes_its_engine_and_ranks_with_it_control_outlives_it(pair):
    """SIGKILL of the API server (the OOM killer, `kill -9`): the engine process and its rank
    end within the bound, the engine with a non-zero status, nothing left; under the control
    (no watch) both still run long after, as under mp."""
    server = pair["keepalive"]
    api, engine_tree = _engine_tree(server)
    assert len(engine_tree) >= 2, engine_tree  # the engine process and rank 1 (at least)
    [engine] = [p for p in engine_tree if "EngineCore" in " ".join(p.cmdline()) or
                "EngineCore" in p.name()]
    with lanes.alone():
        api.kill()
        t0 = time.time()
        server.proc.wait(GONE_BOUND_S + 5)  # the subreaper: no child of its tree left
    ended = {json.loads(line)["pid"]: json.loads(line)
             for line in server.status_path.read_text().splitlines()}
    # the subreaper waited for every process that was left to it (an engine reaps its own
    # ranks when it ends them), so each is gone: none runs, none is an unreaped zombie
    assert [p for p in engine_tree if psutil.pid_exists(p.pid)] == []
    took = ended[engine.pid]["at"] - t0
    assert took < GONE_BOUND_S, (took, ended)
    assert ended[engine.pid]["code"] not in (None, 0), ended[engine.pid]
    assert "vLLM's front end) is gone; this engine and its ranks end with it" in server.log()
    print(f"API server killed: engine and ranks gone {took:.2f}s later, engine exit "
          f"{ended[engine.pid]}")

    control = pair["control"]
    api, engine_tree = _engine_tree(control)
    api.kill()
    lanes.idle(CONTROL_ALIVE_S)
    alive = [p for p in engine_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == engine_tree, "the control's engine ended with its API server"
    for p in alive:
        p.send_signal(signal.SIGKILL)
    control.proc.wait(30)
