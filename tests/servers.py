"""`vllm serve` and `torchrun -m keepalive_executor serve` of the tiny model, as real
processes in their own sessions with their logs in files: shared by the tests and the
benchmarks (benchmarks/ puts tests/ on sys.path)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
from procs import keep_niceness, name_of, tagged_processes

__all__ = ["BASE_ENV", "env", "free_port", "Server", "TorchrunServer", "by_title",
           "assert_control_failed"]

BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    # vLLM itself refuses to ship a collective_rpc callable to its engine process otherwise
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update(BASE_ENV)
    e.update(extra)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def failure_excerpt(text: str, tail: int = 6000) -> str:
    """What a failed start-up printed: the first error lines (the root cause, often far above
    the end of a long log) and then the log's tail."""
    lines = text.splitlines()
    first = [ln for ln in lines
             if any(w in ln for w in ("Error", "error", "ERROR", "Traceback"))][:40]
    return "first error lines:\n" + "\n".join(first) + "\n...\nlog tail:\n" + text[-tail:]


class Server:
    """`vllm serve` of the tiny model in its own process group, logs to a file."""

    def __init__(self, model: str, log_path: Path, *, tp: int = 2, backend: str = "keepalive",
                 extra_args: list[str] | None = None, extra_env: dict | None = None,
                 pp: int = 1, wrapper: list[str] | None = None):
        """``wrapper``: a command the server runs under (tests/subreaper.py), which is then
        ``proc``; the server is its child."""
        self.port = free_port()
        self.log_path = log_path
        args = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "-tp", str(tp), "-pp", str(pp), "--enforce-eager", "--max-model-len", "256",
            "--max-num-seqs", "8", "--gpu-memory-utilization", "0.2",
            "--served-model-name", "tiny", "--seed", "0",
        ]
        if tp * pp > 1:
            args += ["--distributed-executor-backend", backend]
        args += extra_args or []
        e = env(**(extra_env or {}))
        # one entry per rank, by local rank; 4 ranks share the 2 CPUs of this machine
        if extra_env is None or "VLLM_CPU_OMP_THREADS_BIND" not in extra_env:
            e["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(("0", "1")[r % 2] for r in range(tp * pp))
        args = [*(wrapper or []), *args]
        self.args = args
        self.leftovers: list[str] = []
        self._log = open(log_path, "w")
        self._log.write("$ " + " ".join(args) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(args, env=e, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=keep_niceness)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"server exited {self.proc.returncode}:\n{failure_excerpt(self.log())}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(
            f"server not ready after {timeout}s:\n{failure_excerpt(self.log())}")

    def health(self) -> int | None:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="x", max_retries=0,
                             timeout=60)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Signal the server; wait; kill the whole session if it lingers. Returns the exit
        code; ``self.leftovers`` names what was still running 5 s after the server exited."""
        tree = self.tree()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.poll()
        _, lingering = psutil.wait_procs(tree, timeout=5)
        self.leftovers = [f"{p.pid}:{name_of(p)}" for p in lingering]
        if code is None:
            self.leftovers.append("the server itself needed SIGKILL")
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        psutil.wait_procs(tree, timeout=10)
        self._log.close()
        return code


def by_title(server: Server, title: str) -> list[psutil.Process]:
    """The processes of ``server``'s tree whose title contains ``title`` (a process that exits
    while the tree is read is left out; one did, once, with 8 streams in flight)."""
    return [p for p in server.tree() if title in name_of(p)]


def assert_control_failed(control: Server, request: Any) -> None:
    """The negative control (a server without keepalives, after an idle) is down, or fails
    ``request()``, because an idle rank's wait on its channel timed out: its log says so, in
    one line (not, say, a start-up rendezvous that timed out on a loaded machine, nor any
    other "Timed out")."""
    failed = control.proc.poll() is not None or control.health() != 200
    if not failed:
        try:
            request()
        except Exception:  # noqa: BLE001 - any failure of the request is the outcome
            failed = True
    log = control.log()
    assert failed, "the control still answers after the idle without keepalives"
    assert any("waiting for the broadcast from rank" in line and "Timed out" in line
               for line in log.splitlines()), log[-3000:]



def serve_once(model: str, log_path: Path, fn: Any, **kwargs: Any) -> Any:
    """Start ``Server(model, log_path, **kwargs)``, return FN(server), stop it; fail if
    anything of it is left running (each reference scenario's one server)."""
    server = Server(model, log_path, **kwargs)
    try:
        server.wait_ready()
        out = fn(server)
    finally:
        server.stop()
    assert not server.leftovers, f"{log_path.name}: left {server.leftovers}"
    return out


class TorchrunServer(Server):
    """`torchrun ... -m keepalive_executor serve` of the tiny model: one agent per node.

    ``nnodes`` agents run on this machine with a static rendezvous on loopback (node rank 0
    holds rank 0, hence the API server); ``node_env[i]`` is extra environment of agent i.
    """

    def __init__(self, model: str, log_dir: Path, *, nnodes: int = 1, nproc: int = 2,
                 tp: int = 2, extra_args: list[str] | None = None,
                 extra_env: dict | None = None, node_env: list[dict] | None = None,
                 rdzv: str = "static", launch_args: list[str] | None = None,
                 master_addr: str = "127.0.0.1", node_prefix: list[list[str]] | None = None,
                 log_prefix: str = "torchrun", pp: int = 1):
        self.port = free_port()
        self.tag = uuid.uuid4().hex
        self.base_url = f"http://127.0.0.1:{self.port}"
        rdzv_port = free_port()
        serve = [
            "-m", "keepalive_executor", "serve", model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "-tp", str(tp), "-pp", str(pp), "--enforce-eager", "--max-model-len", "256",
            "--max-num-seqs", "8", "--gpu-memory-utilization", "0.2",
            "--served-model-name", "tiny", "--seed", "0", *(extra_args or []),
        ]
        self.leftovers: list[str] = []
        self.agents: list[subprocess.Popen] = []
        self.log_paths: list[Path] = []
        self._logs = []
        for node in range(nnodes):
            launch = [sys.executable, "-m", "torch.distributed.run",
                      "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
                      "--monitor-interval", "0.2", *(launch_args or [])]
            if rdzv == "static":
                launch += ["--node-rank", str(node), "--master-addr", master_addr,
                           "--master-port", str(rdzv_port)]
            else:
                launch += ["--rdzv-backend", "c10d", "--rdzv-id", self.tag,
                           "--rdzv-endpoint", f"{master_addr}:{rdzv_port}"]
            # e.g. ["ip", "netns", "exec", NS]: that node's agent runs in its own network
            launch = [*(node_prefix or [[]] * nnodes)[node], *launch]
            e = env(KEEPALIVE_TEST_TAG=self.tag, **(extra_env or {}))
            if nnodes > 1:
                # several "nodes" share one secret, as a deployment's would (bootstrap HMAC)
                e.setdefault("VLLM_KEEPALIVE_SECRET", self.tag * 2)
            e.update((node_env or [{}] * nnodes)[node])
            path = log_dir / f"{log_prefix}-node{node}.log"
            log = open(path, "w")
            self.log_paths.append(path)
            self._logs.append(log)
            self.agents.append(subprocess.Popen(
                launch + serve, env=e, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=keep_niceness))
            if rdzv != "static" and node == 0:
                time.sleep(1.0)  # agent 0 hosts the c10d store: let it bind first
        self.proc = self.agents[0]
        self.log_path = self.log_paths[0]

    def log(self, node: int = 0) -> str:
        if not self._logs[node].closed:
            self._logs[node].flush()
        return self.log_paths[node].read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(self.log(i) for i in range(len(self.agents)))

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for a in self.agents:
                if a.poll() is not None:
                    raise AssertionError(
                        f"torchrun exited {a.returncode}:\n{failure_excerpt(self.logs())}")
            if self.health() == 200:
                return
            time.sleep(0.5)
        raise AssertionError(
            f"server not ready after {timeout}s:\n{failure_excerpt(self.logs())}")

    def tree(self) -> list[psutil.Process]:
        """Agents and all their descendants (ranks are children of an agent, each in its
        own session), plus any other process that still carries this run's tag."""
        found: dict[int, psutil.Process] = {}
        for a in self.agents:
            try:
                root = psutil.Process(a.pid)
                for p in [root, *root.children(recursive=True)]:
                    found[p.pid] = p
            except psutil.NoSuchProcess:
                pass
        for p in tagged_processes(self.tag):
            found.setdefault(p.pid, p)
        return list(found.values())

    def wait_agents(self, timeout: float) -> list[int | None]:
        """Each agent's exit code (None if still running after ``timeout`` in all)."""
        deadline = time.monotonic() + timeout
        for a in self.agents:
            try:
                a.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [a.poll() for a in self.agents]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Signal every agent, wait, then kill whatever is left (tagged). Agent 0's code.

        ``self.sigkilled`` lists the agents that had not exited on ``sig`` within
        ``timeout`` and were SIGKILLed; ``self.stop_codes`` every agent's code. A second call
        (the ``finally`` of a test) leaves both as the first call set them."""
        first = not hasattr(self, "sigkilled")
        for a in self.agents:
            if a.poll() is None:
                a.send_signal(sig)
        self.wait_agents(timeout)
        killed = [i for i, a in enumerate(self.agents) if a.poll() is None]
        for i in killed:
            os.killpg(self.agents[i].pid, signal.SIGKILL)
        if first:
            self.sigkilled = killed
            for a in self.agents:
                a.wait(10)
            self.stop_codes = [a.poll() for a in self.agents]
        self.leftovers = self.kill_leftovers()
        for log in self._logs:
            log.close()
        return self.agents[0].poll()

    def kill_leftovers(self) -> list[str]:
        """Kill (and name) any tagged process still running: the test fails on them."""
        left = self.tree()
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=10)
        return [f"{p.pid} {name_of(p)}" for p in left]


