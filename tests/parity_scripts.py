"""Feature scenarios run under ``keepalive`` and under vLLM's ``mp`` in the same test, so that
their outputs can be compared (tests/test_parity.py). Each function starts one engine and
exercises every feature that can share it; it returns plain data (token ids, texts, rounded
logprobs) that must be equal between the two executors.

``python parity_scripts.py NAME JSON_KWARGS`` prints ``RESULT <json>`` (see run_engine.py).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

PROMPTS = ["Hello, my name is", "The capital of France is", "A driver broadcasts the work;",
           "One, two, three,"]
LONG = [(i * 7) % 500 + 3 for i in range(200)]  # a 200-token prompt of this model's ids
# small enough that this random model finishes it well within max_tokens (no whitespace:
# the engines run with structured_outputs_config disable_any_whitespace)
JSON_SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]},
                                                "b": {"type": "string", "maxLength": 6}},
               "required": ["a", "b"], "additionalProperties": False}
STRUCTURED_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe"]


def base_kwargs(model: str, backend: str, **extra: Any) -> dict:
    kw = dict(model=model, tensor_parallel_size=2, distributed_executor_backend=backend,
              enforce_eager=True, max_model_len=256, max_num_seqs=8,
              gpu_memory_utilization=0.2, seed=0, dtype="float32",
              structured_outputs_config=STRUCTURED_CONFIG)
    kw.update(extra)
    return kw


def ids(outs: Any) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def texts(outs: Any) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def rounded(logprobs: Any, nd: int = 4) -> Any:
    """Logprobs as [{token id: rounded logprob}] per position (None stays None)."""
    if logprobs is None:
        return None
    return [None if pos is None else {str(k): round(v.logprob, nd) for k, v in pos.items()}
            for pos in logprobs]


def _executor(llm: Any) -> Any:
    """The engine's executor (the engine runs in this process)."""
    return llm.llm_engine.engine_core.engine_core.model_executor


def structured(kind: str) -> Any:
    from vllm.sampling_params import StructuredOutputsParams

    if kind == "json":
        return StructuredOutputsParams(json=JSON_SCHEMA)
    if kind == "regex":
        return StructuredOutputsParams(regex=REGEX)
    return StructuredOutputsParams(choice=CHOICES)


def offline_features(model: str, backend: str, workdir: str) -> dict:
    """One in-process engine; every feature that can share it. Small KV cache (12 blocks of
    32 tokens) for preemption, 32-token chunks for chunked prefill, prefix caching on."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from rpc_targets import model_info, whoami
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prof = os.path.join(workdir, "profile")
    llm = LLM(**base_kwargs(model, backend, block_size=32, num_gpu_blocks_override=12,
                            max_num_batched_tokens=32, enable_prefix_caching=True,
                            disable_log_stats=False,
                            profiler_config={"profiler": "torch", "torch_profiler_dir": prof}))
    r: dict[str, Any] = {}
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    gen = lambda prompts, sp: llm.generate(prompts, sp, use_tqdm=False)  # noqa: E731
    r["greedy"] = ids(gen(PROMPTS, greedy))
    outs = gen(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                                           prompt_logprobs=3))
    r["logprobs"] = [rounded(c.logprobs) for o in outs for c in o.outputs]
    r["prompt_logprobs"] = [rounded(o.prompt_logprobs) for o in outs]
    r["seeded_n3"] = ids(gen(PROMPTS[:2], SamplingParams(n=3, temperature=1.0, seed=1234,
                                                         max_tokens=12)))
    first = gen(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
    r["max_tokens_1"] = [list(first.token_ids), first.finish_reason]
    stop_text = gen(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    later = llm.get_tokenizer().decode(list(stop_text.token_ids)[1:2])
    outs = gen(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, stop=[later]))
    r["stop_string"] = [(c.text, c.finish_reason, str(c.stop_reason)) for c in outs[0].outputs]
    outs = gen(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, stop=[first.text]))
    r["empty_output"] = [(c.text, list(c.token_ids), c.finish_reason) for c in outs[0].outputs]
    outs = gen(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, min_tokens=5,
                                           stop_token_ids=[first.token_ids[0]]))
    r["min_tokens"] = ids(outs)
    # chunked prefill: 200 tokens through 32-token chunks; then prefix caching: the same
    # prompt three times more (block-aligned hits), then reset_prefix_cache
    long = [TokensPrompt(prompt_token_ids=LONG)]
    r["chunked_prefill"] = ids(gen(long, greedy))
    repeats = [gen(long, greedy)[0] for _ in range(3)]
    r["prefix_cache_ids"] = [list(o.outputs[0].token_ids) for o in repeats]
    r["prefix_cached_tokens"] = [o.num_cached_tokens for o in repeats]
    r["reset_prefix_cache"] = llm.reset_prefix_cache()
    r["cached_after_reset"] = gen(long, greedy)[0].num_cached_tokens
    # preemption: 8 sequences of 40 + 120 tokens need 40 blocks; there are 12
    preempt_prompts = [TokensPrompt(prompt_token_ids=[(i * 13 + j) % 500 + 3 for j in range(40)])
                       for i in range(8)]
    r["preemption_ids"] = ids(gen(preempt_prompts, SamplingParams(temperature=0, max_tokens=120,
                                                                  ignore_eos=True)))
    r["preemptions"] = _counter(llm, "vllm:num_preemptions")
    # structured outputs alone, then mixed in one batch with free requests
    so = {k: texts(gen(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=60,
                                                   structured_outputs=structured(k))))[0]
          for k in ("json", "regex", "choice")}
    r["structured_alone"] = so
    mixed = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=structured(k))
             for k in ("json", "regex", "choice")]
    mixed += [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)]
    outs = llm.generate(PROMPTS[:1] * 5, mixed, use_tqdm=False)
    r["structured_mixed"] = texts(outs)
    r["structured_mixed_free_ids"] = ids(outs[3:])
    # control calls
    llm.start_profile()
    gen(PROMPTS[:1], greedy)
    llm.stop_profile()
    time.sleep(1)
    r["profile_ranks"] = sorted({os.path.basename(p).split(".")[0]
                                 for p in glob.glob(os.path.join(prof, "*trace*"))})
    r["apply_model"] = llm.apply_model(model_info)
    r["collective_rpc_ranks"] = [rank for rank, _ in llm.collective_rpc(whoami)]
    r["unique_reply_rank_1"] = _executor(llm).collective_rpc(whoami, unique_reply_rank=1)[0]
    llm.sleep(level=1)
    llm.wake_up()
    r["after_sleep_wake"] = ids(gen(PROMPTS, greedy)) == r["greedy"]
    return r


def _counter(llm: Any, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


def spec_decode(model: str, backend: str) -> dict:
    """n-gram speculative decoding (the engine calls take_draft_token_ids after every step),
    with a structured-output request mixed in."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from vllm import LLM, SamplingParams

    llm = LLM(**base_kwargs(model, backend, disable_log_stats=False, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}))
    r: dict[str, Any] = {}
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    r["greedy"] = ids(llm.generate(PROMPTS, greedy, use_tqdm=False))
    r["accepted_tokens"] = _counter(llm, "vllm:spec_decode_num_accepted_tokens")
    r["draft_tokens"] = _counter(llm, "vllm:spec_decode_num_draft_tokens")
    outs = llm.generate(PROMPTS[:2], [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=structured("regex")),
        greedy], use_tqdm=False)
    r["with_structured"] = texts(outs)
    return r


def kv_connector(model: str, backend: str, workdir: str, fault_dir: str) -> dict:
    """--kv-transfer-config with tests/kv_connectors.py's RankedExampleConnector: compute and
    save, load back, load back with rank 1's load failing; then the blocks are all free."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    store = os.path.join(workdir, "kvstore")
    os.makedirs(store, exist_ok=True)
    ktc = KVTransferConfig(kv_connector="RankedExampleConnector",
                           kv_connector_module_path="kv_connectors", kv_role="kv_both",
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"shared_storage_path": store})
    llm = LLM(**base_kwargs(model, backend, block_size=32, enable_prefix_caching=False,
                            kv_transfer_config=ktc))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    long = [TokensPrompt(prompt_token_ids=LONG)]
    r: dict[str, Any] = {}
    runs = []
    for i in range(3):
        if i == 2:
            with open(os.path.join(fault_dir, "kv_fail_rank1"), "w") as f:
                f.write("1")
        out = llm.generate(long, sp, use_tqdm=False)[0]
        runs.append({"ids": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})
    r["runs"] = runs
    r["fault_fired"] = not os.path.exists(os.path.join(fault_dir, "kv_fail_rank1"))
    # one more short request: its steps deliver the finished reports of the runs above (its
    # own single block stays held until a later step reports it)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    r["blocks_held_after"] = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
    r["files"] = sorted({os.path.basename(p).split(".", 1)[1]
                         for p in glob.glob(os.path.join(store, "**", "*.safetensors"),
                                            recursive=True)})
    return r


PP_COMPILATION = {"mode": 2, "backend": "eager"}


def pipeline(model: str, backend: str, tp: int, pp: int, eager: bool = False) -> dict:
    """Pipeline parallelism: greedy answers of 16 requests (two batches of 8, prefills split
    into 64-token chunks, so several batches are in flight), and structured outputs mixed with
    free requests (the non-fused path). ``eager``: ``enforce_eager``, which vLLM 0.32's mp
    cannot run with PP on CPU (see docs/usage.md); otherwise compilation mode 2 with the eager
    backend, which both can."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(("0", "1")[r % 2] for r in range(tp * pp))
    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = dict(max_num_batched_tokens=64)
    if not eager:
        extra.update(enforce_eager=False, compilation_config=PP_COMPILATION)
    kw = base_kwargs(model, backend, **extra)
    kw.update(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if backend == "none":
        kw.pop("distributed_executor_backend")
    llm = LLM(**kw)
    r: dict[str, Any] = {}
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    r["greedy"] = ids(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                           ignore_eos=True), use_tqdm=False))
    mixed = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=structured(k))
             for k in ("json", "regex", "choice")]
    mixed.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    r["structured_mixed"] = texts(llm.generate(PROMPTS, mixed, use_tqdm=False))
    if backend == "keepalive":
        r["max_steps_in_flight"] = _executor(llm)._outputs.max_pending
    return r


# ---------------------------------------------------------------- through vllm serve

#: the arguments both backends' servers of a serve scenario get
SERVE_ARGS = ["--dtype", "float32"]
EMBED_INPUTS = ["Hello, my name is", "The capital of France is", "One, two, three,"]


def _serve(model: str, backend: str, workdir: str, name: str, extra_args: list[str],
           ask: Any) -> dict:
    from servers import serve_once

    return serve_once(model, Path(workdir) / f"{name}-{backend}.log", ask, backend=backend,
                      extra_args=[*SERVE_ARGS, *extra_args])


def _lora_and_structured_answers(server: Any) -> dict:
    """Base and two adapters, one at a time; then structured outputs streamed concurrently
    with free requests."""
    import threading

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


def lora_serve(model: str, backend: str, workdir: str) -> dict:
    """``vllm serve`` with two LoRA adapters (built locally, seeded) and structured outputs:
    the answers of _lora_and_structured_answers."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))
    from tiny_model import build_tiny_lora

    ad1 = build_tiny_lora(os.path.join(workdir, "ad1"), model, seed=1)
    ad2 = build_tiny_lora(os.path.join(workdir, "ad2"), model, seed=2)
    return _serve(model, backend, workdir, "lora", [
        "--structured-outputs-config", json.dumps(STRUCTURED_CONFIG),
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        "--lora-modules", f"ad1={ad1}", f"ad2={ad2}"], _lora_and_structured_answers)


def pooling_serve(model: str, backend: str, workdir: str) -> dict:
    """``vllm serve --runner pooling``: the embeddings of EMBED_INPUTS (full floats)."""
    def ask(server: Any) -> dict:
        data = server.client().embeddings.create(model="tiny", input=EMBED_INPUTS).data
        return {"embeddings": [d.embedding for d in data]}

    return _serve(model, backend, workdir, "pooling", ["--runner", "pooling"], ask)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    name, kwargs = sys.argv[1], json.loads(sys.argv[2])
    out = globals()[name](**kwargs)
    print("RESULT " + json.dumps(out), flush=True)
