"""Our own forward for Llama-family targets (Llama, Mistral, Qwen2, Qwen3; SmolLM2 is a Llama): a
static KV cache written by index, attention under the tree mask, and boundary capture inside the
forward, with no hooks and no Hugging Face module called.

A step is four pure functions over tensors, which take the model's weight tensors as arguments
(references gathered once at construction, no copies):

- ``_prologue``: the embeddings, the rotary cos/sin of the positions, the cache slots the step
  writes and its attention mask, from ids, positions, the new tokens' [B, B] block mask and the
  first slot (cache_len, a device scalar);
- ``_layer``: one decoder block (RMSNorm, q/k/v with optional bias, Qwen3's per-head q/k norm,
  rotate-half rope, keys/values written into the block's cache by index, grouped-query attention
  over the cache under the mask, o, RMSNorm, the MLP's gate/up and SiLU); every block is the same
  function on its own weights and cache;
- ``_down``: the block's last product, the MLP's down projection (apart from ``_layer`` for one
  reason: see its docstring);
- ``_head``: the final norm and the logits.

The numerics are Hugging Face's: RMSNorm in float32 (x * rsqrt(mean(x^2) + eps), cast back, times the
weight), scores q.k in the model's dtype, scaled and softmaxed in float32, cast back (the eager
attention's order). ``tests/test_engine_llama.py`` holds the logits and the features equal to
:class:`~eyas.engine.target.HFTarget` in float32.

Fused projections. A step at batch 1 is launch-bound on a small model (SmolLM2-135M on an H200:
~2.7 us a kernel, each of a block's 7 GEMMs ~3.5 us), so a block runs q/k/v as ONE GEMM and gate/up
as ONE GEMM (4 GEMMs a block instead of 7). :func:`fuse_projections`, which :class:`LlamaTarget`
calls first, stores each block's q/k/v weights as consecutive rows of one tensor
[(Hq+2Hkv)*D, H] and gate/up as rows of one [2I, H] (biases likewise) and makes the Hugging Face
model's own parameters views into it: no weight is held twice, the model computes exactly as
before (HFTarget, capture and training use it), and its state_dict is unchanged. The step splits
the GEMM's output into views. A model whose parameters cannot be stacked (on the ``meta`` device,
quantized or other tensor subclasses) keeps its separate GEMMs, with the reason in
``LlamaTarget.unfused_reason``.

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

On a GPU the four functions are then compiled with ``torch.compile(fullgraph=True,
dynamic=False)`` (inductor fuses each block's norms, rope, cache writes, softmax and SiLU into a
few kernels; all blocks have the same shapes, so one compilation per (B, K) serves every block:
``_layer`` and ``_prologue`` compile once per (B, K), ``_down`` and ``_head`` once per B) and each (B, K) step is
captured once as a CUDA graph and replayed (forward hooks would not survive a replay: the captured
boundaries are an output of the step). A graph for key bucket K reads entries [0, K) only, and a
step runs the graph of its own K, so a captured graph stays valid as the cache grows. On the CPU
the same functions run eagerly, so the tests check the code the GPU compiles. Compilation happens
at a (B, K) pair's first use, or up front with :meth:`LlamaTarget.warmup` (default: every token
bucket with the key buckets of a sequence of up to ``WARM_CONTEXT`` = 2048 tokens, a typical
request; ``context=`` or ``keys=`` say otherwise); ``compile_seconds`` says how long it took. A
compiler that fails (e.g. no C compiler for Triton) leaves the same functions eager, with a
warning and ``compile_error``.

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
last block's output before the final norm. ``_layer`` returns the stream entering its block (its
boundary), and ``_down`` leaves the block's last residual add to the next block (or ``_head``),
where it fuses with the next norm (a fixed-shape step whose products run eyas' Triton kernels, or
one of one token with ``matvec="reduce"``, adds it in the down product's kernel instead: see
:func:`_down`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.convention.boundaries import CaptureSpec
from eyas.engine.graphs import brief_error, capture, raise_recompile_limits
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.targets.structure import find_decoder_blocks, text_config

# model_type values whose decoder layer is the Llama layer (pre-norm, rotary, optional q/k bias,
# optional per-head q/k norm) with full attention everywhere.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


# How the fixed-shape steps multiply by the weights (LlamaTarget's matvec).
MATVEC_CHOICES = ("auto", "gemm", "reduce", "reduce-tuned", "triton", "triton-verify")
# What the step's functions do with their rows (see _in_kernels): "reduce-tuned" is "reduce" with
# other compiler options; "auto" is "triton" or "triton-verify" on the compiled GPU path, else "gemm"
# (see _auto_kernels).
OneRow = Literal["gemm", "reduce", "triton", "triton-verify"]
# With matvec="triton-verify", the fixed-shape steps of up to this many tokens run every product
# through eyas.engine.matvec's kernels (its MAX_ROWS): a plain step, and trees of up to 63 drafted
# tokens (with "triton", the plain steps only).
KERNEL_ROWS = 64

# How a step attends over the cache (LlamaTarget's attention; see _layer).
ATTENTION_CHOICES = ("auto", "eager", "sdpa", "split-kv")  # auto: split-kv with matvec's auto kernels, else eager

# Products of at most this many rows run transposed on the CPU (see linear).
CPU_TRANSPOSED_ROWS = 7
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


def why_no_triton(device: torch.device, holder: str = "model") -> str | None:
    """None where eyas' Triton kernels can run on ``device`` (the ``holder``'s: "model", "drafter");
    else why not, as the end of a sentence that starts with what asked for them."""
    if importlib.util.find_spec("triton") is None:
        return "runs Triton kernels, and triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"runs Triton kernels, on a GPU (the {holder} is on {device.type}) or under TRITON_INTERPRET=1"
    return None


def why_not_split_kv(head_dim: int) -> str | None:
    """None when the split-KV attention kernels take this head dimension; else why not (call after
    :func:`why_no_triton`: the check imports them)."""
    from eyas.engine.decode_attention import supported_head_dim

    if supported_head_dim(head_dim):
        return None
    return f"needs a power-of-two head dimension of at least 16, found {head_dim}"


def _check_triton(option: str, fallback: str, device: torch.device) -> None:
    """Refuse an option that runs our Triton kernels (``option``, e.g. "attention='split-kv'") where
    they cannot run, saying what it needs and what to use instead (``fallback``)."""
    why = why_no_triton(device)
    if why is not None:
        raise UnsupportedTarget(f"LlamaTarget: {option} {why}; use {fallback}")


# Models up to this hidden size also verify and draft through eyas' kernels by default ("auto" picks
# "triton-verify"): their steps are bound by kernel launches, which the kernels' fused products cut,
# while a large model's few-row products are bound by the weights' bytes, where cuBLAS is faster.
# Measured on an H200 in bf16 (benchmarks/2026-12-02-round-compile-h200.md): SmolLM2-135M (hidden
# 576) verified 24 tokens in 1.120 ms through them against 1.365 with cuBLAS (two calls), and on
# MT-bench its rounds of tree 4,8,24 verified in 0.97 ms against 1.12 (one call); an 8B-shaped
# Llama (hidden 4096) verified 24 tokens in 7.25 ms through them against 5.45 with cuBLAS.
FEW_ROW_KERNELS_UP_TO_HIDDEN = 1024


def _auto_kernels(compiled: bool, head_dim: int, hidden_size: int) -> tuple[str, str]:
    """(matvec, attention) for "auto": eyas' Triton kernels where the fixed-shape steps are compiled
    on a GPU (the fast path) and triton is installed, else cuBLAS and the eager order ("gemm",
    "eager"). With the kernels: split-kv attention where the head dimension is one its kernels take
    (else "eager"); "triton" (the one-token steps through the kernels, verification on cuBLAS) and,
    for a model of hidden size up to FEW_ROW_KERNELS_UP_TO_HIDDEN with split-kv, "triton-verify"
    (verification and the drafter's steps through them too). The kernels make a plain step's
    block 6 kernels instead of 16, which is what a launch-bound step needs."""
    if not compiled or importlib.util.find_spec("triton") is None:
        return "gemm", "eager"
    if why_not_split_kv(head_dim) is not None:
        return "triton", "eager"
    return ("triton-verify" if hidden_size <= FEW_ROW_KERNELS_UP_TO_HIDDEN else "triton"), "split-kv"


def _check_split_kv(head_dim: int, device: torch.device) -> None:
    """Refuse attention="split-kv" where its Triton kernels cannot run, saying what it needs."""
    _check_triton("attention='split-kv'", "attention='eager'", device)
    why = why_not_split_kv(head_dim)
    if why is not None:
        raise UnsupportedTarget(f"LlamaTarget: attention='split-kv' {why}; use attention='eager'")


# -- fused projections ---------------------------------------------------------------------------


def stacked_rows(parts: Sequence[Tensor]) -> Tensor | None:
    """The rows of ``parts`` (weights [r_i, H] or biases [r_i]) as one tensor [sum r_i, ...] when
    they already lie one after another in one storage (as :func:`fuse_projections` leaves them): a
    view, no copy. None when they do not."""
    first = parts[0]
    if first.dim() not in (1, 2) or first.device.type == "meta":
        return None
    ptr, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if (p.dim() != first.dim() or p.shape[1:] != first.shape[1:] or p.dtype != first.dtype
                or p.device != first.device or not p.is_contiguous()
                or p.untyped_storage().data_ptr() != ptr or p.storage_offset() != offset):
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    shape, stride = ((rows, first.shape[1]), (first.shape[1], 1)) if first.dim() == 2 else ((rows,), (1,))
    return torch.as_strided(first.detach(), shape, stride)  # from first's storage offset on


def why_not_stackable(linears: Sequence[nn.Module]) -> str | None:
    """None when these projections' weights (and biases) can be stacked into one tensor; else why not."""
    for m in linears:
        if not isinstance(m, nn.Linear):
            return f"{type(m).__name__} is not an nn.Linear"
    for name in ("weight", "bias"):
        params = [getattr(m, name) for m in linears]
        if all(p is None for p in params):
            continue
        if any(p is None for p in params):
            return f"only some of them have a {name}"
        for p in params:
            if p.device.type == "meta":
                return "its parameters are on the meta device (not loaded)"
            if type(p) is not nn.Parameter or p.layout != torch.strided:
                return f"its {name} is a {type(p).__name__}, not a plain nn.Parameter (quantized?)"
            if not p.dtype.is_floating_point or not p.is_contiguous():
                return f"its {name} is {p.dtype}{'' if p.is_contiguous() else ', not contiguous'}"
        if len({(p.dtype, p.device, p.shape[1:]) for p in params}) > 1:
            return f"their {name}s differ in dtype, device or width"
    return None


def _projection_groups(block: nn.Module) -> tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]:
    """A decoder block's (q_proj, k_proj, v_proj) and (gate_proj, up_proj), in row order."""
    attn, mlp = block.self_attn, block.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)


def fuse_projections(model: nn.Module) -> str | None:
    """Stack each decoder block's q/k/v projections into one weight and gate/up into another, in
    place, so that a step runs one GEMM where it ran three (two), without a second copy of any weight.

    For every block: one new contiguous tensor [(Hq+2Hkv)*D, H] holds the rows of q_proj.weight,
    k_proj.weight and v_proj.weight one after another, one [2I, H] those of gate_proj.weight and
    up_proj.weight (and the biases likewise, [(Hq+2Hkv)*D] for Qwen2's q/k/v), and each of the
    model's parameters becomes a view of its rows (``param.data = fused[rows]``: the same Parameter
    objects, their storage shared, the old tensors freed). The Hugging Face model computes exactly
    as before (it still multiplies by q_proj.weight, now a view), its ``state_dict`` keys and values
    are unchanged, in-place writes (an optimizer, ``load_state_dict``) reach the fused tensors, and
    ``save_pretrained`` writes the same tensors. Converting or moving the model afterwards
    (``.to``, ``.half()``) gives every parameter its own storage again: fuse again then.

    Idempotent: projections whose rows already lie one after another in one storage are left alone.
    All or nothing: when some block's projections cannot be stacked (parameters on the ``meta``
    device, not plain ``nn.Parameter``s as with quantized weights, mixed dtypes, a bias on some of
    them only), nothing changes and the reason is returned. Returns None when every block is fused.
    """
    blocks = find_decoder_blocks(model)
    groups = []
    for i, block in enumerate(blocks):
        try:
            qkv, gate_up = _projection_groups(block)
        except AttributeError as e:
            return f"block {i}: {e}"
        for group, names in ((qkv, "q/k/v"), (gate_up, "gate/up")):
            why = why_not_stackable(group)
            if why is not None:
                return f"block {i} {names}: {why}"
            groups.append(group)
    stack_rows(groups)
    return None


def stack_rows(groups: Sequence[Sequence[nn.Module]]) -> None:
    """For each group of projections (checked stackable: :func:`why_not_stackable`), one new
    contiguous tensor holding their weights' rows one after another (and their biases'), each
    parameter becoming a view of its rows (``param.data = fused[rows]``: the same Parameter, its
    old tensor freed). Groups already stacked are left alone (:func:`fuse_projections`; the
    drafter's, :func:`eyas.engine.draft_kernels.fuse_drafter_projections`)."""
    with torch.no_grad():
        for group in groups:
            for name in ("weight", "bias"):
                params = [getattr(m, name) for m in group]
                if params[0] is None or stacked_rows(params) is not None:  # no bias, or already stacked
                    continue
                fused = torch.cat([p.detach() for p in params])  # [sum of rows, in] (or [sum of rows])
                start = 0
                for p in params:
                    p.data = fused[start:start + p.shape[0]]  # a contiguous row slice: a view
                    start += p.shape[0]


# -- the step's pure functions (eager on the CPU, compiled on a GPU) ----------------------------------


class BlockWeights(NamedTuple):
    """One decoder block's weight tensors (the model's own storage, detached; None = absent).

    ``qkv`` and ``gate_up`` hold one fused tensor when the projections are fused
    (:func:`fuse_projections`: one GEMM each), else the separate matrices (one GEMM each)."""

    input_norm: Tensor  # [H]
    qkv: tuple[Tensor, ...]  # ([(Hq+2Hkv)*D, H],) fused, or (q [Hq*D, H], k [Hkv*D, H], v [Hkv*D, H])
    qkv_bias: tuple[Tensor, ...] | None  # likewise ([(Hq+2Hkv)*D],) or (q, k, v) biases (Qwen2)
    o: Tensor  # [H, Hq*D]
    o_bias: Tensor | None
    q_norm: Tensor | None  # [D] (Qwen3: RMSNorm per head, before the rotation)
    k_norm: Tensor | None
    post_norm: Tensor  # [H]
    gate_up: tuple[Tensor, ...]  # ([2I, H],) fused, or (gate [I, H], up [I, H])
    gate_up_bias: tuple[Tensor, ...] | None
    down: Tensor  # [H, I]
    down_bias: Tensor | None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's LlamaRMSNorm: float32, x * rsqrt(mean(x^2) + eps), cast back, times the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def linear(a: Tensor, w: Tensor, bias: Tensor | None = None, *, matvec: bool = False) -> Tensor:
    """a [B, in] times w [out, in] transposed, plus bias [out] -> [B, out] (``F.linear``; a [..., in]
    with more dimensions -> [..., out], by F.linear).

    ``matvec`` (for compiled steps; B = 1 only, else ignored): the product written as a float32
    reduction, sum_k w[n, k] * a[k], which inductor turns into one Triton kernel that streams w once,
    with a's cast and any cheap pointwise producer of a (a norm's scaling) fused into its loads (not
    an expensive one: every program would recompute it, see :func:`_down`). On an H200,
    in CUDA graphs, an 8B-shaped step's matrices take 1.11x the bandwidth floor with cuBLAS and
    1.00x as tuned reductions (``benchmarks/2026-12-01-matvec-h200.md``); a small model's step
    gains more, from fewer kernels. Run eagerly it would materialise w * a: compiled functions
    only. The sum is float32 like cuBLAS's accumulator; only its order differs."""
    if matvec and a.shape[0] == 1:
        y = (w.float() * a.float()).sum(-1)[None]  # [1, out], float32
        return (y if bias is None else y + bias.float()).to(a.dtype)
    B = a.shape[0]
    if a.device.type == "cpu" and a.dim() == 2 and B <= CPU_TRANSPOSED_ROWS:
        # On the CPU, y^T = w a^T (a GEMM whose second operand has B columns) streams w faster than
        # F.linear for a few rows, and one row runs as two (MKL's GEMV is slower still). The
        # products of SmolLM2's step (540 MB of float32 weights, from DRAM) on the 2-core EPYC,
        # medians of 3 rounds: 1, 2, 4, 7 rows 52, 94, 85, 108 ms with F.linear and 27, 30, 43,
        # 66 ms so (benchmarks/2026-12-02-cpu-demo.md).
        rows = a if B > 1 else torch.cat([a, a])  # [max(B, 2), in]
        y = (w @ rows.T).T[:B].contiguous()  # [B, out]
        return y if bias is None else y + bias
    return F.linear(a, w, bias)


def project(a: Tensor, weights: tuple[Tensor, ...], biases: tuple[Tensor, ...] | None,
            sizes: Sequence[int], *, matvec: bool = False) -> tuple[Tensor, ...]:
    """a [B, H] through stacked projections of output widths ``sizes``: one GEMM by the fused weight
    [sum(sizes), H] whose output [B, sum(sizes)] is split into views [B, size] (no copy), or one
    GEMM by each separate weight [size, H]. ``matvec``: see :func:`linear`."""
    if len(weights) == 1:
        return linear(a, weights[0], None if biases is None else biases[0], matvec=matvec).split(list(sizes), dim=-1)
    return tuple(linear(a, w, None if biases is None else biases[j], matvec=matvec) for j, w in enumerate(weights))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rope: x [B, heads, D], cos/sin [B, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _prologue(ids: Tensor, pos: Tensor, block: Tensor, start: Tensor, embed: Tensor, inv_freq: Tensor, *,
              n_keys: int, rope_scaling: float) -> tuple[Tensor, ...]:
    """A step's inputs on the device. ids, pos [B] long; block [B, B] bool (new token i may attend
    new token j); start [1] long (cache_len: the first slot written); embed [V, H]; inv_freq [D/2].

    Returns h [B, H] (the embeddings: boundary 0), zero [B, H] (the residual still to add: none),
    cos, sin [B, 1, D] (Hugging Face's rotary embedding, attention scaling included, in the model's
    dtype), slots [B] long (start .. start+B-1) and mask [B, n_keys] bool: every committed entry
    (index < start), then the block at start .. start+B-1, nothing after."""
    B = ids.shape[0]
    h = F.embedding(ids, embed)  # [B, H]
    freqs = pos.float()[:, None] * inv_freq.float()[None, :]  # [B, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, D]
    cos = (emb.cos() * rope_scaling).to(h.dtype)[:, None]  # [B, 1, D]
    sin = (emb.sin() * rope_scaling).to(h.dtype)[:, None]
    rel = torch.arange(n_keys, device=ids.device) - start  # [n_keys]: entry index - cache_len
    in_block = block[:, rel.clamp(0, B - 1)]  # [B, n_keys]: block[i, entry - cache_len]
    mask = (rel < 0) | ((rel < B) & in_block)  # [B, n_keys]
    slots = start + torch.arange(B, device=ids.device)  # [B]
    return h, torch.zeros_like(h), cos, sin, slots, mask


def _before_attention(x: Tensor, d: Tensor | None, w: BlockWeights, kv_heads: int, head_dim: int, *, eps: float,
                      qk_eps: float, matvec: OneRow) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A block's front for B tokens: the stream entering it h_in = x + d [B, H] (the previous
    block's last residual add is done here, fused with this block's norm; d None: x alone), and its
    queries, keys and values q [B, Hq, D], k, v [B, Hkv, D], not yet rotated (views of the fused
    projection's output; Qwen3's per-head norms applied). ``matvec``: see :func:`_in_kernels`."""
    h_in = x if d is None else x + d  # [B, H]
    B, Hkv, D = h_in.shape[0], kv_heads, head_dim
    Hq = w.o.shape[1] // D
    sizes = (Hq * D, Hkv * D, Hkv * D)
    if _in_kernels(matvec, h_in):  # the norm in the product's kernel
        q, k, v = stacked_products(h_in, w.qkv, w.qkv_bias, prologue="rms", norm=w.input_norm,
                                   eps=eps).split(sizes, dim=-1)
    else:
        q, k, v = project(rms_norm(h_in, w.input_norm, eps), w.qkv, w.qkv_bias, sizes,
                          matvec=matvec == "reduce")  # [B, Hq*D], [B, Hkv*D] x 2
    q, k, v = q.view(B, Hq, D), k.view(B, Hkv, D), v.view(B, Hkv, D)  # (views of the fused output too)
    if w.q_norm is not None:  # Qwen3: RMSNorm per head, before the rotation
        q, k = rms_norm(q, w.q_norm, qk_eps), rms_norm(k, w.k_norm, qk_eps)
    return h_in, q, k, v


def _layer(x: Tensor, d: Tensor | None, cos: Tensor, sin: Tensor, slots: Tensor, mask: Tensor, keys: Tensor,
           values: Tensor, w: BlockWeights, *, eps: float, qk_eps: float, scaling: float,
           matvec: OneRow = "gemm", sdpa: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """One decoder block for B tokens. The stream entering it is x + d [B, H] (the previous block's
    last residual add is done here, fused with this block's norm; d None: x alone); cos, sin
    [B, 1, D]; slots [B] (where the new keys/values go); mask [B, n] bool over the first n cache
    entries; keys, values [Hkv, C, D] this block's cache, written in place at ``slots``.

    Returns (h_in, h, act): the stream entering the block (its boundary) and the stream after
    attention [B, H], and the MLP's activation SiLU(gate) * up [B, I], which :func:`_down` projects
    (where :func:`_in_kernels`: the gate/up output [B, 2I], SiLU(gate) * up done in the down
    product's kernel). ``matvec``: see :func:`_in_kernels`. ``sdpa``: attention as one
    ``scaled_dot_product_attention`` call (a fused kernel on a GPU, which keeps the probabilities in
    float32 for PV) instead of the eager order's three steps (QK in the model's dtype; scale, mask
    and softmax in float32, cast back; PV)."""
    Hkv, _, D = keys.shape
    h_in, q, k, v = _before_attention(x, d, w, Hkv, D, eps=eps, qk_eps=qk_eps, matvec=matvec)
    out = _attend(q, k, v, cos, sin, slots, mask, keys, values, scaling=scaling, sdpa=sdpa)
    return _after_attention(h_in, out, w, eps=eps, matvec=matvec)


def _attend(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: Tensor, keys: Tensor,
            values: Tensor, *, scaling: float, sdpa: bool = False) -> Tensor:
    """:func:`_layer`'s attention: q [B, Hq, D] and k [B, Hkv, D] rotated, k and v [B, Hkv, D]
    written to keys, values [Hkv, C, D] at ``slots``, then the B queries attend the first n entries
    under mask [B, n]. Returns out [B, Hq*D], query head j attending key-value head j // G."""
    Hkv, _, D = keys.shape
    B, Hq = q.shape[:2]
    G = Hq // Hkv
    n = mask.shape[1]
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    # Two writes: inductor fuses the keys' with rope (a stacked write of both took one kernel more)
    keys.index_copy_(1, slots, k.transpose(0, 1))  # [Hkv, B, D] into [Hkv, C, D]
    values.index_copy_(1, slots, v.transpose(0, 1))
    keys, values = keys[:, :n], values[:, :n]  # [Hkv, n, D]: the entries attended
    # Grouped-query attention without copying the cache: query head j reads key/value head j // G,
    # so the G query heads of a group become G*B rows against their shared keys.
    qg = q.view(B, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * B, D)  # rows (g, b)
    if sdpa:  # row (g, b) attends under mask[b]: the mask repeated per group, [G*B, n] (no row is all False)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask.repeat(G, 1), scale=scaling)
    else:
        scores = torch.matmul(qg, keys.transpose(1, 2))  # [Hkv, G*B, n], the model's dtype
        scores = (scores.float() * scaling).view(Hkv, G, B, n).masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(v.dtype).view(Hkv, G * B, n)
        out = torch.matmul(p, values)  # [Hkv, G*B, D]
    return out.view(Hkv, G, B, D).permute(2, 0, 1, 3).reshape(B, Hq * D)  # head j = g-th of group j // G


def _layer_split_kv(x: Tensor, d: Tensor | None, cos: Tensor, sin: Tensor, slots: Tensor, mask: Tensor, kv: Tensor,
                    w: BlockWeights, *, eps: float, qk_eps: float, scaling: float,
                    matvec: OneRow = "gemm") -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_layer` with attention by :func:`~eyas.engine.decode_attention.decode_attention`'s two
    Triton kernels, which also rotate q and k and write k and v at slots (slots[0] = cache_len;
    float32 scores, the probabilities rounded for PV). kv [2, Hkv, C, D]: the block's cache as ONE
    tensor: handed to a Triton kernel that writes it, two aliasing views (keys, values) made
    inductor clone them and copy them back (7 us a block on the H200), while the eager order's
    index_copy_ writes are cheaper through two views (one tensor there cost a copy of the block's
    cache a step: ``benchmarks/2026-12-02-split-kv-h200.md``)."""
    from eyas.engine.decode_attention import decode_attention

    Hkv, _, D = kv.shape[1:]
    h_in, q, k, v = _before_attention(x, d, w, Hkv, D, eps=eps, qk_eps=qk_eps, matvec=matvec)
    B, Hq = q.shape[:2]
    out = decode_attention(q.reshape(B, Hq * D), k.reshape(B, Hkv * D), v.reshape(B, Hkv * D), cos[:, 0], sin[:, 0],
                           kv, mask, slots, scaling)
    return _after_attention(h_in, out, w, eps=eps, matvec=matvec)


def _after_attention(h_in: Tensor, out: Tensor, w: BlockWeights, *, eps: float,
                     matvec: OneRow) -> tuple[Tensor, Tensor, Tensor]:
    """The rest of :func:`_layer` from the attention's output out [B, Hq*D]: the o projection and
    its residual add, the post-attention norm, gate/up and SiLU(gate) * up (where :func:`_in_kernels`:
    the o product with its residual add, then gate/up with its norm, two kernels; one row leaves the
    SiLU to :func:`_down`'s kernel and returns the gate/up output [1, 2I], more rows of a fused
    gate/up compute SiLU(gate) * up [B, I] in the gate/up kernel's epilogue, ``glu``)."""
    I = w.down.shape[1]
    if _in_kernels(matvec, out):
        h = _fused_matvec(out.contiguous(), w.o, bias=w.o_bias, residual=h_in)
        if h.shape[0] > 1 and len(w.gate_up) == 1:  # few rows: the SiLU once, in the gate/up kernel
            return h_in, h, _fused_matvec(h, w.gate_up[0], prologue="rms", norm=w.post_norm, eps=eps,
                                          bias=None if w.gate_up_bias is None else w.gate_up_bias[0], glu=True)
        return h_in, h, stacked_products(h, w.gate_up, w.gate_up_bias, prologue="rms", norm=w.post_norm,
                                         eps=eps)  # [B, 2I]
    by_reduction = matvec == "reduce"
    h = h_in + linear(out, w.o, w.o_bias, matvec=by_reduction)
    gate, up = project(rms_norm(h, w.post_norm, eps), w.gate_up, w.gate_up_bias, (I, I),
                       matvec=by_reduction)  # [B, I] each
    return h_in, h, F.silu(gate) * up


def _fused_matvec(x: Tensor, w: Tensor, **options) -> Tensor:
    """:func:`eyas.engine.matvec.matvec`, imported at its first use: Triton is needed only where
    ``matvec="triton"`` is asked for (and checked then, by :func:`_check_triton`)."""
    from eyas.engine.matvec import matvec

    return matvec(x, w, **options)


def _in_kernels(matvec: OneRow, a: Tensor) -> bool:
    """Whether a product of a [B, ...] runs our Triton kernels (:mod:`eyas.engine.matvec`, the norms,
    SiLU and residual adds in the products' kernels): with ``matvec="triton"`` and B = 1 (the
    one-row kernel), or ``"triton-verify"`` and B <= ``KERNEL_ROWS`` (more rows by the few-row
    kernel). ``"gemm"``: F.linear; ``"reduce"``: one row as a float32 reduction (see :func:`linear`).
    Other steps use F.linear."""
    B = a.shape[0]
    return (matvec == "triton" and B == 1) or (matvec == "triton-verify" and B <= KERNEL_ROWS)


def stacked_products(a: Tensor, weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...] | None,
                     **options) -> Tensor:
    """The rows a [B, K] through stacked projections with eyas' kernels (:func:`eyas.engine.matvec.matvec`
    and its ``options``, e.g. the norm as an "rms" prologue): [B, sum of their rows], one kernel for
    a fused weight, else one per separate weight (each repeating the prologue), concatenated. The
    target's q/k/v and gate/up, and the drafter's (:mod:`eyas.engine.draft_kernels`)."""
    rows = [_fused_matvec(a, w, bias=None if biases is None else biases[j], **options) for j, w in enumerate(weights)]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=-1)


def _down(h: Tensor, act: Tensor, down: Tensor, down_bias: Tensor | None, *,
          matvec: OneRow = "gemm") -> tuple[Tensor, Tensor | None]:
    """A block's last product: the MLP's activation act [B, I] by down [H, I], m [B, H]. Returns the
    block's output as (x, d) for the next block: (h, m), the add left to the next norm, or with
    ``matvec="reduce"`` and one row, or where :func:`_in_kernels`, (h + m, None), the add done in
    this product's kernel (with the Triton kernels, act may be the gate/up output [B, 2I], and the
    kernel computes SiLU(gate) * up: see :func:`_after_attention`).

    A function of its own (compiled apart from :func:`_layer`) so that act reaches it as a buffer:
    compiled together, inductor inlines SiLU(gate) * up into the down reduction's loads, and every
    program of that weight-streaming kernel recomputes the exponentials of the whole [I] vector (on
    the 8B shape, in one H200 call: 34.5 us a block, against 29.2 us with act read from a buffer,
    written by a 1.2 us kernel; ``benchmarks/2026-12-02-llama8b-h200.md``). Saving that kernel by
    computing gate and up as two reductions that inductor fuses with SiLU was slower (63.5 us for
    gate/up against 56.1 us as one reduction of the fused weight, in one call)."""
    if _in_kernels(matvec, act):  # act: the gate/up output [B, 2I] (SiLU in this kernel), or SiLU(gate) * up
        prologue = "silu" if act.shape[1] == 2 * down.shape[1] else None
        return _fused_matvec(act, down, prologue=prologue, bias=down_bias, residual=h), None
    m = linear(act, down, down_bias, matvec=matvec == "reduce")
    if matvec == "reduce" and act.shape[0] == 1:
        return h + m, None
    return h, m


def _head(x: Tensor, d: Tensor | None, norm: Tensor, lm_head: Tensor, lm_bias: Tensor | None, *,
          eps: float, matvec: OneRow = "gemm") -> tuple[Tensor, Tensor]:
    """The last block's output x + d [B, H] (boundary L; d None: x) and the logits [B, V]."""
    h = x if d is None else x + d
    if _in_kernels(matvec, h):
        return h, _fused_matvec(h, lm_head, prologue="rms", norm=norm, eps=eps, bias=lm_bias)
    return h, linear(rms_norm(h, norm, eps), lm_head, lm_bias, matvec=matvec == "reduce")


class _StepFunctions(NamedTuple):
    """A step's four functions (eager or compiled), up to how many rows their blocks return their
    output whole (see :func:`_down`: the blocks then pass no residual along; 0: never), and
    split-kv's layer (:func:`_layer_split_kv`, which takes a block's cache as one tensor kv
    [2, Hkv, C, D]; ``layer`` takes keys, values) with the most rows a step runs it for."""

    prologue: Callable
    layer: Callable
    down: Callable
    head: Callable
    whole_output_rows: int
    split_kv_layer: Callable | None = None
    split_kv_rows: int = 0


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

    ``matvec`` says how the fixed-shape steps multiply by the weights: ``"gemm"`` (``F.linear``:
    cuBLAS), ``"reduce"`` (steps of one token: a float32 reduction that inductor compiles into one
    weight-streaming kernel, see :func:`linear`), ``"reduce-tuned"`` (the same, with inductor's
    coordinate-descent tuning of every kernel's block sizes: a longer compilation), ``"triton"``
    (steps of one token, plain decoding: :mod:`eyas.engine.matvec`'s one-row kernel, one Triton
    kernel per product that also does the norm before it, SiLU(gate) * up and the residual add, 4
    kernels a block; it needs Triton, like split-kv), ``"triton-verify"`` (those kernels for every
    fixed-shape step of up to ``KERNEL_ROWS`` = 64 tokens, the verification of a tree included,
    more rows by the few-row kernel; with split-kv attention, verification attends through it
    too; and the drafter's steps run the same kernels, :mod:`eyas.engine.draft_kernels`), or
    ``"auto"`` (the default: where the steps are compiled on a GPU and triton is installed,
    ``"triton-verify"`` for a model of hidden size up to ``FEW_ROW_KERNELS_UP_TO_HIDDEN`` (1024)
    with split-kv attention, ``"triton"`` for larger ones, else ``"gemm"``; :func:`_auto_kernels`).
    Other steps use ``F.linear``.
    Measured on an H200 in bf16 (``benchmarks/2026-12-01-matvec-h200.md``): a SmolLM2-shaped plain
    step 1.229 ms (gemm), 0.976 (reduce), 0.933 (reduce-tuned); an 8B-shaped one 4.949, 6.458 and
    4.849 ms, warm-up 27, 4 and 89 s; with the down product compiled apart (:func:`_down`), 4.878
    (gemm) and 4.427 ms (reduce-tuned) on one machine (``benchmarks/2026-12-02-llama8b-h200.md``:
    1.37x and 1.24x the floor). Not the default: the float32 greedy identity test with the HF
    model failed once on that GPU with ``"reduce"`` and passed on 2026-12-02. With ``"triton"`` and
    split-kv attention the 8B-shaped plain step took 4.244 and 4.206 ms on two machines, 1.19x the
    floor, against 5.190 and 5.073 ms with cuBLAS
    (``benchmarks/2026-12-02-matvec-triton-h200.md``); a SmolLM2-shaped one 0.614 ms against 1.404.
    ``"triton-verify"`` (``benchmarks/2026-12-02-verify-kernels-h200.md``): its first
    version verified 24 tokens in 13.02 ms on the 8B shape against 5.49 with cuBLAS, and on
    SmolLM2's MT-bench speculative decoding ran at 1164.5 tok/s against 1299.9 (one call; the down
    product's SiLU prologue took 4-7x cuBLAS's time). With the SiLU in the gate/up kernel (glu) and
    measured tilings, SmolLM2-shaped verification of 24 tokens took 1.146 ms against 1.365 with
    cuBLAS (another call), while the 8B step's compilation ran out of shared memory (since fixed,
    measured since: 7.25 ms, against 5.45 with cuBLAS). With ``"triton"``, eyas plain decoded
    SmolLM2 at 1415.6 tok/s against 860.4 with cuBLAS, and speculative decoding (cuBLAS
    verification) at 1299.9; with ``"triton-verify"`` and the drafter's round functions compiled
    whole, speculative decoding ran at 1556.7 tok/s against 1410.0 plain, 1.10x
    (``benchmarks/2026-12-02-round-compile-h200.md``).

    ``attention`` says how the steps attend over the cache: ``"auto"`` (the default: ``"split-kv"``
    where ``matvec``'s auto picks eyas' kernels and the head dimension is a power of two of at least
    16, else ``"eager"``), ``"eager"`` (Hugging Face's eager
    order: QK, a float32 softmax under the mask, PV; three kernels a block on a GPU), ``"sdpa"``
    (one ``scaled_dot_product_attention`` call a block, a fused kernel on a GPU; equal to the model
    in float32 on the CPU), or ``"split-kv"`` (the fixed-shape steps of one token, and with
    ``matvec="triton-verify"`` those of up to 64: two Triton kernels a block that also rotate q and
    k and write the cache, :mod:`eyas.engine.decode_attention`; it needs Triton, a GPU or
    ``TRITON_INTERPRET=1``, and a power-of-two head dimension). On an H200, 8B-shaped, bf16
    (``benchmarks/2026-12-02-split-kv-h200.md``): SDPA 6.245 ms a plain step against 5.391 eager
    (gemm, one call); split-kv with gemm 4.769 ms and 400 kernels (1.34x the floor, another
    machine); verifying 24 tokens with gemm, 5.98 ms split-kv against 5.59 eager (one call). SDPA
    is opt-in (slower); split-kv goes with ``matvec="triton"`` (above)."""

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
        def w(module: nn.Module | None, name: str = "weight") -> Tensor | None:
            t = getattr(module, name, None) if module is not None else None
            return None if t is None else t.detach()

        def rows(group: Sequence[nn.Module], name: str = "weight") -> tuple[Tensor, ...] | None:
            """The group's weights (biases) as (the fused tensor,), a view of the rows the model's
            parameters share, or the separate tensors when not fused."""
            parts = [w(m, name) for m in group]
            if parts[0] is None:
                return None
            if self.unfused_reason is None:
                fused = stacked_rows(parts)
                assert fused is not None, "fuse_projections left rows apart"
                return (fused,)
            return tuple(parts)  # type: ignore[arg-type]

        self.weights = []
        for b in blocks:
            qkv, gate_up = _projection_groups(b)
            self.weights.append(BlockWeights(
                input_norm=w(b.input_layernorm), qkv=rows(qkv), qkv_bias=rows(qkv, "bias"),
                o=w(b.self_attn.o_proj), o_bias=w(b.self_attn.o_proj, "bias"),
                q_norm=w(getattr(b.self_attn, "q_norm", None)), k_norm=w(getattr(b.self_attn, "k_norm", None)),
                post_norm=w(b.post_attention_layernorm),
                gate_up=rows(gate_up), gate_up_bias=rows(gate_up, "bias"),
                down=w(b.mlp.down_proj), down_bias=w(b.mlp.down_proj, "bias"),
            ))  # type: ignore[arg-type]
        self.embed_weight = base.embed_tokens.weight.detach()  # [V, H]
        self.inv_freq = base.rotary_emb.inv_freq  # [D/2] (a buffer: rope scaling already applied)
        self.norm_weight = base.norm.weight.detach()  # [H]
        self.lm_head_weight, self.lm_head_bias = w(lm_head), w(lm_head, "bias")  # [V, H], None

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
        auto_matvec, auto_attention = _auto_kernels(self.compile, self.head_dim, int(cfg.hidden_size))
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

    def _functions(self, backend: str | None, matvec: str = "gemm", attention: str = "eager") -> _StepFunctions:
        """The step's functions (prologue, layer, down, head) with this model's constants, ``matvec``
        and ``attention`` bound; compiled with ``backend`` (None: eager). Compiled, every call with a
        bucket's shapes hits the same compilation."""
        c = self._consts
        how: OneRow = "reduce" if matvec == "reduce-tuned" else matvec  # type: ignore[assignment]
        block = dict(eps=c["eps"], qk_eps=c["qk_eps"], scaling=c["scaling"], matvec=how)
        fns = [functools.partial(_prologue, rope_scaling=c["rope_scaling"]),
               functools.partial(_layer, **block, sdpa=attention == "sdpa"),
               functools.partial(_down, matvec=how), functools.partial(_head, eps=c["eps"], matvec=how)]
        whole_rows = {"gemm": 0, "reduce": 1, "triton": 1, "triton-verify": KERNEL_ROWS}[how]  # see _down
        # split-kv: the steps of one token; with the Triton kernels for verification, those steps too
        split_rows = 0 if attention != "split-kv" else KERNEL_ROWS if how == "triton-verify" else 1
        if split_rows:
            fns.append(functools.partial(_layer_split_kv, **block))
        if backend is not None:
            # Each function's shapes (_prologue and _layer: per (token bucket, key bucket) pair; _down and
            # _head: per token bucket; per model) are separate compilations of one code object
            # (functools.partial's): 6 token buckets x 4 key buckets = 24 of _layer for C = 4096.
            raise_recompile_limits()
            options = {"coordinate_descent_tuning": True} if matvec == "reduce-tuned" else None
            fns = [torch.compile(f, backend=backend, fullgraph=True, dynamic=False, options=options) for f in fns]
        return _StepFunctions(*fns[:4], whole_rows, fns[4] if split_rows else None, split_rows)

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

    def _step(self, inputs: _Inputs, n_keys: int, fns: _StepFunctions) -> tuple[Tensor, Tensor]:
        """One forward of B = len(inputs.ids) tokens attending the first ``n_keys`` cache entries; its
        shapes depend only on those two numbers. Returns logits [B, V] and the captured boundaries
        [B, S*H] in the spec's slot order (boundary b = the residual stream entering block b;
        boundary L = the last block's output, before the final norm)."""
        prologue, layer, down, head, whole_output_rows, split_kv_layer, split_kv_rows = fns
        x, d, cos, sin, slots, mask = prologue(*inputs, self.embed_weight, self.inv_freq, n_keys=n_keys)
        if x.shape[0] <= whole_output_rows:
            d = None  # every block returns its output whole (see _down): one compilation of _layer
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
        and the key bucket it attends; None where it runs exact shapes (not ``fixed_shapes``, T past
        the largest bucket, or the pads' slots past the capacity). Host ints only."""
        B = next((b for b in self.buckets if b >= T), None) if self.fixed_shapes else None
        if B is None or self._len + B > self.max_length:
            return None
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
        compilation of ``_prologue`` and ``_layer`` (``_down`` and ``_head`` compile once per B) and one CUDA
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


TARGET_IMPLEMENTATIONS = ("auto", "fast", "hf")


def build_target(model: nn.Module, spec: CaptureSpec, implementation: str = "auto", matvec: str = "auto",
                 attention: str = "auto") -> Target:
    """The target the engine serves ``model`` with (``--target-impl``).

    - ``fast``: :class:`LlamaTarget` (fixed shapes, compiled, CUDA graphs on a GPU; refused, with the
      reason, for an architecture it does not implement);
    - ``hf``: :class:`~eyas.engine.target.HFTarget`, any causal LM;
    - ``auto``: ``fast`` wherever it applies (on a GPU with CUDA graphs; on a CPU eagerly, where
      its static cache still beats the Hugging Face model: SmolLM2 in float32 on 2 cores, 22.6
      against 20.0 tok/s plain and 20.0 against 17.6 speculative), else ``hf``.
    The returned target's ``implementation`` says which one runs. ``matvec`` and ``attention``: the
    fast target's one-token products and its attention (:class:`LlamaTarget`, which checks them);
    asking for one that is not the default where the Hugging Face target runs is refused, with the
    reason.
    """
    from eyas.engine.target import HFTarget

    impl = str(implementation).lower()
    if impl not in TARGET_IMPLEMENTATIONS:
        raise UnsupportedTarget(f"--target-impl: expected one of {list(TARGET_IMPLEMENTATIONS)}, found {implementation!r}")
    on_gpu = next(model.parameters()).device.type == "cuda"
    if impl == "hf" or (impl == "auto" and supports(model) is not None):
        asked = [f"--{k} {v}" for k, v in (("matvec", matvec), ("attention", attention))
                 if v not in ("auto", "gemm", "eager")]  # what the fast target would change
        if asked:
            why = "--target-impl hf" if impl == "hf" else supports(model)
            raise UnsupportedTarget(f"{' '.join(asked)}: options of the fast Llama-family target, and this model runs "
                                    f"on the Hugging Face target ({why}); leave them out")
        return HFTarget(model, spec)
    return LlamaTarget(model, spec, cuda_graphs=on_gpu, matvec=matvec, attention=attention)
