"""The cached reference outputs (tests/references/, run_engine.Reference): keyed by what they
depend on, one variant per CPU, run live and rewritten on any mismatch, current for the scripts
on main, and each used by a test. Fast: no engine starts here."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import run_engine
from conftest import SNAPSHOT_ENV
from reference_calls import REFERENCES
from run_engine import (
    CPU_PART,
    REFERENCE_DIR,
    Reference,
    reference_call,
    reference_key,
    with_references,
)
from test_parity import COMPARED

pytestmark = pytest.mark.fast  # in `scripts/test.sh --fast`: see pyproject.toml

HERE = Path(__file__).resolve().parent
#: the references compared outside tests/test_parity.py, and the modules that compare them
COMPARED_ELSEWHERE = {
    "serve_tp2": ["test_serve.py", "test_torchrun.py", "../benchmarks/gpu_check.py"],
    "serve_tp1_pp2": ["test_pipeline.py", "test_torchrun.py"],
    "load_tp2": ["test_serve.py"],
    "llm_generate_mp": ["test_executor_llm.py"],
    "llm_generate_tp1": ["test_executor_llm.py"],
    "dp2_tp2_mp": ["test_data_parallel.py"],
    "dp2_tp1_mp": ["test_data_parallel.py"],
    "moe_dp2_tp2_mp": ["test_data_parallel.py"],
}


def _fake_model(tmp_path: Path) -> str:
    """A model directory as far as the key is concerned: the build parameters that
    tiny_model.build_tiny_model writes (the weights are not read)."""
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "keepalive_tiny_model.json").write_text(json.dumps({"seed": 0}))
    return str(model)


def _tamper(path: Path, part: str) -> None:
    stored = json.loads(path.read_text())
    for v in stored["variants"]:
        v["key"][part] += " (tampered)"
    path.write_text(json.dumps(stored))


def test_a_reference_whose_key_does_not_match_is_run_live_and_rewritten(tmp_path):
    """For each part of the key tampered with in turn: the lookup says which part, the
    reference call is run (not the cache), and its file is rewritten with the current key;
    with the key intact, only the keepalive call runs and the cached result is returned."""
    model, directory = _fake_model(tmp_path), tmp_path / "references"
    name = "spec_decode"
    call = reference_call(REFERENCES[name], model, tmp_path / "work")
    live = {"name": "spec_decode", "backend": "keepalive"}
    ran: list[list[dict]] = []

    def run(*calls: dict) -> list[dict]:  # stands in for run_scripts: which calls ran
        ran.append(list(calls))
        return [{"ran": c["backend"], "n": len(ran)} for c in calls]

    notes: list[str] = []
    absent = Reference.look_up(name, call, model, directory)
    assert absent.cached is None and absent.mismatch == ["no cached file"]
    absent.store({"greedy": [[1, 2]]})
    [variant] = Reference.variants(absent.path)
    key = variant["key"]
    assert key == reference_key(call, model)
    for part in key:
        _tamper(absent.path, part)
        ref = Reference.look_up(name, call, model, directory)
        assert ref.cached is None and ref.mismatch == [part]
        got, [result] = with_references([live], [ref], run=run, say=notes.append)
        assert ran[-1] == [live, call]  # the reference ran live, beside keepalive
        assert got == [{"ran": "keepalive", "n": len(ran)}]
        assert result == {"ran": "mp", "n": len(ran)}
        assert notes[-1] == f"reference {name}: live (key mismatch: {part})"
        # the tampered variant is replaced, except one that differs in the CPU alone: it is
        # another machine's, and stays beside this one's
        variants = Reference.variants(absent.path)
        assert [v["result"] for v in variants if v["key"] == key] == [result]
        assert len(variants) == (2 if part == CPU_PART else 1), variants
        if part == CPU_PART:
            _drop_other_cpus(absent.path, key)
    # the key matches again: only keepalive runs, the reference comes from the file
    ref = Reference.look_up(name, call, model, directory)
    assert ref.cached == result
    got, [cached] = with_references([live], [ref], run=run, say=notes.append)
    assert ran[-1] == [live] and cached == result
    assert re.fullmatch(rf"reference {name}: cached \(key [0-9a-f]{{12}}\)", notes[-1])


def _drop_other_cpus(path: Path, key: dict) -> None:
    stored = json.loads(path.read_text())
    stored["variants"] = [v for v in stored["variants"] if v["key"] == key]
    path.write_text(json.dumps(stored))


def test_each_cpu_keeps_its_own_variant_and_finds_it(tmp_path, monkeypatch):
    """Two machines with different ISAs share one file: each run stores its own variant
    without dropping the other's, and each finds its own result."""
    model, directory = _fake_model(tmp_path), tmp_path / "references"
    call = reference_call(REFERENCES["offline_features"], model, tmp_path / "work")
    results = {}
    for cpu in ("torch:AVX512 flags:amx_bf16 avx512f", "torch:AVX512 flags:avx512f sse4a"):
        monkeypatch.setattr(run_engine, "cpu_isa", lambda cpu=cpu: cpu)
        ref = Reference.look_up("offline_features", call, model, directory)
        assert ref.cached is None
        results[cpu] = ref.result(run=lambda c, cpu=cpu: {"computed on": cpu})
    for cpu, result in results.items():
        monkeypatch.setattr(run_engine, "cpu_isa", lambda cpu=cpu: cpu)
        assert Reference.look_up("offline_features", call, model, directory).cached == result
    assert len(Reference.variants(directory / "offline_features.json")) == 2


def test_the_key_covers_what_the_reference_depends_on(tmp_path, monkeypatch):
    """The key changes with the model's build parameters, the scripts' sources (also a
    module the call's script imports, and the call's own script) and the scenario's
    arguments."""
    model = _fake_model(tmp_path)
    call = reference_call(REFERENCES["offline_features"], model, tmp_path / "work")
    key = reference_key(call, model)
    assert key == reference_key({**call, "model": "/elsewhere", "workdir": "/x"}, model)
    Path(model, "keepalive_tiny_model.json").write_text(json.dumps({"seed": 1}))
    assert reference_key(call, model).keys() == key.keys()
    assert reference_key(call, model)["model_builder"] != key["model_builder"]
    Path(model, "keepalive_tiny_model.json").write_text(json.dumps({"seed": 0}))
    assert reference_key({**call, "tp": 1}, model)["scenario"] != key["scenario"]
    assert {"parity_scripts.py", "rpc_targets.py", "servers.py", "procs.py",
            "kv_connectors.py", "run_engine.py"} <= set(run_engine.tests_imported_by(
                "parity_scripts.py", "run_engine.py", "kv_connectors.py"))
    serve = reference_call(REFERENCES["serve_tp2"], model, tmp_path / "serve")
    assert reference_key(serve, model)["scripts"] != key["scripts"]  # serve_scripts.py's
    real_read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: real_read(p) + (
        b"#" if p.name == "rpc_targets.py" else b""))
    assert reference_key(call, model)["scripts"] != key["scripts"]
    monkeypatch.setattr(run_engine, "cpu_isa", lambda: "torch:DEFAULT flags:sse")
    assert reference_key(call, model)["cpu_isa"] != key["cpu_isa"]


def test_the_serve_reference_runs_with_the_serving_tests_arguments():
    """mp's answers are compared with servers started with serve_scripts.LOAD_ARGS."""
    from serve_scripts import LOAD_ARGS

    assert REFERENCES["serve_tp2"]["extra_args"] == LOAD_ARGS


def _as_found(name: str) -> Path:
    """NAME's reference file as this run found it (conftest's snapshot; a live run earlier in
    the same run may have rewritten the file itself)."""
    return Path(os.environ.get(SNAPSHOT_ENV, REFERENCE_DIR)) / f"{name}.json"


def test_every_reference_is_compared_by_a_test_and_has_its_file(tmp_path):
    """Every reference is compared by a test (and the tests named for it mention it); every
    one has its file, for the call those tests make now, with every part of the key; and no
    file is left over."""
    compared = [n for names in COMPARED.values() for n in names] + list(COMPARED_ELSEWHERE)
    assert sorted(compared) == sorted(REFERENCES)
    for name, modules in COMPARED_ELSEWHERE.items():
        for module in modules:
            source = (HERE / module).read_text()
            assert f'reference("{name}")' in source or f'"{name}"' in source, (name, module)
    assert sorted(p.stem for p in REFERENCE_DIR.glob("*.json")) == sorted(REFERENCES)
    model = _fake_model(tmp_path)
    for name, spec in REFERENCES.items():
        variants = Reference.variants(_as_found(name))
        key = reference_key(reference_call(spec, model, tmp_path / name), model)
        assert variants, name
        for v in variants:
            assert v["key"].keys() == key.keys(), name
            assert v["key"]["scenario"] == key["scenario"], name
            assert isinstance(v["result"], dict) and v["result"], name


def test_the_cached_references_are_current_apart_from_the_cpu(tiny_model, tmp_path):
    """Each file holds a variant valid for this checkout on some CPU: vLLM, torch, the
    packages, the model builder and the scripts all as they are now. A change to the scripts
    without `python scripts/make_references.py` would make every run of the suite compute the
    references live (minutes) on every machine: this fails instead, naming what is stale. It
    reads the files as the run found them (conftest's snapshot): a live run earlier in the
    same session rewrites a stale file."""
    stale = {}
    for name, spec in REFERENCES.items():
        key = reference_key(reference_call(spec, tiny_model, tmp_path / name), tiny_model)
        variants = Reference.variants(_as_found(name))
        differences = [sorted(p for p in key if p != CPU_PART and key[p] != v["key"].get(p))
                       for v in variants]
        if not any(d == [] for d in differences):
            stale[name] = min(differences, key=len, default=["no cached file"])
    assert stale == {}, f"run `python scripts/make_references.py`: stale parts {stale}"
