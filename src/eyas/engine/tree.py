"""The draft tree: its shape (:class:`TreeSpec`, a chain when top_k = 1), the tree of each kind of
request (:class:`TreePlan`), a drafted tree as device tensors (:class:`DraftTree`), and the top-k
selections that grow it. The drafter's cache and the drafting itself are :mod:`eyas.engine.draft_state`.

Tree shape (TreeSpec(depth, top_k, total_tokens)). At each depth the top_k best nodes, by cumulative
log-probability under the drafter, are expanded; each expanded node proposes top_k children.
- Greedy (EAGLE-2), and sampled requests with top-k drafts (the default: ``sampling.accept_top_k_drafts``):
  children are the top_k tokens; at the end the ``total_tokens`` best nodes of all depths are kept.
  Scores only decrease along a path, so a kept node's parent is kept too. The tree is a function of
  the prefix alone, which is what EAGLE's sampled verification needs.
- Gumbel drafts (``sampled_drafts="gumbel"``): children are drawn WITHOUT replacement from q
  (Gumbel-top-k) and every drawn node is kept; ``total_tokens`` caps how many are drawn, level by
  level, best parents first. Rejection sampling is only lossless if a node's verified children are
  the first n of its draw sequence with n decided before they were drawn: pruning drawn children by
  their own scores (EAGLE-2's final selection) would bias the output (e.g. keeping the likelier of
  two draws over-represents it), so these drafts are never pruned after drawing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from eyas.engine.sampling import SamplingParams
from eyas.errors import EyasError


class TreeSpecError(EyasError, ValueError):
    """A tree shape that cannot be drafted (``--tree`` text that does not parse, a size below 1)."""


@dataclass(frozen=True)
class TreeSpec:
    """depth: most draft tokens on a path; top_k: nodes expanded per depth and children per
    expanded node; total_tokens: draft nodes verified per round (root excluded).

    ``total_tokens`` is the tree's one size: given as None (all candidates) or above what the
    expansion can produce, top_k + (depth - 1) * top_k^2, it is stored as that number, so every
    reader (the drafter, the JSON reports, ``--tree auto``) sees the size a round really verifies.
    TreeSpec(d, 1, d) is a chain of d tokens."""

    depth: int = 5
    top_k: int = 1
    total_tokens: int | None = None  # an int after construction (see above)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or (self.total_tokens is not None and self.total_tokens < 1):
            raise TreeSpecError(f"tree: expected depth >= 1, top_k >= 1, total_tokens >= 1; found "
                                f"depth={self.depth}, top_k={self.top_k}, total_tokens={self.total_tokens}")
        most = self.top_k + (self.depth - 1) * self.top_k**2
        object.__setattr__(self, "total_tokens", min(self.total_tokens or most, most))  # frozen: set once here

    @classmethod
    def chain(cls, depth: int) -> "TreeSpec":
        return cls(depth, 1, depth)

    @classmethod
    def parse(cls, text: str) -> "TreeSpec":
        """'DEPTH,TOPK,TOTAL' (e.g. '6,10,60') or 'DEPTH' for a chain."""
        try:
            parts = [int(x) for x in text.split(",")]
        except ValueError:
            parts = []
        if len(parts) == 1:
            return cls.chain(parts[0])
        if len(parts) != 3:
            raise TreeSpecError(f"--tree: expected DEPTH,TOPK,TOTAL like '6,10,60' or DEPTH for a chain, "
                                f"found {text!r}")
        return cls(*parts)

    @property
    def scratch_slots(self) -> int:
        """Drafter cache slots that the expansion of one round writes."""
        return self.top_k * (self.depth - 1)

    @property
    def label(self) -> str:
        """The ``--tree`` text of this tree: 'DEPTH' for a chain, else 'DEPTH,TOPK,TOTAL'."""
        return str(self.depth) if self.top_k == 1 else f"{self.depth},{self.top_k},{self.total_tokens}"


@dataclass(frozen=True)
class TreePlan:
    """The tree for each kind of request: ``greedy`` for temperature 0, ``sampled`` for any
    temperature above it (a request at 0.8 uses the sampled tree). Sampled requests accept less
    per node (a node's chance is the target's mass on its children, not a hit of the argmax), so
    their best tree is usually shallower or narrower; ``--tree auto`` chooses each on text decoded
    at its own temperature (:mod:`eyas.tune`)."""

    greedy: TreeSpec
    sampled: TreeSpec

    @classmethod
    def same(cls, tree: TreeSpec) -> "TreePlan":
        return cls(tree, tree)

    @classmethod
    def parse(cls, greedy: str, sampled: str | None = None) -> "TreePlan":
        """``--tree`` (every request's tree) and ``--tree-sampled`` (the sampled requests', when given)."""
        tree = TreeSpec.parse(greedy)
        return cls(tree, TreeSpec.parse(sampled) if sampled else tree)

    def for_sampling(self, sampling: SamplingParams) -> TreeSpec:
        return self.greedy if sampling.greedy else self.sampled

    def to_dict(self) -> dict[str, list[int]]:
        return {"greedy": _triple(self.greedy), "sampled": _triple(self.sampled)}


def _triple(spec: TreeSpec) -> list[int]:
    return [spec.depth, spec.top_k, int(spec.total_tokens)]


@dataclass
class DraftTree:
    """A drafted tree in topological order, on the drafter's device; node 0 is the root (the last
    committed token x_m). Every field is a tensor except ``depth``, so verifying and accepting a
    tree never reads the device:

        tokens     long  [N+1]      target token ids
        parents    long  [N+1]      parents[0] = -1, parents[i] < i
        depths     long  [N+1]      depth 0 = the root
        mask       bool  [N+1, N+1] row i True at node i's ancestors and at i (the tree mask)
        children   long  [N+1, K]   node i's children in the order verification examines them (draw
                                    order), -1 past the last; K = the tree's top_k (at least 1)
        valid      bool  [N+1]      False for padding nodes (sampling: a draw past a distribution's
                                    support); they are verified, for fixed shapes, but never accepted
        proposals  float [N+1, V] | None   sampling: q over the target vocabulary that node i's
                                    children were drawn from (a zero row for a node without children)
        depth      int              levels drafted: the deepest a path can be (a host int)
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    mask: Tensor
    children: Tensor
    valid: Tensor
    depth: int
    proposals: Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def from_parents(cls, tokens: Tensor, parents: Tensor, depth: int, top_k: int,
                     proposals: Tensor | None = None, valid: Tensor | None = None) -> "DraftTree":
        """The tree given its tokens [N+1] and parents [N+1] (parents[0] = -1, parents[i] < i,
        siblings in examination order) on one device; ``depth`` bounds the depth of every node and
        ``top_k`` the children of each. Derives depths, the ancestor mask and the children table
        with tensor ops only (``depth`` gathers, no device read)."""
        n, dev = tokens.shape[0], tokens.device
        nodes = torch.arange(n, device=dev)
        # Ancestors: walk every node up one level per iteration, marking what it reaches.
        mask = torch.eye(n, dtype=torch.bool, device=dev)
        depths = torch.zeros(n, dtype=torch.long, device=dev)
        up = parents.clone()
        for _ in range(depth):
            has = up >= 0
            mask[nodes, up.clamp(min=0)] |= has
            depths += has.long()
            up = torch.where(has, parents[up.clamp(min=0)], up)
        # Children: node i is child number rank(i) of its parent, rank = earlier siblings.
        kids = parents[1:]  # [N] the parent of nodes 1..N
        earlier = (kids[:, None] == kids[None, :]).tril(-1)  # [N, N] j < i with the same parent
        children = torch.full((n, max(top_k, 1)), -1, dtype=torch.long, device=dev)
        children[kids, earlier.sum(1)] = nodes[1:]
        if valid is None:
            valid = torch.ones(n, dtype=torch.bool, device=dev)
        return cls(tokens=tokens, parents=parents, depths=depths, mask=mask, children=children, valid=valid,
                   depth=depth, proposals=proposals)


def largest(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of x [..., V] and their indices, largest first (torch.topk)."""
    return x.topk(k, dim=-1)


def by_sort(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of x [..., V] and their indices by a stable descending sort
    (of equal values, the lower index first). Inductor lowers a sort of at most 512 elements a row to
    one Triton kernel, where torch.topk stays two aten kernels (gatherTopK, then a bitonic sort): in a
    compiled draft, the chunked top-k of a level by sorts took 21-22 us on the H200 against 37-40 by
    torch.topk (``benchmarks/draft_topk_gpu.py``, SmolLM2's drafter vocabulary, 1 and 8 rows);
    eagerly it is the slower one (56-57 against 39-43 us)."""
    best = x.sort(dim=-1, descending=True, stable=True)
    return best.values[..., :k], best.indices[..., :k]


def top_k(x: Tensor, k: int, chunk: int = 256,
          select: Callable[[Tensor, int], tuple[Tensor, Tensor]] = largest) -> tuple[Tensor, Tensor]:
    """The k largest values of each row of x [r, V] and their indices, largest first: ``select``
    (x.topk), in two stages when rows are long. A GPU's top-k gives a row one thread block, so a
    few long rows (the drafter's frontier over its vocabulary) leave it idle for tens of
    microseconds; splitting each row into chunks of ``chunk`` first (the top k of every chunk, then
    of those) spreads the work over r * V / chunk blocks. The same values; among equal values the
    order may differ. (A compiled draft selects by :func:`by_sort`.)"""
    r, V = x.shape
    if k > chunk or V < 4 * chunk:
        return select(x, k)
    pad = (-V) % chunk
    if pad:
        x = F.pad(x, (0, pad), value=float("-inf"))
    values, indices = select(x.view(r, -1, chunk), k)  # [r, V/chunk, k]
    offsets = torch.arange(0, x.shape[1], chunk, device=x.device)[None, :, None]
    best_values, best = select(values.flatten(1), k)  # [r, k] over the chunks' candidates
    return best_values, (indices + offsets).flatten(1).gather(1, best)
