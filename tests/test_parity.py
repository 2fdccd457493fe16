"""A drop-in for vLLM's ``mp``: every feature that works with ``mp`` gives the same outputs
with ``keepalive``. The ``mp`` (and TP=1) side of each comparison is a reference output that
depends only on the environment: it is computed once per environment by
scripts/make_references.py and cached in tests/references/ (run_engine.Reference). When the
cached file's key matches this environment only the keepalive engine starts; otherwise the
reference runs live beside it, as it always did, and its file is rewritten. The test output
says which ("reference NAME: cached (key ...)" or "... live (key mismatch: PART)").

Features that fail under ``mp`` on this CPU build too are not tested here (see
docs/usage.md's feature table); features keepalive refuses are in tests/test_bad_config.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from parity_scripts import CHOICES, JSON_SCHEMA, REGEX
from reaping import reaped
from reference_calls import REFERENCES
from run_engine import Reference, parity_call, reference_call, run_scripts, say, with_references

slow = pytest.mark.slow
# scripts/test.sh runs these two at a time (pytest-xdist, --dist loadgroup): the tests that
# share an engine run are one group, so they run on one worker, and the run's fixture is
# session-scoped, so it is not torn down when that worker runs another module's test between
# two of them (a module-scoped one would be, and the engine would run again)

NO_MERGE = "keepalive-rank0-only"  # the negative control of the KV connector tests

#: the references each group of parity tests compares with (the others: tests/test_references.py)
COMPARED = {"offline": ["offline_features"], "spec": ["spec_decode"], "kv": ["kv_connector"],
            "lora": ["lora_serve"], "pooling": ["pooling_serve"],
            "pipeline_tp1_pp2": ["pipeline_tp1_pp2_mp", "pipeline_tp1"],
            "pipeline_tp2_pp2": ["pipeline_tp2_pp2_mp"]}


def references(tmp_path_factory: pytest.TempPathFactory, model: str,
               names: list[str]) -> list[Reference]:
    """Look up the cached references NAMES (each a REFERENCES entry), with the call that runs
    one live in a fresh directory."""
    return [Reference.look_up(n, reference_call(REFERENCES[n], model,
                                                tmp_path_factory.mktemp(f"{n}-ref")), model)
            for n in names]


def keepalive_call(tmp_path_factory: pytest.TempPathFactory, model: str, reference: str,
                   run: str = "keepalive", extra_env: dict | None = None, **change) -> dict:
    """The call of REFERENCE (a REFERENCES entry) with the keepalive backend (and CHANGE)."""
    spec = {**REFERENCES[reference], "backend": "keepalive", **change}  # change: may name
    # a negative control's executor as the backend (tests/controls.py)
    return parity_call(model=model, work=tmp_path_factory.mktemp(f"{reference}-{run}"),
                       extra_env=extra_env, **spec)


def both(tmp_path_factory: pytest.TempPathFactory, model: str, group: str,
         negative_control: bool = False, run: Callable[..., list[dict]] = run_scripts) -> dict:
    """keepalive live and GROUP's reference (cached, or live beside it): {backend: result};
    with ``negative_control`` also keepalive with the connector-output merge switched off."""
    [name] = COMPARED[group]
    live = [keepalive_call(tmp_path_factory, model, name)]
    if negative_control:
        live.append(keepalive_call(tmp_path_factory, model, name, run=NO_MERGE,
                                   backend="controls.NoConnectorMerge"))
    # (reaped: a run that times out leaves no server of its scripts behind)
    got, [ref] = with_references(live, references(tmp_path_factory, model, [name]),
                                 run=reaped(run), say=say)
    return {"keepalive": got[0], "mp": ref, **({NO_MERGE: got[1]} if negative_control else {})}


# ---------------------------------------------------------------- offline, one engine each


@pytest.fixture(scope="session")  # once per pytest-xdist worker: see above
def offline(tiny_model, tmp_path_factory):
    return both(tmp_path_factory, tiny_model, "offline")


OFFLINE = ["greedy", "logprobs", "prompt_logprobs", "seeded_n3", "max_tokens_1",
           "stop_string", "empty_output", "min_tokens", "chunked_prefill",
           "prefix_cache_ids", "prefix_cached_tokens", "cached_after_reset", "preemption_ids",
           "structured_alone", "structured_mixed", "structured_mixed_free_ids",
           "profile_ranks", "apply_model", "collective_rpc_ranks", "unique_reply_rank_1",
           "after_sleep_wake"]


@pytest.mark.xdist_group("parity-offline")
@slow
@pytest.mark.parametrize("feature", OFFLINE)
def test_offline_feature_gives_the_same_outputs_as_mp(offline, feature):
    assert offline["keepalive"][feature] == offline["mp"][feature]


@pytest.mark.xdist_group("parity-offline")
@slow
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


@pytest.fixture(scope="session")  # once per pytest-xdist worker: see above
def spec(tiny_model, tmp_path_factory):
    return both(tmp_path_factory, tiny_model, "spec")


@slow
def test_ngram_speculative_decoding_gives_the_same_outputs_as_mp(spec):
    ka, mp = spec["keepalive"], spec["mp"]
    assert ka["greedy"] == mp["greedy"] and ka["with_structured"] == mp["with_structured"]
    # drafts reached the scheduler (take_draft_token_ids every step) and some were accepted
    assert ka["draft_tokens"] > 0 and ka["accepted_tokens"] > 0
    assert mp["draft_tokens"] > 0 and mp["accepted_tokens"] > 0  # the reference's too
    assert re.fullmatch(REGEX, ka["with_structured"][0])


# ---------------------------------------------------------------- KV connector


@pytest.fixture(scope="session")  # once per pytest-xdist worker: see above
def kv(tiny_model, tmp_path_factory):
    """keepalive, mp, and (negative control) keepalive passing on rank 0's connector output
    alone, as the executor did before: all three side by side."""
    return both(tmp_path_factory, tiny_model, "kv", negative_control=True)


@pytest.mark.xdist_group("parity-kv")
@slow
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


@pytest.mark.xdist_group("parity-kv")
@slow
def test_negative_control_rank0_connector_output_alone_goes_wrong(kv):  # noqa: D401
    """What the executor did before: rank 0's output alone. Rank 1's load failure is lost: it
    attends to zeroed KV, so the answer changes. (Rank 1's finished reports are lost too, but
    that does not show here: without the merge the scheduler frees a request's blocks on rank
    0's report alone, earlier than it should, and as many blocks are free at the end, 1 held,
    as with the merge. An earlier version of this test claimed blocks stayed allocated and
    accepted either loss; seen false when both were required.)"""
    res = kv[NO_MERGE]
    computed, _, failed_on_rank1 = (run["ids"] for run in res["runs"])
    assert res["fault_fired"]
    assert failed_on_rank1 != computed, res


# ---------------------------------------------------------------- through vllm serve


@slow
def test_lora_and_streamed_structured_outputs_through_vllm_serve(tiny_model, tmp_path_factory):
    answers = both(tmp_path_factory, tiny_model, "lora")
    ka, mp = answers["keepalive"], answers["mp"]
    assert ka == mp
    assert len({ka["tiny"], ka["ad1"], ka["ad2"]}) == 3  # each adapter changes the answer
    js, rx, ch, *free = ka["structured_streams"]
    assert set(json.loads(js)) == {"a", "b"} and re.fullmatch(REGEX, rx) and ch in CHOICES
    assert all(free)


@slow
def test_pooling_model_embeddings_through_vllm_serve(tiny_model, tmp_path_factory):
    got = {k: v["embeddings"] for k, v in both(tmp_path_factory, tiny_model, "pooling").items()}
    ka, mp = got["keepalive"], got["mp"]
    assert len(ka) == 3 and len(ka[0]) == 256
    for a, b in zip(ka, mp, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    assert abs(sum(x * x for x in ka[0]) - 1.0) < 1e-4  # normalised, as vLLM's pooler does


# ---------------------------------------------------------------- pipeline parallelism


@pytest.fixture(scope="session")  # once per pytest-xdist worker: see above
def pipeline_tp1_pp2(tiny_model, tmp_path_factory):
    """-tp 1 -pp 2 under keepalive (eager, and compilation mode 2) and mp (mode 2: mp cannot
    run PP in eager mode on vLLM 0.32's CPU backend), and the TP=1 reference."""
    name = "pipeline_tp1_pp2_mp"
    (ka, ka_eager), (mp, tp1) = with_references(
        [keepalive_call(tmp_path_factory, tiny_model, name),
         keepalive_call(tmp_path_factory, tiny_model, name, run="eager", eager=True)],
        references(tmp_path_factory, tiny_model, COMPARED["pipeline_tp1_pp2"]),
        run=reaped(run_scripts), say=say)
    return {"keepalive": ka, "mp": mp, "keepalive-eager": ka_eager, "tp1": tp1}


@pytest.mark.xdist_group("parity-pipeline")
@slow
def test_pipeline_tp1_pp2_gives_mps_and_tp1s_answers_with_batches_overlapping(
        pipeline_tp1_pp2):
    r = pipeline_tp1_pp2
    assert r["keepalive"]["greedy"] == r["mp"]["greedy"] == r["tp1"]["greedy"]
    assert r["keepalive-eager"]["greedy"] == r["tp1"]["greedy"]
    assert len(r["keepalive"]["greedy"]) == 16
    # the engine kept two batches in flight (its batch queue is PP deep)
    assert r["keepalive"]["max_steps_in_flight"] >= 2


@pytest.mark.xdist_group("parity-pipeline")
@slow
def test_pipeline_structured_outputs_the_non_fused_path_equal_mps(pipeline_tp1_pp2):
    r = pipeline_tp1_pp2
    assert r["keepalive"]["structured_mixed"] == r["mp"]["structured_mixed"]
    assert r["keepalive-eager"]["structured_mixed"] == r["tp1"]["structured_mixed"]
    js, rx, ch, free = r["keepalive"]["structured_mixed"]
    assert set(json.loads(js)) == {"a", "b"} and re.fullmatch(REGEX, rx) and ch in CHOICES


@pytest.mark.xdist_group("parity-pipeline")
@slow
def test_pipeline_tp2_pp2_four_ranks_gives_mps_and_tp1s_answers(tiny_model, tmp_path_factory,
                                                                pipeline_tp1_pp2):
    """Four ranks on this 2-core machine (two per core): one at a time."""
    def one_at_a_time(*calls: dict) -> list[dict]:
        return [run_scripts(c)[0] for c in calls]

    r = both(tmp_path_factory, tiny_model, "pipeline_tp2_pp2", run=one_at_a_time)
    ka, mp = r["keepalive"], r["mp"]
    assert ka["greedy"] == mp["greedy"] == pipeline_tp1_pp2["tp1"]["greedy"]
    assert ka["structured_mixed"] == mp["structured_mixed"]
    assert ka["max_steps_in_flight"] >= 2
