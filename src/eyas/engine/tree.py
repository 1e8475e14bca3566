"""Drafting: the EAGLE-2 dynamic tree (a chain when top_k = 1), its masks, and the drafter's cache.

Positions. At the start of a round the committed tokens are x_0 .. x_m. The target has seen
x_0 .. x_{m-1} (m cache entries). The drafter's committed cache also holds m entries: entry t read
(f_t, x_{t+1}) at position t -- step 0 of training-time test -- so its last entry (reading x_m)
predicts x_{m+1}; its output there is the tree's *root*. A tree node at depth d is a candidate for
x_{m+d}:
  - the target verifies it at position m + d (the root x_m itself at position m);
  - the drafter expands it by reading (g_parent, x_{m+d}) at position m - 1 + d, attending its
    committed entries plus the node's ancestors and itself: step d of TTT at position t = m - 1
    (g = the drafter's hidden state, fed back).
Expanded nodes write their K/V into scratch slots after the committed entries; drafting never
advances the committed length, so "rolling the drafter back" after verification is free: the re-run
over the accepted tokens (``extend``) overwrites the scratch slots.

Tree shape (TreeSpec(depth, top_k, total_tokens)). At each depth the top_k best nodes, by cumulative
log-probability under the drafter, are expanded; each expanded node proposes top_k children.
- Greedy (EAGLE-2): children are the top_k tokens; at the end the ``total_tokens`` best nodes of
  all depths are kept. Scores only decrease along a path, so a kept node's parent is kept too.
- Sampling: children are drawn WITHOUT replacement from q (Gumbel-top-k) and every drawn node is
  kept; ``total_tokens`` caps how many are drawn, level by level, best parents first. Rejection
  sampling is only lossless if a node's verified children are the first n of its draw sequence
  with n decided before they were drawn: pruning drawn children by their own scores (EAGLE-2's
  final selection) would bias the output (e.g. keeping the likelier of two draws over-represents
  it), so sampling never prunes after drawing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from eyas.drafter.model import Eagle3Drafter
from eyas.engine.sampling import SamplingParams, gumbel_top_k, probabilities
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


@dataclass
class DraftTree:
    """A drafted tree in topological order; node 0 is the root (the last committed token x_m)."""

    tokens: Tensor  # long [N+1] target token ids
    parents: list[int]  # [N+1]; parents[0] = -1, parents[i] < i
    depths: Tensor  # long [N+1]; depth 0 = root
    children: list[list[int]]  # per node, children in the order verification examines them
    proposals: dict[int, Tensor] = field(default_factory=dict)  # sampling: node -> q [V] of its children

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def ancestor_mask(self) -> Tensor:
        """bool [N+1, N+1]: row i is True at node i's ancestors and at i."""
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
        for i in range(1, n):  # parents come first, so their rows are complete
            mask[i] |= mask[self.parents[i]]
        return mask


class DraftState:
    """The drafter, its static KV cache, and its output at the last committed entry (the root)."""

    def __init__(self, drafter: Eagle3Drafter, max_len: int) -> None:
        self.drafter = drafter
        self.device = drafter.fc.weight.device
        self.dtype = drafter.fc.weight.dtype
        self.cache = drafter.new_cache(1, max_len)
        self.max_len = max_len
        self.length = 0  # committed entries
        vd = drafter.config.draft_vocab_size
        self.draft_ids = drafter.draft_to_target(torch.arange(vd, device=self.device))  # [Vd] target ids
        self.root_token = -1
        self.root_logits: Tensor | None = None  # [Vd]
        self.root_hidden: Tensor | None = None  # [H]

    @torch.no_grad()
    def extend(self, tokens: list[int], features: Tensor) -> None:
        """Commit n entries: entry length+i reads (features[i], tokens[i]) at position length+i.

        tokens: the n committed tokens that follow the target positions of ``features`` [n, S*H_t],
        i.e. x_{t+1} for feature f_t.
        """
        n = len(tokens)
        slots = torch.arange(self.length, self.length + n, device=self.device)
        # causal over the committed cache: entry s sees entries 0..s
        mask = torch.arange(self.max_len, device=self.device)[None] <= slots[:, None]  # [n, max_len]
        out = self.drafter(torch.tensor([tokens], device=self.device), features[None].to(self.dtype),
                           slots[None], cache=self.cache, cache_slots=slots, mask=mask[None, None],
                           from_target=True)
        self.root_token = tokens[-1]
        self.root_logits, self.root_hidden = out.logits[0, -1], out.hidden[0, -1]
        self.length += n

    @torch.no_grad()
    def draft(self, spec: TreeSpec, depth: int, sampling: SamplingParams,
              generator: torch.Generator | None, vocab_size: int) -> DraftTree:
        """Draft a tree of at most ``depth`` (<= spec.depth) from the root. vocab_size: the
        target's, for the proposals q. depth 0 gives the root alone (a plain decoding step)."""
        greedy = sampling.greedy
        total = int(spec.total_tokens)  # draft nodes kept (greedy) or drawn at most (sampling)
        top_k = min(spec.top_k, self.drafter.config.draft_vocab_size)
        m = self.length
        # Every node drafted so far (index 0 = root): target token, parent, depth, cumulative log q.
        tokens, parents, depths, scores = [self.root_token], [-1], [0], [0.0]
        proposals: dict[int, Tensor] = {}
        # The nodes whose children are drawn next, with their drafter outputs and mask rows.
        expand = [0]
        logits = self.root_logits[None]  # [k, Vd]
        hidden = self.root_hidden[None]  # [k, H]
        rows = (torch.arange(self.max_len, device=self.device) < m)[None]  # [k, max_len]
        next_slot = m
        for d in range(1, depth + 1):
            # 1. children of each expanded node
            new: list[int] = []
            if greedy:
                logp = torch.log_softmax(logits.float(), dim=-1)
                top = logp.topk(top_k, dim=-1)  # [k, top_k]
                child_tokens = self.draft_ids[top.indices].tolist()
                child_logp = top.values.tolist()
                for row, node in enumerate(expand):
                    for tok, lp in zip(child_tokens[row], child_logp[row]):
                        new.append(len(tokens))
                        tokens.append(tok), parents.append(node), depths.append(d), scores.append(scores[node] + lp)
            else:
                q = probabilities(logits, sampling)  # [k, Vd]
                support = (q > 0).sum(-1).tolist()
                # draw order; a row with fewer than n tokens in its support ends in -inf keys, cut below
                drawn = gumbel_top_k(q, min(top_k, max(support)), generator)  # [k, n]
                child_tokens = self.draft_ids[drawn].tolist()
                child_logq = q.gather(-1, drawn).log().tolist()
                for row, node in enumerate(expand):  # best parents first: ``expand`` is sorted
                    # n is fixed before looking at the draws (see module docstring)
                    n = min(top_k, support[row], total - (len(tokens) - 1))
                    if n <= 0:
                        continue
                    q_target = torch.zeros(vocab_size, device=self.device)
                    q_target[self.draft_ids] = q[row]
                    proposals[node] = q_target
                    for tok, lq in zip(child_tokens[row][:n], child_logq[row][:n]):
                        new.append(len(tokens))
                        tokens.append(tok), parents.append(node), depths.append(d), scores.append(scores[node] + lq)
            if d == depth or not new:
                break
            # 2. the top_k best new nodes get their own drafter step (batched: one forward)
            frontier = sorted(new, key=lambda i: -scores[i])[:top_k]  # stable: ties by creation order
            parent_row = [expand.index(parents[i]) for i in frontier]
            slots = torch.arange(next_slot, next_slot + len(frontier), device=self.device)
            next_slot += len(frontier)
            rows = rows[parent_row].clone()  # the parent's visibility (committed + its ancestors)...
            rows[torch.arange(len(frontier), device=self.device), slots] = True  # ...plus the node itself
            out = self.drafter(
                torch.tensor([[tokens[i] for i in frontier]], device=self.device),
                hidden[parent_row][None],
                torch.full((1, len(frontier)), m - 1 + d, device=self.device),
                cache=self.cache, cache_slots=slots, mask=rows[None, None], from_target=False,
            )
            expand, logits, hidden = frontier, out.logits[0], out.hidden[0]

        if greedy:  # EAGLE-2: keep the `total_tokens` best nodes; a parent always ranks before its child
            chosen = {0}
            for i in sorted(range(1, len(tokens)), key=lambda i: (-scores[i], depths[i], i)):
                if len(chosen) > total:
                    break
                if parents[i] in chosen:
                    chosen.add(i)
            keep = sorted(chosen)  # creation order is topological and keeps sibling order
        else:
            keep = list(range(len(tokens)))
        new_index = {old: new for new, old in enumerate(keep)}
        children: list[list[int]] = [[] for _ in keep]
        for new, old in enumerate(keep[1:], start=1):
            children[new_index[parents[old]]].append(new)
        return DraftTree(
            tokens=torch.tensor([tokens[i] for i in keep], device=self.device),
            parents=[-1] + [new_index[parents[i]] for i in keep[1:]],
            depths=torch.tensor([depths[i] for i in keep], device=self.device),
            children=children,
            proposals={new_index[i]: q for i, q in proposals.items() if i in new_index},
        )
