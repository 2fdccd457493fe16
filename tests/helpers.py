"""Helpers for engine-level tests: the tiny model, running scripts, serving."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
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


def run_script(name: str, timeout: float = 600, extra_env: dict | None = None,
               **kwargs) -> dict:
    """Run engine_scripts.NAME in a fresh interpreter; return its RESULT or fail with its log."""
    popen = subprocess.Popen(
        [sys.executable, str(HERE / "engine_scripts.py"), name, json.dumps(kwargs)],
        env=env(**(extra_env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, 9)
            popen.wait()
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
    # No orphans: once the script has exited, nothing of its session may be left running.
    leftovers = session_processes(popen.pid)
    if leftovers:
        for p in leftovers:
            p.kill()
        raise AssertionError(f"{name} left processes behind: {leftovers}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(
        f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )


def session_processes(sid: int, wait_s: float = 15.0) -> list[psutil.Process]:
    """Processes still alive in session ``sid`` after up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` of the tiny model in its own process group, logs to a file."""

    def __init__(self, model: str, log_path: Path, *, tp: int = 2, backend: str = "keepalive",
                 extra_args: list[str] | None = None, extra_env: dict | None = None):
        self.port = free_port()
        self.log_path = log_path
        args = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "-tp", str(tp), "--enforce-eager", "--max-model-len", "256",
            "--max-num-seqs", "8", "--gpu-memory-utilization", "0.2",
            "--served-model-name", "tiny", "--seed", "0",
        ]
        if tp > 1:
            args += ["--distributed-executor-backend", backend]
        args += extra_args or []
        e = env(**(extra_env or {}))
        if tp == 1:
            e["VLLM_CPU_OMP_THREADS_BIND"] = "0"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, env=e, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
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
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"server not ready after {timeout}s:\n{self.log()[-6000:]}")

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
        """Signal the server; wait; kill the whole session if it lingers. Returns exit code."""
        tree = self.tree()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.poll()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        psutil.wait_procs(tree, timeout=10)
        self._log.close()
        return code


def by_title(server: Server, title: str) -> list[psutil.Process]:
    """The processes of ``server``'s tree whose title contains ``title``."""
    return [p for p in server.tree() if title in p.name()]


def left_after(procs: list[psutil.Process], seconds: float) -> list[str]:
    """Processes of ``procs`` still running ``seconds`` from now (each may exit meanwhile)."""
    psutil.wait_procs([p for p in procs if p.is_running()], timeout=seconds)
    return alive(procs)


def alive(procs: list[psutil.Process]) -> list[str]:
    """``"pid name"`` of each process still running (zombies count as gone)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Every live process whose environment still shows ``KEEPALIVE_TEST_TAG=tag``.

    torchrun starts each rank in its own session, so a session does not find them; the
    inherited environment finds those that did not overwrite it (setproctitle does).
    """
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("KEEPALIVE_TEST_TAG") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


class TorchrunServer(Server):
    """`torchrun ... -m keepalive_executor serve` of the tiny model: one agent per node.

    ``nnodes`` agents run on this machine with a static rendezvous on loopback (node rank 0
    holds rank 0, hence the API server); ``node_env[i]`` is extra environment of agent i.
    """

    def __init__(self, model: str, log_dir: Path, *, nnodes: int = 1, nproc: int = 2,
                 tp: int = 2, extra_args: list[str] | None = None,
                 extra_env: dict | None = None, node_env: list[dict] | None = None,
                 rdzv: str = "static", launch_args: list[str] | None = None,
                 master_addr: str = "127.0.0.1", node_prefix: list[list[str]] | None = None):
        import uuid

        self.port = free_port()
        self.tag = uuid.uuid4().hex
        self.base_url = f"http://127.0.0.1:{self.port}"
        rdzv_port = free_port()
        serve = [
            "-m", "keepalive_executor", "serve", model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "-tp", str(tp), "--enforce-eager", "--max-model-len", "256",
            "--max-num-seqs", "8", "--gpu-memory-utilization", "0.2",
            "--served-model-name", "tiny", "--seed", "0", *(extra_args or []),
        ]
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
            e.update((node_env or [{}] * nnodes)[node])
            path = log_dir / f"torchrun-node{node}.log"
            log = open(path, "w")
            self.log_paths.append(path)
            self._logs.append(log)
            self.agents.append(subprocess.Popen(
                launch + serve, env=e, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
            if rdzv != "static" and node == 0:
                time.sleep(1.0)  # agent 0 hosts the c10d store: let it bind first
        self.proc = self.agents[0]

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
                    raise AssertionError(f"torchrun exited {a.returncode}:\n{self.logs()[-8000:]}")
            if self.health() == 200:
                return
            time.sleep(0.5)
        raise AssertionError(f"server not ready after {timeout}s:\n{self.logs()[-8000:]}")

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
        """Signal every agent, wait, then kill whatever is left (tagged). Agent 0's code."""
        for a in self.agents:
            if a.poll() is None:
                a.send_signal(sig)
        self.wait_agents(timeout)
        for a in self.agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        self.kill_leftovers()
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
        return [f"{p.pid} {p.name()}" for p in left]


class VethPair:
    """A second "host" for multi-node tests: a network namespace joined to this one by a
    veth pair, ``10.77.<n>.1`` here and ``10.77.<n>.2`` there. Needs root and iproute2."""

    def __init__(self) -> None:
        n = os.getpid() % 200 + 20
        self.ns = f"ka-test-{os.getpid()}"
        self.here_if, self.there_if = f"kav{os.getpid() % 100000}h", f"kav{os.getpid() % 100000}t"
        self.here_ip, self.there_ip = f"10.77.{n}.1", f"10.77.{n}.2"
        self.prefix = ["ip", "netns", "exec", self.ns]

    def up(self) -> None:
        def ip(*args: str) -> None:
            subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

        ip("netns", "add", self.ns)
        ip("link", "add", self.here_if, "type", "veth", "peer", "name", self.there_if)
        ip("link", "set", self.there_if, "netns", self.ns)
        ip("addr", "add", f"{self.here_ip}/24", "dev", self.here_if)
        ip("link", "set", self.here_if, "up")
        ip("netns", "exec", self.ns, "ip", "addr", "add", f"{self.there_ip}/24", "dev",
           self.there_if)
        ip("netns", "exec", self.ns, "ip", "link", "set", self.there_if, "up")
        ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")

    def down(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.here_if], capture_output=True)
