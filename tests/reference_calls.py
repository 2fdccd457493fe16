"""The reference runs the tests compare keepalive with: vLLM's ``mp`` executor (or TP=1), as
``run_engine.parity_call`` arguments. Each is computed once per environment by
scripts/make_references.py and cached in tests/references/NAME.json (run_engine.Reference: a
key mismatch runs it live again and rewrites the file).

This registry is not part of any reference's key (a scenario script never imports it), so an
entry added here leaves the others' cached files valid; an entry's own arguments are part of
its key ("scenario"). "WORKDIR" and "FAULTDIR" stand for per-run directories.
"""

from __future__ import annotations

REFERENCES: dict[str, dict] = {
    "offline_features": dict(name="offline_features", backend="mp", workdir="WORKDIR"),
    "spec_decode": dict(name="spec_decode", backend="mp"),
    "kv_connector": dict(name="kv_connector", backend="mp", workdir="WORKDIR",
                         fault_dir="FAULTDIR"),
    "lora_serve": dict(name="lora_serve", backend="mp", workdir="WORKDIR",
                       multiprocessing=True),
    "pooling_serve": dict(name="pooling_serve", backend="mp", workdir="WORKDIR",
                          multiprocessing=True),
    "pipeline_tp1_pp2_mp": dict(name="pipeline", backend="mp", tp=1, pp=2),
    "pipeline_tp1": dict(name="pipeline", backend="none", tp=1, pp=1, eager=True),
    "pipeline_tp2_pp2_mp": dict(name="pipeline", backend="mp", tp=2, pp=2),
    # the serving tests' questions (tests/serve_scripts.py): TP=2 with serve_scripts.LOAD_ARGS,
    # and TP=1 x PP=2 in float32 (mp compiled: it cannot run PP in eager mode here); the load
    # test's answers; the
    # offline LLM's greedy tokens at TP=2 under mp and at TP=1 (tests/engine_scripts.py)
    "serve_tp2": dict(name="serve_answers", script="serve_scripts.py", backend="mp",
                      workdir="WORKDIR", multiprocessing=True,
                      extra_args=["--dtype", "float32", "--max-num-seqs", "16"]),
    "serve_tp1_pp2": dict(name="serve_answers", script="serve_scripts.py", backend="mp",
                          workdir="WORKDIR", multiprocessing=True, tp=1, pp=2,
                          extra_args=["--dtype", "float32", "--no-enforce-eager",
                                      "--compilation-config",
                                      '{"mode": 2, "backend": "eager"}']),
    "load_tp2": dict(name="load_answers", script="serve_scripts.py", backend="mp",
                     workdir="WORKDIR", multiprocessing=True),
    "llm_generate_mp": dict(name="llm_generate", script="engine_scripts.py", backend="mp",
                            tp=2, multiprocessing=True),
    # data parallelism (tests/dp_scripts.py): a wave's answers, the engines that served it,
    # and (TP=2) what killing replica 1's rank 1 under load does to the server
    "dp2_tp2_mp": dict(name="dp_serve", script="dp_scripts.py", backend="mp",
                       workdir="WORKDIR", multiprocessing=True, dp=2, tp=2),
    "dp2_tp1_mp": dict(name="dp_serve", script="dp_scripts.py", backend="mp",
                       workdir="WORKDIR", multiprocessing=True, dp=2, tp=1),
    # a mixture-of-experts model (tests/tiny_moe.py): one torch world across the replicas
    "moe_dp2_tp2_mp": dict(name="dp_serve", script="dp_scripts.py", backend="mp",
                           workdir="WORKDIR", multiprocessing=True, dp=2, tp=2, moe=True),
    "llm_generate_tp1": dict(name="llm_generate", script="engine_scripts.py", backend=None,
                             tp=1, multiprocessing=True),
}
