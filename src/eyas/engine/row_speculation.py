"""Batched speculative rounds: every row of a running batch drafts a chain of gamma tokens with the
EAGLE-3 drafter, the target verifies every row's chain in one forward, and each row accepts its own
length (:class:`RowSpeculation`, driven by :meth:`eyas.engine.continuous.RowBatch.speculate`). A
round may draft a tree per row instead (:mod:`eyas.engine.row_trees`, same state, same commit).

Why chains. A lone request decodes with EAGLE-2 trees (:mod:`eyas.engine.speculative`); in a batch,
a row's verification costs rows x (gamma + 1) token positions, so each row gets the few most likely
tokens of its own chain, and the accepted path is always a prefix of what was verified: a row's
target cache stays in place (the accepted entries are where they were written; the rejected ones lie
past the row's new length and are overwritten as it grows), and so does its drafter cache. No
gather, no compaction, rows never read each other's entries.

One round, for rows 0..n-1 (row r has committed x_0 .. x_m, m = pos[r]; the target has seen
x_0 .. x_{m-1}, it feeds ids[r] = x_m next; the drafter's cache holds m entries, entry t read
(f_t, x_{t+1}) at position t, and its output at entry m - 1 is the row's *root*):

    draft    d_1 = the root's choice; d_{i+1} from the drafter reading (g_i, d_i) at position
             m - 1 + i (slot m - 1 + i: scratch past the committed entries; g_i its state fed back),
             i = 1 .. gamma - 1. Greedy rows take the argmax, sampled rows draw from q_i (the
             drafter's distribution with the row's temperature and top-p), in the target's vocabulary
    verify   the target over [x_m, d_1 .. d_gamma] at positions m .. m + gamma, causal, writing entries
             m .. m + gamma of the row's cache: logits p_0 .. p_gamma and the capture boundaries'
             features f_m .. f_{m+gamma}
    accept   greedy: a = the leading drafts equal to the target's argmax, then the argmax at a (the
             bonus). Sampled (Leviathan et al. 2023, chain speculative sampling): d_{i+1} is accepted
             with probability min(1, p_i(d) / q_i(d)); at the first rejection the token is drawn from
             norm(max(0, p_i - q_i)), and after gamma acceptances from p_gamma. The output is
             distributed as plain sampling from p, whatever q is (so a stale drafter costs speed,
             never correctness). a + 1 new tokens: d_1 .. d_a, then the bonus
    commit   ids = the bonus, pos += a + 1, n_gen += a + 1; the row ends at an eos token among the
             new ones or at its limit. The drafter re-reads (f_{m+i}, x_{m+i+1}) at positions
             m + i, i = 0 .. a (the accepted drafts, then the bonus): its entries m .. m + a, and its
             output at a is the next root. The re-read runs gamma + 1 entries for every row; entries
             past a write slots past the new length (scratch: overwritten before anything attends
             them).

Random numbers are :func:`~eyas.engine.sampling.counter_uniform` of the row's key (salted: a stream
apart from the plain steps') and n_gen x 64 + a tag (draft i: i, acceptance i: 32 + i, the bonus: 63),
so gamma <= 31 and rounds never share draws. A round reads the device once: the new tokens, the
accepted lengths and the rows' active flags.

Plain steps between rounds do not run the drafter: after k of them a row's drafter cache lacks
entries m - k .. m - 1 and its root is the output at m - k - 1, a token behind; its next round's
drafts are then mostly wrong (still lossless): on the CPU, SmolLM2's tree 3,4,12 at 4 greedy rows
accepted 1.69 drafts a round with rounds only and 1.22 with a plain step every 4th
(``benchmarks/results/2026-12-07-catch-up-cpu.md``; 1.66 with what follows). So the plain
steps record each fed token and its features (:meth:`BatchedLlama.tap`, the last FOLLOW positions
of a row), and before the next round the drafter re-reads the entries it missed
(:meth:`RowSpeculation.catch_up`): entry t's key and value depend on (f_t, x_{t+1}, t) alone, so
the re-read writes what a drafter that had followed every step would hold, and its output at m - 1
is the root it would have. Rows are prefilled with the features the drafter reads
(:meth:`RowSpeculation.read`), so a row is fresh from its admission.

On a GPU (the engine's ``compile`` and ``cuda_graphs``) the verification's prologue and block, and
the drafter's step and re-read, are compiled with dynamic sizes (one compilation serves every rows x
depth x key bucket, where static sizes would compile each), and the whole round, draft to commit, is captured as one CUDA graph per
(rows, depth, mode, key bucket) at its first use and replayed: a round launches one graph, as a
plain step does. The capture's warm-up runs are real rounds: the rows' state (ids, pos, n_gen,
active) and the roots are restored from a snapshot after each, and everything else they write lies
past the rows' committed entries (scratch). On a CPU the same functions run eagerly.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Callable, Sequence

import torch
from torch import Tensor

from eyas.drafter.model import Eagle3Drafter, KVCache
from eyas.engine.batched import BatchedLlama
from eyas.engine.batched_steps import Rows, chain_layer, chain_prologue, draw, row_probabilities
from eyas.engine.graphs import CompiledOrEager, capture, snapshot
from eyas.engine.llama import rms_norm
from eyas.engine.row_trees import (RowTree, accept_tree, accept_tree_sampled, check_tree, draft_tree, move_path_entries,
                                   tree_prologue)
from eyas.engine.sampling import counter_uniform
from eyas.engine.tree import TreeSpec

MAX_DEPTH = 31  # the counter tags of a round (module docstring)
FOLLOW = 4  # the plain steps' positions a row's drafter can catch up on (module docstring)
Draft = int | TreeSpec  # what a caller asks a round to draft: a chain's depth, or a tree (eyas.engine.row_trees)
RoundKey = tuple[int, TreeSpec, str, int]  # (rows, draft, mode, key bucket); a chain as TreeSpec.chain(depth)
_SALT = 0x5BD1E995  # the rounds' random stream, apart from the plain steps' (same row key)


class RowKVCache(KVCache):
    """The drafter's cache for rows that each write their own slots: ``update(slots [B, T], k, v [B,
    Hkv, T, D])`` writes row b's entries at its slots. Over ``kv`` [2, R, Hkv, C, D]: the update writes
    rows 0..B-1 and returns their cache (views), or, with ``rows`` [B], rows ``rows`` (in place; it
    returns a copy of their cache). One object serves every B, so a compiled step that reads it
    sees the same cache whatever the batch."""

    def __init__(self, kv: Tensor, rows: Tensor | None = None) -> None:
        torch.nn.Module.__init__(self)
        self.kv, self.rows = kv, rows

    @property
    def k(self) -> Tensor:
        return self.kv[0] if self.rows is None else self.kv[0, self.rows]

    @property
    def v(self) -> Tensor:
        return self.kv[1] if self.rows is None else self.kv[1, self.rows]

    def update(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, H = k.shape[0], k.shape[1]
        rows = torch.arange(B, device=k.device) if self.rows is None else self.rows
        index = (rows[:, None, None], torch.arange(H, device=k.device)[None, :, None], slots[:, None, :])
        self.kv[0].index_put_(index, k.to(self.kv.dtype))
        self.kv[1].index_put_(index, v.to(self.kv.dtype))
        if self.rows is None:
            return self.kv[0, :B], self.kv[1, :B]
        return self.k, self.v


class RowSpeculation:
    """The drafter's state for the rows of a :class:`BatchedLlama` and the round (module docstring).

    State: ``kv`` [2, R, Hkv_d, C, D_d] (the drafter's cache per row), ``root_logits`` [R, Vd] and
    ``root_hidden`` [R, H_d] (each row's output at its last committed entry)."""

    def __init__(self, engine: BatchedLlama, drafter: Eagle3Drafter, boundaries: Sequence[int]) -> None:
        cfg = drafter.config
        if cfg.num_slots != len(boundaries):
            raise ValueError(f"boundaries: the drafter reads {cfg.num_slots} feature slots, found {list(boundaries)}")
        self.engine, self.drafter, self.boundaries = engine, drafter, tuple(int(b) for b in boundaries)
        dev = engine.device
        R, C = engine.rows, engine.capacity
        self.kv = torch.zeros(2, R, cfg.num_key_value_heads, C, cfg.head_dim, dtype=drafter.fc.weight.dtype, device=dev)
        self.root_logits = torch.zeros(R, cfg.draft_vocab_size, dtype=torch.float32, device=dev)
        self.root_hidden = torch.zeros(R, cfg.hidden_size, dtype=drafter.fc.weight.dtype, device=dev)
        self.cache = RowKVCache(self.kv)  # rows 0..n-1 of a round: n from its inputs
        self.draft_ids = drafter.draft_to_target(torch.arange(cfg.draft_vocab_size, device=dev))  # [Vd]
        c = engine.constants
        self._prologue = functools.partial(chain_prologue, rope_scaling=c["rope_scaling"])
        self._layer = functools.partial(chain_layer, eps=c["eps"], qk_eps=c["qk_eps"], scaling=c["scaling"])
        self._tree_prologue = functools.partial(tree_prologue, rope_scaling=c["rope_scaling"])
        self._draft_step, self._reread = self._draft_step_eager, self._reread_eager
        self._tree_step = self._tree_step_eager
        if engine.compile:  # dynamic sizes: one compilation for every (rows, depth, key bucket) (module docstring)
            self._prologue = CompiledOrEager(self._prologue, engine.backend, "batched chain prologue", dynamic=True)
            self._layer = CompiledOrEager(self._layer, engine.backend, "batched chain block", dynamic=True)
            # The drafter's forwards too: eagerly each is ~60 small kernels (norms, rope, the cache's
            # writes, the masked attention, SiLU), which a captured round replays at a few us each
            self._draft_step = CompiledOrEager(self._draft_step, engine.backend, "batched chain draft step", dynamic=True)
            self._reread = CompiledOrEager(self._reread, engine.backend, "batched chain re-read", dynamic=True)
            self._tree_prologue = CompiledOrEager(self._tree_prologue, engine.backend, "batched tree prologue",
                                                  dynamic=True)
            self._tree_step = CompiledOrEager(self._tree_step, engine.backend, "batched tree draft step", dynamic=True)
        engine.tap(self.boundaries, FOLLOW)  # what catch_up() re-reads
        self.cuda_graphs = engine.cuda_graphs
        # (rows, depth, mode, key bucket) -> the captured round and its outputs (tokens, accepted)
        self._graphs: dict[RoundKey, tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]]] = {}
        self._done: set[RoundKey] = set()  # the shapes compiled (and captured) so far
        self.compile_s = 0.0  # their compilation and capture

    @property
    def compile_per_shape_s(self) -> float | None:
        """The mean seconds a round shape has cost to compile and capture so far (None: none yet)."""
        return self.compile_s / len(self._done) if self._done else None

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    # -- a row's prompt ----------------------------------------------------------------------------

    @torch.no_grad()
    def read(self, rows: Sequence[int], tokens: Sequence[Sequence[int]], features: Tensor) -> None:
        """Rows start: row rows[j] reads (features[j, t], tokens[j][t]) at position t for t < len(tokens[j])
        (x_1 .. x_m after the prompt's features f_0 .. f_{m-1}); features [g, P, W], P >= the longest.
        Each row's root is its output at its last entry."""
        dev = self.kv.device
        g, P = len(rows), max(len(t) for t in tokens)
        ids = torch.zeros(g, P, dtype=torch.long)
        for j, t in enumerate(tokens):
            ids[j, :len(t)] = torch.as_tensor(list(t), dtype=torch.long)
        ids = ids.to(dev)
        last = torch.tensor([len(t) - 1 for t in tokens], device=dev)
        at = torch.arange(P, device=dev)[None, :].expand(g, P)
        mask = torch.arange(self.capacity, device=dev)[None, None, :] <= at[:, :, None]  # [g, P, C]
        index = torch.tensor(list(rows), dtype=torch.long, device=dev)
        out = self.drafter(ids, features[:, :P].to(self.kv.dtype), at, cache=RowKVCache(self.kv, index),
                           cache_slots=at, mask=mask[:, None], from_target=True,
                           logits_at=at == last[:, None])
        self.root_logits.index_copy_(0, index, out.logits.float())
        self.root_hidden.index_copy_(0, index, out.hidden[torch.arange(g, device=dev), last])

    @torch.no_grad()
    def catch_up(self, n: int, missed: Tensor) -> None:
        """The drafter's entries that the plain steps since its last read left out, for rows 0..n-1
        (module docstring): row r missed the last j = min(missed[r], FOLLOW) positions m - j .. m - 1
        (m = pos[r]), and re-reads (f_t, x_{t+1}) there from the engine's taps, x_m being ids[r];
        its root becomes its output at m - 1. The re-read is FOLLOW entries wide for every row: a
        row's entries past m - 1 are scratch (overwritten before anything attends them), and a row
        with j = 0 keeps its root. Entries before m - FOLLOW stay missing."""
        st, e = self.engine.state, self.engine
        assert st is not None
        K, dev = FOLLOW, self.kv.device
        m, j = st.pos[:n], missed.to(dev).clamp(0, K)
        start = m - j
        t = start[:, None] + torch.arange(K, device=dev)[None, :]  # [n, K] the entries re-read
        features = e.tapped[:n].gather(1, (t % K)[..., None].expand(-1, -1, e.tapped.shape[-1]))  # f_t
        tokens = torch.where(t + 1 == m[:, None], st.ids[:n, None], e.tapped_ids[:n].gather(1, (t + 1) % K))  # x_{t+1}
        logits, hidden = self._reread(tokens, features, start, (j - 1).clamp(min=0))
        behind = (j > 0)[:, None]
        self.root_logits[:n] = torch.where(behind, logits, self.root_logits[:n])
        self.root_hidden[:n] = torch.where(behind, hidden, self.root_hidden[:n])

    # -- the round ----------------------------------------------------------------------------------

    def draft(self, st: Rows, n: int, depth: int, mode: str) -> tuple[Tensor, Tensor | None]:
        """The chains of rows 0..n-1: (drafts [n, depth] long target ids, q [n, depth, V] their
        distributions, None when every row is greedy)."""
        dev, C, V = self.kv.device, self.capacity, self.engine.vocab_size
        logits, hidden = self.root_logits[:n], self.root_hidden[:n]
        key, count0 = st.key[:n] ^ _SALT, st.n_gen[:n] * 64
        drafts, qs = [], []
        for i in range(depth):
            greedy_pick = self.draft_ids[logits.argmax(-1)]
            if mode == "greedy":
                token = greedy_pick
            else:
                q_draft = row_probabilities(logits, st.temperature[:n], st.drop_mass[:n], mode == "top_p")  # [n, Vd]
                picked = self.draft_ids[draw(q_draft, counter_uniform(key, count0 + i))]
                token = torch.where(st.greedy[:n], greedy_pick, picked)
                qs.append(torch.zeros(n, V, device=dev).index_add_(1, self.draft_ids, q_draft))
            drafts.append(token)
            if i + 1 < depth:
                slot = (st.pos[:n] + i).clamp(max=C - 1)[:, None]  # [n, 1]
                logits, hidden = self._draft_step(token, hidden, slot)
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    def verify(self, st: Rows, n: int, tokens: Tensor, n_keys: int) -> tuple[Tensor, Tensor]:
        """The target over tokens [n, T] of rows 0..n-1 at positions pos .. pos + T - 1, attending
        their first n_keys entries: (logits [n, T, V], features [n, T, W] at the boundaries)."""
        e = self.engine
        return self.blocks(n, *self._prologue(tokens, st.pos[:n], e.embed, e.inv_freq, n_keys, e.capacity))

    def verify_tree(self, st: Rows, n: int, tree: RowTree, n_keys: int) -> tuple[Tensor, Tensor]:
        """The target over the trees of rows 0..n-1 (:mod:`eyas.engine.row_trees`, verify): (logits
        [n, N+1, V], features [n, N+1, W])."""
        e = self.engine
        return self.blocks(n, *self._tree_prologue(tree.tokens, tree.depths, tree.mask, st.pos[:n], e.embed,
                                                   e.inv_freq, n_keys, e.capacity))

    def blocks(self, n: int, x: Tensor, d: Tensor, cos: Tensor, sin: Tensor, at: Tensor,
               mask: Tensor) -> tuple[Tensor, Tensor]:
        """The target's blocks and head over a prologue's inputs for rows 0..n-1 (token t of row r
        written at entry at[r, t], attending under mask): (logits, the boundaries' features)."""
        e = self.engine
        seen = {0: x} if 0 in self.boundaries else {}
        for b, w in enumerate(e.weights):
            x, d = self._layer(x, d, cos, sin, at, mask, e.keys[b, :n], e.values[b, :n], w)
            if b + 1 in self.boundaries:
                seen[b + 1] = x + d
        logits = torch.nn.functional.linear(rms_norm(x + d, e.norm_weight, e.constants["eps"]), e.lm_head, e.lm_bias)
        return logits, torch.cat([seen[b] for b in self.boundaries], dim=-1)

    def _draft_step_eager(self, token: Tensor, hidden: Tensor, slot: Tensor) -> tuple[Tensor, Tensor]:
        """One draft step of rows 0..n-1: the drafter reads (its own state hidden [n, H_d], token [n])
        at slot [n, 1] (its position and cache slot; written there): (logits [n, Vd] float32, the
        next state [n, H_d])."""
        C = self.capacity
        mask = torch.arange(C, device=slot.device)[None, None, None, :] <= slot[:, None, :, None]
        out = self.drafter(token[:, None], hidden[:, None], slot, cache=self.cache, cache_slots=slot, mask=mask,
                           from_target=False)
        return out.logits[:, 0].float(), out.hidden[:, 0]

    def _tree_step_eager(self, tokens: Tensor, hidden: Tensor, positions: Tensor, slots: Tensor,
                         mask: Tensor) -> tuple[Tensor, Tensor]:
        """One level of rows 0..n-1's trees: the drafter reads k nodes a row (tokens [n, k], their
        parents' states hidden [n, k, H_d]) at positions [n, k], written at slots [n, k], attending
        under mask [n, 1, k, C]: (logits [n, k, Vd] float32, their states [n, k, H_d])."""
        out = self.drafter(tokens, hidden, positions, cache=self.cache, cache_slots=slots, mask=mask,
                           from_target=False)
        return out.logits.float(), out.hidden

    def _reread_eager(self, tokens: Tensor, features: Tensor, pos: Tensor, accepted: Tensor) -> tuple[Tensor, Tensor]:
        """The re-read of :meth:`reread` (its entries written): (the roots' logits [n, Vd] float32,
        their states [n, H_d])."""
        C, (n, T) = self.capacity, tokens.shape
        at = (pos[:, None] + torch.arange(T, device=pos.device)[None, :]).clamp(max=C - 1)  # [n, T]
        mask = torch.arange(C, device=pos.device)[None, None, :] <= at[:, :, None]
        out = self.drafter(tokens, features.to(self.kv.dtype), at, cache=self.cache, cache_slots=at,
                           mask=mask[:, None], from_target=True, logits_at=accepted)
        return out.logits.float(), out.hidden[torch.arange(n, device=pos.device), accepted]

    def reread(self, st: Rows, n: int, tokens: Tensor, features: Tensor, accepted: Tensor) -> None:
        """The drafter's entries m .. m + a of rows 0..n-1 (module docstring, commit): tokens [n, T]
        the new x_{m+1} .., features [n, T, W] the verified f_m ..; the roots at index accepted [n]."""
        logits, hidden = self._reread(tokens, features, st.pos[:n], accepted)
        self.root_logits[:n] = logits
        self.root_hidden[:n] = hidden

    @torch.no_grad()
    def round(self, n: int, draft: Draft, mode: str, n_keys: int) -> tuple[Tensor, Tensor]:
        """One round of rows 0..n-1 (module docstring; ``draft`` a chain's depth, or a tree:
        :mod:`eyas.engine.row_trees`), the rows' state committed in place: (the new tokens [n, depth
        + 1], of which row r's first accepted[r] + 1 count; accepted [n]). With CUDA graphs these
        are the graph's buffers, overwritten by the next round of the same shape."""
        draft = self.check(draft, mode)
        key = (n, draft, mode, n_keys)
        if self.cuda_graphs:
            captured = self._graphs.get(key) or self._capture(key)
            if captured is not None:
                graph, out = captured
                graph.replay()
                return out
        if self.engine.compile and key not in self._done:  # its first, compiling, call
            t0 = time.perf_counter()
            out = self._round(*key)
            self._done.add(key)
            self.compile_s += time.perf_counter() - t0
            return out
        return self._round(*key)

    def check(self, draft: Draft, mode: str) -> TreeSpec:
        """``draft`` as a round's key holds it (a chain's depth d as TreeSpec.chain(d), the tree of
        top_k 1 it is), or a ValueError saying what a round can draft."""
        tree = TreeSpec.chain(draft) if isinstance(draft, int) else draft
        if tree.top_k == 1:
            if not 1 <= tree.depth <= MAX_DEPTH:
                raise ValueError(f"depth: expected 1 .. {MAX_DEPTH}, found {tree.depth}")
            return TreeSpec.chain(tree.depth)
        check_tree(tree, MAX_DEPTH + 1)
        if mode != "greedy" and tree.depth * tree.top_k > MAX_DEPTH:
            raise ValueError(f"tree {tree.label}: a sampled round draws a uniform per child examined, "
                             f"depth x top_k <= {MAX_DEPTH}; found {tree.depth * tree.top_k}")
        return tree

    def prepared(self, n: int, draft: Draft, mode: str, n_keys: int) -> bool:
        """Whether the round of this shape runs without compiling or capturing first."""
        key = (n, self.check(draft, mode), mode, n_keys)
        return not (self.cuda_graphs or self.engine.compile) or key in self._done

    @torch.no_grad()
    def prepare(self, n: int, draft: Draft, mode: str, n_keys: int) -> bool:
        """Compile (and on a GPU capture) the round of this shape now, the rows' state left as it was
        (a server's idle time: its first use then replays it); False where there is nothing to do."""
        key = (n, self.check(draft, mode), mode, n_keys)
        if self.prepared(*key):
            return False
        if self.cuda_graphs:
            return self._capture(key) is not None
        restore = self._snapshot()
        self.round(*key)  # its first, compiling, call (timed there)
        restore()
        return True

    def _snapshot(self) -> Callable[[], None]:
        """A copy of the rows' state a round changes; calling what it returns puts it back (what
        else a round writes lies past the rows' committed entries: scratch, module docstring)."""
        st = self.engine.state
        assert st is not None
        return snapshot(st.ids, st.pos, st.n_gen, st.active, self.root_logits, self.root_hidden)

    def _capture(self, key: RoundKey) -> tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]] | None:
        """Compile (in the warm-ups) and capture the round of ``key``; the state restored after each
        warm-up and after the capture (module docstring). Its seconds count in ``compile_s`` (the
        rounds' own; ``RowBatch.compile_s`` adds the plain steps'). A capture that fails warns, and rounds run eagerly from then on."""
        t0 = time.perf_counter()
        restore = self._snapshot()

        def warm() -> None:
            restore()
            self._round(*key)

        try:
            graph, out = capture(lambda: self._round(*key), self.engine._pool, warm=warm)
        except RuntimeError as e:  # an op a graph cannot hold: the same rounds, eagerly
            warnings.warn(f"batched speculative rounds: CUDA graph capture failed, running them eagerly: {e}",
                          stacklevel=3)
            self.cuda_graphs = False
            restore()
            return None
        restore()
        torch.cuda.synchronize(self.engine.device)
        self._graphs[key] = (graph, out)
        self._done.add(key)
        self.compile_s += time.perf_counter() - t0
        return graph, out

    def _round(self, n: int, draft: TreeSpec, mode: str, n_keys: int) -> tuple[Tensor, Tensor]:
        """The round itself (what the graphs capture): no host reads, shapes fixed by the arguments
        (``draft`` as :meth:`check` returns it)."""
        st = self.engine.state
        assert st is not None
        if draft.top_k > 1:  # eyas.engine.row_trees' round
            tree = draft_tree(self, st, n, draft)
            logits, features = self.verify_tree(st, n, tree, n_keys)
            if mode == "greedy":
                tokens, accepted, path = accept_tree(tree, logits, draft.depth)
            else:
                tokens, accepted, path = accept_tree_sampled(st, n, tree, logits, draft.depth, mode, _SALT)
            e = self.engine
            move_path_entries(e.keys[:, :n], e.values[:, :n], st.pos[:n], path)
            self.reread(st, n, tokens, features.gather(1, path[..., None].expand(-1, -1, features.shape[-1])), accepted)
            commit_chain(st, n, tokens, accepted)
            return tokens, accepted
        drafts, q = self.draft(st, n, draft.depth, mode)
        logits, features = self.verify(st, n, torch.cat([st.ids[:n, None], drafts], 1), n_keys)
        tokens, accepted = accept_chain(st, n, drafts, q, logits, mode)
        self.reread(st, n, tokens, features, accepted)
        commit_chain(st, n, tokens, accepted)
        return tokens, accepted


def accept_chain(st: Rows, n: int, drafts: Tensor, q: Tensor | None, logits: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """Acceptance of rows 0..n-1 (module docstring, accept): drafts [n, g], q [n, g, V] or None,
    logits [n, g + 1, V]. Returns (tokens [n, g + 1]: d_1 .. d_a, then the bonus, then anything;
    accepted a [n])."""
    g = drafts.shape[1]
    target = logits.argmax(-1)  # [n, g + 1]
    a = (drafts == target[:, :g]).long().cumprod(-1).sum(-1)
    if mode != "greedy":
        assert q is not None
        p = row_probabilities(logits, st.temperature[:n], st.drop_mass[:n], mode == "top_p")  # [n, g + 1, V]
        key, count0 = st.key[:n] ^ _SALT, st.n_gen[:n] * 64
        p_d = p[:, :g].gather(-1, drafts[..., None])[..., 0]
        q_d = q.gather(-1, drafts[..., None])[..., 0]
        u = counter_uniform(key[:, None], count0[:, None] + 32 + torch.arange(g, device=drafts.device)[None, :])
        a_sampled = (u * q_d < p_d).long().cumprod(-1).sum(-1)  # accept d_{i+1} w.p. min(1, p/q)
        residual = torch.cat([(p[:, :g] - q).clamp(min=0), p[:, g:]], 1)  # [n, g + 1, V]
        rows = torch.arange(n, device=drafts.device)
        r = residual[rows, a_sampled]
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, p[rows, a_sampled])  # p == q there: draw from p
        bonus = draw(r, counter_uniform(key, count0 + 63))
        sampled = torch.cat([drafts, bonus[:, None]], 1).scatter(1, a_sampled[:, None], bonus[:, None])
        greedy = st.greedy[:n]
        a = torch.where(greedy, a, a_sampled)
        chosen = torch.cat([drafts, target[:, g:]], 1).scatter(1, a[:, None], target.gather(1, a[:, None]))
        return torch.where(greedy[:, None], chosen, sampled), a
    tokens = torch.cat([drafts, target[:, g:]], 1).scatter(1, a[:, None], target.gather(1, a[:, None]))
    return tokens, a


def commit_chain(st: Rows, n: int, tokens: Tensor, accepted: Tensor) -> None:
    """The rows' state after a round (module docstring, commit), in place; idle rows keep theirs."""
    active = st.active[:n]
    k = torch.where(active, accepted + 1, 0)
    within = torch.arange(tokens.shape[1], device=tokens.device)[None, :] <= accepted[:, None]
    eos = (st.is_eos[tokens] & within).any(-1)
    n_gen = st.n_gen[:n] + k
    st.ids[:n] = torch.where(active, tokens.gather(1, accepted[:, None])[:, 0], st.ids[:n])
    st.pos[:n] += k
    st.n_gen[:n] = n_gen
    st.active[:n] = active & ~eos & (n_gen < st.limit[:n])
