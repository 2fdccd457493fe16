"""Build a tiny random Mixtral (mixture of experts) beside the tiny Llama (no model hub).

``python tests/tiny_moe.py [DIR]``: 2 layers, 4 experts with 2 per token, hidden 256,
4 heads, 2 KV heads (head_dim 64), float32, seeded, with the tiny Llama's tokenizer.
Idempotent, like scripts/tiny_model.py. It lives in tests/ so that the cached references of
the MoE scenarios are keyed by its source (tests/dp_scripts.py imports it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_moe", "tiny_moe_config", "copy_tokenizer", "DEFAULT_MOE_DIR"]

DEFAULT_MOE_DIR = Path(
    os.environ.get("KEEPALIVE_TINY_MOE_DIR", "~/.cache/keepalive-executor/tiny-mixtral")
).expanduser()


def tiny_moe_config() -> Any:
    """The tiny Mixtral's transformers config."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, dtype="float32")


def copy_tokenizer(src: str | os.PathLike[str], out: Path) -> None:
    """The tokenizer files of the model in SRC (the tiny Llama's) into OUT."""
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".jinja"):
            shutil.copy(f, out)


def build_tiny_moe(path: str | os.PathLike[str] = DEFAULT_MOE_DIR, seed: int = 0,
                   tokenizer_from: str | os.PathLike[str] | None = None) -> Path:
    """Write the tiny Mixtral to ``path`` (if not already there) and return the path."""
    out = Path(path)
    marker = out / ".complete"
    if marker.exists():
        return out
    import torch
    from transformers import MixtralForCausalLM

    if tokenizer_from is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
        from tiny_model import build_tiny_model

        tokenizer_from = build_tiny_model()
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    MixtralForCausalLM(tiny_moe_config()).to(torch.float32).save_pretrained(
        out, safe_serialization=True)
    copy_tokenizer(tokenizer_from, out)
    marker.write_text("ok\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(DEFAULT_MOE_DIR))
    print(build_tiny_moe(parser.parse_args().path))


if __name__ == "__main__":
    main()
