"""A tiny offline chat target, for the tests of regeneration and hidden-state shards: a byte-level
tokenizer (every byte one token, no merges) with a ChatML template, and a tiny random Llama over its
259 ids. Built in well under a second, nothing downloaded."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.support.tiny import tiny_config

# ChatML with a default system prompt when the conversation has none (like SmolLM2's template).
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nBe brief.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges (ids 0..255 = bytes) + <|endoftext|> 256 (bos, pad),
    <|im_end|> 257 (eos), <|im_start|> 258. Built offline in well under a second."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def chat_target(tok: PreTrainedTokenizerFast, seed: int = 0, num_blocks: int = 6):
    """A tiny random Llama (hidden 64) whose vocab and special ids are the tokenizer's."""
    cfg = tiny_config("llama", num_blocks)
    cfg.vocab_size = len(tok)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
