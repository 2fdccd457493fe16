"""Bad settings make `vllm serve` exit non-zero before any model weight is loaded,
with a message that names the setting."""

import subprocess
import sys

import pytest
from helpers import env

CASES = [
    ({"VLLM_KEEPALIVE_INTERVAL_S": "100"}, [], ["VLLM_KEEPALIVE_INTERVAL_S=100", "at most half",
                                                 "5s", "--distributed-timeout-seconds"]),
    ({"VLLM_KEEPALIVE_INTERVAL_S": "soon"}, [], ["VLLM_KEEPALIVE_INTERVAL_S='soon'",
                                                  "not a number"]),
    ({"VLLM_KEEPALIVE_INTERVAL_S": "0"}, [], ["VLLM_KEEPALIVE_INTERVAL_S=0", "must be positive"]),
    ({}, ["--additional-config", '{"keepalive_interval_s": -2}'],
     ["keepalive_interval_s=-2", "must be positive"]),
    ({"VLLM_KEEPALIVE_TRANSPORT": "carrier-pigeon"}, [],
     ["VLLM_KEEPALIVE_TRANSPORT='carrier-pigeon'", "'device'", "'cpu'"]),
    ({}, ["-pp", "2"], ["ipeline"]),
]


@pytest.mark.parametrize("extra_env, args, needles", CASES,
                         ids=["too-large", "nan", "zero", "additional-config", "transport", "pp"])
def test_bad_setting_fails_before_loading(tiny_model, extra_env, args, needles):
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", tiny_model,
           "-tp", "2", "--distributed-executor-backend", "keepalive",
           "--distributed-timeout-seconds", "5", "--enforce-eager", "--port", "0", *args]
    proc = subprocess.run(cmd, env=env(**extra_env), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out[-3000:]}"
    assert "Loading weights" not in out and "Starting to load model" not in out
