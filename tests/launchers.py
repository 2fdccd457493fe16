"""`srun` and `mpirun` serving the tiny model (`python -m keepalive_executor serve`), and the
one-machine Slurm cluster the srun side runs on (scripts/slurm_cluster.sh)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
from procs import keep_niceness, name_of, tagged_processes
from servers import Server, env, failure_excerpt, free_port

__all__ = ["require", "slurm_cluster", "LaunchedServer", "SERVE_ARGS", "mpirun_launch"]

REPO = Path(__file__).resolve().parent.parent
SERVE_ARGS = ["--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8",
              "--gpu-memory-utilization", "0.2", "--served-model-name", "tiny", "--seed", "0"]


def require(*tools: str) -> None:
    """Fail (never skip) when a launcher is missing: scripts/setup_launchers.sh installs them
    (as root, with apt-get), so a missing one is a broken set-up, not a reason to pass."""
    missing = [t for t in tools if shutil.which(t) is None]
    assert not missing, (f"{', '.join(missing)} not installed: run `bash "
                         "scripts/setup_launchers.sh` as root (it installs slurm-wlm, munge, "
                         "openmpi-bin and systemd with apt-get; scripts/test.sh runs it)")


@contextmanager
def slurm_cluster(workdir: Path) -> Iterator[dict[str, str]]:
    """A running one-machine Slurm cluster; yields the environment its commands need."""
    require("munged", "slurmctld", "slurmd", "srun")
    script = str(REPO / "scripts" / "slurm_cluster.sh")
    started = subprocess.run(["bash", script, "start", str(workdir)], capture_output=True,
                             text=True, timeout=120)
    assert started.returncode == 0, f"the Slurm cluster did not start:\n{started.stderr}"
    try:
        yield {"SLURM_CONF": str(workdir / "slurm.conf")}
    finally:
        subprocess.run(["bash", script, "stop", str(workdir)], timeout=60)


class LaunchedServer(Server):
    """``LAUNCHER ... python -m keepalive_executor serve`` of the tiny model (``srun`` or
    ``mpirun``), in a session of its own, every rank tagged by ``KEEPALIVE_TEST_TAG``."""

    def __init__(self, model: str, log_path: Path, launch: list[str], *, tp: int = 2,
                 extra_args: list[str] | None = None, extra_env: dict | None = None):
        self.port = free_port()
        self.tag = uuid.uuid4().hex
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.leftovers: list[str] = []
        self.args = [*launch, sys.executable, "-m", "keepalive_executor", "serve", model,
                     "--host", "127.0.0.1", "--port", str(self.port), "-tp", str(tp),
                     *SERVE_ARGS, *(extra_args or [])]
        e = env(KEEPALIVE_TEST_TAG=self.tag, **(extra_env or {}))
        self._log = open(log_path, "w")
        self._log.write("$ " + " ".join(self.args) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.args, env=e, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=keep_niceness)
        self.jobs: set[str] = set()

    def ranks(self) -> list[psutil.Process]:
        """Every live process of this launch's ranks (srun's are slurmstepd's children, not
        srun's: found by the tag they inherited), noting their Slurm job ids."""
        found = tagged_processes(self.tag)
        for p in found:
            try:
                job = p.environ().get("SLURM_JOB_ID")
            except psutil.Error:
                continue
            if job:
                self.jobs.add(job)
        return found

    def step_daemons(self) -> list[psutil.Process]:
        """The slurmstepd processes of the Slurm jobs this launch's ranks ran in (titled
        ``slurmstepd: [JOB.STEP]``): a step whose daemon is still up is not over."""
        out = []
        for p in psutil.process_iter():
            try:
                title = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if title.startswith("slurmstepd") and any(f"[{j}." in title for j in self.jobs):
                out.append(p)
        return out

    def tree(self) -> list[psutil.Process]:
        """The launcher and its descendants (mpirun's ranks are its children), the job
        steps' daemons and theirs (srun's ranks are slurmstepd's children), and any process
        that still carries the tag (a rank's title, once set, hides its environment)."""
        procs = {p.pid: p for p in self.ranks()}
        roots = [self.proc.pid, *(p.pid for p in self.step_daemons())]
        for pid in roots:
            try:
                root = psutil.Process(pid)
                for p in [root, *root.children(recursive=True)]:
                    procs.setdefault(p.pid, p)
            except psutil.NoSuchProcess:
                pass
        return list(procs.values())

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.args[0]} exited {self.proc.returncode}:\n"
                                     f"{failure_excerpt(self.log())}")
            if self.health() == 200:
                self.ranks()
                return
            time.sleep(0.5)
        raise AssertionError(f"not ready after {timeout}s:\n{failure_excerpt(self.log())}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Stop the launcher (it stops its ranks), then kill and name whatever is left."""
        code = super().stop(sig, timeout)
        left = [p for p in self.tree() if p.is_running()]
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(left, timeout=10)
        self.leftovers += [f"{p.pid}:{name_of(p)}" for p in left]
        return code


def mpirun_launch(np: int = 2) -> list[str]:
    """mpirun on this machine: as root it needs --allow-run-as-root; --bind-to none leaves
    the CPU binding to vLLM's VLLM_CPU_OMP_THREADS_BIND, as under torchrun and srun."""
    require("mpirun")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return ["mpirun", *root, "-np", str(np), "--bind-to", "none"]
