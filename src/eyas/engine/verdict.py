"""A round's acceptance on the device: the verdict, what the host reads of it, and the drafter's
re-read, as one function of tensors whose shapes the tree fixes (captured once per tree depth and
kind of acceptance on a target with CUDA graphs, compiled where the target compiles).

How a request's rounds are accepted is its :class:`Acceptance`: greedy (argmax matches), top-k
drafts (EAGLE's rule, the temperature an input of the graph) or Gumbel drafts (recursive rejection
sampling against the drafter's q); the rules themselves are :mod:`eyas.engine.sampling`'s.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from eyas.engine.graphs import CompiledOrEager, StepGraphs
from eyas.engine.sampling import (
    SAMPLED_DRAFTS, AcceptRule, CounterStream, SamplingParams, Verdict, accept_greedy, accept_sampling,
    accept_top_k_drafts,
)
from eyas.engine.errors import RequestError
from eyas.engine.target import Target
from eyas.engine.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    """How one request's rounds are accepted.

    how: "greedy", "top-k" (a sampled request on the greedy draft: ``sampling.accept_top_k_drafts``)
    or "gumbel" (children drawn from q: ``sampling.accept_sampling`` with ``rule``); params: the
    sampling parameters on the device (sampled requests: an input of the captured acceptance, and
    of a Gumbel draft, so one graph serves every temperature); draws: the request's CounterStream
    (sampled requests)."""

    how: str
    sampling: SamplingParams
    rule: AcceptRule
    params: Tensor | None = None
    draws: CounterStream | None = None

    @classmethod
    def of(cls, sampling: SamplingParams, sampled_drafts: str, rule: AcceptRule, draws: CounterStream | None,
           device: torch.device) -> "Acceptance":
        if sampled_drafts not in SAMPLED_DRAFTS:
            raise RequestError(f"sampled_drafts: expected one of {list(SAMPLED_DRAFTS)}, found {sampled_drafts!r}")
        how = "greedy" if sampling.greedy else sampled_drafts
        return cls(how, sampling, rule, None if sampling.greedy else sampling.as_tensor(device), draws)


class Reread(NamedTuple):
    """The drafter's re-read after a pipelined round, padded to depth + 1 entries."""

    tokens: Tensor  # long [D+1]: x_{m+1} .. x_{m+a}, the bonus at index a, then pads
    features: Tensor  # [D+1, S*H]: f[path], the target's features at x_m and the accepted nodes
    n: Tensor  # long []: a + 1, the entries to commit


# The verdict's CUDA graphs per target and (tree depth, kind of acceptance, re-read): they live as
# long as the target's buffers they read, and go with the target.
_VERDICTS: weakref.WeakKeyDictionary[Target, dict[tuple, StepGraphs]] = weakref.WeakKeyDictionary()


def pack(t: DraftTree, v: Verdict) -> Tensor:
    """What the host needs of a round, in one tensor (one transfer): a, the path's tokens
    [depth+1], the bonus token and the tree's depth."""
    return torch.cat([v.accepted[None], t.tokens[v.path], v.bonus[None], t.depths.max()[None]])


def round_verdict(target: Target, acceptance: Acceptance, t: DraftTree, logits: Tensor, position: Tensor,
                  features: Tensor | None = None) -> tuple[Verdict, Tensor, Reread | None]:
    """Acceptance and its pack: a function of tensors whose shapes the tree fixes, so on a target
    with CUDA graphs it is captured once per tree depth and kind of acceptance (greedy; top-k drafts
    per filter set, for every temperature; Gumbel drafts per sampling parameters and rule) and
    replayed (its outputs are the graph's, valid until the next round's replay). logits [N+1, V]; position long []: the
    committed length m, where the request's CounterStream takes a sampled round's draws.

    Returns (verdict, pack, re-read): the re-read when given the features f [N+1, S*H] (the
    pipelined round), else None."""
    how, sampling, rule, depth = acceptance.how, acceptance.sampling, acceptance.rule, t.depth
    filters = sampling.filters(target.vocab_size)
    reread = features is not None

    def verdict(tokens: Tensor, parents: Tensor, depths: Tensor, mask: Tensor, children: Tensor, valid: Tensor,
                logits: Tensor, position: Tensor, *more: Tensor) -> tuple[Tensor, ...]:
        if how == "greedy":
            tree = DraftTree(tokens, parents, depths, mask, children, valid, depth)
            v = accept_greedy(tree, logits)
        elif how == "top-k":
            params, key, *more = more  # type: ignore[assignment]
            tree = DraftTree(tokens, parents, depths, mask, children, valid, depth)
            v = accept_top_k_drafts(tree, logits, params, filters, CounterStream(key).at(position))
        else:
            proposals, key, *more = more  # type: ignore[assignment]
            tree = DraftTree(tokens, parents, depths, mask, children, valid, depth, proposals)
            v = accept_sampling(tree, logits, sampling, CounterStream(key).at(position), rule)
        out = (v.path, v.accepted, v.bonus, pack(tree, v))
        if more:  # the features: the drafter's re-read, padded to depth + 1
            following = torch.cat([tree.tokens[v.path[1:]], v.bonus[None]])  # [D+1]: x_{m+1} .. x_{m+a}, ...
            index = torch.arange(following.shape[0], device=following.device)
            following = torch.where(index == v.accepted, v.bonus, following)  # ... the bonus at a, pads after
            out += (following, more[0][v.path], v.accepted + 1)
        return out

    args = (t.tokens, t.parents, t.depths, t.mask, t.children, t.valid, logits, position)
    if how == "top-k":
        args += (acceptance.params, acceptance.draws.key)
    elif how == "gumbel":
        args += (t.proposals, acceptance.draws.key)
    if reread:
        args += (features,)
    if getattr(target, "cuda_graphs", False):
        graphs = _VERDICTS.setdefault(target, {})  # StepGraphs keys the shapes
        # top-k: one graph for every temperature (the values are an input; the filters fix the ops)
        key = (depth, how, filters, reread) if how == "top-k" else (depth, how, sampling, rule, reread)
        if key not in graphs:
            # Acceptance is some 35 small ops (greedy: argmax, the children's matches, the walk down
            # the path, the pack and the re-read's padding), top-k drafts' a softmax over [N+1, V] and
            # [N+1, K] gathers, Gumbel drafts' K steps of rejection sampling over [N+1, V] (p - q,
            # norms, scatters): compiled where the target
            # compiles, so they fuse into a few kernels. Only the pipelined round's (full depth: one
            # compilation per tree and sampling): the last rounds of a request, shallower, would
            # each compile mid-request (seconds each).
            fused = reread and getattr(target, "compile", False)
            # the target's logits (args[6]) and features (the last) read where its graph left them;
            # the tree copied (the draft reads this graph's outputs, through the re-read: a cycle)
            graphs[key] = StepGraphs(CompiledOrEager(verdict, "inductor", "acceptance") if fused else verdict,
                                     in_place=(6, len(args) - 1) if reread else (6,))
        run = graphs[key]
    else:
        run = verdict
    path, accepted, bonus, packed, *rest = run(*args)
    return Verdict(path, accepted, bonus), packed, (Reread(*rest) if reread else None)


class Readback:
    """A round's one device-to-host transfer, started as soon as its value is queued: on a GPU the
    copy goes into pinned memory behind the verdict and the host waits for that copy alone (an
    event), not for the drafting queued after it. On the CPU it is a plain read."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.event = torch.cuda.Event() if self.cuda else None
        self.buffer: Tensor | None = None  # pinned host memory (GPU) or the tensor itself (CPU)

    def start(self, x: Tensor) -> None:
        if not self.cuda:
            self.buffer = x
            return
        if self.buffer is None or self.buffer.shape != x.shape or self.buffer.dtype != x.dtype:
            self.buffer = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        self.buffer.copy_(x, non_blocking=True)
        self.event.record()  # type: ignore[union-attr]

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.buffer.tolist()  # type: ignore[union-attr]
