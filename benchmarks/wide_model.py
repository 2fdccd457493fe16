"""A wider random Llama than the tiny test model, for heavy-load benchmarks (issue 29's shape).

``python benchmarks/wide_model.py [DIR]`` writes, next to the tiny model unless DIR is given,
a 3-layer Llama with intermediate size 768 and a vocabulary of 768 (the tiny model: 2 layers,
512, 512), the same hidden size 256, 4 heads and 2 KV heads (so TP=2 splits it evenly),
float32, seeded random weights, and the tiny model's tokenizer (431 tokens; the extra
vocabulary rows are never produced by a prompt but are computed in every step's logits).
Idempotent: an existing complete model is left alone. Benchmarks only: the tests and their
references use ``scripts/tiny_model.py`` unchanged.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from tiny_model import DEFAULT_DIR, build_tiny_model  # noqa: E402

__all__ = ["WIDE_DIR", "build_wide_model"]

WIDE_DIR = DEFAULT_DIR.with_name(f"{DEFAULT_DIR.name}-wide")
SHAPE = {"num_hidden_layers": 3, "intermediate_size": 768, "vocab_size": 768}


def build_wide_model(path: str | Path = WIDE_DIR, seed: int = 0) -> Path:
    """Write the wide model to ``path`` (if not already there) and return the path."""
    out = Path(path)
    marker = out / ".complete"
    if marker.exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = build_tiny_model()
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():  # the tokenizer's files
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    config = LlamaConfig.from_pretrained(tiny)
    for key, value in SHAPE.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    (out / "keepalive_wide_model.json").write_text(json.dumps({"seed": seed, **SHAPE}))
    marker.write_text("ok\n")
    return out


if __name__ == "__main__":
    print(build_wide_model(sys.argv[1] if len(sys.argv) > 1 else WIDE_DIR))
