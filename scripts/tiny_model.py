"""Build the tiny local Llama model the demo, tests and benchmarks serve (no model hub).

``python scripts/tiny_model.py [DIR]`` writes a 2-layer Llama with random
(seeded) float32 weights and a byte-level BPE tokenizer trained on a few sentences:
vocab 512, hidden 256, 4 heads, 2 KV heads (head_dim 64), so TP=2 splits it evenly.
Building is deterministic and idempotent: an existing complete model is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

__all__ = ["build_tiny_model", "DEFAULT_DIR"]

DEFAULT_DIR = Path(
    os.environ.get("KEEPALIVE_TINY_MODEL_DIR", "~/.cache/keepalive-executor/tiny-llama")
).expanduser()

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tensor parallelism splits every layer across ranks.",
    "A driver broadcasts the work; the workers follow.",
    "While idle, a keepalive keeps the collective from timing out.",
    "Hello, my name is vLLM and I serve language models.",
    "The capital of France is Paris. One, two, three, four, five.",
]

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_model(path: str | os.PathLike[str] = DEFAULT_DIR, seed: int = 0) -> Path:
    """Write the tiny model to ``path`` (if not already there) and return the path."""
    out = Path(path)
    marker = out / ".complete"
    if marker.exists():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        dtype="float32",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "keepalive_tiny_model.json").write_text(json.dumps({"seed": seed}))
    marker.write_text("ok\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(DEFAULT_DIR))
    args = parser.parse_args()
    print(build_tiny_model(args.path))


if __name__ == "__main__":
    main()
