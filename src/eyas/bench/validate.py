"""The engine's accept length on a few validation prompts: what training keeps its best checkpoint by.

Held-out accuracy is measured teacher-forced on the training distribution; a user sees tau, the
tokens per drafting-verification round that the engine reaches on their prompts, with the drafter
feeding on its own drafts and the target's own answers. :class:`TauProbe` measures that figure the
way `eyas bench` does (greedy, the same engine), on prompts that training never sees, and is
passed to :func:`eyas.training.loop.train` as its ``validate`` hook.

The probe serves a *copy* of the drafter in the target's dtype (training keeps float32 weights
under autocast), on the target model training already holds, through the Hugging Face engine
target (eager: no compilation per evaluation). It restores nothing because it changes nothing.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from eyas.convention import CaptureSpec
from eyas.data.conversations import Conversation
from eyas.data.render import render_prompt
from eyas.drafter.model import Eagle3Drafter
from eyas.engine import TreeSpec, build_target, speculative_generate


class TauProbe:
    """``probe(drafter) -> {"tau": ..., "tau_rounds": ..., "tau_new_tokens": ...}``.

    tau = (sum over prompts of the tokens committed by rounds) / (number of rounds): the pooled
    accept length of greedy speculative decoding with ``tree`` over ``prompts``, each answered up to
    ``max_new_tokens`` tokens or its eos.
    """

    def __init__(self, model: Any, spec: CaptureSpec, prompts: Sequence[Sequence[int]], eos_token_ids: Sequence[int],
                 tree: TreeSpec = TreeSpec.chain(4), max_new_tokens: int = 64) -> None:
        """``prompts``: rendered prompts, target token ids (see :meth:`from_conversations`)."""
        if not prompts:
            raise ValueError("TauProbe: expected at least one validation prompt, found none")
        self.model, self.spec, self.tree, self.max_new_tokens = model, spec, tree, max_new_tokens
        self.eos = list(eos_token_ids)
        device = next(model.parameters()).device
        self.prompts = [torch.as_tensor(list(p), dtype=torch.long, device=device)[None] for p in prompts]  # [1, n]
        self._target: Any = None  # built on first use (it allocates the KV buffers)

    @classmethod
    def from_conversations(cls, model: Any, tokenizer: Any, spec: CaptureSpec, prompts: Sequence[Conversation],
                           eos_token_ids: Sequence[int], **kw: Any) -> "TauProbe":
        """Prompts rendered with the tokenizer's chat template, as `eyas bench` renders them."""
        return cls(model, spec, [render_prompt(c, tokenizer).tolist() for c in prompts], eos_token_ids, **kw)

    @torch.no_grad()
    def __call__(self, drafter: Eagle3Drafter) -> dict[str, float]:
        if self._target is None:
            self._target = build_target(self.model, self.spec, "hf")
        p = next(self.model.parameters())
        d = copy.deepcopy(drafter).to(device=p.device, dtype=p.dtype).eval()
        committed, rounds, new = 0, 0, 0
        for ids in self.prompts:
            r = speculative_generate(self._target, d, ids, tree=self.tree, max_new_tokens=self.max_new_tokens,
                                     eos_token_ids=self.eos, timing="off")
            committed += sum(r.stats.accept_lengths)
            rounds += len(r.stats.accept_lengths)
            new += r.stats.new_tokens
        return {"tau": committed / rounds if rounds else 1.0, "tau_rounds": float(rounds), "tau_new_tokens": float(new)}
