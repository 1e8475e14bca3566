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

Top-k drafts (EAGLE's sampled verification, the default). The drafter drafts the same tree as
greedy decoding (each node's children are its top-k tokens under the drafter: a deterministic
function of the prefix), and each child c is a proposal q = one-hot(c), for which the rule above
reads: accept c with probability p(c), else zero p(c) and renormalise. In closed form, for the
children c_1 .. c_k of a node, in draft order:

    P(accept c_j | c_1 .. c_{j-1} rejected) = p(c_j) / (1 - p(c_1) - .. - p(c_{j-1}))
    no child accepted:  the bonus token from p with c_1 .. c_k zeroed, renormalised

The product telescopes: P(the node's token is c_j) = p(c_j), and any other token x leaves with
(1 - sum_j p(c_j)) * p(x) / (1 - sum_j p(c_j)) = p(x), so the output is the target's distribution
(:func:`accept_top_k_drafts`). A node's expected acceptance is the target's mass on its drafted
children, so the tree that serves greedy requests well serves sampled ones, drafted by the same
captured function; and a path is accepted exactly when the target's own sample follows it, so a
greedy replay over text the target sampled predicts these rounds (``eyas.tune``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from eyas.engine.errors import RequestError

if TYPE_CHECKING:  # a type only: tree.py imports this module
    from eyas.engine.tree import DraftTree


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 and top_p 1 disable those filters (HF's order: temperature,
    then top-k, then top-p)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise RequestError(f"temperature: expected >= 0, found {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p: expected 0 < top_p <= 1, found {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k: expected >= 0, found {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def filters(self, vocab_size: int) -> tuple[bool, bool]:
        """(top-k applies, top-p applies) over a vocabulary of ``vocab_size``: what fixes the shapes
        and ops of :func:`filtered_probabilities` (the values may be device tensors)."""
        return 0 < self.top_k < vocab_size, self.top_p < 1

    def as_tensor(self, device: torch.device) -> Tensor:
        """float32 [3] on ``device``: temperature, top_p, top_k. A captured or compiled acceptance
        takes these as an input, so one graph serves every temperature (a compilation per
        temperature would cost seconds inside a request)."""
        return torch.tensor([self.temperature, self.top_p, float(self.top_k)], dtype=torch.float32, device=device)


GREEDY = SamplingParams()

# How a sampled request's tree is drafted (``speculative.start``'s ``sampled_drafts``): "top-k", the
# greedy draft verified by EAGLE's rule (module docstring; the default), or "gumbel", children drawn
# without replacement from q and verified by recursive rejection sampling.
SAMPLED_DRAFTS = ("top-k", "gumbel")


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] -> the distribution plain sampling draws from, float32 [..., V]."""
    use_top_k, use_top_p = params.filters(logits.shape[-1])
    return filtered_probabilities(logits, params.temperature, params.top_p, params.top_k, use_top_k, use_top_p)


# The longest scan :func:`cumsum_last` leaves to one cumsum: inductor splits a longer scan over a
# few rows across thread blocks (SplitScan), and on torch 2.11 that codegen failed for a sampled
# batch's draw (its scan over the vocabulary fused with the count after it: "NYI
# TritonSplitDimKernel reductions"), leaving the batched epilogue eager. Inductor never splits a
# scan of at most 32 elements. (The single-request acceptance keeps torch's cumsum: on the H100 the
# chunked scan there failed to lower, "NotImplementedError: View", where the plain one compiles
# at temperature alone; with top-p, both fail and it runs eagerly.)
SCAN_CHUNK = 32


def cumsum_last(x: Tensor, chunk: int = SCAN_CHUNK) -> Tensor:
    """The cumulative sum along the last dimension, [..., V] -> [..., V], as scans of at most
    ``chunk`` elements: within each chunk of the (zero-padded) row, then, recursively, over the
    chunks' totals, which are added back as each chunk's exclusive offset. Equal to ``x.cumsum(-1)``
    up to float summation order."""
    V = x.shape[-1]
    if V <= chunk:
        return x.cumsum(-1)
    pad = (-V) % chunk
    inner = F.pad(x, (0, pad)).unflatten(-1, (-1, chunk)).cumsum(-1)  # [..., V'/chunk, chunk]
    totals = inner[..., -1]  # [..., V'/chunk]
    before = cumsum_last(totals, chunk) - totals  # each chunk's offset: the totals of the chunks before it
    return (inner + before[..., None]).flatten(-2)[..., :V]


def filtered_probabilities(logits: Tensor, temperature: float | Tensor, top_p: float | Tensor, top_k: int | Tensor,
                           use_top_k: bool, use_top_p: bool) -> Tensor:
    """logits [..., V] -> softmax(logits / temperature) after top-k, then top-p (HF's order), float32.

    The parameters are host numbers or device tensors (0-dim; top_k a float or long holding an
    integer); ``use_top_k`` and ``use_top_p`` say which filters run, so the ops do not depend on
    the values and one captured graph serves every temperature. Top-k keeps the tokens whose
    logit is at least the k-th largest (``topk`` for a host k, the ascending sort's entry V - k for a
    device k: the same value)."""
    x = logits.float() / temperature
    V = x.shape[-1]
    if use_top_k:
        if isinstance(top_k, Tensor):
            kth = x.sort(dim=-1).values.gather(-1, (V - top_k.long()).expand(x.shape[:-1] + (1,)))
        else:
            kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if use_top_p:
        # HF's TopPLogitsWarper: drop the smallest tokens whose cumulative mass is <= 1 - top_p,
        # always keeping the most likely one.
        sorted_x, order = x.sort(dim=-1)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


# ---------------------------------------------------------------------------------------------
# Random draws. Uniforms come from an optional torch.Generator on its own device (a CPU generator
# works with a CUDA model), or from a CounterStream on the model's device; every random choice is
# derived from them.
# ---------------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor | int) -> Tensor | int:
    """A 32-bit integer hash (two multiply-xorshift rounds; int64 lanes holding values < 2**32, whose
    products stay < 2**63; a Python int hashes to the same value)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def counter_uniform(key: Tensor, count: Tensor) -> Tensor:
    """Uniforms in (0, 1), float32, of (key, count) long [...] (keys < 2**32): a stateless hash, so
    prompt i's j-th token draws u(key_i, j) wherever and whenever it is decoded. 23 bits."""
    x = _mix32(key ^ _mix32(count & _MASK32))
    x = _mix32((x + key) & _MASK32)
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


class CounterStream:
    """Uniforms that are a hash of device tensors, so that random draws can sit inside a CUDA graph.

    A generator's draws cannot: a CPU generator's numbers would be frozen into the graph at
    capture, and a CUDA generator advances with every replay, not with the request. Here a uniform
    is :func:`counter_uniform` of (key, index), where the key is the session's ``key`` (one draw
    from the request's generator) hashed with a position (:meth:`at`, a device tensor: a round's
    committed length, which grows every round, so rounds never share draws) and a tag (which draw
    of the round: a drafting level, acceptance, the bonus token). The same (key, position, tag)
    gives the same numbers wherever they are computed, on the CPU or the GPU, eagerly or in a
    replayed graph: a round drafted ahead of the host (a pipelined round) draws exactly what it
    would have drawn in turn. ``key``: long [1], < 2**32, on the device."""

    def __init__(self, key: Tensor) -> None:
        self.key = key

    @classmethod
    def from_generator(cls, generator: torch.Generator | None, device: torch.device) -> "CounterStream":
        """A stream keyed by one draw from ``generator`` (None: torch's default CPU generator)."""
        gen_device = generator.device if generator is not None else torch.device("cpu")
        key = torch.randint(0, 1 << 32, (1,), generator=generator, device=gen_device)
        return cls(key.to(device))

    def at(self, position: Tensor) -> "CounterStream":
        """The stream of one position (long [] or [1] on the key's device)."""
        return CounterStream(_mix32((self.key ^ _mix32(position.reshape(1) & _MASK32)) & _MASK32))

    def uniform(self, shape: tuple[int, ...], tag: int) -> Tensor:
        """Uniforms in (0, 1), float32 [shape], for draw ``tag`` (a small int) of this stream."""
        key = _mix32((self.key + _mix32(tag)) & _MASK32)  # the tag's hash on the host (ints hash alike)
        return counter_uniform(key, torch.arange(math.prod(shape), device=key.device).view(shape))


# Draws for tags of CounterStream: drafting level d uses tag d; acceptance these two.
ACCEPT_TAG = 1 << 20
BONUS_TAG = ACCEPT_TAG + 1

Draws = torch.Generator | CounterStream | None


def uniform(shape: tuple[int, ...], generator: Draws, device: torch.device, tag: int = 0) -> Tensor:
    """Uniforms in [0, 1) of ``shape`` on ``device``: from the generator (None: torch's default),
    or draw ``tag`` of a CounterStream."""
    if isinstance(generator, CounterStream):
        return generator.uniform(shape, tag)
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device).to(device)


def sample(p: Tensor, generator: Draws, tag: int = 0) -> Tensor:
    """One draw from each row of p [..., V] by inverse CDF (the first index whose cumulative mass
    exceeds u): long [...], on p's device (nothing is read back)."""
    cdf = p.cumsum(-1)
    u = uniform(tuple(p.shape[:-1]) + (1,), generator, p.device, tag) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).clamp(max=p.shape[-1] - 1).squeeze(-1)


def gumbel_top_k(q: Tensor, n: int, generator: Draws, tag: int = 0) -> Tensor:
    """n draws without replacement from each row of q [B, V], in draw order: long [B, n].

    Gumbel-top-k (Kool et al. 2019): the order of log q + Gumbel noise is the order of sequential
    sampling without replacement. Rows must have at least n tokens with q > 0.
    """
    u = uniform(tuple(q.shape), generator, q.device, tag).clamp(min=1e-20, max=1 - 1e-7)
    keys = q.log() - (-u.log()).log()
    return keys.topk(n, dim=-1).indices


# ---------------------------------------------------------------------------------------------
# Acceptance rules. A rule maps (p, q, drafted token c) to
#   (probability of accepting c, p to continue with if rejected, q to continue with if rejected),
# batched over leading dimensions: p, q [..., V], c long [...]. The verifier draws the uniforms;
# keeping rules deterministic lets tests compute their exact output distribution, and lets a
# deliberately broken rule be injected.
# ---------------------------------------------------------------------------------------------

AcceptRule = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


def _normalised(x: Tensor, fallback: Tensor) -> Tensor:
    s = x.sum(-1, keepdim=True)
    # Rejection only happens when p(c) < q(c), so max(p - q, 0) has positive mass; the fallback
    # only guards float round-off when p and q are (almost) equal.
    return torch.where(s > 1e-12, x / s.clamp(min=1e-30), fallback)


def rejection_rule(p: Tensor, q: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Recursive rejection sampling (lossless)."""
    c = torch.as_tensor(c, device=p.device)[..., None]  # [..., 1]
    accept = (p.gather(-1, c) / q.gather(-1, c).clamp(min=1e-30)).clamp(max=1.0).squeeze(-1)
    p_rejected = _normalised((p - q).clamp(min=0), p)
    q_rejected = q.scatter(-1, c, 0.0)
    return accept, p_rejected, _normalised(q_rejected, q_rejected)


# ---------------------------------------------------------------------------------------------
# Acceptance over a verified tree, batched: every node's verdict is computed at once on the
# device, then one walk of ``tree.depth`` gathers follows the accepted children from the root.
# Nothing is read back; the caller reads the verdict once.
# ---------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What verification decided, on the device.

    path      long [depth+1]  the accepted nodes from the root (path[0] = 0); past the accepted
                              length it repeats the last accepted node
    accepted  long []         a, the number of accepted draft tokens
    bonus     long []         the target's token after the last accepted node
    """

    path: Tensor
    accepted: Tensor
    bonus: Tensor


def _follow(accepted_child: Tensor, depth: int) -> tuple[Tensor, Tensor]:
    """The path from the root along accepted_child [N+1] (-1 = none accepted): path [depth+1], a [].

    The current node is a [1] tensor, never a 0-dim one: indexing with a 0-dim tensor reads its
    value back to the host (a device sync per step)."""
    node = torch.zeros(1, dtype=torch.long, device=accepted_child.device)
    alive = torch.ones(1, dtype=torch.bool, device=accepted_child.device)
    path = [node]
    for _ in range(depth):
        nxt = accepted_child[node]
        alive = alive & (nxt >= 0)
        node = torch.where(alive, nxt, node)
        path.append(node)
    path_t = torch.cat(path)
    return path_t, (path_t[1:] != path_t[:-1]).sum()


def accept_greedy(tree: "DraftTree", logits: Tensor) -> Verdict:
    """logits [N+1, V]: the target's logits after each node. A child is accepted iff it is the
    target's argmax after its parent (siblings are distinct tokens: at most one is)."""
    best = logits.argmax(-1)  # [N+1]
    kids = tree.children  # [N+1, K]
    match = (kids >= 0) & tree.valid[kids.clamp(min=0)] & (tree.tokens[kids.clamp(min=0)] == best[:, None])
    accepted_child = torch.where(match.any(-1), kids.gather(1, match.long().argmax(-1, keepdim=True)).squeeze(1), -1)
    path, a = _follow(accepted_child, tree.depth)
    return Verdict(path, a, best[path[-1:]][0])  # [-1:]: a [1] index (see _follow)


def accept_sampling(tree: "DraftTree", logits: Tensor, params: SamplingParams, generator: Draws,
                    rule: AcceptRule = rejection_rule) -> Verdict:
    """logits [N+1, V]; tree.proposals[i] = q [V] that node i's children were drawn from.

    Every node runs the module docstring's loop over its children at once (K steps over [N+1, V]):
    a node whose children are all rejected ends with its residual p. The walk from the root then
    follows the accepted children, and the bonus token is drawn from the residual p where it stops.
    Uniforms drawn at nodes off the path are never used, so each node on the path sees fresh
    independent uniforms, exactly as the sequential walk would."""
    p = probabilities(logits, params)  # [N+1, V]
    q = tree.proposals if tree.proposals is not None else torch.zeros_like(p)  # None: the root alone
    kids = tree.children  # [N+1, K]
    u = uniform(tuple(kids.shape), generator, p.device, ACCEPT_TAG)
    accepted_child = torch.full_like(kids[:, 0], -1)
    decided = torch.zeros_like(accepted_child, dtype=torch.bool)
    for j in range(kids.shape[1]):
        c = kids[:, j]
        examined = (c >= 0) & tree.valid[c.clamp(min=0)] & ~decided
        a, p_rejected, q_rejected = rule(p, q, tree.tokens[c.clamp(min=0)])
        take = examined & (u[:, j] < a)
        rejected = (examined & ~take)[:, None]
        accepted_child = torch.where(take, c, accepted_child)
        decided = decided | take
        p, q = torch.where(rejected, p_rejected, p), torch.where(rejected, q_rejected, q)
    path, a = _follow(accepted_child, tree.depth)
    return Verdict(path, a, sample(p[path[-1:]][0], generator, BONUS_TAG))  # [-1:]: a [1] index (see _follow)


def accept_top_k_drafts(tree: "DraftTree", logits: Tensor, params: Tensor, filters: tuple[bool, bool],
                        generator: Draws) -> Verdict:
    """EAGLE's sampled verification of a deterministic tree (module docstring, "Top-k drafts").

    logits [N+1, V]: the target's after each node; params float32 [3] (:meth:`SamplingParams.as_tensor`:
    temperature, top_p, top_k) and ``filters`` (:meth:`SamplingParams.filters`). Every node decides at
    once from the target's mass on its children, [N+1, K] gathers rather than K passes over
    [N+1, V]; the walk follows the accepted children and the bonus is drawn where it stops, from p
    with that node's children (all rejected) zeroed. Siblings are distinct tokens (a node's top-k),
    which the closed form needs."""
    p = filtered_probabilities(logits, params[0], params[1], params[2], *filters)  # [N+1, V]
    kids = tree.children  # [N+1, K] in draft order, -1 past the last
    real = (kids >= 0) & tree.valid[kids.clamp(min=0)]
    child_tokens = tree.tokens[kids.clamp(min=0)]  # [N+1, K]
    mass = torch.where(real, p.gather(1, child_tokens), 0.0)  # p(c_j)
    before = mass.cumsum(-1) - mass  # p(c_1) + .. + p(c_{j-1})
    chance = (mass / (1 - before).clamp(min=1e-30)).clamp(max=1.0)  # P(accept c_j | earlier siblings rejected)
    u = uniform(tuple(kids.shape), generator, p.device, ACCEPT_TAG)
    take = real & (u < chance)  # [N+1, K]; the first True is the child the sequential walk accepts
    first = take.long().argmax(-1, keepdim=True)  # [N+1, 1]
    accepted_child = torch.where(take.any(-1), kids.gather(1, first).squeeze(1), -1)
    path, a = _follow(accepted_child, tree.depth)
    end = path[-1:]  # [1]: a [1] index (see _follow)
    row = p[end][0]  # [V]
    removed = torch.zeros_like(row).scatter_add(0, child_tokens[end][0], real[end][0].float())
    residual = _normalised(torch.where(removed > 0, 0.0, row), row)
    return Verdict(path, a, sample(residual, generator, BONUS_TAG))
