"""A served pair for the server tests: a toy target (tiny random Llama, SmolLM2's tokenizer) and a
drafter trained a few seconds on the target's own greedy answers to chat prompts, saved the way
training saves one: eyas.json with the contract, the training fingerprint of each slot and the
held-out metrics (so the watchdog has a prediction to hold serving against).

``broken_copy`` makes the classic mismatch from it: eyas.json's boundaries (and the contract's)
rewritten with the embeddings prepended as a slot and the last slot dropped, as a converter that
counts the embeddings as layer 0 writes them. The fingerprint still says what training captured.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from eyas.capture import BoundaryCapture, FingerprintAccumulator
from eyas.convention import CaptureSpec
from eyas.data.render import render_prompt
from eyas.drafter.build import new_drafter
from eyas.drafter.ttt import Tally, TargetLabels, ttt_forward
from eyas.interop import save_drafter
from eyas.targets import load_target
from tests.support.tiny import train_drafter
from tests.support.toy import gsm8k_questions, make_toy_target

BLOCKS, HIDDEN = 8, 32
BOUNDARIES = (2, 4, 5)  # the EAGLE default [2, L//2, L-3] for L = 8
ANSWER_TOKENS = 24
TTT_STEPS = 3


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@torch.no_grad()
def _answers(model, tok, questions: list[str], n: int) -> tuple[list[torch.Tensor], list[int]]:
    seqs, lens = [], []
    for q in questions:
        ids = render_prompt(chat(q), tok)[None]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
        seqs.append(out)
        lens.append(ids.shape[1])
    return seqs, lens


def _train(model, spec: CaptureSpec, seqs: list[torch.Tensor], lens: list[int], draft_ids: torch.Tensor, steps: int,
           lr: float):
    """TTT training (3 steps deep) of a drafter whose token embedding is zero: it predicts from the
    target's features alone. A toy target's greedy text falls into short loops where the last token
    decides the next, so a drafter that reads its own token would accept just as well from the
    wrong layers and a wrong capture would not show; a real LLM's drafter cannot do without the
    features, and this one cannot either (the zero embedding is saved with it)."""
    return train_drafter(model, spec, seqs, lens, steps, draft_ids=draft_ids, lr=lr, zero_embedding=True)


def make_served_pair(root: Path, initializer_range: float = 0.06, steps: int = 12) -> tuple[Path, Path, list[str]]:
    """(target dir, drafter dir, the held-out questions its metrics were measured on)."""
    target_dir = make_toy_target(root / "target", num_blocks=BLOCKS, hidden=HIDDEN, initializer_range=initializer_range)
    loaded = load_target(str(target_dir))
    model, tok = loaded.model, loaded.tokenizer
    spec = CaptureSpec(BOUNDARIES, BLOCKS)
    questions = gsm8k_questions(40)
    train_q, held_q = questions[:24], questions[24:40]
    seqs, lens = _answers(model, tok, train_q, ANSWER_TOKENS)
    vocab = torch.unique(torch.cat([s.flatten() for s in seqs]))
    held, held_lens = _answers(model, tok, held_q, ANSWER_TOKENS)
    vocab = torch.unique(torch.cat([vocab] + [s.flatten() for s in held]))  # the draft vocabulary: tokens seen
    drafter = _train(model, spec, seqs, lens, vocab, steps, 1e-2)
    _, contract = new_drafter(loaded, tok, BOUNDARIES, draft_vocab_size=len(vocab), source=str(target_dir))
    tally = Tally(TTT_STEPS)
    fp = FingerprintAccumulator(list(BOUNDARIES), HIDDEN)
    draft_ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))
    with torch.no_grad():
        for seq, n in zip(held, held_lens):
            with BoundaryCapture(model, spec) as cap:
                logits = model(seq).logits
                features = cap.features()
            mask = torch.ones_like(seq)
            mask[:, :n] = 0
            tally.add(ttt_forward(drafter, seq, features, TargetLabels.from_logits(logits, draft_ids), mask,
                                  steps=TTT_STEPS))
            fp.update_sequence(features[0, 1:].view(-1, len(BOUNDARIES), HIDDEN))
    contract.metrics = tally.summary()
    contract.fingerprint = fp.result()
    contract.drafter = contract.drafter.model_copy(update={"vocab_map": "trained"})
    out = save_drafter(drafter, contract, root / "drafter", include_embeddings=True)
    return target_dir, out, held_q


def broken_copy(drafter_dir: Path, out: Path) -> Path:
    """The drafter with eyas.json's boundaries shifted: the embeddings prepended as a slot."""
    shutil.copytree(drafter_dir, out)
    path = out / "eyas.json"
    e = json.loads(path.read_text())
    shifted = [0] + list(e["boundaries"])[:-1]
    e["boundaries"] = shifted
    e["contract"]["capture"]["boundaries"] = shifted
    path.write_text(json.dumps(e, indent=2))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if "eyas_boundaries" in cfg:
        cfg["eyas_boundaries"] = shifted
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return out
