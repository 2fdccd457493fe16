"""The deployment examples in examples/ work as their comments say.

- Slurm (examples/slurm/serve.sbatch): its arithmetic and secret through a stand-in srun
  (pure, ``fast``), then submitted with ``sbatch`` to the tests' one-machine Slurm cluster
  (scripts/slurm_cluster.sh): it serves mp's answers, and ``scancel`` leaves nothing.
- Kubernetes (examples/kubernetes/leaderworkerset.yaml): no Kubernetes here, and
  kubernetes-validate bundles no schema for LWS's custom resource. So the parts that are
  Kubernetes' own types are validated, strictly, against Kubernetes' schemas from
  kubernetes-validate (offline): the leader's and the workers' pod templates (as a core/v1
  PodTemplate) and the Service; the LeaderWorkerSet's own fields are checked here by hand
  against LWS's v1 API (its CRD's required fields, types and enums); the containers'
  commands with LWS's variables filled in are parsed by torchrun's and vLLM's own parsers.
- systemd (examples/systemd/keepalive-serve.service): ``systemd-analyze verify`` on a copy
  whose ExecStart names this venv's real ``vllm`` (verify refuses a command that does not
  exist), silent and exit 0; its restart and stop settings; its vLLM flags parsed by vLLM.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml
from launchers import SERVE_ARGS, LaunchedServer, require, slurm_cluster
from procs import alive, left_after
from serve_scripts import LOAD_ARGS, ask, texts
from servers import env, free_port

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
SBATCH = EXAMPLES / "slurm" / "serve.sbatch"
LWS = EXAMPLES / "kubernetes" / "leaderworkerset.yaml"
UNIT = EXAMPLES / "systemd" / "keepalive-serve.service"

fast = pytest.mark.fast


def vllm_serve_args(argv: list[str]):
    """``argv`` (what follows ``vllm serve``) through vLLM's own ``vllm serve`` parser: a flag
    this vLLM does not know, or a bad value, fails the test."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    try:
        return parser.parse_args(["serve", *argv])
    except SystemExit as e:  # argparse's way of refusing
        raise AssertionError(f"vllm serve refuses {argv}") from e


# ---------------------------------------------------------------- Slurm


def _run_sbatch_script(tmp_path: Path, slurm: dict[str, str], *args: str,
                       **settings: str) -> tuple[subprocess.CompletedProcess, list[str], dict]:
    """Run serve.sbatch as a batch job's shell would, with ``slurm`` as the job's variables
    and a stand-in ``srun`` that records its arguments and environment instead of starting
    ranks. Returns the script's outcome, srun's argv and srun's environment."""
    bin_dir, out = tmp_path / "bin", tmp_path / "srun-out"
    bin_dir.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {out}/argv\nenv > {out}/env\n')
    srun.chmod(0o755)
    run_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable,
               **slurm, **settings}
    proc = subprocess.run(["bash", str(SBATCH), *args], env=run_env, capture_output=True,
                          text=True, timeout=60)
    if not (out / "argv").exists():
        return proc, [], {}
    argv = (out / "argv").read_text().splitlines()
    srun_env = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines()
                    if "=" in line)
    (out / "argv").unlink()
    return proc, argv, srun_env


ONE_NODE = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "1"}
TWO_NODES = {"SLURM_JOB_ID": "8", "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2"}


@fast
def test_the_sbatch_script_runs_tp_inside_a_node_and_pp_across_nodes(tmp_path):
    """The defaults follow the allocation (TP = tasks on a node, PP = nodes), srun starts
    TP x PP ranks that end the step together, extra arguments reach vLLM; a secret is made
    for several nodes only (one node: rank 0 makes its per-run one)."""
    proc, argv, srun_env = _run_sbatch_script(tmp_path, ONE_NODE, "--max-model-len", "4096",
                                              MODEL="/m")
    assert proc.returncode == 0, proc.stderr
    assert argv == ["--ntasks", "8", "--kill-on-bad-exit=1", sys.executable, "-m",
                    "keepalive_executor", "serve", "/m", "-tp", "8", "-pp", "1", "--host",
                    "0.0.0.0", "--port", "8000", "--max-model-len", "4096"]
    assert "VLLM_KEEPALIVE_SECRET" not in srun_env
    proc, argv, srun_env = _run_sbatch_script(tmp_path, TWO_NODES, MODEL="/m", PORT="9000")
    assert proc.returncode == 0, proc.stderr
    assert argv[:2] == ["--ntasks", "16"] and argv[8:16] == ["-tp", "8", "-pp", "2", "--host",
                                                             "0.0.0.0", "--port", "9000"]
    assert re.fullmatch(r"[0-9a-f]{64}", srun_env.get("VLLM_KEEPALIVE_SECRET", "")), srun_env
    # a secret the user set (here as a file) is left as it is
    _, _, srun_env = _run_sbatch_script(tmp_path, TWO_NODES, MODEL="/m",
                                        VLLM_KEEPALIVE_SECRET_FILE="/shared/secret")
    assert "VLLM_KEEPALIVE_SECRET" not in srun_env
    assert srun_env["VLLM_KEEPALIVE_SECRET_FILE"] == "/shared/secret"


@fast
def test_the_sbatch_script_refuses_a_shape_that_is_not_the_jobs_and_a_missing_model(tmp_path):
    proc, argv, _ = _run_sbatch_script(tmp_path, TWO_NODES, MODEL="/m", TP="4")
    assert proc.returncode == 2 and argv == []
    assert "TP=4 x PP=2 is 8 ranks, but the job has 16 tasks" in proc.stderr
    proc, argv, _ = _run_sbatch_script(tmp_path, ONE_NODE)
    assert proc.returncode != 0 and argv == []
    assert "set MODEL to the model to serve" in proc.stderr


class BatchJob:
    """A Slurm job as LaunchedServer watches its launcher's process: ``poll()`` is None while
    the job is pending or running, then the state Slurm ended it in."""

    ACTIVE = ("PENDING", "CONFIGURING", "RUNNING")

    def __init__(self, job: str, slurm_env: dict[str, str]):
        self.job, self.env = job, slurm_env

    def state(self) -> str:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-j", self.job, "-o", "%T"],
                             env=self.env, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or "gone"

    def poll(self) -> str | None:
        state = self.state()
        return None if state in self.ACTIVE else state

    returncode = property(poll)

    def cancel(self, timeout: float = 60) -> str:
        """``scancel`` the job and wait until Slurm has finished it; its final state."""
        subprocess.run(["scancel", self.job], env=self.env, timeout=30, check=True)
        deadline = time.monotonic() + timeout
        while (state := self.state()) in (*self.ACTIVE, "COMPLETING"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return state


class SbatchJob(LaunchedServer):
    """``sbatch examples/slurm/serve.sbatch`` of the tiny model on this 2-core machine: 2
    tasks, no GPU (sbatch's options override the script's #SBATCH lines), the CPU settings
    and the test tag in the environment sbatch passes on. Its processes are found as
    LaunchedServer finds srun's: the tagged ranks and the job's slurmstepd daemons."""

    def __init__(self, model: str, log_path: Path, slurm: dict[str, str], args: list[str]):
        self.port = free_port()
        self.tag = uuid.uuid4().hex
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.leftovers: list[str] = []
        submit = ["sbatch", "--parsable", "--ntasks-per-node=2", "--gpus-per-node=0",
                  "--cpus-per-task=1", f"--output={log_path}", str(SBATCH), *args]
        e = env(**slurm, KEEPALIVE_TEST_TAG=self.tag, MODEL=model, HOST="127.0.0.1",
                PORT=str(self.port), PYTHON=sys.executable)
        done = subprocess.run(submit, env=e, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"sbatch refused the script: {done.stderr}"
        job = done.stdout.strip().split(";")[0]
        self.jobs = {job}
        self.proc = BatchJob(job, env(**slurm))  # what wait_ready watches
        self.args = [f"the batch job {job}", *submit]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tree(self) -> list[psutil.Process]:
        procs = {p.pid: p for p in self.ranks()}
        for daemon in self.step_daemons():
            with contextlib.suppress(psutil.NoSuchProcess):
                for p in [daemon, *daemon.children(recursive=True)]:
                    procs.setdefault(p.pid, p)
        return list(procs.values())

    def stop(self, *_args, **_kwargs) -> None:
        """Whatever of the job is still running: cancelled, then killed and named."""
        if self.proc.poll() is None:
            self.proc.cancel()
        left = self.tree()
        self.leftovers += alive(left)
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(left, timeout=10)


@pytest.mark.slow
def test_the_sbatch_script_serves_mps_answers_and_scancel_leaves_nothing(
        tiny_model, tmp_path, reference):
    """Submitted with sbatch (one node, 2 tasks, the tiny model's flags after the script's
    name): rank 0 serves under srun with rank 1 following it, mp's greedy answers; then
    scancel ends the job with no rank, engine or job step left."""
    require("sbatch", "squeue", "scancel")
    with slurm_cluster(tmp_path / "slurm") as slurm:
        job = SbatchJob(tiny_model, tmp_path / "job.log", slurm, [*SERVE_ARGS, *LOAD_ARGS])
        try:
            job.wait_ready()
            log = job.log()
            assert f"serve.sbatch: job {job.proc.job} serves {tiny_model} with -tp 2 -pp 1" in log
            assert ("keepalive torchrun mode: configuration published for ranks 1..1 (one "
                    "node") in log, log[-3000:]
            assert "rank 1 of 2 (local rank 1) follows the driver" in log
            assert texts(ask(job.client())) == reference("serve_tp2")  # mp's greedy answers
            procs = job.tree()
            assert len(procs) >= 3, procs  # the ranks and the job's slurmstepd daemons
            state = job.proc.cancel()
            left = left_after(procs, 10)
            steps = [p.pid for p in job.step_daemons() if p.is_running()]
        finally:
            job.stop()
    assert state == "CANCELLED", state
    assert left == [] and steps == [] and job.leftovers == [], (left, steps, job.leftovers)


# ---------------------------------------------------------------- Kubernetes


#: The oldest Kubernetes LWS supports (its installation guide: 1.26 or later) and the newest
#: kubernetes-validate bundles.
K8S_VERSIONS = ("1.26", "latest")


def _k8s_validate(resource: dict, version: str) -> None:
    """``resource`` against Kubernetes' own schema, strictly (an unknown field is an error,
    as with kubectl's default field validation); kubernetes-validate works offline."""
    try:
        import kubernetes_validate
    except ImportError:  # pragma: no cover - a broken set-up, named
        pytest.fail("kubernetes-validate is not installed: run `bash scripts/setup.sh` (it "
                    "installs this project's `examples` extra, pinned in "
                    "scripts/constraints.txt)")
    from kubernetes_validate.utils import latest_version

    kubernetes_validate.validate(resource, latest_version() if version == "latest" else version,
                                 strict=True)


def _manifest() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(LWS.read_text()) if d]
    return {d["kind"]: d for d in docs}


def _pod_template(template: dict) -> dict:
    """A pod template as Kubernetes' own PodTemplate object (core/v1), whose ``template`` is
    the PodTemplateSpec type LWS embeds for leaderTemplate and workerTemplate."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
            "template": template}


@fast
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_manifests_pod_templates_and_service_pass_kubernetes_schema(version):
    import kubernetes_validate

    manifest = _manifest()
    assert set(manifest) == {"LeaderWorkerSet", "Service"}
    lwt = manifest["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    for name in ("leaderTemplate", "workerTemplate"):
        _k8s_validate(_pod_template(lwt[name]), version)
    _k8s_validate(manifest["Service"], version)
    # the validator checks what it is given: one unknown field and one wrong type are refused
    leader = lwt["leaderTemplate"]
    typo = {**leader, "spec": {**leader["spec"], "terminationGracePeriod": 90}}
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        _k8s_validate(_pod_template(typo), version)
    container = {**leader["spec"]["containers"][0], "ports": [{"containerPort": "8000"}]}
    bad_type = {**leader, "spec": {**leader["spec"], "containers": [container]}}
    with pytest.raises(kubernetes_validate.ValidationError, match="'8000' is not of type"):
        _k8s_validate(_pod_template(bad_type), version)
    # and it has no schema for LWS's custom resource: those fields are checked by hand below
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(manifest["LeaderWorkerSet"], "1.26", strict=True)


#: LWS's v1 API (api/leaderworkerset/v1/leaderworkerset_types.go, and the CRD generated from
#: it): the fields of spec and spec.leaderWorkerTemplate, with their types or enums.
LWS_SPEC = {"replicas": int, "leaderWorkerTemplate": dict, "rolloutStrategy": dict,
            "startupPolicy": ("LeaderCreated", "LeaderReady"), "networkConfig": dict}
LWS_TEMPLATE = {"leaderTemplate": dict, "workerTemplate": dict, "size": int,
                "restartPolicy": ("Default", "RecreateGroupOnPodRestart",
                                  "RecreateGroupAfterStart", "None"),
                "subGroupPolicy": dict, "volumeClaimTemplates": list,
                "persistentVolumeClaimRetentionPolicy": dict}


def _check_fields(obj: dict, fields: dict, where: str) -> None:
    for key, value in obj.items():
        assert key in fields, f"{where}.{key} is not a field of LWS's v1 API"
        want = fields[key]
        if isinstance(want, tuple):
            assert value in want, f"{where}.{key}={value!r} is not one of {want}"
        else:
            assert isinstance(value, want) and not isinstance(value, bool), \
                f"{where}.{key}={value!r} is not a {want.__name__}"


@fast
def test_the_leaderworkerset_has_lws_fields_and_leaves_the_group_to_start_and_restart():
    lws = _manifest()["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", lws["metadata"]["name"])
    spec = lws["spec"]
    _check_fields(spec, LWS_SPEC, "spec")
    lwt = spec["leaderWorkerTemplate"]  # required
    _check_fields(lwt, LWS_TEMPLATE, "spec.leaderWorkerTemplate")
    assert "workerTemplate" in lwt  # required
    assert spec["replicas"] >= 0 and lwt["size"] >= 2  # a leader and at least one worker
    # the leader becomes ready only once the workers joined: they must not wait for that
    assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated"
    # a failed rank ends its pod's torchrun; the whole group must come back, not that pod
    assert lwt.get("restartPolicy", "RecreateGroupOnPodRestart") == "RecreateGroupOnPodRestart"
    # the Service reaches the leader pods only
    service = _manifest()["Service"]
    assert service["spec"]["selector"] == {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
        **lwt["leaderTemplate"]["metadata"]["labels"]}


def _expand(args: list[str], variables: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion in a container's args."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables[m.group(1)], a)
            for a in args]


@fast
def test_every_pod_runs_torchrun_with_lws_variables_for_its_place_and_a_valid_vllm_command():
    """The containers' commands, with the variables LWS sets in the leader (index 0) and in
    a worker (index 1), through torchrun's own parser and vLLM's: the node rank is the
    worker index, the rendezvous is the leader's address, TP x PP is every rank of the
    group, the secret comes from a Secret, and only the leader serves (its probe on
    /health, its port the one vLLM listens on)."""
    from torch.distributed.run import get_args_parser

    lwt = _manifest()["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    size = lwt["size"]
    for index, template in ((0, lwt["leaderTemplate"]), (1, lwt["workerTemplate"])):
        [container] = template["spec"]["containers"]
        assert container["command"] == ["torchrun"]
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_KEEPALIVE_SECRET"]["valueFrom"]["secretKeyRef"]["name"]
        variables = {"LWS_LEADER_ADDRESS": "keepalive-serve-0.keepalive-serve.default",
                     "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index),
                     **{k: e["value"] for k, e in env.items() if "value" in e}}
        run = get_args_parser().parse_args(_expand(container["args"], variables))
        assert (run.nnodes, run.node_rank, run.master_addr) == (
            str(size), index, variables["LWS_LEADER_ADDRESS"])
        assert run.module and run.training_script == "keepalive_executor"
        assert run.training_script_args[0] == "serve"
        serve = vllm_serve_args(run.training_script_args[1:])
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert int(run.nproc_per_node) == gpus == serve.tensor_parallel_size
        assert serve.tensor_parallel_size * serve.pipeline_parallel_size == gpus * size
        assert serve.model_tag == variables["MODEL"]
        if index == 0:
            probe = container["readinessProbe"]["httpGet"]
            assert probe["path"] == "/health" and probe["port"] == serve.port
            assert {p["containerPort"] for p in container["ports"]} == {serve.port}
            assert serve.host == "0.0.0.0"
        else:
            assert "readinessProbe" not in container and "ports" not in container


# ---------------------------------------------------------------- systemd


def _verify(unit: Path) -> subprocess.CompletedProcess:
    """``systemd-analyze verify`` of ``unit``; it exits 0 even for a line it ignores as
    unparsable (it only warns), so a unit passes when it is also silent."""
    require("systemd-analyze")
    return subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                          capture_output=True, text=True, timeout=60)


def _unit_with_this_vllm(tmp_path: Path, text: str) -> Path:
    """The unit with ExecStart's vllm replaced by this venv's (verify checks that the command
    exists and is executable)."""
    vllm = Path(sys.executable).parent / "vllm"
    assert vllm.exists(), vllm
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace("/opt/keepalive-serve/venv/bin/vllm", str(vllm)))
    return unit


def _settings(text: str) -> dict[str, str]:
    """The unit's ``Key=value`` settings (continuation lines joined; of a key given twice,
    the last)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return dict(line.split("=", 1) for line in joined.splitlines()
                if re.match(r"^[A-Za-z]+=", line))


@fast
def test_the_systemd_unit_verifies_restarts_on_failure_and_outlasts_vllms_drain(tmp_path):
    text = UNIT.read_text()
    done = _verify(_unit_with_this_vllm(tmp_path, text))
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done
    # the check above can fail: a misspelt value is only a warning, and a missing command
    # an error
    bad = _verify(_unit_with_this_vllm(tmp_path, text.replace("KillMode=mixed",
                                                              "KillMode=mixd")))
    assert "Failed to parse kill mode" in bad.stderr, bad
    missing = tmp_path / "missing" / UNIT.name
    missing.parent.mkdir()
    missing.write_text(text)
    assert _verify(missing).returncode != 0
    settings = _settings(text)
    assert settings["Restart"] == "on-failure"
    assert settings["KillMode"] == "mixed"  # SIGTERM to the API server: vLLM's drain
    argv = shlex.split(settings["ExecStart"])
    assert Path(argv[0]).name == "vllm" and argv[1] == "serve"
    model = re.search(r"^Environment=MODEL=(\S+)$", text, re.M).group(1)
    serve = vllm_serve_args([model if a == "${MODEL}" else a for a in argv[2:]])
    assert serve.distributed_executor_backend == "keepalive"
    # systemd's SIGKILL must not cut vLLM's drain short (it comes TimeoutStopSec after the
    # SIGTERM), and restarts are spaced
    assert int(settings["TimeoutStopSec"]) > serve.shutdown_timeout + 30
    assert int(settings["RestartSec"]) >= 5
