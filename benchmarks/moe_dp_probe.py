"""Probe: can vLLM's own ``mp`` executor run a mixture-of-experts model with data parallelism
on this CPU build? (Why keepalive refuses ``-dp > 1`` for MoE models: docs/design.md.)

``python benchmarks/moe_dp_probe.py`` builds the tiny random Mixtral of tests/tiny_moe.py (2
layers, 4 experts, 2 per token, float32, the tiny Llama's tokenizer) in a temporary
directory, then for each layout starts ``vllm serve ... --distributed-executor-backend mp``
of it, sends one greedy completion and prints whether it answered, or the server's first
error lines. Layouts: ``-tp 1``,
``-dp 2 -tp 1``, ``-dp 2 -tp 1 --enable-expert-parallel``. It asserts nothing: a probe.
About 3 minutes.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts")]

from servers import Server  # noqa: E402
from tiny_moe import build_tiny_moe  # noqa: E402

LAYOUTS = {
    "mp -tp 1": (1, []),
    "mp -dp 2 -tp 1": (2, ["-dp", "2", "--api-server-count", "1"]),
    "mp -dp 2 -tp 1 --enable-expert-parallel": (
        2, ["-dp", "2", "--api-server-count", "1", "--enable-expert-parallel"]),
}


def main() -> None:
    from tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="moe_dp_probe_") as tmp:
        moe = build_tiny_moe(Path(tmp) / "tiny-mixtral", tokenizer_from=build_tiny_model())
        for name, (ranks, args) in LAYOUTS.items():
            server = Server(str(moe), Path(tmp) / f"{len(name)}.log", tp=1, backend="mp",
                            extra_args=["--distributed-executor-backend", "mp", *args],
                            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(
                                ("0", "1")[r % 2] for r in range(ranks))})
            try:
                server.wait_ready()
                c = server.client().completions.create(
                    model="tiny", prompt="Hello, my name is", max_tokens=8, temperature=0)
                outcome = f"answered {c.choices[0].text!r}"
            except Exception as e:  # noqa: BLE001 - the probe reports it
                log = server.log().splitlines()
                # the first error, and the frame it was raised in
                at = next((i for i, ln in enumerate(log) if " WARNING " not in ln
                           and re.search(r"\b\w+Error\b(:|$)", ln)), len(log))
                frame = [ln for ln in log[:at] if re.search(r'File ".*", line \d+, in ', ln)]
                errors = [*frame[-1:], *log[at:at + 2]]
                outcome = f"failed ({type(e).__name__}); server log: " + " | ".join(
                    ln[-160:] for ln in errors)
            finally:
                server.stop()
            print(f"{name}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
