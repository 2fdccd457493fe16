"""`vllm serve ... --distributed-executor-backend keepalive` as a real server, real client."""

import time

import pytest
from procs import alive
from servers import Server

TIMEOUT = "5"  # --distributed-timeout-seconds: the device group's timeout (default transport)
IDLE_S = 30.0  # six times the timeout


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
def test_serve_answers_survives_idle_and_shuts_down_clean(tiny_model, tmp_path):
    server = Server(tiny_model, tmp_path / "serve.log",
                    extra_args=["--distributed-timeout-seconds", TIMEOUT])
    try:
        server.wait_ready()
        client = server.client()
        before = ask(client)
        assert before["stream_chunks"] > 1 and before["completion"] and before["chat"]
        tree = server.tree()
        time.sleep(IDLE_S)
        assert server.health() == 200
        after = ask(client)
        assert texts(after) == texts(before)
        log = server.log()
        assert "keepalive executor: transport=device, interval=1.25s" in log
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
    assert alive(tree) == []


@pytest.mark.slow
def test_negative_control_without_keepalive_idle_kills_the_server(tiny_model, tmp_path):
    """Same serve, same idle, pacer disabled by the test-only switch: it must fail."""
    server = Server(tiny_model, tmp_path / "serve-nopacer.log",
                    extra_args=["--distributed-timeout-seconds", TIMEOUT],
                    extra_env={"_KEEPALIVE_EXECUTOR_TEST_ONLY_DISABLE_PACER": "1"})
    try:
        server.wait_ready()
        client = server.client()
        tree = server.tree()
        try:
            # Without the pacer the worker's wait has been running since start-up, so on a
            # slow machine even this first request may already find it dead: also a failure
            # of the same scenario.
            ask(client)
        except Exception:  # noqa: BLE001
            pass
        time.sleep(IDLE_S)
        failed = False
        try:
            ask(client)
        except Exception:  # noqa: BLE001 - any failure of the request is the expected outcome
            failed = True
        assert failed or server.health() != 200 or server.proc.poll() is not None
        assert "worker rank 1" in server.log()
    finally:
        server.stop()
    assert alive(tree) == []
