"""Load: 256 streaming requests at concurrency 32, mixed prompt and output lengths, 10% of
clients disconnecting mid-stream. The keepalive server stays healthy, frees what the aborted
requests held, and every completed greedy answer equals vLLM's mp executor's answer."""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request

import pytest
from servers import Server

pytestmark = pytest.mark.slow

WORDS = ("the quick brown fox jumps over lazy dog tensor parallel driver worker keepalive "
         "broadcast collective timeout engine idle busy hello name capital france").split()
N, CONCURRENCY, ABORT_EVERY = 256, 32, 10
# float32 on both servers: the answers must not depend on bf16 rounding of a batch's shape
ARGS = ["--dtype", "float32", "--max-num-seqs", "16"]


def workload() -> list[dict]:
    rng = random.Random(0)
    reqs = []
    for i in range(N):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))
        reqs.append({"i": i, "prompt": prompt, "max_tokens": rng.randint(4, 64),
                     "abort": i % ABORT_EVERY == ABORT_EVERY - 1})
    return reqs


async def run_wave(base_url: str, reqs: list[dict]) -> dict[int, str]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0,
                                timeout=300)
    sem = asyncio.Semaphore(CONCURRENCY)
    done: dict[int, str] = {}

    async def one(r: dict) -> None:
        async with sem:
            stream = await client.completions.create(
                model="tiny", prompt=r["prompt"], max_tokens=r["max_tokens"], temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            text, chunks = [], 0
            async for c in stream:
                text.append(c.choices[0].text)
                chunks += 1
                if r["abort"] and chunks >= 2:
                    await stream.close()  # the client goes away mid-stream
                    return
            done[r["i"]] = "".join(text)

    await asyncio.gather(*(one(r) for r in reqs))
    await client.close()
    return done


def metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        body = r.read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*\}} (\S+)$", body, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_load_with_disconnects_matches_mp(tiny_model, tmp_path):
    reqs = workload()
    server = Server(tiny_model, tmp_path / "load-keepalive.log", extra_args=ARGS)
    try:
        server.wait_ready()
        done = asyncio.run(run_wave(server.base_url, reqs))
        assert server.health() == 200
        # the aborted requests gave back their slots and KV blocks
        assert metric(server.base_url, "vllm:num_requests_running") == 0
        assert metric(server.base_url, "vllm:num_requests_waiting") == 0
        assert metric(server.base_url, "vllm:kv_cache_usage_perc") == 0
        # and the server keeps serving: a second wave completes in full
        second = asyncio.run(run_wave(server.base_url, [dict(r, abort=False) for r in reqs[:32]]))
        assert len(second) == 32
    finally:
        server.stop()
    expected = [r for r in reqs if not r["abort"]]
    assert sorted(done) == [r["i"] for r in expected]

    reference = Server(tiny_model, tmp_path / "load-mp.log", backend="mp", extra_args=ARGS)
    try:
        reference.wait_ready()
        ref = asyncio.run(run_wave(reference.base_url, expected))
    finally:
        reference.stop()
    mismatches = [i for i in done if done[i] != ref[i]]
    assert mismatches == [], f"{len(mismatches)} answers differ from mp: {mismatches[:10]}"
