"""A tiny Qwen2-architecture causal LM, randomly initialised and saved in HF format so vLLM loads it as-is."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


def config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, max_positions: int,
           eos_token_id: int | None = None, pad_token_id: int | None = None) -> Qwen2Config:
    """The tiny model's architecture (also what `rstar2 plan` sizes a tiny-world run from)."""
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=True, rope_theta=10000.0, torch_dtype="float32",
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )


def create(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
           max_positions: int, seed: int, out_dir: Path) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = config(len(tokenizer), hidden, layers, heads, kv_heads, ffn, max_positions, tokenizer.eos_token_id,
                 tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return model

