"""What the serving tests ask a `vllm serve` of the tiny model, and the same questions as
reference scenarios: the answers of vLLM's ``mp`` executor that the keepalive servers of
tests/test_serve.py, test_torchrun.py and test_pipeline.py must equal.

The reference side is computed once per environment (scripts/make_references.py, cached in
tests/references/, see run_engine.Reference) instead of starting an ``mp`` server beside every
keepalive server. ``python serve_scripts.py NAME JSON_KWARGS`` prints ``RESULT <json>``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

#: vLLM 0.32's mp cannot run PP in eager mode on CPU; compilation mode 2 with the eager
#: backend it can (the same kernels; greedy answers equal eager's: tests/test_parity.py)
MP_PP_ARGS = ["--no-enforce-eager", "--compilation-config", '{"mode": 2, "backend": "eager"}']
#: the pipeline servers' dtype (float32: see tests/test_pipeline.py)
PP_ARGS = ["--dtype", "float32"]


def ask(client: Any) -> dict:
    """A completion, a chat completion and a streamed completion, greedy, 12 tokens each."""
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


def texts(answers: dict) -> dict:
    """The answers without the chunk count: how many SSE chunks a stream of the same tokens
    arrives in depends on timing (the front end coalesces tokens that are ready together),
    so only the texts are compared between runs."""
    return {k: v for k, v in answers.items() if k != "stream_chunks"}


# ---------------------------------------------------------------- load (tests/test_serve.py)

WORDS = ("the quick brown fox jumps over lazy dog tensor parallel driver worker keepalive "
         "broadcast collective timeout engine idle busy hello name capital france").split()
N, CONCURRENCY, ABORT_EVERY = 256, 32, 10
# float32 on both servers: the answers must not depend on bf16 rounding of a batch's shape.
# Every TP=2 serving test runs with these (one server serves test_serve.py's scenarios).
LOAD_ARGS = ["--dtype", "float32", "--max-num-seqs", "16"]


def workload() -> list[dict]:
    """256 requests: prompts of 2 to 60 words, 4 to 64 output tokens, every tenth client
    closing its stream after two chunks."""
    rng = random.Random(0)
    reqs = []
    for i in range(N):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))
        reqs.append({"i": i, "prompt": prompt, "max_tokens": rng.randint(4, 64),
                     "abort": i % ABORT_EVERY == ABORT_EVERY - 1})
    return reqs


async def run_wave(base_url: str, reqs: list[dict]) -> dict[int, str]:
    """Stream every request, CONCURRENCY at a time; the texts of those not aborted."""
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


# ---------------------------------------------------------------- the reference scenarios

def _serving(model: str, backend: str, workdir: str, name: str, tp: int, pp: int,
             extra_args: list[str], fn: Any) -> Any:
    from servers import serve_once

    return serve_once(model, Path(workdir) / f"{name}-{backend}.log", fn, backend=backend,
                      tp=tp, pp=pp, extra_args=extra_args)


def serve_answers(model: str, backend: str, workdir: str, tp: int = 2, pp: int = 1,
                  extra_args: list[str] | None = None) -> dict:
    """The texts of :func:`ask` through ``vllm serve -tp TP -pp PP``."""
    return _serving(model, backend, workdir, "ask", tp, pp, extra_args or [],
                    lambda server: texts(ask(server.client())))


def load_answers(model: str, backend: str, workdir: str) -> dict:
    """The answers to every request of :func:`workload` that is not aborted (TP=2,
    LOAD_ARGS), keyed by the request's index (as a string: JSON)."""
    expected = [r for r in workload() if not r["abort"]]
    done = _serving(model, backend, workdir, "load", 2, 1, LOAD_ARGS,
                    lambda server: asyncio.run(run_wave(server.base_url, expected)))
    return {str(i): text for i, text in sorted(done.items())}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    name, kwargs = sys.argv[1], json.loads(sys.argv[2])
    out = globals()[name](**kwargs)
    print("RESULT " + json.dumps(out), flush=True)
