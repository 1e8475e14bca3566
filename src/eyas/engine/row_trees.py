"""Batched speculative rounds with a draft *tree* per row: every row of a running batch drafts an
EAGLE-2 tree of the same shape (:class:`~eyas.engine.tree.TreeSpec` depth d, top_k k, N nodes), the
target verifies every row's tree in one forward, and each row accepts its own path (greedy rows the
target's argmax path, sampled rows by SpecInfer's rule: :func:`accept_tree_sampled`); a chain is
:mod:`eyas.engine.row_speculation`'s round.

Why trees in a batch. A chain accepts its drafts only while each is the drafter's first choice; a
tree also verifies the runners-up, so a round accepts more (the lone request's tau rises from a
chain's to a tree's for the same depth) for a verification of rows x (N + 1) positions instead of
rows x (d + 1). While the target's forward is bound by reading its weights (few rows) the extra
positions are nearly free; with many rows they are not, which is why a server measures both
(:class:`eyas.serve.policy.BatchSpeculation`).

One round, for rows 0..n-1 (the notation of :mod:`eyas.engine.row_speculation`: row r has committed
x_0 .. x_m, m = pos[r], feeds x_m next; its drafter cache holds m entries and its root is the
drafter's output at entry m - 1):

    draft    level 1: the k most likely tokens of the root (scores: their log-probabilities). Level
             i = 2 .. d: the drafter reads the k best nodes of level i - 1 (its *frontier*; level 1's
             k are all of it) at position m - 2 + i, in scratch slots m + (i - 2) k + j, each
             attending the row's committed entries, its ancestors' slots and its own; each proposes
             its k most likely children, scored by the path's summed log-probability. Candidates:
             k + (d - 1) k^2, level by level. The tree keeps the N best by a stable sort (of equal
             scores the earlier: a parent's score is at least its child's and it comes first, so a
             kept node's parent is kept), in candidate order, which is topological
    verify   the target over [x_m, nodes 1..N] at positions m + depth(node), node t written at entry
             m + t of the row's cache, attending the row's committed entries, its ancestors and itself
    accept   node t is *right* when its token is the target's argmax at its parent; a path is
             accepted while every node on it is right: a = the deepest such node's depth (one node
             per depth can be right: siblings differ), then the target's argmax there (the bonus)
    commit   the accepted path's entries move to m + 1 .. m + a in every block of the target's cache
             (source m + t >= destination: gathered first, then written); the drafter re-reads the
             new tokens with the path's features, as after a chain; the rows' state as a chain's

The tree of a row is a function of its prefix alone, and greedy acceptance takes exactly the
target's argmax sequence, so a round is lossless: a row's tokens are its plain steps' (float32);
sampled rows' tokens follow the target's distribution whatever the tree (:func:`accept_tree_sampled`).
At temperature 1 a top-k tree accepts less than a chain drawn from the drafter (each child counts
only the target's own probability of it), so a server gives trees to greedy batches
(:class:`eyas.serve.policy.BatchSpeculation`).
Everything a round writes past a row's new length (the tree's other nodes, the drafter's scratch) is
overwritten before anything attends it. No host reads: the round is captured in a CUDA graph like a
chain's (:meth:`eyas.engine.row_speculation.RowSpeculation.round`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from eyas.engine.batched_steps import Rows, draw, rotary, row_probabilities
from eyas.engine.sampling import counter_uniform
from eyas.engine.tree import TreeSpec


class RowTree(NamedTuple):
    """The drafted trees of rows 0..n-1, N + 1 nodes each in topological order (node 0 the root x_m)."""

    tokens: Tensor  # [n, N+1] long: target token ids
    parents: Tensor  # [n, N+1] long: parents[:, 0] = -1, parents[:, t] < t
    depths: Tensor  # [n, N+1] long: 0 at the root
    mask: Tensor  # [n, N+1, N+1] bool: node t's ancestors and itself
    children: Tensor  # [n, N+1, k] long: node t's children, most likely first, -1 past the last


def check_tree(tree: TreeSpec, most: int) -> None:
    """A tree a batched round can draft within ``most`` scratch entries past a row's position."""
    if tree.top_k < 2:
        raise ValueError(f"tree: a batched tree round needs top_k >= 2 (a chain is a depth), found {tree.label}")
    if tree.total_tokens + 1 > most or tree.scratch_slots > most:
        raise ValueError(f"tree {tree.label}: a round writes {max(tree.total_tokens + 1, tree.scratch_slots)} "
                         f"entries past a row's position, expected at most {most}")


def _ancestors(parents: Tensor, depth: int) -> Tensor:
    """The ancestor-or-self mask [n, T, T] of parents [n, T] (-1 at the root): each node walks up one
    level per iteration, ``depth`` times."""
    n, T = parents.shape
    nodes = torch.arange(T, device=parents.device)
    mask = (nodes[:, None] == nodes[None, :]).expand(n, T, T).clone()
    up = parents
    for _ in range(depth):  # (comparisons, not F.one_hot: its range check reads the device)
        has = up >= 0
        mask |= (up.clamp(min=0)[..., None] == nodes) & has[..., None]
        up = torch.where(has, parents.gather(1, up.clamp(min=0)), up)
    return mask


def draft_tree(spec, st: Rows, n: int, tree: TreeSpec) -> RowTree:
    """The trees of rows 0..n-1 (module docstring, draft), through ``spec``'s drafter and cache
    (:class:`~eyas.engine.row_speculation.RowSpeculation`)."""
    k, d, N = tree.top_k, tree.depth, int(tree.total_tokens)
    dev, C = spec.kv.device, spec.capacity
    pos = st.pos[:n]
    scores, picks = torch.log_softmax(spec.root_logits[:n], -1).topk(k)  # [n, k] level 1
    tokens = [spec.draft_ids[picks]]
    all_scores = [scores]
    parent_of = [torch.full((n, k), -1, dtype=torch.long, device=dev)]  # candidate index of the parent; -1: root
    frontier = torch.arange(k, device=dev).expand(n, k)  # candidate indices of the level read next
    frontier_tokens, frontier_scores = tokens[0], scores
    hidden = spec.root_hidden[:n, None].expand(n, k, spec.root_hidden.shape[-1])
    S = max(tree.scratch_slots, 1)
    lineage = torch.zeros(n, k, S, dtype=torch.bool, device=dev)  # scratch slots of each frontier node's path
    at_keys = torch.arange(C, device=dev)
    first = k  # candidates so far
    for i in range(2, d + 1):
        base = (i - 2) * k
        lineage = lineage | ((base + torch.arange(k, device=dev))[:, None] == torch.arange(S, device=dev))[None]
        slots = (pos[:, None] + base + torch.arange(k, device=dev)[None, :]).clamp(max=C - 1)  # [n, k]
        positions = (pos + i - 2)[:, None].expand(n, k)
        rel = at_keys[None, :] - pos[:, None]  # [n, C]: a key's offset past the committed entries
        inside = (rel >= 0) & (rel < S)
        mine = lineage.gather(2, rel.clamp(0, S - 1)[:, None, :].expand(n, k, C))  # [n, k, C]
        mask = (rel[:, None, :] < 0) | (inside[:, None, :] & mine)
        logits, out = spec._tree_step(frontier_tokens, hidden, positions, slots, mask[:, None])
        child_scores, child = (torch.log_softmax(logits, -1) + frontier_scores[..., None]).topk(k)  # [n, k, k]
        tokens.append(spec.draft_ids[child].flatten(1))
        all_scores.append(child_scores.flatten(1))
        parent_of.append(frontier[..., None].expand(n, k, k).flatten(1))
        if i < d:  # the next frontier: the level's k best
            frontier_scores, best = child_scores.flatten(1).topk(k)  # [n, k]
            frontier = first + best
            frontier_tokens = tokens[-1].gather(1, best)
            hidden = out.gather(1, (best // k)[..., None].expand(n, k, out.shape[-1]))
            lineage = lineage.gather(1, (best // k)[..., None].expand(n, k, S))
        first += k * k
    cand_tokens, cand_scores, cand_parents = (torch.cat(x, 1) for x in (tokens, all_scores, parent_of))
    M = cand_tokens.shape[1]
    cand_depths = torch.cat([torch.ones(k, dtype=torch.long, device=dev)]
                            + [torch.full((k * k,), i, dtype=torch.long, device=dev) for i in range(2, d + 1)])
    kept = cand_scores.sort(dim=-1, descending=True, stable=True).indices[:, :N].sort(-1).values  # [n, N] topological
    node_of = torch.zeros(n, M, dtype=torch.long, device=dev)
    node_of.scatter_(1, kept, torch.arange(1, N + 1, device=dev).expand(n, N))  # candidate -> node (0: not kept)
    parent = cand_parents.gather(1, kept)
    parent = torch.where(parent < 0, 0, node_of.gather(1, parent.clamp(min=0)))
    parents = torch.cat([torch.full((n, 1), -1, dtype=torch.long, device=dev), parent], 1)
    depths = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=dev), cand_depths[kept]], 1)
    all_tokens = torch.cat([st.ids[:n, None], cand_tokens.gather(1, kept)], 1)
    return RowTree(all_tokens, parents, depths, _ancestors(parents, d), _children(parents, k))


def _children(parents: Tensor, k: int) -> Tensor:
    """The children table [n, T, k] of parents [n, T]: node t is child number (its earlier siblings)
    of its parent; siblings come in node order, which is the drafter's order (most likely first)."""
    n, T = parents.shape
    kids = parents[:, 1:]  # [n, T-1]
    rank = ((kids[:, :, None] == kids[:, None, :]) & torch.ones(T - 1, T - 1, dtype=torch.bool,
                                                                 device=parents.device).tril(-1)).sum(-1)
    children = torch.full((n, T * k), -1, dtype=torch.long, device=parents.device)
    children.scatter_(1, kids * k + rank, torch.arange(1, T, device=parents.device).expand(n, T - 1))
    return children.view(n, T, k)


def tree_prologue(ids: Tensor, depths: Tensor, tree_mask: Tensor, pos: Tensor, embed: Tensor, inv_freq: Tensor,
                  n_keys: int, capacity: int, *, rope_scaling: float) -> tuple[Tensor, ...]:
    """The inputs of a tree of T nodes per row (``batched_steps.chain_prologue`` for a tree): ids,
    depths [R, T] long, tree_mask [R, T, T]; node t of row r sits at position pos[r] + depths[r, t]
    and is written at entry pos[r] + t. Returns x [R, T, H], d (a zero residual), cos, sin [R, T, 1,
    D], at [R, T] (the entries written, clamped to the capacity) and mask [R, T, n_keys] (node t
    attends the row's committed entries j < pos[r], and entry pos[r] + u for u in its ancestry)."""
    T = ids.shape[1]
    at = pos[:, None] + torch.arange(T, device=ids.device)[None, :]
    x = F.embedding(ids, embed)
    cos, sin = rotary(pos[:, None] + depths, inv_freq, rope_scaling, x.dtype)
    rel = torch.arange(n_keys, device=ids.device)[None, :] - pos[:, None]  # [R, n_keys]
    inside = (rel >= 0) & (rel < T)
    ancestry = tree_mask.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(-1, T, -1))  # [R, T, n_keys]
    mask = (rel[:, None, :] < 0) | (inside[:, None, :] & ancestry)
    return x, torch.zeros_like(x), cos[:, :, None], sin[:, :, None], at.clamp(max=capacity - 1), mask


def accept_tree(tree: RowTree, logits: Tensor, depth: int) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance (module docstring, accept) of trees with logits [n, N+1, V]. Returns (tokens
    [n, depth + 1]: the path's drafts, then the bonus, then anything; accepted a [n]; path [n, depth +
    1]: the node at each depth of the accepted path, node t = t past it, so moving entry m + path[t]
    to m + t is the identity there)."""
    n = logits.shape[0]
    rows = torch.arange(n, device=logits.device)
    target = logits.argmax(-1)  # [n, N+1]
    right = tree.tokens == target.gather(1, tree.parents.clamp(min=0))
    right[:, 0] = True
    on_right_path = ~(tree.mask & ~right[:, None, :]).any(-1)  # [n, N+1]
    best = (tree.depths * on_right_path).argmax(-1)  # the deepest (the root when none: first of the zeros)
    a = tree.depths[rows, best]
    on_path = tree.mask[rows, best]  # [n, N+1]
    path = torch.arange(depth + 2, device=logits.device).expand(n, depth + 2).clone()
    nodes = torch.arange(tree.tokens.shape[1], device=logits.device).expand_as(tree.depths)
    path = path.scatter(1, torch.where(on_path, tree.depths, depth + 1), nodes)[:, :depth + 1]  # off-path: a bin
    drafts = tree.tokens.gather(1, path[:, 1:])  # [n, depth]
    bonus = target[rows, best]
    tokens = torch.cat([drafts, bonus[:, None]], 1).scatter(1, a[:, None], bonus[:, None])
    return tokens, a, path


def accept_tree_sampled(st: Rows, n: int, tree: RowTree, logits: Tensor, depth: int, mode: str,
                        salt: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sampled acceptance (module docstring, accept) of trees with logits [n, N+1, V], returned as
    :func:`accept_tree`'s; rows whose ``st.greedy`` is set accept greedily all the same.

    Each node's children are the drafter's top k, a function of the prefix alone: k deterministic
    drafts, so SpecInfer's multi-draft rule applies with q a point mass on each. At node v, the
    residual r starts as p_v (the row's temperature and top-p); child c (most likely first) is
    accepted with probability r(c) / sum(r); a rejected c leaves r with r(c) = 0 (norm(max(r - q,
    0)) for that point mass). An accepted child is the next node (r = its p); a node whose children
    are all rejected, or that has none, ends the path, and the bonus is drawn from r. The tokens are
    distributed as plain sampling from p, whatever the tree. Uniforms: counter_uniform of the row's
    salted key and n_gen x 64 + 32 + i k + j for child j at depth i (so depth x k <= 31), + 63 for
    the bonus."""
    dev = logits.device
    rows = torch.arange(n, device=dev)
    k = tree.children.shape[-1]
    key, count0 = st.key[:n] ^ salt, st.n_gen[:n] * 64
    temperature, drop_mass, top_p = st.temperature[:n], st.drop_mass[:n], mode == "top_p"
    cur = torch.zeros(n, dtype=torch.long, device=dev)
    walking = torch.ones(n, dtype=torch.bool, device=dev)
    accepted = torch.zeros(n, dtype=torch.long, device=dev)
    path = torch.arange(depth + 1, device=dev).expand(n, depth + 1).clone()
    residual = row_probabilities(logits[:, 0], temperature, drop_mass, top_p)  # [n, V]
    for i in range(depth):
        moved = torch.zeros(n, dtype=torch.bool, device=dev)
        nxt = cur
        for j in range(k):
            child = tree.children[rows, cur, j]
            valid = walking & ~moved & (child >= 0)
            tok = tree.tokens[rows, child.clamp(min=0)]
            r_tok = residual[rows, tok]
            take = valid & (counter_uniform(key, count0 + 32 + i * k + j) * residual.sum(-1) < r_tok)
            nxt = torch.where(take, child, nxt)
            moved = moved | take
            residual = _without(residual, tok, valid & ~take)
        accepted = accepted + moved.long()
        path[:, i + 1] = torch.where(moved, nxt, path[:, i + 1])
        cur, walking = nxt, walking & moved
        p_next = row_probabilities(logits[rows, cur], temperature, drop_mass, top_p)
        residual = torch.where(moved[:, None], p_next, residual)
    p_last = row_probabilities(logits[rows, cur], temperature, drop_mass, top_p)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_last)  # r rounded to nothing: p
    bonus = draw(residual, counter_uniform(key, count0 + 63))
    drafts = tree.tokens.gather(1, path[:, 1:])
    tokens = torch.cat([drafts, bonus[:, None]], 1).scatter(1, accepted[:, None], bonus[:, None])
    greedy = st.greedy[:n]
    g_tokens, g_accepted, g_path = accept_tree(tree, logits, depth)
    return (torch.where(greedy[:, None], g_tokens, tokens), torch.where(greedy, g_accepted, accepted),
            torch.where(greedy[:, None], g_path, path))


def _without(residual: Tensor, tok: Tensor, rejected: Tensor) -> Tensor:
    """residual [n, V] with residual[r, tok[r]] = 0 where rejected [n] (a point mass's max(r - q, 0))."""
    rows = torch.arange(residual.shape[0], device=residual.device)
    return residual.index_put((rows, tok), torch.where(rejected, 0.0, residual[rows, tok]))


def move_path_entries(keys: Tensor, values: Tensor, pos: Tensor, path: Tensor) -> None:
    """Entries m + path[:, t] -> m + t, t = 1 .. depth, of rows 0..n-1 in every block of the target's
    cache keys, values [L, R, Hkv, C, D] (module docstring, commit); gathered before written."""
    n, C = path.shape[0], keys.shape[3]
    rows = torch.arange(n, device=pos.device)[:, None]
    src = (pos[:, None] + path[:, 1:]).clamp(max=C - 1)  # [n, depth]
    dst = (pos[:, None] + torch.arange(1, path.shape[1], device=pos.device)[None, :]).clamp(max=C - 1)
    for cache in (keys, values):
        cache[:, rows, :, dst] = cache[:, rows, :, src]  # [n, depth, L, Hkv, D] gathered, then written
