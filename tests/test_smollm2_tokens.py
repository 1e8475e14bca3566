"""The embedded SmolLM2's end-of-turn token, as eyas stores it, is the GGUF's eos and the chat
template's end of turn, on every transformers version eyas allows (issue 34: on transformers 5.17 the
GGUF converter read eos as ``<|im_start|>``, and `eyas doctor` warned about the shipped pair)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eyas.contract.contract import tokenisation_of
from eyas.interop import read_contract, resolve_draft
from eyas.targets.loading import gguf_special_tokens, load_tokenizer, smollm2_gguf

pytestmark = pytest.mark.integration


def end_of_turn(tok) -> str:
    """What the chat template writes right after an assistant message's text."""
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "QQQ"}],
                                   tokenize=False)
    rest = text[text.index("QQQ") + 3:]
    return next(t for t in tok.all_special_tokens if rest.startswith(t))


def test_the_stored_eos_is_the_gguf_eos_and_the_chat_templates_end_of_turn():
    assert gguf_special_tokens(smollm2_gguf()) == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    tok = load_tokenizer("smollm2")
    stored = tokenisation_of(tok).eos_token
    assert stored == "<|im_end|>" == end_of_turn(tok)
    assert read_contract(resolve_draft(None, "smollm2")).tokenisation.eos_token == stored  # the shipped pair agrees


def test_a_converter_that_misreads_the_gguf_eos_is_corrected(monkeypatch):
    """transformers 5.17's reading, simulated: the tokenizer comes back with eos <|im_start|>."""
    real = AutoTokenizer.from_pretrained

    def misread(*args, **kwargs):
        tok = real(*args, **kwargs)
        tok.eos_token = "<|im_start|>"
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", misread)
    tok = load_tokenizer("smollm2")
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert tok.eos_token_id == 2 and tokenisation_of(tok).eos_token == end_of_turn(tok)
