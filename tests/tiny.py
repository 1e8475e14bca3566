"""Tiny random Hugging Face causal LMs built from configs, for unit tests (no downloads)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, Qwen2Config, Qwen3Config

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def tiny_config(kind: str = "llama", num_blocks: int = 10):
    if kind == "llama":
        return LlamaConfig(num_hidden_layers=num_blocks, **COMMON)
    if kind == "qwen2":
        return Qwen2Config(num_hidden_layers=num_blocks, **COMMON)
    if kind == "qwen3":
        return Qwen3Config(num_hidden_layers=num_blocks, head_dim=16, **COMMON)
    if kind == "deepseek_v3":
        # MLA attention + MoE blocks after the first dense one.
        return DeepseekV3Config(
            num_hidden_layers=num_blocks, vocab_size=128, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=1, max_position_embeddings=256, tie_word_embeddings=False,
        )
    raise ValueError(f"unknown tiny model kind {kind!r}")


def tiny_model(kind: str = "llama", num_blocks: int = 10, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, num_blocks), dtype=torch.float32)
    return model.eval()
