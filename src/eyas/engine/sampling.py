"""Sampling parameters, random draws, and the acceptance rules that verify a draft tree.

Notation (as in the speculative-sampling papers): p = the target's distribution at a tree node
(temperature, top-k, top-p applied), q = the distribution the drafter drew that node's children from.
Both are over the target vocabulary [V]; q is zero outside the draft vocabulary.

Greedy: a child is accepted iff it is the target's argmax; the bonus token is the argmax where the
walk stops. Sampling: recursive rejection sampling over the children of a node, in the order they
were drawn without replacement from q (Gumbel-top-k):

    for each child c:   accept with probability min(1, p(c) / q(c))
                        else p <- norm(max(p - q, 0));  q[c] <- 0;  q <- norm(q)
    no child accepted:  sample the bonus token from the residual p

Each step is ordinary speculative sampling of the current p with proposal q (the next child is
distributed as the renormalised q because it was drawn without replacement), so by induction the
token leaving a node is distributed exactly as p: the output distribution is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 and top_p 1 disable those filters (HF's order: temperature,
    then top-k, then top-p)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: expected >= 0, found {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected 0 < top_p <= 1, found {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0, found {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] -> the distribution plain sampling draws from, float32 [..., V]."""
    x = logits.float() / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        # HF's TopPLogitsWarper: drop the smallest tokens whose cumulative mass is <= 1 - top_p,
        # always keeping the most likely one.
        sorted_x, order = x.sort(dim=-1)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - params.top_p
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


# ---------------------------------------------------------------------------------------------
# Random draws. Uniforms come from an optional torch.Generator on its own device (a CPU generator
# works with a CUDA model); every random choice is derived from them.
# ---------------------------------------------------------------------------------------------


def uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device).to(device)


def sample(p: Tensor, generator: torch.Generator | None) -> int:
    """One draw from p [V] by inverse CDF (the first index whose cumulative mass exceeds u)."""
    cdf = p.cumsum(-1)
    u = uniform((1,), generator, p.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=p.shape[-1] - 1))


def gumbel_top_k(q: Tensor, n: int, generator: torch.Generator | None) -> Tensor:
    """n draws without replacement from each row of q [B, V], in draw order: long [B, n].

    Gumbel-top-k (Kool et al. 2019): the order of log q + Gumbel noise is the order of sequential
    sampling without replacement. Rows must have at least n tokens with q > 0.
    """
    u = uniform(tuple(q.shape), generator, q.device).clamp(min=1e-20, max=1 - 1e-7)
    keys = q.log() - (-u.log()).log()
    return keys.topk(n, dim=-1).indices


# ---------------------------------------------------------------------------------------------
# Acceptance rules. A rule maps (p, q, drafted token c) to
#   (probability of accepting c, p to continue with if rejected, q to continue with if rejected).
# The verifier draws the uniform; keeping rules deterministic lets tests compute their exact output
# distribution, and lets a deliberately broken rule be injected.
# ---------------------------------------------------------------------------------------------

AcceptRule = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor, Tensor]]


def _normalised(x: Tensor, fallback: Tensor) -> Tensor:
    s = x.sum()
    # Rejection only happens when p(c) < q(c), so max(p - q, 0) has positive mass; the fallback
    # only guards float round-off when p and q are (almost) equal.
    return x / s if s > 1e-12 else fallback


def rejection_rule(p: Tensor, q: Tensor, c: int) -> tuple[Tensor, Tensor, Tensor]:
    """Recursive rejection sampling (lossless)."""
    accept = (p[c] / q[c].clamp(min=1e-30)).clamp(max=1.0)
    p_rejected = _normalised((p - q).clamp(min=0), p)
    q_rejected = q.clone()
    q_rejected[c] = 0
    q_rejected = _normalised(q_rejected, q_rejected)
    return accept, p_rejected, q_rejected


# ---------------------------------------------------------------------------------------------
# Walks over a verified tree. ``children[i]`` lists node i's children in the order they must be
# examined (draw order); ``tokens[i]`` is node i's target token id; node 0 is the root (the last
# committed token). Both return the accepted path (node indices, starting with 0) and the bonus token.
# ---------------------------------------------------------------------------------------------


def accept_greedy(tokens: list[int], children: list[list[int]], logits: Tensor) -> tuple[list[int], int]:
    """logits [N+1, V]: the target's logits after each node."""
    best = logits.argmax(-1).tolist()  # one device sync for the whole tree
    path = [0]
    while True:
        x = best[path[-1]]
        nxt = next((c for c in children[path[-1]] if tokens[c] == x), None)
        if nxt is None:  # no child is the target's token (possibly outside the draft vocabulary)
            return path, x
        path.append(nxt)


def accept_sampling(tokens: list[int], children: list[list[int]], logits: Tensor, proposals: dict[int, Tensor],
                    params: SamplingParams, generator: torch.Generator | None,
                    rule: AcceptRule = rejection_rule) -> tuple[list[int], int]:
    """logits [N+1, V]; proposals[i] = q [V] that node i's children were drawn from."""
    path = [0]
    while True:
        node = path[-1]
        p = probabilities(logits[node], params)
        q = proposals.get(node)
        accepted = None
        for c in children[node]:
            a, p_rejected, q_rejected = rule(p, q, tokens[c])
            if bool(uniform((), generator, p.device) < a):
                accepted = c
                break
            p, q = p_rejected, q_rejected
        if accepted is None:
            return path, sample(p, generator)
        path.append(accepted)
