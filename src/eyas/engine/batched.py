"""Batched generation on eyas' own Llama-family forward: R rows decoding together, with continuous
batching (``eyas regenerate --engine fast``, :class:`BatchedLlama`).

Same models as :func:`eyas.engine.llama.supports` (Llama, Mistral without a sliding window, Qwen2,
Qwen3; SmolLM2 is a Llama), same weights (gathered once by :class:`~eyas.engine.llama.LlamaTarget`
into :class:`~eyas.engine.llama.BlockWeights`, references, no copies) and the same numerics as
``llama._layer``: RMSNorm in float32 (:func:`~eyas.engine.llama.rms_norm`), rotate-half rope
(:func:`~eyas.engine.llama.rope`), grouped-query attention with the scores q.k in the model's
dtype, scaled and softmaxed in float32, cast back. The attention's input projections and the MLP are
read in one place each (``batched_steps._project_qkv``, ``_mlp``), one GEMM each on the target's fused
q/k/v and gate/up weights (:func:`~eyas.engine.llama.fuse_projections`).

State. Shapes: L blocks, R rows, Hkv key/value heads, D head dim, C the cache's capacity (the
longest prompt + max_new_tokens, grown when a longer prompt comes), M the answers' room.

    keys, values  [L, R, Hkv, C, D]   row r, entry i = the key/value of the token at position i of the
                                     prompt answered in row r (its prompt, then its answer so far)
    ids           [R] long            the token row r feeds at the next step (its last generated one)
    pos           [R] long            that token's position (= the row's cache length before the step)
    active        [R] bool            the row is still generating
    n_gen         [R] long            tokens generated so far (the first one by the prefill)
    out           [R, M+1] long       the generated tokens; column M is a bin for idle rows' writes

A row holds one prompt from its prefill to the step that ends its answer (an eos token, or
max_new_tokens tokens); an idle row (none yet, or finished) still runs through every step with its
stale state, and what it writes (its own cache entry at its own position, the bin column) is never
read. All of the state lives on the device; the host only knows upper bounds of it between syncs.

Algorithm (:meth:`BatchedLlama.run`):

1. Prompts wait in input order. Refill: when at least ``refill_rows`` rows are free (or all the
   waiting prompts fit, or no row is busy), the next waiting prompts are prefilled into the free
   rows together, in groups bounded by a token and an attention-score budget. A prefill group is [g,
   P] tokens right-padded to its longest prompt; a prompt attends itself causally (its row's cache is
   empty, and no real token attends a pad), writes its keys/values into entries 0..P-1 of its own row
   (a pad's entries lie past the row's length: never attended, overwritten as the answer grows), and
   its last real token's logits give the answer's first token.
2. Decode steps: every row feeds ``ids`` at ``pos``, writes its key/value into its own entry
   ``pos``, attends entries 0..pos of its own row (a mask over the first K entries), and the chosen
   token is recorded in ``out``; ``active`` drops at an eos token or at max_new_tokens. K is the
   smallest bucket of a ladder (128, 192, 256, 384, ... up to C) above the longest row's length,
   which the host bounds without reading the device (a row's position grows by at most one a step),
   so short contexts do not pay for the capacity.
3. Every ``sync_every`` steps (fewer when every row must have finished sooner) the host reads
   ``n_gen`` and ``active`` once, takes the finished rows' answers out of ``out``, frees their rows
   and refills (1.). Answers are returned per prompt in input order: (ids without the eos token,
   ``"eos"`` | ``"length"``), as :class:`eyas.data.generation.BatchGenerator` says.

Fixed shapes. A decode step's shapes depend only on (R, K, C, M) and on the sampling mode (greedy;
sampled; sampled with top-p), never on which rows are busy or how long they are, and no device value
is read inside it: on a GPU its three functions (prologue, block, epilogue) are compiled with
inductor (``torch.compile(fullgraph=True, dynamic=False)`` through
:class:`~eyas.engine.graphs.CompiledOrEager`; every block shares its bucket's compilation) and the
whole step, all blocks and the state's update included, is captured as one CUDA graph per (K, mode)
and replayed. On a CPU the same functions run eagerly, so the tests check the code the GPU compiles.
A bucket's first use compiles and captures it (``compile_s``; :mod:`eyas.engine.batched_shapes`);
its warm-up runs are undone (the state is restored from a snapshot; the only other write, a row's
entry at its own position, is written again by the real step). Prefills (shapes vary with the
group) run eagerly everywhere.

Sampling. ``temperature`` > 0 draws from Hugging Face's distribution (temperature, then top-p: the
order of :func:`eyas.engine.sampling.probabilities`) by the inverse CDF of one uniform per row and
token. The uniform of prompt i's j-th token is a stateless hash of (key_i, j), where the keys come
from a ``torch.Generator`` seeded with ``seed`` (one per prompt, in input order): a sampled answer
depends on the seed, its prompt's index and its logits only, not on the rows, the refills or the
other prompts, and nothing random runs on a generator inside the graph.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from eyas.convention.boundaries import CaptureSpec
from eyas.data.generation import Answer, BatchParams
from eyas.engine.batch_engines import BatchResult, fast_unsupported
from eyas.engine.batched_shapes import StepShapes
from eyas.engine.batched_steps import (MODES, Rows, choose, decode_epilogue, decode_layer, decode_prologue, key_ladder,
                                       model_constants, prefill_head, prefill_layer, prefill_prologue)
from eyas.engine.graphs import CompiledOrEager
from eyas.engine.llama import BlockWeights, LlamaTarget, UnsupportedTarget
from eyas.errors import EyasError
from eyas.targets.structure import find_decoder_blocks


class BatchCapacityError(EyasError, ValueError):
    """The KV cache for these rows and this capacity does not fit in the device's free memory."""



# -- the engine ---------------------------------------------------------------------------------------


class BatchedLlama(StepShapes):
    """Batched generation with continuous batching on a Llama-family model (module docstring); a
    :class:`eyas.data.generation.BatchGenerator` (``name = "fast"``).

    Args:
        model: a Hugging Face Llama-family causal LM on one device (:func:`fast_unsupported`); its
            weights are referenced, not copied (build this after moving or converting the model).
        rows: R, the rows decoded together.
        capacity: the cache's positions per row, if known (else sized by :meth:`reserve` or the first
            call); grown when a longer prompt comes.
        key_buckets: the decode step's key lengths (default :func:`key_ladder`); the capacity is
            always the last.
        compile, cuda_graphs: default on a GPU, off on a CPU. ``backend`` compiles with another
            torch.compile backend, also on a CPU (tests trace the step with ``aot_eager``).
        sync_every: decode steps between host reads of the state.
        refill_rows: free rows that trigger a refill (default R // 8, at least 1).
        prefill_tokens, prefill_scores: a prefill group's budget: g x P tokens, and g x Hq x P x P
            attention scores (computed by the fused SDPA, which materialises them only where it
            falls back to its math kernel).
        progress: a tqdm bar of answered prompts per call.
    """

    name = "fast"

    def __init__(self, model: nn.Module, rows: int = 256, capacity: int | None = None, *,
                 key_buckets: Sequence[int] | None = None, compile: bool | None = None,
                 cuda_graphs: bool | None = None, backend: str | Callable[..., Any] | None = None,
                 sync_every: int = 16, refill_rows: int | None = None, prefill_tokens: int = 16384,
                 prefill_scores: int = 1 << 30, progress: bool = False) -> None:
        why = fast_unsupported(model)
        if why is not None:
            raise UnsupportedTarget(f"fast engine: {why}; use the hf engine (Hugging Face generate)")
        if rows < 1 or sync_every < 1:
            raise ValueError(f"rows, sync_every: expected >= 1, found {rows}, {sync_every}")
        L = len(find_decoder_blocks(model))
        # LlamaTarget gathers the weights (references to the model's parameters) with a 1-entry cache.
        target = LlamaTarget(model, CaptureSpec((L,), L), max_length=1)
        self.weights: list[BlockWeights] = target.weights
        self.embed, self.inv_freq, self.norm_weight = target.embed_weight, target.inv_freq, target.norm_weight
        self.lm_head, self.lm_bias = target.lm_head_weight, target.lm_head_bias
        self.device, self.dtype, self.vocab_size = target.device, target.dtype, target.vocab_size
        self.num_blocks, self.num_heads = L, target.num_heads
        self.num_kv_heads, self.head_dim = target.num_kv_heads, target.head_dim
        c = model_constants(model, self.head_dim)
        self.constants = c  # eps, qk_eps, scaling, rope_scaling: what other steps on these weights need

        on_gpu = self.device.type == "cuda"
        self.cuda_graphs = bool(on_gpu if cuda_graphs is None else cuda_graphs) and on_gpu
        self.compile = bool(self.cuda_graphs if compile is None else compile) and (on_gpu or backend is not None)
        self.rows = int(rows)
        self.sync_every = int(sync_every)
        self.refill_rows = max(1, int(refill_rows if refill_rows is not None else self.rows // 8))
        self.prefill_tokens, self.prefill_scores = int(prefill_tokens), int(prefill_scores)
        self.key_buckets = None if key_buckets is None else sorted({int(b) for b in key_buckets})
        self.progress = progress

        layer_kw = dict(eps=c["eps"], qk_eps=c["qk_eps"], scaling=c["scaling"])
        self._prologue = functools.partial(decode_prologue, rope_scaling=c["rope_scaling"])
        self._layer = functools.partial(decode_layer, **layer_kw)
        self._epilogue = {m: functools.partial(decode_epilogue, eps=c["eps"], mode=m) for m in MODES}
        self._prefill_fns = (functools.partial(prefill_prologue, rope_scaling=c["rope_scaling"]),
                             functools.partial(prefill_layer, **layer_kw),
                             functools.partial(prefill_head, eps=c["eps"]))
        self.backend = backend or "inductor"  # what compiles the steps (other steps on these weights too)
        if self.compile:
            be = self.backend
            self._prologue = CompiledOrEager(self._prologue, be, "batched decode prologue")
            self._layer = CompiledOrEager(self._layer, be, "batched decode block")
            self._epilogue = {m: CompiledOrEager(f, be, f"batched decode epilogue ({m})")
                              for m, f in self._epilogue.items()}
        self.implementation = "+".join(["fast"] + ["compile"] * self.compile + ["cuda-graphs"] * self.cuda_graphs)

        self.capacity = 0  # C; the cache is allocated by reserve() or the first call
        self.keys = self.values = torch.empty(0, device=self.device)
        self.state: Rows | None = None
        # (K, mode), or (K, mode, n) for a step of the first n rows only -> its captured step
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._compiled: set[tuple] = set()  # the same keys, run compiled without graphs
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.compile_s = 0.0  # all compilation and capture so far
        self.taps: tuple[int, ...] = ()  # the boundaries each decode step records (tap())
        self.tapped = self.tapped_ids = torch.empty(0, device=self.device)
        self.last: BatchResult | None = None
        self.last_decode_steps = 0
        if capacity:
            self.ensure(int(capacity), 1)

    # -- the BatchGenerator interface ------------------------------------------------------------

    def reserve(self, max_prompt_tokens: int, max_new_tokens: int) -> None:
        self.ensure(max_prompt_tokens + max_new_tokens, max_new_tokens)

    def generate(self, prompts: list[list[int]], params: BatchParams) -> list[Answer]:
        result = self.run(prompts, params.max_new_tokens, params.eos_ids, params.temperature, params.top_p,
                          params.seed)
        return result.answers

    # -- state ------------------------------------------------------------------------------------

    def cache_bytes(self, capacity: int) -> int:
        """The KV cache's size for ``capacity`` positions per row."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_blocks * self.rows * self.num_kv_heads * capacity * self.head_dim * itemsize

    def ensure(self, capacity: int, max_new_tokens: int) -> None:
        """A cache of at least ``capacity`` positions per row and answers of ``max_new_tokens``
        tokens. Growing reallocates (1.5x at least, so later growths are rare) and drops the
        captured graphs (their buffers moved); compiled functions recompile for the new shapes."""
        if capacity > self.capacity:
            C = -(-max(capacity, self.capacity * 3 // 2) // 64) * 64
            self.keys = self.values = torch.empty(0, device=self.device)  # free the old cache first
            self._graphs.clear()
            self._compiled.clear()
            need = self.cache_bytes(C)
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                if need > 0.9 * free:
                    raise BatchCapacityError(
                        f"fast engine: the KV cache of {self.rows} rows x {C} positions needs {need / 2**30:.1f} GiB, "
                        f"{free / 2**30:.1f} GiB free on {self.device}: use fewer rows (--rows) or shorter "
                        f"prompts/answers (--max-prompt-tokens, --max-new-tokens)")
            shape = (self.num_blocks, self.rows, self.num_kv_heads, C, self.head_dim)
            self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.capacity = C
        if self.state is None or self.state.out.shape[1] - 1 < max_new_tokens:
            M = -(-max(max_new_tokens, 1) // 64) * 64
            R, dev = self.rows, self.device

            def longs() -> Tensor:
                return torch.zeros(R, dtype=torch.long, device=dev)

            self.state = Rows(ids=longs(), pos=longs(), active=torch.zeros(R, dtype=torch.bool, device=dev),
                              n_gen=longs(), out=torch.zeros(R, M + 1, dtype=torch.long, device=dev), limit=longs(),
                              key=longs(), temperature=torch.ones(R, device=dev), drop_mass=torch.zeros(R, device=dev),
                              is_eos=torch.zeros(self.vocab_size, dtype=torch.bool, device=dev),
                              greedy=torch.zeros(R, dtype=torch.bool, device=dev))
            self._graphs.clear()
            self._compiled.clear()

    def tap(self, boundaries: Sequence[int], slots: int) -> None:
        """Record, at every decode step from now on, what a drafter following the rows would read:
        the token x_t each row feeds at its position t, in ``tapped_ids`` [R, slots], and its features
        f_t (the residual stream after each boundary block, 0 the embeddings, concatenated: [W]), in
        ``tapped`` [R, slots, W], both at slot t % slots: a row's last ``slots`` decoded positions
        (:meth:`eyas.engine.row_speculation.RowSpeculation.catch_up` reads them). A few small writes a
        step, inside its graph; graphs captured before are dropped."""
        self.taps = tuple(int(b) for b in boundaries)
        W = len(self.taps) * self.embed.shape[1]
        self.tapped = torch.zeros(self.rows, slots, W, dtype=self.dtype, device=self.device)
        self.tapped_ids = torch.zeros(self.rows, slots, dtype=torch.long, device=self.device)
        self._graphs.clear()
        self._compiled.clear()

    def buckets(self) -> list[int]:
        """The key lengths a decode step attends (one compiled step and graph each), the capacity last."""
        if self.key_buckets is None:
            return key_ladder(self.capacity)
        return [b for b in self.key_buckets if b < self.capacity] + [self.capacity]

    # -- one call ---------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: Sequence[int] = (),
            temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> BatchResult:
        """Answer every prompt (module docstring, Algorithm). ``temperature`` 0 is greedy; sampled
        answers draw from ``seed`` (None: 0). Returns the answers in input order and the costs."""
        t0 = time.perf_counter()
        compile_before = self.compile_s
        n = len(prompts)
        result = BatchResult(answers=[], rows=self.rows)
        if n == 0:
            return result
        params = BatchParams(int(max_new_tokens), tuple(int(e) for e in eos_ids), float(temperature), float(top_p),
                             seed)  # validates
        V = self.embed.shape[0]
        for i, p in enumerate(prompts):
            if len(p) == 0 or min(p) < 0 or max(p) >= V:
                raise ValueError(f"prompt {i}: expected 1+ token ids in [0, {V}), found {len(p)} ids"
                                 + (f" in [{min(p)}, {max(p)}]" if len(p) else ""))
        lengths = [len(p) for p in prompts]
        mode = "greedy" if params.greedy else "top_p" if params.top_p < 1 else "sample"
        self.ensure(max(lengths) + params.max_new_tokens, params.max_new_tokens)
        st = self.state
        assert st is not None
        eos = [e for e in params.eos_ids if 0 <= e < self.vocab_size]  # an id past the head is never generated
        st.active.zero_()
        st.pos.zero_()
        st.n_gen.zero_()
        st.limit.fill_(params.max_new_tokens)
        st.temperature.fill_(params.temperature if not params.greedy else 1.0)
        st.drop_mass.fill_(1.0 - params.top_p)
        st.greedy.zero_()  # one mode for every row (RowBatch mixes them)
        st.is_eos.zero_()
        if eos:
            st.is_eos[torch.tensor(eos, device=self.device)] = True
        if params.greedy:
            keys = torch.zeros(n, dtype=torch.long)
        else:
            gen = torch.Generator().manual_seed(0 if params.seed is None else int(params.seed))
            keys = torch.randint(0, 1 << 32, (n,), generator=gen, dtype=torch.long)

        R = self.rows
        buckets = self.buckets()
        row_prompt = [-1] * R  # the prompt a row holds (-1: free)
        hpos = [0] * R  # an upper bound of the row's pos on the device
        gen_known = [0] * R  # the row's n_gen at the last sync (1 after its prefill)
        waiting = deque(range(n))
        answers: list[Answer | None] = [None] * n
        eos_set = set(eos)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, desc="fast engine", unit="answer", leave=False, dynamic_ncols=True)
        done = 0
        try:
            while done < n:
                free = [r for r in range(R) if row_prompt[r] < 0]
                busy = R - len(free)
                if waiting and free and (busy == 0 or len(free) >= min(self.refill_rows, len(waiting))):
                    pairs = [(r, waiting.popleft()) for r in free[:min(len(free), len(waiting))]]
                    result.prefills += self.prefill_rows(pairs, prompts, keys, mode)
                    for r, i in pairs:
                        row_prompt[r], hpos[r], gen_known[r] = i, lengths[i], 1
                    result.prompt_tokens += sum(lengths[i] for _, i in pairs)
                busy_rows = [r for r in range(R) if row_prompt[r] >= 0]
                # Every busy row ends within max_new_tokens - n_gen more steps: no step past that.
                steps = min(self.sync_every, max(params.max_new_tokens - gen_known[r] for r in busy_rows))
                # A busy row's pos grows by one a step, up to its prompt + max_new_tokens - 1: step s
                # attends at most min(top + s, cap) + 1 entries (host ints only).
                top = max(hpos[r] for r in busy_rows)
                cap = max(lengths[row_prompt[r]] for r in busy_rows) + params.max_new_tokens - 1
                for s in range(steps):
                    need = min(top + s, cap) + 1
                    self.decode_step(next(b for b in buckets if b >= need), mode)
                result.decode_steps += steps
                # sync: which rows finished, and their answers
                n_gen, active = torch.stack((st.n_gen, st.active.long())).cpu().tolist()
                result.syncs += 1
                finished = [r for r in busy_rows if not active[r]]
                for r in busy_rows:
                    gen_known[r] = n_gen[r]
                    hpos[r] = lengths[row_prompt[r]] + n_gen[r] - 1  # exact (a finished row's is not used)
                if finished:
                    width = max(n_gen[r] for r in finished)
                    outs = st.out[torch.tensor(finished, device=self.device), :width].cpu().tolist()
                    for r, toks in zip(finished, outs):
                        toks = toks[:n_gen[r]]
                        answers[row_prompt[r]] = ((toks[:-1], "eos") if toks and toks[-1] in eos_set
                                                  else (toks, "length"))
                        result.new_tokens += n_gen[r]
                        row_prompt[r] = -1
                    done += len(finished)
                    if bar is not None:
                        bar.update(len(finished))
        finally:
            if bar is not None:
                bar.close()
        result.answers = answers  # type: ignore[assignment]
        result.wall_s = time.perf_counter() - t0
        result.compile_s = self.compile_s - compile_before
        self.last, self.last_decode_steps = result, result.decode_steps
        return result

    def _groups(self, pairs: list[tuple[int, int]], lengths: list[int]) -> Iterator[list[tuple[int, int]]]:
        """``pairs`` (row, prompt) cut, in order, into prefill groups within the budgets."""
        group: list[tuple[int, int]] = []
        P = 0
        for pair in pairs:
            P2, g2 = max(P, lengths[pair[1]]), len(group) + 1
            if group and (g2 * P2 > self.prefill_tokens or g2 * self.num_heads * P2 * P2 > self.prefill_scores):
                yield group
                group, P2 = [], lengths[pair[1]]
            group.append(pair)
            P = P2
        if group:
            yield group

    def prefill_rows(self, pairs: list[tuple[int, int]], prompts: Sequence[Sequence[int]], keys: Tensor, mode: str,
                     boundaries: Sequence[int] = (),
                     on_features: Callable[[list[tuple[int, int]], Tensor], None] | None = None) -> int:
        """Prefill prompts into free rows ((row, prompt) ``pairs``), in groups: each prompt's cache
        entries, its first token (counter 0) and its row's state. Eager; no host read. Returns the
        number of groups. With ``boundaries`` (the layer convention's), ``on_features(group,
        features)`` gets each group's features [g, P, len(boundaries) * H] at those boundaries (the
        residual stream before block b; b = L: after the last block, before the final norm), for a
        drafter to read."""
        st = self.state
        assert st is not None
        prologue, layer, head = self._prefill_fns
        groups = 0
        for group in self._groups(pairs, [len(p) for p in prompts]):
            g, P = len(group), max(len(prompts[i]) for _, i in group)
            ids = torch.zeros(g, P, dtype=torch.long)
            for j, (_, i) in enumerate(group):
                ids[j, :len(prompts[i])] = torch.as_tensor(list(prompts[i]), dtype=torch.long)
            dev = self.device
            ids = ids.to(dev, non_blocking=True)
            rows = torch.tensor([r for r, _ in group], dtype=torch.long).to(dev, non_blocking=True)
            lens = torch.tensor([len(prompts[i]) for _, i in group], dtype=torch.long).to(dev, non_blocking=True)
            key = keys[[i for _, i in group]].to(dev, non_blocking=True)
            x, d, cos, sin = prologue(ids, self.embed, self.inv_freq)
            seen = {0: x} if 0 in boundaries else {}
            for b, w in enumerate(self.weights):
                x, d = layer(x, d, cos, sin, rows, self.keys[b], self.values[b], w)
                if b + 1 in boundaries:
                    seen[b + 1] = x + d
            if on_features is not None and boundaries:
                on_features(group, torch.cat([seen[b] for b in boundaries], dim=-1))
            logits = head(x, d, lens - 1, self.norm_weight, self.lm_head, self.lm_bias)
            tok = choose(logits, key, torch.zeros_like(key), st.temperature[rows], st.drop_mass[rows], mode,
                         st.greedy[rows])
            st.ids.index_copy_(0, rows, tok)
            st.pos.index_copy_(0, rows, lens)
            st.n_gen.index_fill_(0, rows, 1)
            st.out[:, 0].index_copy_(0, rows, tok)
            st.key.index_copy_(0, rows, key)
            st.active.index_copy_(0, rows, ~(st.is_eos[tok] | (st.limit[rows] <= 1)))
            groups += 1
        return groups

    # -- the decode step ---------------------------------------------------------------------------

    def _decode(self, K: int, mode: str, n: int | None = None) -> None:
        """One decode step over the first ``n`` rows (default all) attending K entries: the function
        the graphs capture. The rows' state and cache are views of the first n rows' (in place)."""
        st = self.state
        assert st is not None
        n = self.rows if n is None else n
        if n < self.rows:
            st = Rows(*(t if name == "is_eos" else t[:n] for name, t in zip(Rows._fields, st)))
        # The mask over the whole cache, then its first K columns (a view): the prologue compiles once
        # per rows bucket, not once per (rows, keys) shape, so a new shape costs one compilation less.
        x, d, cos, sin, mask = self._prologue(st.ids, st.pos, self.embed, self.inv_freq, self.capacity)
        mask = mask[:, :K]  # [n, K]
        seen = [x] if 0 in self.taps else []  # tap(): the fed token's features at the boundaries
        for b, w in enumerate(self.weights):
            x, d = self._layer(x, d, cos, sin, st.pos, mask, self.keys[b, :n], self.values[b, :n], w)
            if b + 1 in self.taps:
                seen.append(x + d)
        if self.taps:
            rows, slot = torch.arange(n, device=self.device), st.pos % self.tapped.shape[1]
            self.tapped[:n].index_put_((rows, slot), torch.cat(seen, -1))
            self.tapped_ids[:n].index_put_((rows, slot), st.ids)
        self._epilogue[mode](x, d, self.norm_weight, self.lm_head, self.lm_bias, st)
