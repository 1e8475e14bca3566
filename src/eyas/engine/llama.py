"""Our own forward for Llama-family targets (Llama, Mistral, Qwen2, Qwen3; SmolLM2 is a Llama): a
static KV cache written by index, attention under the tree mask, and boundary capture inside the
forward, with no hooks and no Hugging Face module called.

The code is in three modules, each read top to bottom: :mod:`eyas.engine.llama_kernels` (how a step's
products and attention run: the ``matvec`` and ``attention`` options, what ``"auto"`` picks, and the
fused q/k/v and gate/up weights), :mod:`eyas.engine.llama_steps` (the step's pure functions over
tensors, their numerics, how they are bound and compiled) and this one (:class:`LlamaTarget`: the
weights gathered, the cache, the walk through the blocks, the step's shapes, compilation and CUDA
graphs; :func:`supports`; :func:`eyas.engine.build.build_target` chooses it or the Hugging Face
target). Names other modules have imported from here
(``rms_norm``, ``rope``, ``linear``, ``project``, ``fuse_projections``, ...) are re-exported.

Every step runs through one walk, ``_step``: B new tokens write their keys/values at cache slots
cache_len .. cache_len+B-1 and attend the first ``keys`` cache entries under a bool mask. Exact
shapes (the default) use B = T and keys = cache_len + T, eagerly. Fixed shapes pad B to a token
bucket (1, 8, 16, 32, 64, 128: a tree of up to 127 drafted tokens verifies in a graph) and the
number of keys to a key bucket K: the smallest rung of the ladder ``key_buckets`` (default 512,
1024, 2048, ... doubling, then the capacity C) that covers cache_len + B. Entries [cache_len + B,
K) are masked like every entry past the block, so the result is the one over the whole capacity,
but attention reads and softmaxes K keys rather than C: on SmolLM2 with C = 4096 a 300-token
sequence attends 512 keys, not 4096 (QK and softmax were 7.6 and 3-10 us a block over all C). The
step's shapes depend only on (B, K), both chosen from host ints (T and cache_len), never on a device
value; each token bucket has its own input buffers, shared by its key buckets. Why these rungs:
below 512 keys the attention kernels are launch-bound anyway, and doubling keeps the keys read
within 2x of the keys in use with log2(C/512) + 1 rungs (4 for C = 4096).

On a GPU the step's four functions (:mod:`eyas.engine.llama_steps`: ``_prologue``, ``_layer``,
``_down``, ``_head``) are then compiled with ``torch.compile(fullgraph=True, dynamic=False)``
(inductor fuses each block's norms, rope, cache writes, softmax and SiLU into a few kernels; all
blocks have the same shapes, so one compilation per (B, K) serves every block: ``_layer`` compiles
once per (B, K); ``_prologue``, ``_down`` and ``_head`` once per B: the prologue's mask covers the
whole cache and the step hands the blocks its first K columns, a view) and each (B, K) step is
captured once as a CUDA graph and replayed (forward hooks would not survive a replay: the captured
boundaries are an output of the step). A graph for key bucket K reads entries [0, K) only, and a step
runs the graph of its own K, so a captured graph stays valid as the cache grows. On the CPU the same
functions run eagerly, so the tests check the code the GPU compiles. Compilation happens at a (B, K)
pair's first use, or up front with :meth:`LlamaTarget.warmup` (default: every token bucket with the
key buckets of a sequence of up to ``WARM_CONTEXT`` = 2048 tokens, a typical request; ``context=`` or
``keys=`` say otherwise); ``compile_seconds`` says how long it took. A compiler that fails (e.g. no C
compiler for Triton) leaves the same functions eager, with a warning and ``compile_error``.

No device value is read on the host: the range check and both buckets use host ints (cache_len + T
<= max_length; a step's positions are at most cache_len + T - 1), host tensors travel with
non-blocking copies, and the mask is built on the device inside the step.

Shapes (batch 1, dropped inside the step): L blocks, H hidden, I the MLP's width, Hq query heads,
Hkv key/value heads, G = Hq / Hkv, D head dim, C the cache's capacity (``max_length`` positions), V
vocabulary, B the step's tokens (T, or its token bucket), K the keys it attends.

    qkv weight     [(Hq+2Hkv)*D, H]  rows: q (Hq*D), k (Hkv*D), v (Hkv*D); the model's q/k/v_proj.weight are views
    gate_up weight [2I, H]           rows: gate (I), up (I); the model's gate/up_proj.weight are views
    kv             [L, 2, Hkv, C, D] keys (kv[:, 0]) and values (kv[:, 1]); entry i = the token at
                                     position i (the cache is kept compact)
    forward(T)     writes entries cache_len .. cache_len+B-1, attends the first K entries with the mask
                   [B, K] = (every committed entry) ++ (tree_mask, or causal; a pad: itself) ++ (none)
    keep(idx)      moves the kept entries of the last block to cache_len_before .. (+k) on the device

Boundary capture follows the contract's convention (docs/conventions.md): boundary 0 is the input of
block 0 (the embeddings), boundary b the output of block b-1 (``hidden + residual``), boundary L the
last block's output before the final norm. ``_step`` captures the stream entering block b as
``_layer`` returns it and boundary L as ``_head`` returns it (how ``_down`` leaves a block's last
residual add to the next one: :mod:`eyas.engine.llama_steps`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from eyas.convention.boundaries import CaptureSpec
from eyas.engine.graphs import brief_error, capture
from eyas.engine.llama_kernels import (ATTENTION_CHOICES, MATVEC_CHOICES, auto_kernels, fuse_projections,
                                       why_no_triton, why_not_split_kv)
from eyas.engine.llama_kernels import (  # noqa: F401 (re-exported: other modules import them from here)
    CPU_TRANSPOSED_ROWS, FEW_ROW_KERNELS_UP_TO_HIDDEN, KERNEL_ROWS, OneRow, linear, project, stack_rows,
    stacked_products, stacked_rows, why_not_stackable)
from eyas.engine.llama_steps import BlockWeights, rms_norm, rope  # noqa: F401 (re-exported, likewise)
from eyas.engine.llama_steps import StepFunctions, block_weights, detached, step_functions
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.targets.structure import find_decoder_blocks, text_config

# model_type values whose decoder layer is the Llama layer (pre-norm, rotary, optional q/k bias,
# optional per-head q/k norm) with full attention everywhere.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")

# Exact-shape steps on the CPU padded to more rows (see LlamaTarget.forward): T tokens -> rows.
CPU_PADDED_ROWS = {3: 4}

# The key buckets' ladder: SMALLEST_KEYS, doubling, then the capacity (see key_ladder).
SMALLEST_KEYS = 512
# What warmup() compiles by default: the key buckets of a sequence (prompt + new tokens) this long.
WARM_CONTEXT = 2048


def key_ladder(capacity: int, smallest: int = SMALLEST_KEYS) -> tuple[int, ...]:
    """The default key buckets for a cache of ``capacity`` entries: ``smallest``, doubling while below
    the capacity, then the capacity (e.g. 512, 1024, 2048, 4096 for 4096; just 64 for 64). Every
    step that fits the cache has a rung: the capacity is the last."""
    rungs, k = [], int(smallest)
    while k < capacity:
        rungs.append(k)
        k *= 2
    return (*rungs, int(capacity))


class UnsupportedTarget(EyasError, ValueError):
    """The model is not a full-attention Llama-family model this forward implements."""


def supports(model: nn.Module) -> str | None:
    """None when :class:`LlamaTarget` can run ``model``; else why not (for ``--target-impl auto``)."""
    cfg = text_config(model)
    kind = getattr(cfg, "model_type", None)
    if kind not in LLAMA_FAMILY:
        return f"model_type {kind!r} is not one of {list(LLAMA_FAMILY)}"
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or (kind == "mistral" and getattr(cfg, "sliding_window", None)):
        return f"layer types {sorted(layer_types)}: sliding-window attention is not implemented"
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r}: only the SiLU MLP is implemented"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("rotary_emb", "embed_tokens", "norm")):
        return f"{type(model).__name__}: expected .model.embed_tokens, .model.rotary_emb and .model.norm"
    rope_type = str(getattr(base.rotary_emb, "rope_type", "default"))
    if "dynamic" in rope_type or rope_type == "longrope" or not hasattr(base.rotary_emb, "inv_freq"):
        return f"rope type {rope_type!r}: frequencies that change with the sequence length are not implemented"
    return None


def _check_triton(option: str, fallback: str, device: torch.device) -> None:
    """Refuse an option that runs our Triton kernels (``option``, e.g. "attention='split-kv'") where
    they cannot run, saying what it needs and what to use instead (``fallback``)."""
    why = why_no_triton(device)
    if why is not None:
        raise UnsupportedTarget(f"LlamaTarget: {option} {why}; use {fallback}")


def _check_split_kv(head_dim: int, device: torch.device) -> None:
    """Refuse attention="split-kv" where its Triton kernels cannot run, saying what it needs."""
    _check_triton("attention='split-kv'", "attention='eager'", device)
    why = why_not_split_kv(head_dim)
    if why is not None:
        raise UnsupportedTarget(f"LlamaTarget: attention='split-kv' {why}; use attention='eager'")


class _Inputs(NamedTuple):
    """A step's inputs on the device (for fixed shapes, a bucket's own buffers: a graph's static inputs)."""

    ids: Tensor  # [B] long
    pos: Tensor  # [B] long
    block: Tensor  # [B, B] bool
    start: Tensor  # [1] long: cache_len


class LlamaTarget(Target):
    """A Llama-family Hugging Face model served with a static KV cache and in-forward capture.

    Holds references to the model's weight tensors (no copy; moving or converting the model
    afterwards is not followed: build the target after). First fuses the model's q/k/v and gate/up
    projections in place (:func:`fuse_projections`, unless ``fuse=False``; the model's own
    parameters become views of the fused weights, its state_dict unchanged); ``unfused_reason`` says
    why a model's projections could not be fused (the step then runs separate GEMMs, with a
    warning), None when they are. ``max_length`` is the cache's
    capacity; it defaults to the model's context, capped at ``default_capacity`` to keep the
    preallocated cache small (2 x L x C x Hkv x D values). With fixed shapes a step's T tokens are
    padded to the smallest of ``buckets`` that holds them and attend the first K cache entries, K
    the smallest of ``key_buckets`` (default :func:`key_ladder`; the capacity is always added as
    the last rung) that holds cache_len + the token bucket. ``compile`` (default: with
    ``cuda_graphs``) compiles the fixed-shape step with inductor; it applies on a GPU only.

    ``matvec`` (one of ``MATVEC_CHOICES``) says how the fixed-shape steps multiply by the weights:
    cuBLAS (``"gemm"``), float32 reductions that inductor compiles (``"reduce"``, ``"reduce-tuned"``),
    or eyas' Triton kernels for the steps of one token (``"triton"``) or of up to ``KERNEL_ROWS`` = 64
    tokens, a tree's verification included (``"triton-verify"``); other steps use ``F.linear``.
    ``attention`` (one of ``ATTENTION_CHOICES``) says how the steps attend over the cache: Hugging
    Face's eager order (``"eager"``), one ``scaled_dot_product_attention`` call a block (``"sdpa"``),
    or split-KV Triton kernels (``"split-kv"``). ``"auto"``, the default of both, picks the Triton
    kernels where the steps are compiled on a GPU and triton is installed (split-kv where the head
    dimension allows it; :func:`~eyas.engine.llama_kernels.auto_kernels`), else ``"gemm"`` and
    ``"eager"``; an option whose kernels cannot run where the model is gets refused, with the reason.
    Each choice, and what it measured: :mod:`eyas.engine.llama_kernels`."""

    def __init__(self, model: nn.Module, spec: CaptureSpec, max_length: int | None = None,
                 default_capacity: int = 4096, fixed_shapes: bool = False, cuda_graphs: bool = False,
                 buckets: Sequence[int] = (1, 8, 16, 32, 64, 128), compile: bool | None = None,
                 fuse: bool = True, key_buckets: Sequence[int] | None = None, matvec: str = "auto",
                 attention: str = "auto") -> None:
        why_not = supports(model)
        if why_not is not None:
            raise UnsupportedTarget(f"LlamaTarget: {why_not}; use the Hugging Face target (HFTarget)")
        self.model = model.eval()
        self.unfused_reason = fuse_projections(model) if fuse else "fuse=False"
        if fuse and self.unfused_reason is not None:
            warnings.warn(f"LlamaTarget: q/k/v and gate/up not fused ({self.unfused_reason}); each block runs "
                          f"7 GEMMs instead of 4", stacklevel=2)
        cfg = text_config(model)
        blocks = find_decoder_blocks(model)
        L = len(blocks)
        if spec.num_blocks != L:
            raise UnsupportedTarget(f"capture spec: expected a spec for {L} blocks, found one for {spec.num_blocks}")
        self.spec = spec
        base = model.model
        attn = blocks[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        lm_head = model.get_output_embeddings()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = lm_head.weight.shape[0]

        # The weights, gathered once: detached references to the model's parameters (no copies).
        self.weights = [block_weights(b, fused=self.unfused_reason is None) for b in blocks]
        self.embed_weight = base.embed_tokens.weight.detach()  # [V, H]
        self.inv_freq = base.rotary_emb.inv_freq  # [D/2] (a buffer: rope scaling already applied)
        self.norm_weight = base.norm.weight.detach()  # [H]
        self.lm_head_weight, self.lm_head_bias = detached(lm_head), detached(lm_head, "bias")  # [V, H], None

        def eps_of(norm: nn.Module) -> float:
            return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", getattr(cfg, "rms_norm_eps", 1e-6))))

        q_norm = getattr(attn, "q_norm", None)
        self._consts = {
            "eps": eps_of(blocks[0].input_layernorm), "qk_eps": eps_of(q_norm) if q_norm is not None else 0.0,
            "scaling": float(getattr(attn, "scaling", self.head_dim ** -0.5)),
            "rope_scaling": float(getattr(base.rotary_emb, "attention_scaling", 1.0))}

        cfg_len = int(getattr(cfg, "max_position_embeddings", 0) or default_capacity)
        self.max_length = int(max_length or min(cfg_len, default_capacity))
        # One buffer for keys and values, so that keep() moves both with one copy: kv[:, 0] the
        # keys, kv[:, 1] the values (a step writes each through its view).
        self.kv = torch.zeros((L, 2, self.num_kv_heads, self.max_length, self.head_dim), dtype=self.dtype,
                              device=self.device)
        self.keys, self.values = self.kv[:, 0], self.kv[:, 1]  # [L, Hkv, C, D] views
        self._slot_of = {b: i for i, b in enumerate(spec.boundaries)}

        # Fixed shapes: a step of T <= max(buckets) tokens runs padded to the smallest token bucket
        # B >= T and attends the first K entries of the cache under a mask, K the smallest key bucket
        # >= cache_len + B, so its shapes are one of a few (B, K) pairs; on a GPU its functions are
        # compiled (compile) and each (B, K) step is captured once as a CUDA graph and replayed
        # (cuda_graphs).
        on_gpu = self.device.type == "cuda"
        self.cuda_graphs = bool(cuda_graphs) and on_gpu
        self.compile = bool(cuda_graphs if compile is None else compile) and on_gpu
        self.fixed_shapes = bool(fixed_shapes or cuda_graphs or self.compile)
        self.buckets = tuple(sorted(int(b) for b in buckets))
        ladder = key_ladder(self.max_length) if key_buckets is None else key_buckets
        self.key_buckets = tuple(sorted({int(k) for k in ladder if 0 < int(k) < self.max_length} | {self.max_length}))
        if matvec not in MATVEC_CHOICES:
            raise UnsupportedTarget(f"LlamaTarget: matvec must be one of {list(MATVEC_CHOICES)}, found {matvec!r}")
        if attention not in ATTENTION_CHOICES:
            raise UnsupportedTarget(f"LlamaTarget: attention must be one of {list(ATTENTION_CHOICES)}, "
                                    f"found {attention!r}")
        auto_matvec, auto_attention = auto_kernels(self.compile, self.head_dim, int(cfg.hidden_size))
        self.matvec = auto_matvec if matvec == "auto" else matvec
        if self.matvec in ("triton", "triton-verify"):
            _check_triton(f"matvec={self.matvec!r}", "matvec='gemm'", self.device)
        attention = auto_attention if attention == "auto" else attention
        if attention == "split-kv":
            _check_split_kv(self.head_dim, self.device)
        self.attention = attention
        # Exact-shape steps attend eagerly (or by SDPA); split-kv serves the fixed-shape steps only.
        self._eager = self._functions(None, attention="sdpa" if attention == "sdpa" else "eager")
        # Eager fixed-shape functions with matvec or split-kv (the CPU tests of the compiled code) are
        # a distinct object from self._eager: a failed compilation falls back to self._eager.
        special = self.matvec != "gemm" or attention == "split-kv"
        self._fixed = (self._functions("inductor", self.matvec, attention) if self.compile
                       else self._functions(None, self.matvec, attention) if self.fixed_shapes and special
                       else self._eager)
        self.implementation = self._implementation()
        self._inputs: dict[int, _Inputs] = {}  # token bucket B -> its input buffers (shared by its key buckets)
        self._ready: set[tuple[int, int]] = set()  # (B, K) steps compiled / captured
        # A step pads to a larger bucket that is ready rather than compile its own (step_shape): a
        # server sets it once its start-up left buckets to the background (eyas.serve.startup)
        self.prefer_ready = False
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.compile_seconds = 0.0  # time spent compiling and capturing (B, K) steps (at first use or in warmup)
        self.compile_error: str | None = None  # why compilation failed, when it did (the step then runs eagerly)
        top = max(self.buckets)
        self._causal = torch.ones(top, top, dtype=torch.bool, device=self.device).tril_()
        self._eye = torch.eye(top, dtype=torch.bool, device=self.device)
        self.reset()

    def _implementation(self) -> str:
        """What runs, e.g. ``fast+compile+cuda-graphs+matvec-reduce-tuned+attention-split-kv``: the
        matvec and split-kv parts only while the fixed-shape steps have their own functions (a failed
        compilation leaves the eager ones, plain F.linear and eager or SDPA attention)."""
        own = self._fixed is not self._eager
        return "+".join(["fast"] + ["compile"] * self.compile + ["cuda-graphs"] * self.cuda_graphs
                        + [f"matvec-{self.matvec}"] * (own and self.matvec != "gemm")
                        + ["attention-sdpa"] * (self.attention == "sdpa")
                        + ["attention-split-kv"] * (own and self._fixed.split_kv_layer is not None))

    def _functions(self, backend: str | None, matvec: str = "gemm", attention: str = "eager") -> StepFunctions:
        """The step's functions with this model's constants, ``matvec`` and ``attention`` bound;
        compiled with ``backend`` (None: eager): :func:`~eyas.engine.llama_steps.step_functions`."""
        return step_functions(self._consts, backend, matvec, attention)

    # -- cache --------------------------------------------------------------------------------

    def reset(self) -> None:
        # The buffers keep their stale values: entries past cache_len are never attended.
        self._len = self._committed = 0

    def keep(self, indices: Sequence[int] | Tensor) -> None:
        idx, P, k = self._kept(indices)
        # Advanced indexing reads a copy first, so overlapping source and destination are fine.
        src = P + idx
        self.kv[:, :, :, P:P + k] = self.kv[:, :, :, src]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise IndexError(f"truncate: expected a length in 0..{self._len} (the cache's), found {length}")
        self._len = self._committed = int(length)  # entries past it are never attended

    # -- forward ------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: Tensor, position_ids: Tensor, tree_mask: Tensor | None = None,
                capture: bool = True) -> tuple[Tensor, Tensor | None]:
        T = input_ids.shape[1]
        # Host ints only: a step's positions are at most cache_len + T - 1 (a tree's deepest node).
        if self._len + T > self.max_length:
            raise ValueError(f"position {self._len + T - 1} is past the context ({self.max_length} positions)")
        shape = self.step_shape(T)
        if shape is not None:
            logits, features = self._fixed_step(*shape, input_ids, position_ids, tree_mask)
        else:  # exact shapes: B = T new tokens against the cache_len + T entries in use, eagerly
            dev = self.device
            ids = input_ids.reshape(-1).to(dev, non_blocking=True)
            pos = position_ids.reshape(-1).to(dev, non_blocking=True)
            block = (torch.ones(T, T, dtype=torch.bool, device=dev).tril_() if tree_mask is None
                     else tree_mask.to(dev, torch.bool, non_blocking=True))
            B = T
            rows = CPU_PADDED_ROWS.get(T, T) if dev.type == "cpu" else T
            if rows > T and self._len + rows <= self.max_length:
                # 3 rows cost about what 4 do in the CPU's products (see linear: 31 to 48 ms against
                # 31 to 44 for SmolLM2's) and 3 tokens are rare (a tree's size): pad to 4. A pad
                # repeats the last token and position, attends itself only and writes a slot past
                # the cache's end.
                B, pad = rows, rows - T
                ids, pos = torch.cat([ids, ids[-1:].expand(pad)]), torch.cat([pos, pos[-1:].expand(pad)])
                block = torch.block_diag(block, torch.eye(pad, dtype=torch.bool, device=dev))
            inputs = _Inputs(ids, pos, block, torch.full((1,), self._len, dtype=torch.long, device=dev))
            logits, features = self._step(inputs, self._len + B, self._eager)
            logits, features = logits[None, :T], features[None, :T]
        self._appended(T)
        return logits, (features if capture else None)

    def _step(self, inputs: _Inputs, n_keys: int, fns: StepFunctions) -> tuple[Tensor, Tensor]:
        """One forward of B = len(inputs.ids) tokens attending the first ``n_keys`` cache entries; its
        shapes depend only on those two numbers. Returns logits [B, V] and the captured boundaries
        [B, S*H] in the spec's slot order (boundary b = the residual stream entering block b;
        boundary L = the last block's output, before the final norm)."""
        prologue, layer, down, head, whole_output_rows, split_kv_layer, split_kv_rows = fns
        # The mask over the whole cache, then its first n_keys columns (a view, no copy): the
        # prologue's shapes depend on B alone, so a warm start traces it 6 times, not 6 x 4.
        x, d, cos, sin, slots, mask = prologue(*inputs, self.embed_weight, self.inv_freq, n_keys=self.max_length)
        mask = mask[:, :n_keys]  # [B, n_keys]
        if x.shape[0] <= whole_output_rows:
            d = None  # every block returns its output whole (see llama_steps._down): one compilation of _layer
        layer_takes_kv = split_kv_layer is not None and x.shape[0] <= split_kv_rows
        layer = split_kv_layer if layer_takes_kv else layer
        captured: list[Tensor | None] = [None] * self.spec.num_slots
        for i, w in enumerate(self.weights):
            cache = (self.kv[i],) if layer_takes_kv else (self.keys[i], self.values[i])
            h_in, h, act = layer(x, d, cos, sin, slots, mask, *cache, w)
            x, d = down(h, act, w.down, w.down_bias)
            if i in self._slot_of:  # boundary i = the input of block i
                captured[self._slot_of[i]] = h_in
        h, logits = head(x, d, self.norm_weight, self.lm_head_weight, self.lm_head_bias)
        L = len(self.weights)
        if L in self._slot_of:
            captured[self._slot_of[L]] = h
        return logits, torch.cat(captured, dim=-1)  # type: ignore[arg-type]

    # -- fixed shapes, compilation and CUDA graphs ------------------------------------------------

    def _key_bucket(self, n: int) -> int:
        """The smallest key bucket >= n (a host int; n <= max_length, the last rung)."""
        return next(k for k in self.key_buckets if k >= n)

    def step_shape(self, T: int) -> tuple[int, int] | None:
        """(B, K) of a forward of T tokens at the current cache_len: the token bucket it is padded to
        (the smallest >= T, or with ``prefer_ready`` a larger one that is compiled and captured when
        the smallest is not) and the key bucket it attends; None where it runs exact shapes (not
        ``fixed_shapes``, T past the largest bucket, or the pads' slots past the capacity). Host ints only."""
        B = next((b for b in self.buckets if b >= T), None) if self.fixed_shapes else None
        if B is None or self._len + B > self.max_length:
            return None
        if self.prefer_ready and (B, self._key_bucket(self._len + B)) not in self._ready:
            # A larger bucket already compiled and captured, rather than compiling this one now (a
            # warm start leaves some to the background): its pads cost a GPU far less than a compilation.
            B = next((b for b in self.buckets if b > B and self._len + b <= self.max_length
                      and (b, self._key_bucket(self._len + b)) in self._ready), B)
        return B, self._key_bucket(self._len + B)

    def _buffers(self, B: int) -> _Inputs:
        if B not in self._inputs:
            dev = self.device
            self._inputs[B] = _Inputs(torch.zeros(B, dtype=torch.long, device=dev),
                                      torch.zeros(B, dtype=torch.long, device=dev),
                                      self._eye[:B, :B].clone(), torch.zeros(1, dtype=torch.long, device=dev))
        return self._inputs[B]

    def _load(self, B: int, input_ids: Tensor, position_ids: Tensor, tree_mask: Tensor | None) -> _Inputs:
        """Write a step's T <= B tokens into bucket B's buffers: four or five small copies/fills, no host read.
        A pad (index >= T) keeps the buffer's previous id and position (any valid ones do) and
        attends the committed entries and itself (a row with nothing to attend would give NaN); no
        real token attends a pad, so padding changes nothing the caller sees."""
        buf = self._buffers(B)
        T = input_ids.shape[1]
        buf.ids[:T].copy_(input_ids.reshape(-1), non_blocking=True)
        buf.pos[:T].copy_(position_ids.reshape(-1), non_blocking=True)
        if T < B:  # pads attend themselves (a tree of the bucket's size has none: one copy less a round)
            buf.block.copy_(self._eye[:B, :B])
        buf.block[:T, :T].copy_(self._causal[:T, :T] if tree_mask is None else tree_mask, non_blocking=True)
        buf.start.fill_(self._len)
        return buf

    def _fixed_step(self, B: int, K: int, input_ids: Tensor, position_ids: Tensor,
                    tree_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """The step padded to token bucket B attending the first K cache entries (cache_len + B <= K):
        run (compiled or eager), or its CUDA graph replayed. Returns logits [1, T, V] and features
        [1, T, S*H]."""
        T = input_ids.shape[1]
        buf = self._load(B, input_ids, position_ids, tree_mask)
        if (B, K) not in self._ready:
            self._prepare(B, K)
        if not self.cuda_graphs:
            logits, features = self._step(buf, K, self._fixed)
            return logits[None, :T], features[None, :T]
        graph, (logits, features) = self._graphs[B, K]
        graph.replay()
        # The graph's own buffers, not copies (Target.forward: valid until the next forward); the
        # round's acceptance graph reads them in place (graphs.StepGraphs).
        return logits[None, :T], features[None, :T]

    def _prepare(self, B: int, K: int) -> None:
        """Compile (first call of the compiled functions with these shapes) and capture the step of
        token bucket B over K keys, on the inputs already in B's buffers. The warm-up runs write
        keys/values only at the step's own slots (entries not yet committed), which the step then
        overwrites. The graph reads cache entries [0, K) only and is replayed only for steps with
        cache_len + B <= K."""
        t0 = time.perf_counter()
        buf = self._buffers(B)
        if self.cuda_graphs:  # the warm-up (and compilation) runs off the capturing stream
            self._graphs[B, K] = capture(lambda: self._step(buf, K, self._fixed), self._pool,
                                         warm=lambda: self._warm_step(buf, K))
            torch.cuda.synchronize(self.device)
        elif self.compile:
            self._warm_step(buf, K)
            torch.cuda.synchronize(self.device)
        self._ready.add((B, K))
        self.compile_seconds += time.perf_counter() - t0

    def _warm_step(self, buf: _Inputs, K: int) -> None:
        """A warm-up run of the fixed-shape step (the first one with compiled functions compiles
        them). When compilation fails (a machine without a C compiler for Triton, an inductor bug),
        say so and run the same functions eagerly: an error of the functions themselves then
        raises again, eagerly."""
        try:
            self._step(buf, K, self._fixed)
        except Exception as e:
            if self._fixed is self._eager:
                raise
            self.compile_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"LlamaTarget: torch.compile failed ({brief_error(self.compile_error)}); the step runs "
                          f"eagerly", stacklevel=3)
            self.compile, self._fixed = False, self._eager
            self.implementation = self._implementation()
            self._step(buf, K, self._fixed)

    def unwarmed(self) -> list[tuple[int, int]]:
        """The (token bucket, key bucket) pairs a step may reach that are not compiled and captured
        yet (B <= K), smallest keys first: what :meth:`warmup` of the whole context would add."""
        if not self.fixed_shapes:
            return []
        return [(B, K) for K in self.key_buckets for B in self.buckets if B <= K and (B, K) not in self._ready]

    @torch.no_grad()
    def warmup(self, buckets: Sequence[int] | None = None, keys: Sequence[int] | None = None,
               context: int | None = None) -> float:
        """Compile and capture the fixed-shape steps of every token bucket in ``buckets`` (default:
        all) with every key bucket in ``keys`` now rather than at their first use, so that timings
        (and requests) leave compilation out. ``keys`` defaults to the key buckets a sequence of up
        to ``context`` tokens (prompt + new tokens; default ``WARM_CONTEXT`` = 2048, a typical
        request, capped at the capacity) reaches: 512, 1024 and 2048 with the default ladder. A
        longer sequence compiles and captures each further key bucket at its first use (a few
        seconds on a GPU); ``context=target.max_length`` warms them all. Each (B, K) pair is one
        compilation of ``_layer`` (``_prologue``, ``_down`` and ``_head`` compile once per B) and one CUDA
        graph. Empties the cache (call it before ``prefill``). Returns the seconds it took (also
        added to ``compile_seconds``)."""
        self.reset()
        if not self.fixed_shapes:
            return 0.0
        t0 = time.perf_counter()
        if keys is None:  # the key buckets up to the one a sequence of ``context`` tokens ends in
            longest = self._key_bucket(min(max(1, WARM_CONTEXT if context is None else int(context)), self.max_length))
            keys = [k for k in self.key_buckets if k <= longest]
        for K in keys:
            if K not in self.key_buckets:
                raise ValueError(f"warmup: key bucket {K} is not one of {list(self.key_buckets)}")
        for B in self.buckets if buckets is None else buckets:
            if B not in self.buckets:
                raise ValueError(f"warmup: bucket {B} is not one of {list(self.buckets)}")
            for K in keys:
                if (B, K) in self._ready or B > K:  # B > K: no step reaches it (cache_len + B <= K)
                    continue
                ids = torch.zeros(1, B, dtype=torch.long, device=self.device)
                self._load(B, ids, torch.arange(B, device=self.device)[None], None)  # at cache_len 0
                self._prepare(B, K)
        return time.perf_counter() - t0
