"""`vllm serve ... --distributed-executor-backend keepalive` as a real server, real client."""

import time

import pytest
from procs import alive
from servers import Server

TIMEOUT = "5"  # --distributed-timeout-seconds: the device group's timeout (default transport)
IDLE_S = 20.0  # four times the timeout


def texts(answers: dict) -> dict:
    """The answers without the chunk count: how many SSE chunks a stream of the same tokens
    arrives in depends on timing (the front end coalesces tokens that are ready together),
    so only the texts are compared between runs."""
    return {k: v for k, v in answers.items() if k != "stream_chunks"}


def ask(client):
    comp = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=12,
                                     temperature=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "The capital of France is"}],
        max_tokens=12, temperature=0)
    stream = client.completions.create(model="tiny", prompt="One, two, three,", max_tokens=12,
                                       temperature=0, stream=True)
    pieces = [c.choices[0].text for c in stream]
    return {
        "completion": comp.choices[0].text,
        "chat": chat.choices[0].message.content,
        "stream": "".join(pieces),
        "stream_chunks": len(pieces),
    }


@pytest.mark.slow
def test_serve_answers_survives_idle_and_shuts_down_clean_negative_control_dies(tiny_model,
                                                                                 tmp_path):
    """Two servers side by side, idle for the same four collective timeouts: keepalive's answers
    stay the same and it shuts down clean; the negative control (pacer disabled by the
    test-only switch, everything else equal) must fail."""
    args = ["--distributed-timeout-seconds", TIMEOUT]
    # One after the other: a cold start beside another can starve a rank past the 5 s
    # timeout inside vLLM's own start-up collectives (docs/usage.md), which is not the subject.
    server = Server(tiny_model, tmp_path / "serve.log", extra_args=args)
    control = None
    try:
        server.wait_ready()
        control = Server(tiny_model, tmp_path / "serve-nopacer.log", extra_args=args,
                         extra_env={"_KEEPALIVE_EXECUTOR_TEST_ONLY_DISABLE_PACER": "1"})
        control.wait_ready()
        client = server.client()
        before = ask(client)
        assert before["stream_chunks"] > 1 and before["completion"] and before["chat"]
        tree, control_tree = server.tree(), control.tree()
        try:
            # Without the pacer the worker's wait has been running since start-up, so on a
            # slow machine even this first request may already find it dead: also a failure
            # of the same scenario.
            ask(control.client())
        except Exception:  # noqa: BLE001
            pass
        time.sleep(IDLE_S)
        assert server.health() == 200
        after = ask(client)
        assert texts(after) == texts(before)
        assert "keepalive executor: transport=device, interval=1.25s" in server.log()
        failed = None
        try:
            ask(control.client())
        except Exception as e:  # noqa: BLE001 - the expected outcome, checked below
            failed = e
        # the control failed for the reason under test: rank 1's idle wait timed out (gloo's
        # own message), rank 1 exited, and the request got an error
        assert failed is not None, "the control answered after the idle without the pacer"
        log = control.log()
        assert "Timed out" in log and "worker rank 1" in log, log[-3000:]
    finally:
        code = server.stop()
        if control is not None:
            control.stop()
    assert code == 0, server.log()[-3000:]
    assert alive(tree) == [] and alive(control_tree) == []
