"""The engine on the embedded SmolLM2-135M-Instruct (float32, CPU): greedy speculative output is
token-identical to the plain decoder and to HF ``generate`` for a chain and for EAGLE-2 trees, with a
drafter trained here for a few seconds (eyas's TTT step) so that rounds really accept drafts and the
identity covers accepted paths, not only rejections; and every chain round accepts exactly what
training-time test predicts on the served sequence (serving computes what training computed)."""

from __future__ import annotations

import pytest
import torch

from eyas.convention import CaptureSpec

from eyas.targets.structure import num_blocks
from eyas.data.render import render_prompt
from eyas.engine import HFTarget, TreeSpec, plain_generate, speculative_generate
from eyas.targets import load_target
from tests.support.tiny import train_drafter, ttt_accepts

pytestmark = pytest.mark.slow

TRAIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers and say why they are prime.",
]
UNSEEN_PROMPTS = ["Give me two tips for learning to cook."]
NEW_TOKENS = 40
DRAFT_VOCAB = 512


@pytest.fixture(scope="module")
def smol():
    loaded = load_target("smollm2")
    model, tok = loaded.model, loaded.tokenizer
    model = model.float().eval()
    spec = CaptureSpec((2, 15, 27), num_blocks(model))
    prompts = {p: render_prompt([{"role": "user", "content": p}], tok).tolist() for p in TRAIN_PROMPTS + UNSEEN_PROMPTS}
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    # The target's own greedy continuations of the training prompts.
    seqs = []
    with torch.no_grad():
        for p in TRAIN_PROMPTS:
            ids = torch.tensor([prompts[p]])
            seqs.append(model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, pad_token_id=eos))

    # A draft vocabulary holding every token of those sequences, padded with the lowest other ids.
    seen = torch.cat([s[0] for s in seqs]).unique()
    unseen = torch.ones(model.config.vocab_size, dtype=torch.bool)
    unseen[seen] = False
    rest = unseen.nonzero()[: DRAFT_VOCAB - len(seen), 0]
    drafter = train_drafter(model, spec, seqs, [len(prompts[p]) for p in TRAIN_PROMPTS], steps=20,
                            draft_ids=torch.cat([seen, rest]))
    target = HFTarget(model, spec)
    # The reference: the plain decoder's greedy tokens for every prompt (checked against HF below).
    plain = {p: plain_generate(target, ids, max_new_tokens=NEW_TOKENS, eos_token_ids=[eos]).tokens
             for p, ids in prompts.items()}
    return model, target, drafter, prompts, eos, plain


def test_plain_decoder_equals_hf_generate_on_smollm2(smol):
    model, _, _, prompts, eos, plain = smol
    for prompt, ids in prompts.items():
        x = torch.tensor([ids])
        with torch.no_grad():
            hf = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                                eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
        assert plain[prompt] == hf, prompt


@pytest.mark.parametrize("tree", [TreeSpec.chain(4), TreeSpec(4, 4, 16), TreeSpec(6, 3, None)], ids=str)
def test_greedy_speculative_equals_plain_on_smollm2(smol, tree):
    _, target, drafter, prompts, eos, plain = smol
    accepted = 0
    for prompt, ids in prompts.items():
        spec = speculative_generate(target, drafter, ids, tree=tree, max_new_tokens=NEW_TOKENS, eos_token_ids=[eos])
        assert spec.tokens == plain[prompt], prompt
        accepted += sum(spec.stats.accepted_at_depth)
    # the identity held through rounds that accepted drafts (several per round), not only rejections
    assert accepted > 20, accepted


def test_every_chain_round_accepts_what_ttt_predicts_on_smollm2(smol):
    model, target, drafter, prompts, eos, _ = smol
    rounds = []
    for ids in prompts.values():
        r = speculative_generate(target, drafter, ids, tree=TreeSpec.chain(4), max_new_tokens=NEW_TOKENS,
                                 eos_token_ids=[eos])
        rounds += ttt_accepts(model, target.spec, drafter, ids, r, 4, NEW_TOKENS)
    assert all(a == e for a, e in rounds), [(i, a, e) for i, (a, e) in enumerate(rounds) if a != e][:5]
    assert len(rounds) > 40 and sum(a for a, _ in rounds) > 20
