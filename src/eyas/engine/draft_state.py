"""The drafter's side of a round: its static KV cache, the committed entries it has read, and the
drafting of a tree (EAGLE-2's dynamic expansion) from its root.

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

On the device. Every tensor of a round stays there: candidates are grown with tensor top-k and
stable sorts (ties keep creation order), the committed length enters as a device tensor, and the
tree comes out as tensors (:class:`~eyas.engine.tree.DraftTree`), so verification and acceptance
read nothing back. Shapes are fixed by (spec, depth): a Gumbel draw past a distribution's support
(a row with fewer than top_k tokens of positive probability) stays in the tree as a padding node
(``valid`` False, never accepted), and the cap ``total_tokens`` counts candidates, valid or not, in
creation order. The greedy draft (which sampled requests with top-k drafts share) is one function
of tensors, captured as one CUDA graph per (spec, depth) on a GPU.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor

from eyas.drafter.model import Eagle3Drafter
from eyas.engine.draft_kernels import check_kernels, fuse_drafter_projections, kernel_step
from eyas.engine.graphs import CompiledOrEager, StepGraphs
from eyas.engine.sampling import (
    GREEDY, CounterStream, Draws, SamplingParams, filtered_probabilities, gumbel_top_k, probabilities,
)
from eyas.engine.tree import DraftTree, TreeSpec, by_sort, largest, top_k


# Rows per step of a prompt's read with fixed shapes (DraftState._read_in_chunks): the most the Triton
# products take (matvec.MAX_ROWS), so the drafter's kernels run it too.
PROMPT_CHUNK = 64


class DraftState:
    """The drafter, its static KV cache, and its output at the last committed entry (the root).

    Every step stays on the device: ``extend`` takes the accepted tokens as a tensor, and ``draft``
    grows the tree with tensor top-k and sorts (EAGLE-2's dynamic tree), so a round reads nothing
    back to the host until acceptance has decided."""

    def __init__(self, drafter: Eagle3Drafter, max_len: int, fixed_shapes: bool = False,
                 cuda_graphs: bool = False, extend_bucket: int = 0, compile: bool | str | Callable | None = None,
                 kernels: str = "torch") -> None:
        """max_len: cache slots (committed entries + one round's scratch). Fixed shapes: ``extend``
        of n <= extend_bucket tokens runs padded to extend_bucket (the re-read after a round), so
        with ``cuda_graphs`` (on a GPU) both of the drafter's round steps are captured once per
        shape and replayed (``graphs.StepGraphs``).

        compile: the round functions of a pipelined round compiled whole (``graphs.CompiledOrEager``)
        before they are captured: the greedy draft of the tree's full depth (which sampled requests
        with top-k drafts share; a Gumbel draft of full depth likewise, its temperature an input) (each level's expansion
        step with the top-k, scores, masks and tree tensors around it: some 90 small ops a draft,
        each a kernel of its own eagerly, fused by inductor into a few) and the re-read of the
        accepted tokens. None = with inductor where CUDA graphs are on, False = never, True =
        inductor, a string = that torch.compile backend (the CPU tests use "aot_eager": the same
        tracing, no C compiler). Everything else runs the steps eagerly (captured, with graphs):
        a prompt's read (in chunks of PROMPT_CHUNK rows, one function), Gumbel drafts given their
        sampling parameters as host numbers (one graph per temperature), and a request's last,
        shallower rounds, where a compilation of their own would take seconds inside the request.

        kernels: what the fixed-shape steps run. "torch": the drafter's forward (inside the compiled
        round functions, inductor makes it 20 kernels a step on a GPU). "triton":
        :func:`eyas.engine.draft_kernels.draft_step`, the fast target's Triton kernels (products with
        the norm before them and the residual add after, split-KV attention that also writes the
        cache: 10 kernels a step); it needs Triton, a
        GPU or ``TRITON_INTERPRET=1``, and a head dimension the attention kernel supports (refused
        otherwise, :class:`~eyas.engine.draft_kernels.UnsupportedDraftKernels`), and first stacks the
        drafter's q/k/v and gate/up weights in place (``fuse_drafter_projections``: views, no
        second copy; ``unfused_reason`` says why not, when not). An exact-shape extend (without
        fixed shapes), and a step of more rows than the kernels take (64), run the drafter's
        forward either way."""
        check_kernels(kernels, drafter)
        self.kernels = kernels
        self.unfused_reason = fuse_drafter_projections(drafter) if kernels == "triton" else None
        if self.unfused_reason is not None:
            warnings.warn(f"DraftState: the drafter's q/k/v and gate/up not stacked ({self.unfused_reason}); its "
                          f"steps run them as 5 products instead of 2", stacklevel=2)
        self.drafter = drafter
        self.device = drafter.fc.weight.device
        self.dtype = drafter.fc.weight.dtype
        self.cache = drafter.new_cache(1, max_len)
        self.max_len = max_len
        self.length = 0  # committed entries (a host int)
        vd = drafter.config.draft_vocab_size
        self.draft_ids = drafter.draft_to_target(torch.arange(vd, device=self.device))  # [Vd] target ids
        self.positions = torch.arange(max_len, device=self.device)  # [max_len] cache slot numbers
        self.root_token: Tensor | None = None  # long [1]: x_m
        self.root_logits: Tensor | None = None  # [Vd]
        self.root_hidden: Tensor | None = None  # [H]
        self.extend_bucket = int(extend_bucket) if (fixed_shapes or cuda_graphs) else 0
        graphs = cuda_graphs and self.device.type == "cuda"
        # the step from target features (extend, re-read) and from fed-back states (expansion)
        self._eager = {True: self._step_fn(True), False: self._step_fn(False)}
        backend = ("inductor" if graphs else None) if compile is None else (
            "inductor" if compile is True else (compile or None))
        # the round functions' compiler (see compile above); the steps alone run eagerly
        self.round_backend = backend if backend and self.extend_bucket else None
        self.compiled_rounds: dict[str, CompiledOrEager] = {}  # name -> the compiled round function
        # a non-pipelined round's re-read (the extend of extend_bucket entries), captured; the expansion
        # step runs inside the captured draft and the re-read inside its own function
        self._extend_step = StepGraphs(self._eager[True]) if graphs else self._eager[True]
        self.graphs = graphs
        # drafts of greedy or CounterStream sampling, per (spec, depth, sampling)
        self._drafts: dict[tuple, Callable[..., tuple[Tensor, ...]]] = {}
        self._reread: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None  # the pipelined re-read
        self._prompt_step: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None  # a prompt's chunks

    def reset(self) -> None:
        """Empty the cache for a new request (stale entries are never attended; graphs stay)."""
        self.length = 0
        self.root_token = self.root_logits = self.root_hidden = None

    def _step_fn(self, from_target: bool):
        """The step ``fn(tokens [1, r], hidden [1, r, W], positions [1, r], slots [r], mask [1, 1, r,
        max_len]) -> (logits [1, r, Vd], hidden [1, r, H])`` that writes the step's K/V into the cache
        at ``slots``: the drafter's forward, or its Triton step (``kernels``)."""
        if self.kernels == "triton":
            return kernel_step(self.drafter, self.cache, from_target)

        def fn(tokens: Tensor, hidden: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
            out = self.drafter(tokens, hidden, positions, cache=self.cache, cache_slots=slots, mask=mask,
                               from_target=from_target)
            return out.logits, out.hidden
        return fn

    def _extend_eager(self, tokens: Tensor, features: Tensor, slots: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """An extend of exact shape (no graph): every entry writes its K/V, but only the last one's
        logits are used (the root's), so the lm_head runs on that row alone: [Vd] and [H]."""
        n = tokens.shape[0]
        last = torch.zeros(1, n, dtype=torch.bool, device=self.device)
        last[0, n - 1] = True
        out = self.drafter(tokens[None], features[None], slots[None], cache=self.cache, cache_slots=slots,
                           mask=mask[None, None], from_target=True, logits_at=last)
        return out.logits[0], out.hidden[0, n - 1]

    @torch.no_grad()
    def extend(self, tokens: Tensor | list[int], features: Tensor) -> None:
        """Commit n entries: entry length+i reads (features[i], tokens[i]) at position length+i.

        tokens: long [n] (or a list), the committed tokens that follow the target positions of
        ``features`` [n, S*H_t], i.e. x_{t+1} for feature f_t. With fixed shapes, n <= extend_bucket
        runs padded: pad i writes the scratch slot length+i (which drafting overwrites before it
        is attended) and attends only itself; no real entry attends a pad. A longer n (a prompt)
        runs in chunks of PROMPT_CHUNK rows, padded the same way (:meth:`_read_in_chunks`), where
        the last chunk's pads fit in the cache; else, and without fixed shapes, in one exact-shape
        step.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).flatten()
        n = tokens.shape[0]
        features = features.to(self.dtype)
        if n > self.extend_bucket > 0 and self.length + -(-n // PROMPT_CHUNK) * PROMPT_CHUNK <= self.max_len:
            self._read_in_chunks(tokens, features)  # a prompt, with fixed shapes: its chunks' pads fit
            return
        B = self.extend_bucket if n <= self.extend_bucket else n
        if B > n:
            tokens = torch.cat([tokens, tokens.new_zeros(B - n)])
            features = torch.cat([features, features.new_zeros(B - n, features.shape[1])])
        slots = self.positions[self.length:self.length + B]
        # causal over the committed cache: entry s sees entries 0..s; a pad sees itself
        mask = self.positions[None] <= slots[:, None]  # [B, max_len]
        mask[n:] = self.positions[None] == slots[n:, None]
        self.root_token = tokens[n - 1:n]
        if B == self.extend_bucket:  # the fixed-shape (graphed) step
            logits, hidden = self._extend_step(tokens[None], features[None], slots[None], slots, mask[None, None])
            # cloned: a graph's outputs are overwritten by its next replay
            self.root_logits, self.root_hidden = logits[0, n - 1].clone(), hidden[0, n - 1].clone()
        else:  # exact shapes (every extend without fixed shapes; a prompt too long for the chunks' pads), eagerly
            self.root_logits, self.root_hidden = self._extend_eager(tokens, features, slots, mask)
        self.length += n

    def _read_in_chunks(self, tokens: Tensor, features: Tensor) -> None:
        """Commit n > extend_bucket entries (a prompt) in chunks of PROMPT_CHUNK rows, each one
        replay of the same fixed-shape function (:meth:`_reread_fn`, captured once on a GPU): entry
        length+i reads (features[i], tokens[i]) at position length+i and attends entries 0 .. length+i,
        exactly as one exact-shape step of n rows, since a chunk's rows see the chunks before it in
        the cache. The last chunk is padded: its pads write scratch slots past the new committed end
        (overwritten before any query attends them) and attend only themselves. The caller checks
        that the pads fit in the cache.

        Why: the exact-shape step ran eagerly, a new shape each prompt, launching the drafter's
        forward one kernel at a time: on the H200 a SmolLM2 request's spec-only start fell from
        about 2.2 to 0.8 ms with the chunks (``benchmarks/results/2026-12-03-prompt-read-h200.md``). Chunks of
        PROMPT_CHUNK rows also run through the Triton kernels (``kernels="triton"``), which take at
        most that many, and keep the step's attention scores [rows, max_len] small."""
        if self._prompt_step is None:  # not compiled: a compilation would cost seconds, a capture milliseconds
            self._prompt_step = StepGraphs(self._reread_fn) if self.graphs else self._reread_fn
        n, C = tokens.shape[0], PROMPT_CHUNK
        pad = -n % C
        tokens = torch.cat([tokens, tokens.new_zeros(pad)])  # [chunks * C]
        features = torch.cat([features, features.new_zeros(pad, features.shape[1])])
        for start in range(0, n, C):
            real = min(C, n - start)
            # device scalars from the position table (no host-to-device copy): the rows to commit, the length
            root = self._prompt_step(tokens[start:start + C], features[start:start + C], self.positions[real],
                                     self.positions[self.length + start])
        # cloned: the graph's outputs are overwritten by the next request's read
        self.root_token, self.root_logits, self.root_hidden = (t.clone() for t in root)
        self.length += n

    @torch.no_grad()
    def reread(self, tokens: Tensor, features: Tensor, n: Tensor, length: Tensor) -> None:
        """The re-read of a round's accepted tokens when only the device knows how many there are
        (a pipelined round: the host reads the verdict while the drafter already works).

        tokens long [B] and features [B, S*H_t] with B = ``extend_bucket`` (the tree's depth + 1);
        n long [] (1 <= n <= B): entries length+i read (features[i], tokens[i]) for i < n, exactly
        as ``extend``; rows i >= n are pads (they write the scratch slots past the new committed
        end, which drafting overwrites before any query attends them, and attend only themselves).
        length long []: the committed length (the host's ``self.length``, on the device).

        The root becomes entry length+n-1's output; ``self.length`` does NOT move: the host adds n
        with :meth:`advance` once it has read it. One function of device tensors with fixed shapes,
        captured as one CUDA graph on a GPU."""
        if self._reread is None:
            fn = self._reread_fn
            if self.round_backend is not None:
                fn = self._compiled_round("re-read", fn)
            self._reread = StepGraphs(fn) if self.graphs else fn
        self.root_token, self.root_logits, self.root_hidden = self._reread(tokens, features.to(self.dtype), n, length)

    def _compiled_round(self, name: str, fn: Callable[..., tuple[Tensor, ...]]) -> CompiledOrEager:
        self.compiled_rounds[name] = CompiledOrEager(fn, self.round_backend, f"drafter's {name}")
        return self.compiled_rounds[name]

    def _reread_fn(self, tokens: Tensor, features: Tensor, n: Tensor, length: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B = tokens.shape[0]
        rows = torch.arange(B, device=self.device)
        slots = length + rows  # [B]
        causal = self.positions[None] <= slots[:, None]  # [B, max_len]: committed entries and earlier rows
        alone = self.positions[None] == slots[:, None]  # a pad sees itself only
        mask = torch.where((rows < n)[:, None], causal, alone)
        step = self._eager[True]  # inside this function's graph (and compilation): not the extend's graph
        logits, hidden = step(tokens[None], features[None], slots[None], slots, mask[None, None])
        last = (n - 1).view(1)  # a [1] index: a 0-dim one would be read back to the host
        return tokens.index_select(0, last), logits[0].index_select(0, last)[0], hidden[0].index_select(0, last)[0]

    @torch.no_grad()
    def warm(self, spec: TreeSpec, vocab_size: int) -> None:
        """Make, now, every fixed-shape function a greedy request with ``spec`` calls: the prompt's
        read in chunks, the extend of ``extend_bucket`` entries (a non-pipelined round's re-read),
        the draft at every depth 1 .. spec.depth (the full depth compiled, the shallower ones of a
        request's last rounds captured eagerly) and the pipelined re-read. Each is compiled,
        captured or JIT-compiled on its first call; without this a request pays them where it
        first needs them, the shallower drafts in
        its last rounds: on the H200 trees new to the process averaged 7-26 ms of drafting a round
        over their first four prompts, and 0.30-0.66 ms once warmed so
        (``benchmarks/results/2026-12-02-few-row-tilings-h200.md``). The calls run on zeros from entry 0;
        the state is then emptied (:meth:`reset`), so no request sees them. What a pipelined round
        reads in place (``graphs.StepGraphs``) is left to its first round: a graph of the re-read
        on the acceptance's outputs, and of the draft on the re-read's, per buffer of the target's
        logits (its key bucket), captured then (milliseconds, nothing compiled)."""
        if not self.extend_bucket:
            return
        B, width = self.extend_bucket, self.drafter.fc.weight.shape[1]
        # a prompt's read (in chunks: _read_in_chunks), then the extend of B entries
        self.extend(torch.zeros(B + 1, dtype=torch.long, device=self.device),
                    torch.zeros(B + 1, width, dtype=self.dtype, device=self.device))
        tokens = torch.zeros(B, dtype=torch.long, device=self.device)
        features = torch.zeros(B, width, dtype=self.dtype, device=self.device)
        self.extend(tokens, features)
        for depth in range(1, spec.depth + 1):
            self.draft(spec, depth, GREEDY, None, vocab_size)
        self.reread(tokens, features, torch.ones((), dtype=torch.long, device=self.device),
                    torch.zeros((), dtype=torch.long, device=self.device))
        self.reset()

    def advance(self, n: int) -> None:
        """The host's side of :meth:`reread`: n entries were committed."""
        self.length += n

    @torch.no_grad()
    def draft(self, spec: TreeSpec, depth: int, sampling: SamplingParams, generator: Draws, vocab_size: int,
              length: Tensor | None = None, params: Tensor | None = None) -> DraftTree:
        """Draft a tree of at most ``depth`` (<= spec.depth) levels from the root (see
        :meth:`_grow`). vocab_size: the target's, for the proposals q. depth 0 gives the root alone.

        The committed length enters as a device tensor, so the whole draft has shapes fixed by
        (spec, depth): with CUDA graphs it is captured once per (spec, depth) and replayed, one
        launch for the round's drafting. Sampling draws from ``generator``: a CounterStream's draws
        are taken at the committed length (``CounterStream.at``) inside the captured draft; a
        torch.Generator's run eagerly. With ``params`` (``SamplingParams.as_tensor``: temperature,
        top_p, top_k on the device) a streamed draft takes them as an input: one graph (compiled like
        the greedy draft at full depth) for every temperature; without, one graph per sampling
        parameters, not compiled. ``length`` (long [] on the device): the committed length to draft
        after, when the host does not know it yet (a pipelined round, after :meth:`reread`); default
        ``self.length``."""
        K = min(spec.top_k, self.drafter.config.draft_vocab_size)
        if depth == 0:  # sampling: a zero proposal row (no children), so that the tree's tensors are all there
            q = None if sampling.greedy else torch.zeros(1, vocab_size, device=self.device)
            return DraftTree.from_parents(self.root_token, torch.full((1,), -1, device=self.device), 0, K, proposals=q)
        m = torch.full((), self.length, dtype=torch.long, device=self.device) if length is None else length
        inputs = (m, self.root_token, self.root_logits, self.root_hidden)
        streamed = not sampling.greedy and isinstance(generator, CounterStream)
        if sampling.greedy or streamed:  # one function of device tensors, captured
            filters = sampling.filters(self.drafter.config.draft_vocab_size)  # q is over the draft vocabulary
            valued = streamed and params is not None  # the parameters an input: one graph for every temperature
            key = (spec, depth, "gumbel", filters) if valued else (spec, depth, sampling)
            if key not in self._drafts:
                # compiled: a draft of full depth, every pipelined round's (see __init__), greedy or with the
                # sampling parameters as an input (a compilation per temperature would cost seconds mid-request)
                whole = (sampling.greedy or valued) and depth == spec.depth and self.round_backend is not None
                select = by_sort if whole else largest

                def grow(*x: Tensor) -> tuple[Tensor, ...]:  # inputs, then (sampled) the stream's key and params
                    draws = CounterStream(x[4]).at(x[0]) if streamed else None
                    q_of = None if not valued else (
                        lambda logits: filtered_probabilities(logits, x[5][0], x[5][1], x[5][2], *filters))
                    return self._grow(spec, depth, sampling, draws, vocab_size, *x[:4], select=select, q_of=q_of)
                name = f"draft {spec}" if sampling.greedy else f"gumbel draft {spec}"
                fn = self._compiled_round(name, grow) if whole else grow
                self._drafts[key] = StepGraphs(fn) if self.graphs else fn
            extra = ((generator.key,) + ((params,) if valued else ())) if streamed else ()
            parts = self._drafts[key](*inputs, *extra)
        else:  # a torch.Generator's draws: eagerly
            parts = self._grow(spec, depth, sampling, generator, vocab_size, *inputs)
        tokens, parents, depths, mask, children, valid, levels, proposals = parts
        return DraftTree(tokens=tokens, parents=parents, depths=depths, mask=mask, children=children, valid=valid,
                         depth=int(levels.shape[0]), proposals=None if sampling.greedy else proposals)

    def _grow(self, spec: TreeSpec, depth: int, sampling: SamplingParams, generator: Draws,
              vocab_size: int, m: Tensor, root_token: Tensor, root_logits: Tensor,
              root_hidden: Tensor, select: Callable[[Tensor, int], tuple[Tensor, Tensor]] = largest,
              q_of: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, ...]:
        """The tree's tensors from the root (m: long [], the committed length; root_token [1],
        root_logits [Vd], root_hidden [H]); tensor ops only, no host read, shapes fixed by (spec,
        depth) -- a CUDA graph can hold it.

        Candidates are numbered in creation order (level by level; within a level, by the rank of
        their parent, then the parent's draw order), which is topological. Per level, r expanded
        nodes (the root, then the frontier) each propose K children: [r, K] tokens and cumulative
        scores (log q summed along the path; -inf marks a draw past q's support, and every
        descendant of such a node). Sorting is stable, so ties keep creation order and a parent,
        whose score is never below its child's, always ranks before it. ``select`` takes each
        node's K best children (``largest``: torch.topk; ``by_sort`` in a compiled draft): the same
        values, and among children of equal scores possibly another pick.

        Returns tokens, parents, depths, mask, children, valid (DraftTree's fields), a [levels]
        placeholder whose length is the number of levels drafted, and the proposals (sampling; a
        [1] placeholder when greedy)."""
        greedy = sampling.greedy
        K = min(spec.top_k, self.drafter.config.draft_vocab_size)
        total = int(spec.total_tokens)  # draft nodes kept (greedy) or drawn at most (sampling)
        dev = self.device
        cand_tokens, cand_parents, cand_scores = [], [], []  # per level, [n_d] each
        q_nodes, q_rows = [], []  # sampling: the expanded nodes (candidate numbers) and their q [r, Vd]
        count = 0  # candidates so far; candidate j is node number j + 1 (the root is 0)
        logits = root_logits[None]  # [r, Vd] the expanded nodes' drafter outputs
        hidden = root_hidden[None]  # [r, H]
        score = torch.zeros(1, device=dev)  # [r] their cumulative scores
        number = torch.zeros(1, dtype=torch.long, device=dev)  # [r] their node numbers (root = 0)
        rows = (self.positions < m)[None]  # [r, max_len] the cache entries each may attend
        scratch = 0  # scratch slots written so far this round (slot m + scratch is next)
        for d in range(1, depth + 1):
            # 1. K children of each expanded node
            if greedy:
                log_q, drawn = top_k(torch.log_softmax(logits.float(), dim=-1), K, select=select)  # [r, K] each
            else:
                q = q_of(logits) if q_of is not None else probabilities(logits, sampling)  # [r, Vd]
                drawn = gumbel_top_k(q, K, generator, tag=d)  # [r, K] draw order; past the support: q = 0
                log_q = q.gather(-1, drawn).log()
                q_nodes.append(number), q_rows.append(q)
            n = drawn.numel() if greedy else min(drawn.numel(), total - count)  # sampling: cap the draws
            if n <= 0:
                break
            level_scores = (score[:, None] + log_q).flatten()[:n]
            cand_tokens.append(self.draft_ids[drawn].flatten()[:n])
            cand_parents.append(number.repeat_interleave(K)[:n])
            cand_scores.append(level_scores)
            first = count + 1
            count += n
            if d == depth:
                break
            # 2. the K best new nodes get their own drafter step (batched: one forward)
            order = level_scores.sort(descending=True, stable=True).indices[:K]  # [r']
            r = order.shape[0]
            parent_row = order // K
            slots = m + scratch + torch.arange(r, device=dev)  # [r']
            scratch += r
            # the parent's visibility (committed + its ancestors), plus the node itself
            rows = rows[parent_row] | (self.positions[None] == slots[:, None])  # [r', max_len]
            logits, hidden = self._eager[False](cand_tokens[-1][order][None], hidden[parent_row][None],
                                                (m - 1 + d).expand(1, r), slots, rows[None, None])
            logits, hidden = logits[0], hidden[0]
            score, number = level_scores[order], first + order

        levels = len(cand_tokens)
        tokens, parents, scores = torch.cat(cand_tokens), torch.cat(cand_parents), torch.cat(cand_scores)
        if greedy:  # EAGLE-2: keep the `total` best candidates, in creation order
            chosen = scores.sort(descending=True, stable=True).indices[:total].sort().values
        else:  # sampling keeps every draw (module docstring)
            chosen = torch.arange(count, device=dev)
        N = chosen.shape[0]
        # candidate number -> node number (-1: not kept); built from device tensors only: a graph
        # cannot hold a copy from a host scalar
        renumber = torch.cat([torch.zeros(1, dtype=torch.long, device=dev),
                              torch.full((count,), -1, dtype=torch.long, device=dev)])
        renumber[chosen + 1] = torch.arange(1, N + 1, device=dev)
        node_tokens = torch.cat([root_token, tokens[chosen]])
        node_parents = torch.cat([torch.full((1,), -1, device=dev), renumber[parents[chosen]]])
        valid = torch.cat([torch.ones(1, dtype=torch.bool, device=dev), scores[chosen] > float("-inf")])
        proposals = torch.zeros(1, device=dev)
        if not greedy:
            # q of each expanded node over the target vocabulary, in its node's row; expanded nodes
            # that are not in the tree (their draws fell past the cap) go to a spare last row
            proposals = torch.zeros(N + 2, vocab_size, device=dev)
            node = renumber[torch.cat(q_nodes)]
            node = torch.where(node >= 0, node, N + 1)
            proposals[node[:, None], self.draft_ids[None, :]] = torch.cat(q_rows).float()
            proposals = proposals[:N + 1]
        tree = DraftTree.from_parents(node_tokens, node_parents, levels, K, valid=valid)  # depths, mask, children
        return (tree.tokens, tree.parents, tree.depths, tree.mask, tree.children, tree.valid,
                torch.empty(levels, device=dev), proposals)
