"""A drop-in for vLLM's ``mp``: every feature that works with ``mp`` gives the same outputs
with ``keepalive``, in the same test. Both executors run side by side (the comparisons are of
outputs, not times), one engine for every feature that can share it.

Features that fail under ``mp`` on this CPU build too are not tested here (see
docs/usage.md's feature table); features keepalive refuses are in tests/test_bad_config.py.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
from parity_scripts import CHOICES, JSON_SCHEMA, REGEX, STRUCTURED_CONFIG
from run_engine import PYTHONPATH, run_scripts
from servers import Server

pytestmark = pytest.mark.slow
BACKENDS = ("keepalive", "mp")


NO_MERGE = "keepalive-rank0-only"  # the negative control of the KV connector tests


def both(tmp_path_factory, name: str, negative_control: bool = False, **kw) -> dict:
    """Run parity_scripts.NAME under keepalive and mp at once: {backend: result}; with
    ``negative_control`` also keepalive with the connector-output merge switched off."""
    runs = [*BACKENDS, *([NO_MERGE] if negative_control else [])]
    calls = []
    for run in runs:
        work = tmp_path_factory.mktemp(f"{name}-{run}")
        (work / "faults").mkdir()
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": PYTHONPATH,
               "KEEPALIVE_FAULT_DIR": str(work / "faults")}
        if run == NO_MERGE:
            env["_KEEPALIVE_EXECUTOR_TEST_ONLY_NO_CONNECTOR_MERGE"] = "1"
        calls.append(dict(name=name, script="parity_scripts.py", extra_env=env,
                          backend="keepalive" if run == NO_MERGE else run,
                          **{k: (str(work) if v == "WORKDIR" else
                                 str(work / "faults") if v == "FAULTDIR" else v)
                             for k, v in kw.items()}))
    return dict(zip(runs, run_scripts(*calls), strict=True))


# ---------------------------------------------------------------- offline, one engine each


@pytest.fixture(scope="module")
def offline(tiny_model, tmp_path_factory):
    return both(tmp_path_factory, "offline_features", model=tiny_model, workdir="WORKDIR")


OFFLINE = ["greedy", "logprobs", "prompt_logprobs", "seeded_n3", "max_tokens_1",
           "stop_string", "empty_output", "min_tokens", "chunked_prefill",
           "prefix_cache_ids", "prefix_cached_tokens", "cached_after_reset", "preemption_ids",
           "structured_alone", "structured_mixed", "structured_mixed_free_ids",
           "profile_ranks", "apply_model", "collective_rpc_ranks", "unique_reply_rank_1",
           "after_sleep_wake"]


@pytest.mark.parametrize("feature", OFFLINE)
def test_offline_feature_gives_the_same_outputs_as_mp(offline, feature):
    assert offline["keepalive"][feature] == offline["mp"][feature]


def test_offline_features_took_effect(offline):
    """The equalities above are not vacuous: each feature did what it is for."""
    r = offline["keepalive"]
    assert all(len(t) == 16 for t in r["greedy"])
    assert all(len(pos) == 5 for seq in r["logprobs"] for pos in seq)
    assert r["prompt_logprobs"][0][0] is None and len(r["prompt_logprobs"][0][1]) >= 3
    assert len(r["seeded_n3"]) == 6 and len({tuple(t) for t in r["seeded_n3"][:3]}) > 1
    assert r["max_tokens_1"][1] == "length" and len(r["max_tokens_1"][0]) == 1
    assert r["stop_string"][0][1] == "stop"
    assert r["empty_output"][0][0] == "" and r["empty_output"][0][2] == "stop"
    assert len(r["min_tokens"][0]) >= 5
    assert all(n > 0 for n in r["prefix_cached_tokens"]) and r["cached_after_reset"] == 0
    assert r["reset_prefix_cache"] is True
    assert r["preemptions"] > 0 and offline["mp"]["preemptions"] > 0
    assert all(len(t) == 120 for t in r["preemption_ids"])
    so = r["structured_alone"]
    assert set(json.loads(so["json"])) == set(JSON_SCHEMA["required"])
    assert re.fullmatch(REGEX, so["regex"]) and so["choice"] in CHOICES
    assert r["profile_ranks"] == ["rank0", "rank1"]
    assert [rank for rank in range(2)] == r["collective_rpc_ranks"]
    assert r["unique_reply_rank_1"] == 1
    assert r["after_sleep_wake"] is True
    assert [name for name, _ in r["apply_model"]] == ["LlamaForCausalLM"] * 2


@pytest.fixture(scope="module")
def spec(tiny_model, tmp_path_factory):
    return both(tmp_path_factory, "spec_decode", model=tiny_model)


def test_ngram_speculative_decoding_gives_the_same_outputs_as_mp(spec):
    ka, mp = spec["keepalive"], spec["mp"]
    assert ka["greedy"] == mp["greedy"] and ka["with_structured"] == mp["with_structured"]
    # drafts reached the scheduler (take_draft_token_ids every step) and some were accepted
    assert ka["draft_tokens"] > 0 and ka["accepted_tokens"] > 0
    assert re.fullmatch(REGEX, ka["with_structured"][0])


# ---------------------------------------------------------------- KV connector


@pytest.fixture(scope="module")
def kv(tiny_model, tmp_path_factory):
    """keepalive, mp, and (negative control) keepalive passing on rank 0's connector output
    alone, as the executor did before: all three side by side."""
    return both(tmp_path_factory, "kv_connector", model=tiny_model, workdir="WORKDIR",
                fault_dir="FAULTDIR", negative_control=True)


def test_kv_connector_outputs_are_merged_from_every_rank_as_mp_does(kv):
    ka, mp = kv["keepalive"], kv["mp"]
    assert ka["runs"] == mp["runs"]
    assert ka["fault_fired"] and mp["fault_fired"]
    computed, loaded, failed_on_rank1 = (run["ids"] for run in ka["runs"])
    assert ka["runs"][1]["cached"] > 0  # loaded back from the connector's files
    assert loaded == computed
    # rank 1's load failure reached the scheduler, which recomputed those blocks
    assert failed_on_rank1 == computed
    # every rank reported every request finished sending: their blocks are free again, but
    # for the one block of the last request, whose reports a later step would deliver
    assert ka["blocks_held_after"] == mp["blocks_held_after"] == 1
    assert ka["files"] == mp["files"]
    assert any(".tp1." in f or f.startswith("tp1") for f in ka["files"]), ka["files"]


def test_negative_control_rank0_connector_output_alone_goes_wrong(kv):  # noqa: D401
    """What the executor did before: rank 0's output alone. Rank 1's load failure is lost
    (it attends to zeroed KV, so the answer changes), and its finished reports too (blocks
    stay allocated)."""
    res = kv[NO_MERGE]
    computed, _, failed_on_rank1 = (run["ids"] for run in res["runs"])
    assert res["fault_fired"]
    assert failed_on_rank1 != computed or res["blocks_held_after"] > 1, res


# ---------------------------------------------------------------- through vllm serve


def _servers(tiny_model, tmp_path, name: str, extra_args: list[str]) -> dict[str, Server]:
    servers = {b: Server(tiny_model, tmp_path / f"{name}-{b}.log", backend=b,
                         extra_args=["--dtype", "float32", *extra_args])
               for b in BACKENDS}
    errors = []

    def ready(s: Server) -> None:
        try:
            s.wait_ready()
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=ready, args=(s,)) for s in servers.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers.values():
            s.stop()
        raise errors[0]
    return servers


def _lora_and_structured_answers(server: Server) -> dict:
    client = server.client()
    out: dict = {}
    for model in ("tiny", "ad1", "ad2"):  # one at a time: never base and LoRA in one batch
        out[model] = client.completions.create(model=model, prompt="Hello, my name is",
                                               max_tokens=16, temperature=0).choices[0].text
    specs = [{"json": JSON_SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}, None, None]
    results: dict[int, str] = {}

    def stream(i: int, so: dict | None) -> None:
        extra = {"structured_outputs": so} if so else {"ignore_eos": True}
        pieces = [c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="The capital of France is", max_tokens=60 if so else 20,
            temperature=0, stream=True, extra_body=extra)]
        results[i] = "".join(pieces)

    threads = [threading.Thread(target=stream, args=(i, so)) for i, so in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    out["structured_streams"] = [results.get(i) for i in range(len(specs))]
    return out


def test_lora_and_streamed_structured_outputs_through_vllm_serve(tiny_model, tmp_path):
    from tiny_model import build_tiny_lora

    ad1 = build_tiny_lora(tmp_path / "ad1", tiny_model, seed=1)
    ad2 = build_tiny_lora(tmp_path / "ad2", tiny_model, seed=2)
    servers = _servers(tiny_model, tmp_path, "lora", [
        "--structured-outputs-config", json.dumps(STRUCTURED_CONFIG),
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        "--lora-modules", f"ad1={ad1}", f"ad2={ad2}"])
    try:
        answers = {b: _lora_and_structured_answers(s) for b, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    ka, mp = answers["keepalive"], answers["mp"]
    assert ka == mp
    assert len({ka["tiny"], ka["ad1"], ka["ad2"]}) == 3  # each adapter changes the answer
    js, rx, ch, *free = ka["structured_streams"]
    assert set(json.loads(js)) == {"a", "b"} and re.fullmatch(REGEX, rx) and ch in CHOICES
    assert all(free)


def test_pooling_model_embeddings_through_vllm_serve(tiny_model, tmp_path):
    servers = _servers(tiny_model, tmp_path, "pooling", ["--runner", "pooling"])
    inputs = ["Hello, my name is", "The capital of France is", "One, two, three,"]
    try:
        got = {b: [d.embedding for d in s.client().embeddings.create(model="tiny",
                                                                      input=inputs).data]
               for b, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    ka, mp = got["keepalive"], got["mp"]
    assert len(ka) == 3 and len(ka[0]) == 256
    for a, b in zip(ka, mp, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    assert abs(sum(x * x for x in ka[0]) - 1.0) < 1e-4  # normalised, as vLLM's pooler does


# ---------------------------------------------------------------- pipeline parallelism


@pytest.fixture(scope="module")
def pipeline_tp1_pp2(tiny_model, tmp_path_factory):
    """-tp 1 -pp 2 under keepalive (eager, and compilation mode 2) and mp (mode 2: mp cannot
    run PP in eager mode on vLLM 0.32's CPU backend), and the TP=1 reference."""
    def call(backend, tp, pp, eager=False):
        return dict(name="pipeline", script="parity_scripts.py", model=tiny_model,
                    backend=backend, tp=tp, pp=pp, eager=eager,
                    extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                               "PYTHONPATH": PYTHONPATH})
    ka, mp, ka_eager, tp1 = run_scripts(call("keepalive", 1, 2), call("mp", 1, 2),
                                        call("keepalive", 1, 2, eager=True),
                                        call("none", 1, 1, eager=True))
    return {"keepalive": ka, "mp": mp, "keepalive-eager": ka_eager, "tp1": tp1}


def test_pipeline_tp1_pp2_gives_mps_and_tp1s_answers_with_batches_overlapping(
        pipeline_tp1_pp2):
    r = pipeline_tp1_pp2
    assert r["keepalive"]["greedy"] == r["mp"]["greedy"] == r["tp1"]["greedy"]
    assert r["keepalive-eager"]["greedy"] == r["tp1"]["greedy"]
    assert len(r["keepalive"]["greedy"]) == 16
    # the engine kept two batches in flight (its batch queue is PP deep)
    assert r["keepalive"]["max_steps_in_flight"] >= 2


def test_pipeline_structured_outputs_the_non_fused_path_equal_mps(pipeline_tp1_pp2):
    r = pipeline_tp1_pp2
    assert r["keepalive"]["structured_mixed"] == r["mp"]["structured_mixed"]
    assert r["keepalive-eager"]["structured_mixed"] == r["tp1"]["structured_mixed"]
    js, rx, ch, free = r["keepalive"]["structured_mixed"]
    assert set(json.loads(js)) == {"a", "b"} and re.fullmatch(REGEX, rx) and ch in CHOICES


def test_pipeline_tp2_pp2_four_ranks_gives_mps_and_tp1s_answers(tiny_model, pipeline_tp1_pp2):
    """Four ranks on this 2-core machine (two per core): one at a time."""
    def call(backend):
        return dict(name="pipeline", script="parity_scripts.py", model=tiny_model,
                    backend=backend, tp=2, pp=2,
                    extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": PYTHONPATH})
    [ka] = run_scripts(call("keepalive"))
    [mp] = run_scripts(call("mp"))
    assert ka["greedy"] == mp["greedy"] == pipeline_tp1_pp2["tp1"]["greedy"]
    assert ka["structured_mixed"] == mp["structured_mixed"]
    assert ka["max_steps_in_flight"] >= 2
