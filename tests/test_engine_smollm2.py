"""The engine on the embedded SmolLM2-135M-Instruct (float32, CPU): greedy speculative output is
token-identical to the plain decoder and to HF ``generate`` for a chain and for EAGLE-2 trees, with a
drafter trained here for a few seconds (eyas's TTT step) so that rounds really accept drafts and the
identity covers accepted paths, not only rejections."""

from __future__ import annotations

import pytest
import torch

from eyas.capture import BoundaryCapture, CaptureSpec, num_blocks
from eyas.data.render import render_prompt
from eyas.drafter.build import new_drafter
from eyas.engine import HFTarget, TreeSpec, plain_generate, speculative_generate
from eyas.targets import load_target
from eyas.training.ttt import TargetLabels, ttt_forward

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
    model, tok, _ = load_target("smollm2")
    model = model.float().eval()
    spec = CaptureSpec((2, 15, 27), num_blocks(model))
    prompts = {p: render_prompt([{"role": "user", "content": p}], tok).tolist() for p in TRAIN_PROMPTS + UNSEEN_PROMPTS}
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    # The target's own greedy continuations of the training prompts, with features and labels.
    data = []
    with torch.no_grad():
        for p in TRAIN_PROMPTS:
            ids = torch.tensor([prompts[p]])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=eos)
            with BoundaryCapture(model, spec) as cap:
                logits = model(seq).logits
                features = cap.features()
            data.append((seq, features, logits, ids.shape[1]))

    # A draft vocabulary holding every token of those sequences, padded with the lowest other ids.
    seen = torch.cat([s[0] for s, *_ in data]).unique()
    rest = torch.tensor([i for i in range(model.config.vocab_size) if i not in set(seen.tolist())][: DRAFT_VOCAB - len(seen)])
    draft_ids = torch.cat([seen, rest])
    drafter, _ = new_drafter(model, boundaries=spec.boundaries, draft_vocab_size=DRAFT_VOCAB, seed=0)
    drafter.set_vocab_map(draft_ids)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(20):
        for seq, features, logits, n in data:
            mask = torch.ones_like(seq)
            mask[:, :n] = 0
            loss = ttt_forward(drafter, seq, features, TargetLabels.from_logits(logits, draft_ids), mask, steps=3).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    target = HFTarget(model, spec)
    # The reference: the plain decoder's greedy tokens for every prompt (checked against HF below).
    plain = {p: plain_generate(target, ids, max_new_tokens=NEW_TOKENS, eos_token_ids=[eos]).tokens
             for p, ids in prompts.items()}
    return model, target, drafter.eval(), prompts, eos, plain


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
