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

__all__ = ["build_tiny_model", "build_tiny_lora", "DEFAULT_DIR"]

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


def build_tiny_lora(path: str | os.PathLike[str], model_dir: str | os.PathLike[str],
                    seed: int = 1, rank: int = 8, alpha: int = 16) -> Path:
    """Write a PEFT LoRA adapter for the tiny model (q_proj and v_proj of every layer, random
    A and B, B nonzero so that the adapter changes the outputs) and return its path."""
    out = Path(path)
    if (out / "adapter_config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    out_features = {"q_proj": cfg["num_attention_heads"] * head_dim,
                    "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, n_out in out_features.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "target_modules": list(out_features), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "base_model_name_or_path": str(model_dir)}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=str(DEFAULT_DIR))
    args = parser.parse_args()
    print(build_tiny_model(args.path))


if __name__ == "__main__":
    main()
