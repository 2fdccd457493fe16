"""The chaos run's clients: greedy completions, streamed and not, whose every token is
compared with the known answer as it arrives; bursts at full concurrency; clients that close
their stream mid-way. Each request's longest wait without an answer or an error is kept
(from the request to its first chunk, between chunks, from the last chunk to its end), and
the tokens the clients received, second by second.

The known answers are the non-aborted requests of tests/serve_scripts.py's ``workload()``
(prompts of 2 to 60 words, 4 to 64 tokens, ``ignore_eos``), whose texts under ``mp`` are
the cached reference ``load_tp2``: :func:`record` asks each of them once of the healthy
server before any fault, with ``return_token_ids``, and keeps the token ids; the texts of
that pass are compared with ``mp``'s where the reference is at hand.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Known", "Load", "record", "pool", "client_for"]


def pool(n: int) -> list[dict]:
    """The first ``n`` requests of serve_scripts.workload() that are not aborted there."""
    from serve_scripts import workload

    return [r for r in workload() if not r["abort"]][:n]


@dataclass
class Known:
    """The known answers: per pool request, its prompt's and its output's token ids."""

    requests: list[dict]
    prompt_ids: dict[int, list[int]]
    tokens: dict[int, list[int]]
    texts: dict[int, str]


def client_for(base_url: str, timeout_s: float) -> Any:
    import httpx
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0,
                         timeout=httpx.Timeout(timeout_s, connect=5.0))


def _body(r: dict) -> dict:
    return dict(model="tiny", prompt=r["prompt"], max_tokens=r["max_tokens"], temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})


def record(base_url: str, requests: list[dict], timeout_s: float = 120,
           concurrency: int = 8) -> Known:
    """Ask every request once (not streamed) of a healthy server: the known answers."""
    def one(r: dict) -> tuple[int, list[int], list[int], str]:
        c = client_for(base_url, timeout_s)
        out = c.completions.create(**_body(r))
        ch = out.choices[0]
        extra = ch.model_extra or {}
        return r["i"], list(extra["prompt_token_ids"]), list(extra["token_ids"]), ch.text

    with ThreadPoolExecutor(concurrency) as ex:
        got = list(ex.map(one, requests))
    return Known(requests, {i: p for i, p, _, _ in got}, {i: t for i, _, t, _ in got},
                 {i: x for i, _, _, x in got})


@dataclass
class Done:
    """A finished request, compact: what the fault windows and the waits are computed from."""

    client: str
    what: str
    start: float
    end: float
    outcome: str  # ok, error, wrong, closed (closed by its client, as the fault asked)
    error: str
    tokens: int
    longest_wait: float


@dataclass
class _Open:
    client: str
    what: str
    start: float
    last: float
    longest: float = 0.0

    def event(self, t: float) -> None:
        self.longest = max(self.longest, t - self.last)
        self.last = t


@dataclass
class Load:
    """``clients`` background clients, each asking pool requests one after another (half of
    them streamed), until :meth:`stop`; :meth:`pause` holds them back until every request
    has ended; :meth:`burst` and :meth:`disconnects` add one-off clients. ``t0`` is the
    run's zero (time.monotonic())."""

    base_url: str
    known: Known
    clients: int
    t0: float
    timeout_s: float
    seed: int = 0
    done: list[Done] = field(default_factory=list)
    wrong: list[dict] = field(default_factory=list)
    tokens_by_s: Counter = field(default_factory=Counter)
    errors_by_s: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        self._open: dict[int, _Open] = {}
        self._next_id = 0
        self._go = threading.Event()
        self._go.set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._by_i = {r["i"]: r for r in self.known.requests}
        self.fault: int | None = None  # the fault whose window a request ends in

    # --------------------------------------------------------------- control

    def start(self) -> None:
        for k in range(self.clients):
            t = threading.Thread(target=self._loop, args=(f"c{k}", random.Random(
                self.seed * 1000 + k)), name=f"chaos-client-{k}", daemon=True)
            t.start()
            self._threads.append(t)

    def pause(self, timeout: float) -> float:
        """Hold the background clients back and wait until no request is open; the time
        that took."""
        t = time.monotonic()
        self._go.clear()
        with self._lock:
            self._lock.wait_for(lambda: not self._open, timeout)
        return time.monotonic() - t

    def resume(self) -> None:
        self._go.set()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._go.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def open_requests(self) -> list[_Open]:
        with self._lock:
            return list(self._open.values())

    def burst(self, n: int, rng: random.Random) -> None:
        """``n`` requests at once (half streamed), each from a client of its own; returns
        when all have ended."""
        items = [rng.choice(self.known.requests)["i"] for _ in range(n)]
        streamed = [rng.random() < 0.5 for _ in range(n)]
        self._one_offs([(f"burst{self.fault}-{k}", items[k], streamed[k], None)
                        for k in range(n)])

    def disconnects(self, chunks: tuple[int, ...], rng: random.Random) -> None:
        """One streamed request per entry of ``chunks``, each closed by its client after
        that many chunks; returns when all have ended."""
        longest = sorted(self.known.requests, key=lambda r: -r["max_tokens"])[:16]
        self._one_offs([(f"disconnect{self.fault}-{k}", rng.choice(longest)["i"], True, c)
                        for k, c in enumerate(chunks)])

    def _one_offs(self, specs: list[tuple[str, int, bool, int | None]]) -> None:
        threads = [threading.Thread(target=self._one_off, args=spec, daemon=True,
                                    name=f"chaos-{spec[0]}") for spec in specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s + 30)

    def _one_off(self, name: str, item: int, streamed: bool, close_after: int | None) -> None:
        self.ask(client_for(self.base_url, self.timeout_s), name, item, streamed, close_after)

    def _loop(self, name: str, rng: random.Random) -> None:
        client = client_for(self.base_url, self.timeout_s)
        while not self._stop.is_set():
            self._go.wait()
            if self._stop.is_set():
                return
            item = rng.choice(self.known.requests)["i"]
            if self.ask(client, name, item, rng.random() < 0.5, None, gated=True) == "error":
                time.sleep(0.2)  # the server is down or failing: no busy loop meanwhile

    # --------------------------------------------------------------- one request

    def ask(self, client: Any, name: str, item: int, streamed: bool,
            close_after: int | None, gated: bool = False) -> str:
        """One request; its outcome. A gated one (a background client's) does not start
        while the load is paused."""
        r = self._by_i[item]
        expected, prompt = self.known.tokens[item], self.known.prompt_ids[item]
        what = f"{'stream' if streamed else 'plain'} request {item}"
        with self._lock:
            if gated and not self._go.is_set():
                return "paused"
            rid = self._next_id
            self._next_id += 1
            t = time.monotonic()
            req = self._open[rid] = _Open(name, what, t, t)
        got: list[int] = []
        outcome, error = "ok", ""
        finish: str | None = None  # the server's finish_reason, once it gave one

        def check(ids: list[int], prompt_ids: list[int] | None, t: float) -> str | None:
            if prompt_ids is not None and list(prompt_ids) != prompt:
                return f"{what}: the prompt's token ids differ from the recorded ones"
            for k, tok in enumerate(ids, start=len(got)):
                if k >= len(expected):
                    return f"{what}: token {k} ({tok}) past the known answer's {len(expected)}"
                if tok != expected[k]:
                    return f"{what}: token {k} is {tok}, the known answer's is {expected[k]}"
            got.extend(ids)
            with self._lock:
                self.tokens_by_s[int(t - self.t0)] += len(ids)
            return None

        try:
            if streamed:
                stream = client.completions.create(stream=True, **_body(r))
                chunks = 0
                for c in stream:
                    t = time.monotonic()
                    req.event(t)
                    if not c.choices:
                        continue
                    finish = c.choices[0].finish_reason or finish
                    extra = c.choices[0].model_extra or {}
                    bad = check(list(extra.get("token_ids") or []),
                                extra.get("prompt_token_ids"), t)
                    if bad:
                        outcome, error = "wrong", bad
                        stream.close()
                        break
                    chunks += 1
                    if close_after is not None and chunks >= close_after:
                        stream.close()  # the client goes away mid-stream
                        outcome = "closed"
                        break
            else:
                out = client.completions.create(**_body(r))
                t = time.monotonic()
                req.event(t)
                finish = out.choices[0].finish_reason
                extra = out.choices[0].model_extra or {}
                bad = check(list(extra.get("token_ids") or []), extra.get("prompt_token_ids"), t)
                if bad:
                    outcome, error = "wrong", bad
            if outcome == "ok" and got != expected:
                if finish in ("stop", "length"):  # the server says this is the whole answer
                    outcome, error = "wrong", (
                        f"{what}: ended ({finish}) after {len(got)} tokens of the known "
                        f"answer's {len(expected)}")
                else:  # "abort" (vLLM's, e.g. a shutdown's) or none: an error, said so
                    outcome, error = "error", (
                        f"{what}: finish_reason {finish!r} after {len(got)} correct tokens "
                        f"of {len(expected)}")
        except Exception as e:  # noqa: BLE001 - any failure is the outcome, recorded
            outcome, error = "error", f"{type(e).__name__}: {str(e)[:160]}"
        end = time.monotonic()
        with self._lock:
            req.event(end)
            del self._open[rid]
            self.done.append(Done(name, what, req.start - self.t0, end - self.t0, outcome,
                                  error, len(got), req.longest))
            if outcome == "error" and name != "probe":
                self.errors_by_s[int(end - self.t0)] += 1
            if outcome == "wrong":
                self.wrong.append({"client": name, "t": round(end - self.t0, 2),
                                   "fault": self.fault, "detail": error})
            self._lock.notify_all()
        return outcome
