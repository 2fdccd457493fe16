"""Benchmark: end-to-end ``vllm serve`` with the keepalive executor vs. vLLM's ``mp`` executor.

Run it with ``python benchmarks/bench_serve.py`` (``--help`` for the knobs). It is a benchmark,
not a test: it prints figures and fails no assertion. Expect 15-20 minutes with the defaults.

What is measured, and how
=========================

Configurations, in this order (``--rounds`` rounds, default 2, alternating so that slow drift
or a burst of outside load on this shared machine lands on both backends alike)::

    keepalive TP=2, mp TP=2, keepalive TP=2, mp TP=2, ..., then TP=1 (no backend flag, floor)

With ``--with-torchrun`` each round also runs the torchrun mode right after keepalive:
``python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port
<free> -m keepalive_executor serve <same options> -tp 2`` (docs/torchrun.md). Its process tree
is rooted at torchrun's agent and includes it.

For each configuration, one ``vllm serve`` of the tiny local model
(``python scripts/tiny_model.py``; ``--model-shape wide``: ``benchmarks/wide_model.py``'s
3-layer model with wider MLPs and vocabulary, for a longer step) is started in its own
session/process group
(``--enforce-eager --max-model-len 256 --max-num-seqs 8 --gpu-memory-utilization 0.2``,
``VLLM_CPU_KVCACHE_SPACE=1``, ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` for TP=2 and ``0`` for TP=1),
bound to 127.0.0.1 on a free port. Readiness = ``GET /health`` returns 200. Then:

1. Throughput/latency: vLLM's own client, ``vllm bench serve --backend openai`` against
   ``/v1/completions`` with the random dataset (input 32 tokens, output 64 tokens,
   ``--ignore-eos``), 64 prompts at ``--max-concurrency 8``, ``--save-result``. One short warm-up
   run (8 prompts) comes first and is discarded. From the saved JSON: ``output_throughput``
   (output tokens/s), ``median_ttft_ms`` and ``median_tpot_ms`` (time per output token after
   the first).
2. Idle cost: right after the benchmark (after ``--idle-settle-seconds``, default 2 s), for
   ``--idle-seconds`` (default 20 s) with no request in flight, the CPU time (user + system,
   psutil ``cpu_times()``) of the whole server process tree (root ``vllm serve`` plus all
   recursive children: API server, engine core, workers, resource tracker...) is sampled at the
   start and end of the window; the delta over the wall time is reported as percent of one
   core. Processes present only at one end count from/to zero. Also reported: the number of
   processes in the tree and the sum of their RSS in GB (RSS double-counts shared pages, so it
   is an upper bound of the real footprint). The machine-wide busy CPU of *other* processes in
   the same window is recorded too, so a contaminated window is visible.
3. Idle first-request latency (keepalive and mp, last round only; ``--idle-ttft-seconds``,
   default 60, 0 disables): once the server has had no request for that long, one streaming
   completion (openai python client, ``max_tokens=8``, temperature 0) is sent and its TTFT =
   time from sending to the first streamed chunk with non-empty text. Then ``--warm-requests``
   (default 3) more requests are timed the same way, back to back, for comparison ("warm").

Each server is then stopped: SIGTERM to its process group, SIGKILL to the group after 30 s, and
any process left in its session is reported and killed. A configuration that fails (server does
not become ready, a client run fails) is reported as failed in the table; the run goes on.

Output: a markdown table (one row per configuration and round), a summary with per-backend
means and the keepalive/mp ratios (of the means, and per round of the paired runs), the idle
TTFT figures, and header lines (date, ``uname -m``, ``nproc``, the CPU model and whether it has
AMX, versions, command line). Raw
figures, including the saved ``vllm bench serve`` JSONs, go to ``--json``
(default ``benchmarks/results/serve.json``); a bar chart of mean throughput and mean median
TPOT per backend to ``benchmarks/results/serve.png``; server and client logs to
``benchmarks/results/<config>-<round>.log`` and ``<config>-<round>-bench.log``.

The machine has 2 cores, shared with others: the client, the API server and the engine all
compete with the TP ranks for them. Absolute figures are noisy; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from procs import name_of  # noqa: E402
from servers import Server, TorchrunServer, env  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
STOP_GRACE_S = 30.0
EXC_LINE = re.compile(r"^\s*[\w.]+(Error|Exception|Interrupt|Exit): ")  # end of a traceback


@dataclass
class Config:
    """One server configuration."""

    name: str  # used in file names: keepalive-tp2, mp-tp2, tp1
    backend: str  # label in the table: keepalive, mp, none
    tp: int
    pp: int = 1
    extra_args: tuple[str, ...] = ()  # more vllm serve flags
    dp: int = 1

    @property
    def layout(self) -> str:
        return ((f"DP={self.dp} " if self.dp > 1 else "") + f"TP={self.tp}"
                + (f" PP={self.pp}" if self.pp > 1 else ""))


KEEPALIVE = Config("keepalive-tp2", "keepalive", 2)
# Same executor, ranks started by torchrun (`torchrun -m keepalive_executor serve`).
TORCHRUN = Config("torchrun-tp2", "torchrun", 2)
MP = Config("mp-tp2", "mp", 2)
TP1 = Config("tp1", "none", 1)
CONFIGS = {c.name: c for c in (KEEPALIVE, TORCHRUN, MP, TP1)}
# With --pp 2 the three two-rank configurations become one TP rank per stage. vLLM 0.32's CPU
# backend fails PP in eager mode under mp (its intermediate-tensor buffer is only allocated
# by a warm-up run that eager mode skips), so PP servers run compilation mode 2 with the eager
# backend: the same kernels, plus that warm-up (docs/benchmarks.md).
PP_ARGS = ("--no-enforce-eager", "--compilation-config", '{"mode": 2, "backend": "eager"}')


def use_pp(pp: int) -> None:
    """Turn the two-rank configurations into TP=2/pp x PP=pp."""
    global KEEPALIVE, TORCHRUN, MP
    tp = 2 // pp
    KEEPALIVE = Config(f"keepalive-pp{pp}", "keepalive", tp, pp, PP_ARGS)
    TORCHRUN = Config(f"torchrun-pp{pp}", "torchrun", tp, pp, PP_ARGS)
    MP = Config(f"mp-pp{pp}", "mp", tp, pp, PP_ARGS)
    CONFIGS.update({c.name: c for c in (KEEPALIVE, TORCHRUN, MP)})


def use_dp(dp: int, tp: int) -> None:
    """Turn keepalive and mp into ``-dp DP -tp TP`` (vLLM's default front end: one API
    server per replica); the TP=1 floor stays one replica of one rank."""
    global KEEPALIVE, MP
    KEEPALIVE, MP = (
        Config(f"{b}-dp{dp}-tp{tp}", b, tp, 1,
               ("-dp", str(dp), *(("--distributed-executor-backend", b) if tp == 1 else ())),
               dp)
        for b in ("keepalive", "mp"))
    CONFIGS.update({c.name: c for c in (KEEPALIVE, MP)})


@dataclass
class RunResult:
    """Everything measured for one configuration in one round."""

    config: str
    backend: str
    tp: int
    round: int
    ok: bool = False
    error: str | None = None
    startup_s: float | None = None
    output_tok_s: float | None = None
    median_ttft_ms: float | None = None
    median_tpot_ms: float | None = None
    completed: int | None = None
    failed_requests: int | None = None
    idle_cpu_pct: float | None = None
    idle_window_s: float | None = None
    idle_others_cpu_pct: float | None = None
    processes: int | None = None
    rss_gb: float | None = None
    idle_ttft: dict[str, Any] | None = None
    cpu_ms_per_token: float | None = None  # CPU time of the server tree during the run
    structured: dict[str, Any] | None = None  # the structured-output run, if asked for
    exit_code: int | None = None
    leftover_processes: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)  # before the stop signal
    shutdown_log_errors: list[str] = field(default_factory=list)  # after it
    async_scheduling: str | None = None
    bench_json: dict[str, Any] | None = None
    server_log: str = ""
    bench_log: str = ""


# --------------------------------------------------------------------------------------------
# Server handling (the tests' own server classes: tests/servers.py)


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def base_env(tp: int) -> dict[str, str]:
    """The servers' environment (tests/servers.py), for the benchmark client too."""
    e = env(TRANSFORMERS_OFFLINE="1")
    e["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if tp == 2 else "0"
    return e


def vllm_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "vllm"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def start_server(cfg: Config, model: str, log_path: Path) -> Server:
    """``vllm serve`` (or torchrun's agent for the torchrun mode, the root of its tree: its
    ranks, in their own sessions, are its children) in its own session."""
    if cfg.backend == "torchrun":
        return TorchrunServer(model, log_path.parent, nnodes=1, nproc=cfg.tp * cfg.pp,
                              tp=cfg.tp, pp=cfg.pp, log_prefix=log_path.stem,
                              extra_args=list(cfg.extra_args))
    # one CPU entry per rank of every replica (vLLM gives replica i entries i*tp...)
    ranks = cfg.dp * cfg.tp * cfg.pp
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(("0", "1")[r % 2] for r in range(ranks))}
    return Server(model, log_path, tp=cfg.tp, pp=cfg.pp, backend=cfg.backend,
                  extra_args=list(cfg.extra_args), extra_env=bind if cfg.dp > 1 else None)


def stop_server(srv: Server) -> tuple[int | None, list[str]]:
    """SIGTERM, then SIGKILL after the grace; the exit code and what had to be killed."""
    code = srv.stop(timeout=STOP_GRACE_S)
    return code, list(srv.leftovers)


_name = name_of


# --------------------------------------------------------------------------------------------
# Measurements


def run_bench(srv: Server, model: str, tok_dir: str, name: str, num_prompts: int, args:
              argparse.Namespace, log_path: Path, result_dir: Path) -> dict[str, Any]:
    """Run ``vllm bench serve`` against ``srv``; return its saved result JSON."""
    filename = f"{name}.json"
    cmd = [
        *vllm_cmd(), "bench", "serve", "--backend", "openai", "--base-url", srv.base_url,
        "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", tok_dir,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
        "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", "0",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", filename,
        "--disable-tqdm",
    ]
    with open(log_path, "a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=base_env(2), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(args.bench_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"vllm bench serve ({name}) timed out after "
                               f"{args.bench_timeout} s") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if code != 0:
        raise RuntimeError(f"vllm bench serve ({name}) exited with code {code}")
    path = result_dir / filename
    if not path.exists():
        raise RuntimeError(f"vllm bench serve ({name}) saved no result at {path}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def run_structured(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    """Our own streaming client: ``--num-prompts`` completions at ``--max-concurrency``, every
    other one constrained by a JSON schema (vLLM's structured outputs: the engine takes the
    two-broadcast step path for those batches). Output tok/s from the usage the server
    reports, TTFT and TPOT per request from the stream's timing."""
    import asyncio

    import openai

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    prompt = "The quick brown fox jumps over the lazy dog. " * 3

    async def main() -> dict[str, Any]:
        client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="x",
                                    max_retries=0, timeout=300)
        sem = asyncio.Semaphore(args.max_concurrency)
        rows: list[tuple[bool, float, float, int, bool]] = []

        async def one(i: int) -> None:
            structured = i % 2 == 0
            extra = ({"structured_outputs": {"json": schema}} if structured
                     else {"ignore_eos": True})
            async with sem:
                t0 = time.perf_counter()
                first = None
                text, tokens = [], 0
                stream = await client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=args.output_len, temperature=0,
                    stream=True, stream_options={"include_usage": True}, extra_body=extra)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text and first is None:
                        first = time.perf_counter()
                    if chunk.choices:
                        text.append(chunk.choices[0].text)
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                end = time.perf_counter()
                valid = True
                if structured:
                    try:
                        json.loads("".join(text))
                    except ValueError:
                        valid = False  # cut by max_tokens: counted, and reported
                rows.append((structured, (first or end) - t0,
                             (end - (first or end)) / max(tokens - 1, 1), tokens, valid))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.num_prompts)))
        wall = time.perf_counter() - t0
        await client.close()
        so = [r for r in rows if r[0]]
        return {
            "requests": len(rows),
            "structured_requests": len(so),
            "structured_valid_json": sum(1 for r in so if r[4]),
            "output_tok_s": sum(r[3] for r in rows) / wall,
            "median_ttft_ms": statistics.median(r[1] for r in rows) * 1e3,
            "median_tpot_ms": statistics.median(r[2] for r in rows) * 1e3,
            "median_tpot_structured_ms": statistics.median(r[2] for r in so) * 1e3,
            "wall_s": wall,
        }

    return asyncio.run(main())


def cpu_seconds(procs: list[psutil.Process]) -> dict[tuple[int, float], float]:
    out: dict[tuple[int, float], float] = {}
    for p in procs:
        try:
            with p.oneshot():
                t = p.cpu_times()
                out[(p.pid, p.create_time())] = t.user + t.system
        except psutil.Error:
            pass
    return out


def machine_busy_seconds() -> float:
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def measure_idle(srv: Server, seconds: float) -> dict[str, Any]:
    """CPU (% of one core) of the server tree over ``seconds`` of idleness; processes; RSS."""
    t_start = time.monotonic()
    m_start = machine_busy_seconds()
    c_start = cpu_seconds(srv.tree())
    time.sleep(seconds)
    tree = srv.tree()
    c_end = cpu_seconds(tree)
    m_end = machine_busy_seconds()
    wall = time.monotonic() - t_start
    # a process born during the window counts from zero; one that exited during it is not
    # counted (its CPU time after the first sample is unknown)
    used = sum(t - c_start.get(k, 0.0) for k, t in c_end.items())
    rss = 0
    for p in tree:
        try:
            rss += p.memory_info().rss
        except psutil.Error:
            pass
    others = max(0.0, (m_end - m_start) - used)
    return {
        "idle_cpu_pct": 100.0 * used / wall,
        "idle_window_s": wall,
        "idle_others_cpu_pct": 100.0 * others / wall,
        "processes": len(c_end),
        "rss_gb": rss / 1e9,
        "tree": [f"{p.pid}:{_name(p)}" for p in tree],
    }


def idle_by_process(srv: Server, seconds: float) -> dict[str, float]:
    """CPU (% of one core) of each process of the server's tree over ``seconds`` with no
    request in flight, by process title (``VLLM::EngineCore``, ``VLLM::Worker_TP1``...)."""
    tree = srv.tree()
    before = cpu_seconds(tree)
    t0 = time.monotonic()
    time.sleep(seconds)
    after = cpu_seconds(tree)
    wall = time.monotonic() - t0
    out: dict[str, float] = {}
    for p in tree:
        try:
            key = (p.pid, p.create_time())
            name = f"{_name(p)} ({p.pid})"
        except psutil.Error:
            continue
        if key in before and key in after:
            out[name] = round(100.0 * (after[key] - before[key]) / wall, 2)
    return out


def stream_ttft(srv: Server, prompt: str) -> float:
    """Seconds from sending a streaming completion to the first chunk with non-empty text."""
    import openai

    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    t0 = time.perf_counter()
    ttft: float | None = None
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                       temperature=0.0, stream=True)
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - t0
    client.close()
    if ttft is None:
        raise RuntimeError("streaming completion returned no text")
    return ttft


def measure_idle_ttft(srv: Server, idle_since: float, idle_s: float, warm: int) -> dict:
    wait = idle_since + idle_s - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    actual_idle = time.monotonic() - idle_since
    prompt = "The quick brown fox jumps over the lazy dog. Once upon a time"
    cold = stream_ttft(srv, prompt)
    warms = [stream_ttft(srv, prompt) for _ in range(warm)]
    return {
        "idle_s": actual_idle,
        "cold_ttft_ms": cold * 1e3,
        "warm_ttft_ms": [w * 1e3 for w in warms],
        "warm_ttft_median_ms": statistics.median(warms) * 1e3 if warms else None,
    }


def log_errors(text: str, limit: int = 8) -> list[str]:
    """Distinct suspicious lines of a server log: errors, the first and last line of tracebacks.

    Traceback frames (lines whose message, after vLLM's ``(Proc pid=N) LEVEL date [file:line]``
    prefix, is indented) are skipped, so a logged traceback shrinks to its header and exception.
    """
    keys = ("ERROR", "Traceback", "CRITICAL", "died", "timed out", "Timeout")
    seen: list[str] = []
    for line in text.splitlines():
        msg = line.split("] ", 1)[1] if line.startswith("(") and "] " in line else line
        if msg.startswith(" "):
            continue
        if any(k in line for k in keys) or EXC_LINE.match(msg):
            s = line.strip()[:300]
            if s not in seen:
                seen.append(s)
        if len(seen) >= limit:
            break
    return seen


def run_config(cfg: Config, rnd: int, model: str, args: argparse.Namespace, result_dir: Path,
               idle_ttft: bool) -> RunResult:
    res = RunResult(config=cfg.name, backend=cfg.backend, tp=cfg.tp, round=rnd)
    log_path = args.results_dir / f"{cfg.name}-{rnd}.log"
    bench_log = args.results_dir / f"{cfg.name}-{rnd}-bench.log"
    bench_log.write_text("")
    res.server_log, res.bench_log = str(log_path), str(bench_log)
    progress(f"[{cfg.name} round {rnd}] starting server (log {log_path.name})")
    t0 = time.monotonic()
    srv = start_server(cfg, model, log_path)
    log_path = srv.log_path
    res.server_log = str(log_path)
    try:
        srv.wait_ready(args.ready_timeout)
        res.startup_s = time.monotonic() - t0
        progress(f"[{cfg.name} round {rnd}] ready after {res.startup_s:.1f} s; warm-up")
        run_bench(srv, model, model, f"{cfg.name}-{rnd}-warmup", args.warmup_prompts, args,
                  bench_log, result_dir)
        progress(f"[{cfg.name} round {rnd}] benchmark ({args.num_prompts} prompts)")
        cpu_before = cpu_seconds(srv.tree())
        data = run_bench(srv, model, model, f"{cfg.name}-{rnd}", args.num_prompts, args,
                         bench_log, result_dir)
        cpu_after = cpu_seconds(srv.tree())
        used = sum(t - cpu_before.get(k, 0.0) for k, t in cpu_after.items())
        tokens = int(data.get("total_output_tokens") or 0)
        res.cpu_ms_per_token = 1000.0 * used / tokens if tokens else None
        if args.structured:
            progress(f"[{cfg.name} round {rnd}] structured-output run")
            res.structured = run_structured(srv, args)
        idle_since = time.monotonic()
        res.bench_json = data
        res.output_tok_s = float(data["output_throughput"])
        res.median_ttft_ms = float(data["median_ttft_ms"])
        res.median_tpot_ms = float(data["median_tpot_ms"])
        res.completed = int(data.get("completed", 0))
        res.failed_requests = int(data.get("failed", 0) or 0)
        if res.completed != args.num_prompts:
            raise RuntimeError(f"only {res.completed}/{args.num_prompts} requests completed")
        time.sleep(args.idle_settle_seconds)
        progress(f"[{cfg.name} round {rnd}] idle window {args.idle_seconds:.0f} s")
        idle = measure_idle(srv, args.idle_seconds)
        for k in ("idle_cpu_pct", "idle_window_s", "idle_others_cpu_pct", "processes", "rss_gb"):
            setattr(res, k, idle[k])
        res.ok = True
        if idle_ttft:
            progress(f"[{cfg.name} round {rnd}] idle TTFT after {args.idle_ttft_seconds:.0f} s")
            try:
                res.idle_ttft = measure_idle_ttft(srv, idle_since, args.idle_ttft_seconds,
                                                  args.warm_requests)
            except Exception as e:  # reported, not fatal
                res.idle_ttft = {"error": f"{type(e).__name__}: {e}"}
    except Exception as e:
        res.ok = False
        res.error = f"{type(e).__name__}: {e}"
        progress(f"[{cfg.name} round {rnd}] FAILED: {res.error}")
        traceback.print_exc(file=sys.stderr)
    finally:
        alive = srv.proc.poll() is None
        try:
            run_log_bytes = log_path.stat().st_size  # the server writes to the file directly
        except OSError:
            run_log_bytes = 0
        res.exit_code, res.leftover_processes = stop_server(srv)
        if not alive and res.ok:
            res.error = "server exited during the run"
        try:
            raw = log_path.read_bytes()
            text = raw.decode(errors="replace")
            res.log_errors = log_errors(raw[:run_log_bytes].decode(errors="replace"))
            res.shutdown_log_errors = log_errors(raw[run_log_bytes:].decode(errors="replace"))
            # vLLM turns async scheduling on by default, and off (with this warning) for an
            # executor whose supports_async_scheduling() is False
            if "Async scheduling will be disabled" in text:
                res.async_scheduling = "off"
            elif "Initializing a V1 LLM engine" in text:
                # vLLM's CPU platform turns it off for every executor, without a warning
                # (platforms/cpu.py: "async scheduling is not required on CPU")
                res.async_scheduling = "off (CPU)" if on_cpu() else "on"
        except OSError:
            pass
        progress(f"[{cfg.name} round {rnd}] stopped (exit {res.exit_code}"
                 + (f", leftovers {res.leftover_processes}" if res.leftover_processes else "")
                 + ")")
    return res


# --------------------------------------------------------------------------------------------
# Reporting


def progress(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def fmt(x: float | int | None, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}"


def mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.3f}x"


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "vllm", "openai", "psutil"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "?"
    return out


def paired_ratios(results: list[RunResult], num: Config, den: Config,
                  rounds: int) -> list[dict[str, float]]:
    """Per round, ``num``'s throughput and median TPOT over ``den``'s (adjacent runs)."""
    out = []
    for rnd in range(1, rounds + 1):
        a = next((r for r in results if r.config == num.name and r.round == rnd), None)
        b = next((r for r in results if r.config == den.name and r.round == rnd), None)
        if a and b and a.ok and b.ok:
            out.append({
                "round": rnd,
                "throughput": (a.output_tok_s or 0) / (b.output_tok_s or 1),
                "tpot": (a.median_tpot_ms or 0) / (b.median_tpot_ms or 1),
            })
    return out


def report(results: list[RunResult], meta: dict[str, Any], args: argparse.Namespace) -> dict:
    v = meta["versions"]
    print("# bench_serve: vllm serve, keepalive executor vs mp executor (TP=2), TP=1 floor\n")
    print(f"date: {meta['date']} | uname -m: {meta['machine']} | nproc: {meta['nproc']} | "
          f"cpu: {meta.get('cpu', 'not recorded')} | "
          f"python {platform.python_version()} | torch {v['torch']} | vllm {v['vllm']}")
    print(f"command: {meta['command']}")
    print(f"cwd: {meta['cwd']}")
    print(f"model: {meta['model']} (served as tiny)")
    print("server: --enforce-eager --max-model-len 256 --max-num-seqs 8 "
          "--gpu-memory-utilization 0.2 | VLLM_CPU_KVCACHE_SPACE=1 | "
          "VLLM_CPU_OMP_THREADS_BIND 0|1 (TP=2), 0 (TP=1)"
          + (f", 0|1 repeated per replica (-dp {args.dp})" if args.dp > 1 else "")
          + (f" | then {args.server_args}" if args.server_args else ""))
    print(f"client: vllm bench serve --backend openai /v1/completions, random dataset "
          f"in={args.input_len} out={args.output_len} --ignore-eos, "
          f"{args.num_prompts} prompts, max concurrency {args.max_concurrency}; "
          f"{args.warmup_prompts}-prompt warm-up run discarded")
    print(f"idle: {args.idle_seconds:.0f} s window starting {args.idle_settle_seconds:.0f} s "
          f"after the benchmark; CPU = user+system of the whole server process tree")
    print(f"order: {' -> '.join(f'{r.config}#{r.round}' for r in results)}\n")

    print("## Per run\n")
    print("| backend | layout | round | output tok/s | median TTFT ms | median TPOT ms | "
          "CPU ms per output token (tree) | idle CPU % of a core (tree) | processes | RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        layout = CONFIGS[r.config].layout if r.config in CONFIGS else f"TP={r.tp}"
        if r.ok:
            print(f"| {r.backend} | {layout} | {r.round} | {fmt(r.output_tok_s)} | "
                  f"{fmt(r.median_ttft_ms)} | {fmt(r.median_tpot_ms, 2)} | "
                  f"{fmt(r.cpu_ms_per_token, 3)} | "
                  f"{fmt(r.idle_cpu_pct)} | {fmt(r.processes)} | {fmt(r.rss_gb, 2)} |")
        else:
            err = (r.error or "failed").replace("|", "/")
            print(f"| {r.backend} | {layout} | {r.round} | FAILED: {err} | - | - | - | - | - "
                  "| - |")
    if any(r.structured for r in results):
        print("\nStructured-output run (every other request constrained by a JSON schema; our "
              "own streaming client, same prompts for every server):\n")
        print("| backend | layout | round | output tok/s | median TTFT ms | median TPOT ms | "
              "median TPOT ms, structured | valid JSON |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            if not r.structured:
                continue
            st = r.structured
            layout = CONFIGS[r.config].layout if r.config in CONFIGS else f"TP={r.tp}"
            print(f"| {r.backend} | {layout} | {r.round} | {fmt(st['output_tok_s'])} | "
                  f"{fmt(st['median_ttft_ms'])} | {fmt(st['median_tpot_ms'], 2)} | "
                  f"{fmt(st['median_tpot_structured_ms'], 2)} | "
                  f"{st['structured_valid_json']}/{st['structured_requests']} |")
    print()
    print("Tails of the same runs (from the saved vllm bench JSON; TPOT excludes the first "
          "token; with async scheduling several tokens can arrive in one chunk, which pulls "
          "the median TPOT/ITL down without making the run faster):\n")
    print("| backend | TP | round | duration s | mean TPOT ms | p99 TPOT ms | p99 TTFT ms | "
          "mean ITL ms | median ITL ms | p99 ITL ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if not (r.ok and r.bench_json):
            continue
        b = r.bench_json
        print(f"| {r.backend} | {r.tp} | {r.round} | {fmt(b.get('duration'), 2)} | "
              + " | ".join(fmt(b.get(k), 2) for k in (
                  "mean_tpot_ms", "p99_tpot_ms", "p99_ttft_ms", "mean_itl_ms",
                  "median_itl_ms", "p99_itl_ms"))
              + " |")
    print()
    print("Other processes on the machine during each idle window (machine busy CPU minus the "
          "server tree), % of a core; server start-up time (spawn to /health 200):")
    print()
    print("| run | others' CPU % during idle window | start-up s | server exit code | "
          "async scheduling |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r.config}#{r.round} | {fmt(r.idle_others_cpu_pct)} | {fmt(r.startup_s)} | "
              f"{fmt(r.exit_code)} | {r.async_scheduling or '-'} |")
    print("\n(async scheduling: 'off' = the server log says vLLM disabled it because the "
          "executor does not support it; 'off (CPU)' = vLLM's CPU platform turns it off for "
          "every executor; 'on' = vLLM's default, no such warning.)")
    print()

    summary: dict[str, Any] = {}
    print("## Summary (means over successful rounds)\n")
    print("| backend | TP | runs ok | output tok/s | median TTFT ms | median TPOT ms | "
          "idle CPU % of a core | processes | RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cfg in (KEEPALIVE, TORCHRUN, MP, TP1):
        if cfg is TORCHRUN and not args.with_torchrun:
            continue
        rs = [r for r in results if r.config == cfg.name and r.ok]
        n_all = len([r for r in results if r.config == cfg.name])
        s = {
            "runs_ok": len(rs), "runs": n_all,
            "output_tok_s": mean([r.output_tok_s for r in rs]),
            "median_ttft_ms": mean([r.median_ttft_ms for r in rs]),
            "median_tpot_ms": mean([r.median_tpot_ms for r in rs]),
            "mean_tpot_ms": mean([(r.bench_json or {}).get("mean_tpot_ms") for r in rs]),
            "idle_cpu_pct": mean([r.idle_cpu_pct for r in rs]),
            "processes": mean([r.processes for r in rs]),
            "rss_gb": mean([r.rss_gb for r in rs]),
            "cpu_ms_per_token": mean([r.cpu_ms_per_token for r in rs]),
            "structured_output_tok_s": mean([(r.structured or {}).get("output_tok_s")
                                             for r in rs]),
            "structured_median_tpot_ms": mean([(r.structured or {}).get("median_tpot_ms")
                                               for r in rs]),
        }
        summary[cfg.name] = s
        print(f"| {cfg.backend} | {cfg.tp} | {len(rs)}/{n_all} | {fmt(s['output_tok_s'])} | "
              f"{fmt(s['median_ttft_ms'])} | {fmt(s['median_tpot_ms'], 2)} | "
              f"{fmt(s['idle_cpu_pct'])} | {fmt(s['processes'])} | {fmt(s['rss_gb'], 2)} |")
    print()
    ka, mp_ = summary[KEEPALIVE.name], summary[MP.name]
    tp1 = summary[TP1.name]
    print("Ratios keepalive/mp (of the means): "
          f"throughput {ratio(ka['output_tok_s'], mp_['output_tok_s'])}, "
          f"median TPOT {ratio(ka['median_tpot_ms'], mp_['median_tpot_ms'])}, "
          f"mean TPOT {ratio(ka['mean_tpot_ms'], mp_['mean_tpot_ms'])}, "
          f"median TTFT {ratio(ka['median_ttft_ms'], mp_['median_ttft_ms'])}, "
          f"CPU per output token {ratio(ka['cpu_ms_per_token'], mp_['cpu_ms_per_token'])}, "
          f"idle CPU {ratio(ka['idle_cpu_pct'], mp_['idle_cpu_pct'])}")
    if args.structured:
        print("Structured-output run, keepalive/mp (of the means): throughput "
              f"{ratio(ka['structured_output_tok_s'], mp_['structured_output_tok_s'])}, "
              "median TPOT "
              f"{ratio(ka['structured_median_tpot_ms'], mp_['structured_median_tpot_ms'])}")
    paired = paired_ratios(results, KEEPALIVE, MP, args.rounds)
    if paired:
        print("Per round keepalive/mp (runs of a round are adjacent in time): " + "; ".join(
            f"round {p['round']}: throughput {p['throughput']:.3f}x, TPOT {p['tpot']:.3f}x"
            for p in paired))
    if args.with_torchrun:
        tr = summary[TORCHRUN.name]
        print("Ratios torchrun mode (of the means): "
              f"throughput {ratio(tr['output_tok_s'], ka['output_tok_s'])} of keepalive's, "
              f"{ratio(tr['output_tok_s'], mp_['output_tok_s'])} of mp's; median TPOT "
              f"{ratio(tr['median_tpot_ms'], ka['median_tpot_ms'])} of keepalive's, "
              f"{ratio(tr['median_tpot_ms'], mp_['median_tpot_ms'])} of mp's; idle CPU "
              f"{ratio(tr['idle_cpu_pct'], ka['idle_cpu_pct'])} of keepalive's")
        tr_paired = paired_ratios(results, TORCHRUN, KEEPALIVE, args.rounds)
        if tr_paired:
            print("Per round torchrun/keepalive: " + "; ".join(
                f"round {p['round']}: throughput {p['throughput']:.3f}x, TPOT {p['tpot']:.3f}x"
                for p in tr_paired))
    print("Vs TP=1 floor (of the means): "
          f"keepalive throughput {ratio(ka['output_tok_s'], tp1['output_tok_s'])}, "
          f"mp throughput {ratio(mp_['output_tok_s'], tp1['output_tok_s'])}; "
          f"keepalive TPOT {ratio(ka['median_tpot_ms'], tp1['median_tpot_ms'])}, "
          f"mp TPOT {ratio(mp_['median_tpot_ms'], tp1['median_tpot_ms'])}")
    print()

    print(f"## First request after {args.idle_ttft_seconds:.0f} s idle (streaming completion, "
          f"max_tokens 8, TTFT = first chunk with text)\n")
    rows = [r for r in results if r.idle_ttft is not None]
    if not rows:
        print("(not measured)" if args.idle_ttft_seconds <= 0 else "(no successful run)")
    else:
        print("| backend | TP | round | idle s | cold TTFT ms | warm TTFT ms (median) | "
              "warm TTFT ms (each) | cold/warm |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            t = r.idle_ttft or {}
            if "error" in t:
                print(f"| {r.backend} | {r.tp} | {r.round} | FAILED: {t['error']} "
                      f"| - | - | - | - |")
                continue
            each = ", ".join(f"{w:.1f}" for w in t["warm_ttft_ms"])
            print(f"| {r.backend} | {r.tp} | {r.round} | {t['idle_s']:.1f} | "
                  f"{t['cold_ttft_ms']:.1f} | {fmt(t['warm_ttft_median_ms'])} | {each} | "
                  f"{ratio(t['cold_ttft_ms'], t['warm_ttft_median_ms'])} |")
    print()

    odd = [r for r in results if r.error or r.leftover_processes or r.log_errors
           or r.shutdown_log_errors or (r.failed_requests or 0) > 0]
    print("## Problems seen\n")
    print("(server log lines are split at the moment the benchmark sent SIGTERM: 'during the "
          "run' vs 'during shutdown'; a traceback is shown as its header and exception line)\n")
    if not odd:
        print("none (no failed run, no failed request, no leftover process, "
              "no ERROR/Traceback line in server logs)")
    for r in odd:
        print(f"- {r.config}#{r.round}: "
              + "; ".join(filter(None, [
                  f"error: {r.error}" if r.error else "",
                  f"failed requests: {r.failed_requests}" if r.failed_requests else "",
                  f"leftover processes: {r.leftover_processes}" if r.leftover_processes else "",
                  f"server log ({Path(r.server_log).name}) during the run: "
                  + " || ".join(r.log_errors) if r.log_errors else "",
                  f"server log ({Path(r.server_log).name}) during shutdown: "
                  + " || ".join(r.shutdown_log_errors) if r.shutdown_log_errors else "",
              ])))
    print()
    return {"summary": summary, "paired_ratios": paired}


def plot(summary: dict[str, Any], results: list[RunResult], path: Path,
         meta: dict[str, Any]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib missing ({e}); pip install matplotlib"
    labels: list[str] = []
    thr: list[float] = []
    tpot: list[float] = []
    colors: list[str] = []
    dots: list[tuple[list[float], list[float]]] = []
    palette = {KEEPALIVE.name: "tab:green", TORCHRUN.name: "tab:olive", MP.name: "tab:blue",
               "tp1": "tab:gray"}
    names = {KEEPALIVE.name: f"keepalive\n{KEEPALIVE.layout}",
             TORCHRUN.name: f"keepalive\ntorchrun {TORCHRUN.layout}",
             MP.name: f"mp\n{MP.layout}", "tp1": "TP=1\n(floor)"}
    for key in (KEEPALIVE.name, TORCHRUN.name, MP.name, "tp1"):
        if not summary.get(key, {}).get("runs"):
            continue  # not in this run (--no-tp1, no --with-torchrun)
        s = summary.get(key, {})
        labels.append(f"{names[key]}\n(n={s.get('runs_ok', 0)})")
        thr.append(s.get("output_tok_s") or 0.0)
        tpot.append(s.get("median_tpot_ms") or 0.0)
        colors.append(palette[key])
        rs = [r for r in results if r.config == key and r.ok]
        dots.append(([r.output_tok_s or 0.0 for r in rs], [r.median_tpot_ms or 0.0 for r in rs]))
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    for i, (ax, vals, title, unit) in enumerate((
        (axes[0], thr, "Output throughput (mean over rounds)", "tokens/s"),
        (axes[1], tpot, "Median TPOT (mean over rounds)", "ms"),
    )):
        bars = ax.bar(labels, vals, color=colors)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        ax.bar_label(bars, fmt="%.1f" if unit == "tokens/s" else "%.2f", label_type="center",
                     color="white", fontweight="bold")
        top = max(vals + [1.0])
        for x, d in enumerate(dots):  # each round's value
            ax.scatter([x] * len(d[i]), d[i], color="black", s=14, zorder=3,
                       label="single rounds" if x == 0 else None)
            top = max([top, *d[i]])
        ax.set_ylim(0, top * 1.18)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"vllm serve, tiny model, CPU ({meta['nproc']} cores), {meta['date']}",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds of keepalive/mp TP=2")
    p.add_argument("--no-tp1", action="store_true", help="skip the TP=1 floor")
    p.add_argument("--with-torchrun", action="store_true",
                   help="also the torchrun mode (torchrun -m keepalive_executor serve) each round")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages of keepalive/mp/torchrun (TP becomes 2/PP)")
    p.add_argument("--dp", type=int, default=1,
                   help="data-parallel replicas of keepalive and mp (-dp; not with --pp or "
                        "--with-torchrun)")
    p.add_argument("--tp", type=int, default=2, help="with --dp > 1: each replica's TP size")
    p.add_argument("--structured", action="store_true",
                   help="after the main run, a structured-output run (half the requests with "
                        "a JSON schema) against each server")
    p.add_argument("--idle-seconds", type=float, default=20.0, help="idle CPU window")
    p.add_argument("--idle-settle-seconds", type=float, default=2.0,
                   help="pause between the benchmark's end and the idle window")
    p.add_argument("--idle-ttft-seconds", type=float, default=60.0,
                   help="idle time before the cold-TTFT request (last round; 0 = skip)")
    p.add_argument("--warm-requests", type=int, default=3, help="warm TTFT requests after it")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--server-args", default="",
                   help='more vllm serve flags for every server, one string, e.g. '
                        '"--max-model-len 512 --max-num-seqs 32" (they override the defaults)')
    p.add_argument("--warmup-prompts", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--bench-timeout", type=float, default=600.0)
    p.add_argument("--model", default=None, help="model path (default: the tiny local model)")
    p.add_argument("--model-shape", default="tiny", choices=("tiny", "wide"),
                   help="without --model: tiny (scripts/tiny_model.py) or wide "
                        "(benchmarks/wide_model.py: 3 layers, intermediate 768, vocab 768)")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--json", type=Path, default=RESULTS / "serve.json", help="raw figures")
    p.add_argument("--png", type=Path, default=RESULTS / "serve.png", help="bar chart")
    a = p.parse_args()
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    if a.dp > 1 and (a.pp > 1 or a.with_torchrun):
        p.error("--dp > 1 goes with neither --pp nor --with-torchrun (torchrun mode refuses -dp)")
    return a


def tiny_model(shape: str = "tiny") -> str:
    script = (REPO / "scripts" / "tiny_model.py" if shape == "tiny"
              else REPO / "benchmarks" / "wide_model.py")
    out = subprocess.run([sys.executable, str(script)], check=True, capture_output=True,
                         text=True).stdout
    return out.strip().splitlines()[-1].strip()


def cpu_model() -> str:
    """The CPU's model name (this machine kind comes with AMD EPYCs and Intel Xeons with AMX,
    whose matrix units change the model's share of a step), and whether it has AMX."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    return f"{name} ({'AMX' if 'amx_tile' in flags else 'no AMX'})"


def add_server_args(extra: list[str]) -> None:
    """Append EXTRA to every configuration's ``vllm serve`` flags (the last of a repeated
    flag wins in vLLM's parser, so these override the servers' defaults)."""
    global KEEPALIVE, TORCHRUN, MP, TP1
    KEEPALIVE, TORCHRUN, MP, TP1 = (
        dataclasses.replace(c, extra_args=(*c.extra_args, *extra))
        for c in (KEEPALIVE, TORCHRUN, MP, TP1))
    CONFIGS.update({c.name: c for c in (KEEPALIVE, TORCHRUN, MP, TP1)})


def main() -> int:
    args = parse_args()
    if args.pp > 1:
        use_pp(args.pp)
    if args.dp > 1:
        use_dp(args.dp, args.tp)
    if args.server_args:
        add_server_args(shlex.split(args.server_args))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    model = args.model or tiny_model(args.model_shape)
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%a %b %d %H:%M:%S UTC %Y"),
        "machine": platform.machine(),
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "versions": versions(),
        "python": platform.python_version(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "model": model,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    plan: list[tuple[Config, int]] = []
    for rnd in range(1, args.rounds + 1):
        plan += [(KEEPALIVE, rnd), *([(TORCHRUN, rnd)] if args.with_torchrun else []),
                 (MP, rnd)]
    if not args.no_tp1:
        plan.append((TP1, 1))
    results: list[RunResult] = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        try:
            for cfg, rnd in plan:
                idle_ttft = (args.idle_ttft_seconds > 0 and cfg.backend != "none"
                             and rnd == args.rounds)
                results.append(run_config(cfg, rnd, model, args, Path(tmp), idle_ttft))
        except KeyboardInterrupt:
            progress("interrupted; reporting what was measured")
        finally:
            # Every server was stopped in run_config's finally; reap anything else we started.
            for child in psutil.Process().children(recursive=True):
                try:
                    child.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(psutil.Process().children(recursive=True), timeout=10)
    meta["wall_s"] = time.monotonic() - t_start
    extra = report(results, meta, args)
    err = plot(extra["summary"], results, args.png, meta)
    print(f"wall time: {meta['wall_s'] / 60:.1f} min")
    print(f"png: {args.png}" if err is None else f"png: not drawn: {err}")
    print(f"json: {args.json}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(
        {"meta": meta, **extra, "runs": [asdict(r) for r in results]}, indent=1, default=str))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
