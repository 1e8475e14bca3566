"""TauProbe: the engine's accept length on validation prompts, training's checkpoint criterion."""

from __future__ import annotations

import copy

import pytest
import torch

from eyas.bench.validate import TauProbe
from eyas.convention import CaptureSpec
from eyas.data.conversations import Conversation
from eyas.engine import TreeSpec, build_target, speculative_generate
from tests.support.chat import chat_target, chat_tokenizer
from tests.support.tiny import SPEC4, random_prompts

pytestmark = pytest.mark.integration


def test_probe_pools_the_engines_rounds_and_leaves_the_drafter_as_it_was(llama, trained_drafter) -> None:
    drafter = copy.deepcopy(trained_drafter).train()
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    prompts = random_prompts(4, llama.config.vocab_size, seed=3, lengths=(3, 12))
    probe = TauProbe(llama, SPEC4, prompts, eos_token_ids=[], tree=TreeSpec.chain(3), max_new_tokens=16)
    got = probe(drafter)

    target = build_target(llama, SPEC4, "hf")
    committed = rounds = new = 0
    reference = copy.deepcopy(trained_drafter).eval()
    for p in prompts:
        r = speculative_generate(target, reference, torch.tensor([p]), tree=TreeSpec.chain(3), max_new_tokens=16,
                                 timing="off")
        committed += sum(r.stats.accept_lengths)
        rounds += len(r.stats.accept_lengths)
        new += r.stats.new_tokens
    assert committed > rounds  # the trained drafter gets drafts accepted: tau is not the trivial 1.0
    assert got == {"tau": committed / rounds, "tau_rounds": float(rounds), "tau_new_tokens": float(new)}
    assert drafter.training  # the probe served a copy
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert probe(drafter) == got  # deterministic, and the cached engine target is reusable


def test_conversations_are_rendered_with_the_chat_template() -> None:
    tok = chat_tokenizer()
    model = chat_target(tok, num_blocks=8)
    conv = Conversation([{"role": "user", "content": "hello"}])
    probe = TauProbe.from_conversations(model, tok, CaptureSpec.create(8, None), [conv], eos_token_ids=[257])
    expected = tok.apply_chat_template(conv.messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert probe.prompts[0].tolist() == [expected]


def test_probe_refuses_an_empty_prompt_list(llama) -> None:
    with pytest.raises(ValueError, match="expected at least one validation prompt"):
        TauProbe(llama, SPEC4, [], eos_token_ids=[])
