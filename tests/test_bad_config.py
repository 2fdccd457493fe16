"""Bad settings fail start-up in vLLM's front end, before any model weight is loaded, with a
message that names the setting.

Three cases go through `vllm serve` itself, as a user would meet them; every case goes
through the same front-end path (vLLM's serve argument parser, ``create_engine_config``,
``Executor.get_class``, which our plugin wraps) in one interpreter, which is much faster."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from run_engine import HERE
from servers import env

CASES = [
    ("too-large", {"VLLM_KEEPALIVE_INTERVAL_S": "100"}, [],
     ["VLLM_KEEPALIVE_INTERVAL_S=100", "at most half", "5s", "--distributed-timeout-seconds"]),
    ("nan", {"VLLM_KEEPALIVE_INTERVAL_S": "soon"}, [],
     ["VLLM_KEEPALIVE_INTERVAL_S='soon'", "not a number"]),
    ("zero", {"VLLM_KEEPALIVE_INTERVAL_S": "0"}, [],
     ["VLLM_KEEPALIVE_INTERVAL_S=0", "must be positive"]),
    ("additional-config", {}, ["--additional-config", '{"keepalive_interval_s": -2}'],
     ["keepalive_interval_s=-2", "must be positive"]),
    ("transport", {"VLLM_KEEPALIVE_TRANSPORT": "carrier-pigeon"}, [],
     ["VLLM_KEEPALIVE_TRANSPORT='carrier-pigeon'", "'device'", "'cpu'"]),
    # our own sentence: vLLM refuses pcp on its own too ("Model Runner V1 does not support:
    # prefill context parallel"), and a flag name alone would also match vLLM's refusal
    ("pcp", {}, ["--prefill-context-parallel-size", "2"],
     ["--distributed-executor-backend keepalive does not support "
      "--prefill-context-parallel-size=2 (not supported: use 1)"]),
    # settings once read at import time (a bare ValueError, or -5 accepted)
    ("failure-grace", {"VLLM_KEEPALIVE_FAILURE_GRACE_S": "abc"}, [],
     ["VLLM_KEEPALIVE_FAILURE_GRACE_S='abc'", "not a number"]),
    ("startup-timeout", {"VLLM_KEEPALIVE_STARTUP_TIMEOUT_S": "-5"}, [],
     ["VLLM_KEEPALIVE_STARTUP_TIMEOUT_S='-5'", "must be positive"]),
    ("execute-timeout", {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "0"}, [],
     ["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS='0'", "must be positive"]),
    ("liveness-timeout", {"VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S": "inf"}, [],
     ["VLLM_KEEPALIVE_LIVENESS_TIMEOUT_S='inf'", "not a finite number"]),
    ("inline-bytes", {"VLLM_KEEPALIVE_INLINE_BYTES": "16k"}, [],
     ["VLLM_KEEPALIVE_INLINE_BYTES='16k'", "non-negative integer number of bytes"]),
    ("max-payload", {"VLLM_KEEPALIVE_MAX_PAYLOAD_BYTES": "-1"}, [],
     ["VLLM_KEEPALIVE_MAX_PAYLOAD_BYTES='-1'", "non-negative integer number of bytes"]),
    # features keepalive refuses (mp runs them): DP with PP for a mixture-of-experts model
    # (TINY_MOE: a Mixtral config without weights, enough for the front end; DP of a dense or
    # MoE model without PP runs, tests/test_data_parallel.py)
    ("data-parallel-moe-pp", {},
     ["--model", "TINY_MOE", "-tp", "1", "-pp", "2", "--data-parallel-size", "2"],
     ["--data-parallel-size=2 with --pipeline-parallel-size=2 for a mixture-of-experts model",
      "use -pp 1 with -dp, or -dp 1"]),
    # vLLM accepts an EC connector here; keepalive's PP path would drop its per-rank outputs
    ("ec-with-pp", {}, ["-pp", "2", "--ec-transfer-config", json.dumps(
        {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
         "ec_connector_extra_config": {"shared_storage_path": "/tmp/keepalive-ec-unused"}})],
     ["--pipeline-parallel-size=2", "--ec-transfer-config", "drop the flag, or use -pp 1"]),
    # the version gate (keepalive_executor/compat.py): a vLLM release outside the range
    ("unsupported-vllm", {"KEEPALIVE_TEST_POSE_AS_VLLM": "0.35.0"}, [],
     ["the installed vLLM is 0.35.0", "supports vLLM 0.32.x, 0.33.x and 0.34.x",
      "VLLM_KEEPALIVE_ALLOW_UNSUPPORTED_VLLM=1"]),
    # vLLM allows fault tolerance only with external DP load balancing, which it allows only
    # for a mixture-of-experts model
    ("fault-tolerance", {}, ["--model", "TINY_MOE", "-tp", "1", "--data-parallel-size", "2",
                             "--data-parallel-rank", "0", "--enable-fault-tolerance"],
     ["does not support --enable-fault-tolerance", "a failed keepalive executor stays failed"]),
    # vLLM refuses this one itself, before our check (mp-only); several nodes: torchrun mode
    ("nnodes", {}, ["--nnodes", "2"], ["nnodes > 1", "mp, uni or external_launcher"]),
]
BASE_ARGS = ["-tp", "2", "--distributed-executor-backend", "keepalive",
             "--distributed-timeout-seconds", "5", "--enforce-eager"]


def tiny_moe_config(directory: Path, tiny_model: str) -> str:
    """The tiny Mixtral's config (tests/tiny_moe.py) and the tiny model's tokenizer, no
    weights: what vLLM's front end reads (is_moe) before any engine starts."""
    from tiny_moe import copy_tokenizer, tiny_moe_config

    directory.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(tiny_model, directory)
    tiny_moe_config().save_pretrained(directory)
    return str(directory)


def _with_models(args: list[str], tiny_model: str, moe: str) -> list[str]:
    """ARGS with the tiny model first (a later --model wins) and TINY_MOE replaced."""
    return ["--model", tiny_model, *[moe if a == "TINY_MOE" else a for a in args]]


@pytest.fixture(scope="session")  # once per pytest-xdist worker (tests/test_parity.py)
def tiny_moe(tiny_model, tmp_path_factory) -> str:
    return tiny_moe_config(tmp_path_factory.mktemp("moe") / "tiny-mixtral-config", tiny_model)


@pytest.fixture(scope="session")
def frontend_errors(tiny_model, tiny_moe):
    cases = [{"id": i, "env": e, "args": _with_models([*BASE_ARGS, *a], tiny_model, tiny_moe)}
             for i, e, a, _ in CASES]
    proc = subprocess.run([sys.executable, str(HERE / "frontend_check.py"), json.dumps(cases)],
                          env=env(), capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.xdist_group("bad-config-frontend")  # one front-end run for all cases
@pytest.mark.parametrize("case_id, needles", [(c[0], c[3]) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_setting_fails_in_the_front_end_naming_it(frontend_errors, case_id, needles):
    out = frontend_errors[case_id]
    assert out["error"] is not None, "the front end accepted it"
    # vLLM's config validation (pydantic) runs our check and wraps its error
    assert out["error_type"] in ("KeepaliveConfigError", "ValidationError",
                                 "NotImplementedError"), out
    for needle in needles:
        assert needle in out["error"], f"{needle!r} not in {out['error']!r}"


@pytest.mark.parametrize("case_id", ["too-large", "failure-grace", "data-parallel-moe-pp",
                                     "ec-with-pp"])
def test_bad_setting_through_vllm_serve_exits_before_loading(tiny_model, tiny_moe, case_id):
    _, extra_env, args, needles = next(c for c in CASES if c[0] == case_id)
    model, *rest = _with_models([*BASE_ARGS, "--port", "0", *args], tiny_model, tiny_moe)[1:]
    if "--model" in rest:  # vllm serve takes the model positionally
        at = rest.index("--model")
        model, rest = rest[at + 1], rest[:at] + rest[at + 2:]
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *rest]
    proc = subprocess.run(cmd, env=env(**extra_env), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out[-3000:]}"
    assert "Loading weights" not in out and "Starting to load model" not in out
