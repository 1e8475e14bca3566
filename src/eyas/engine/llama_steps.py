"""The fast Llama-family target's step as pure functions over tensors (eager on the CPU, compiled on
a GPU), which take the model's weight tensors as arguments (references gathered once at
construction, no copies: :func:`block_weights`):

- ``_prologue``: the embeddings, the rotary cos/sin of the positions, the cache slots the step
  writes and its attention mask, from ids, positions, the new tokens' [B, B] block mask and the
  first slot (cache_len, a device scalar);
- ``_layer``: one decoder block (RMSNorm, q/k/v with optional bias, Qwen3's per-head q/k norm,
  rotate-half rope, keys/values written into the block's cache by index, grouped-query attention
  over the cache under the mask, o, RMSNorm, the MLP's gate/up and SiLU); every block is the same
  function on its own weights and cache (``_layer_split_kv``: the same block with split-KV
  attention kernels);
- ``_down``: the block's last product, the MLP's down projection (apart from ``_layer`` for one
  reason: see its docstring);
- ``_head``: the final norm and the logits.

The ``matvec`` argument picks how each product runs (``F.linear``, a float32 reduction or eyas' Triton
kernels: :mod:`eyas.engine.llama_kernels`). :func:`step_functions` binds a model's constants and its
``matvec`` and ``attention`` options into a step's functions, eager or compiled;
:class:`~eyas.engine.llama.LlamaTarget` walks the blocks through them (its ``_step``).

The numerics are Hugging Face's: RMSNorm in float32 (x * rsqrt(mean(x^2) + eps), cast back, times the
weight), scores q.k in the model's dtype, scaled and softmaxed in float32, cast back (the eager
attention's order). ``tests/test_engine_llama.py`` holds the logits and the features equal to
:class:`~eyas.engine.target.HFTarget` in float32.

Boundaries (docs/conventions.md): ``_layer`` returns the stream entering its block (its boundary),
and ``_down`` leaves the block's last residual add to the next block (or ``_head``), where it fuses
with the next norm (a fixed-shape step whose products run eyas' Triton kernels, or one of one token
with ``matvec="reduce"``, adds it in the down product's kernel instead: see :func:`_down`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.engine.graphs import raise_recompile_limits
from eyas.engine.llama_kernels import (KERNEL_ROWS, OneRow, fused_matvec, in_kernels, projection_groups, linear,
                                       project, stacked_products, stacked_rows)


class BlockWeights(NamedTuple):
    """One decoder block's weight tensors (the model's own storage, detached; None = absent).

    ``qkv`` and ``gate_up`` hold one fused tensor when the projections are fused
    (:func:`~eyas.engine.llama_kernels.fuse_projections`: one GEMM each), else the separate matrices
    (one GEMM each)."""

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


def detached(module: nn.Module | None, name: str = "weight") -> Tensor | None:
    """``module``'s tensor ``name`` detached (a reference to the model's storage, no copy); None when
    there is none."""
    t = getattr(module, name, None) if module is not None else None
    return None if t is None else t.detach()


def block_weights(block: nn.Module, fused: bool) -> BlockWeights:
    """A decoder block's weights, gathered once: detached references to the model's parameters (no
    copies). ``fused``: its q/k/v and gate/up projections were stacked
    (:func:`~eyas.engine.llama_kernels.fuse_projections`)."""
    w = detached

    def rows(group: Sequence[nn.Module], name: str = "weight") -> tuple[Tensor, ...] | None:
        """The group's weights (biases) as (the fused tensor,), a view of the rows the model's
        parameters share, or the separate tensors when not fused."""
        parts = [w(m, name) for m in group]
        if parts[0] is None:
            return None
        if fused:
            stacked = stacked_rows(parts)
            assert stacked is not None, "fuse_projections left rows apart"
            return (stacked,)
        return tuple(parts)  # type: ignore[arg-type]

    attn, mlp = block.self_attn, block.mlp
    qkv, gate_up = projection_groups(block)
    return BlockWeights(
        input_norm=w(block.input_layernorm), qkv=rows(qkv), qkv_bias=rows(qkv, "bias"),
        o=w(attn.o_proj), o_bias=w(attn.o_proj, "bias"),
        q_norm=w(getattr(attn, "q_norm", None)), k_norm=w(getattr(attn, "k_norm", None)),
        post_norm=w(block.post_attention_layernorm),
        gate_up=rows(gate_up), gate_up_bias=rows(gate_up, "bias"),
        down=w(mlp.down_proj), down_bias=w(mlp.down_proj, "bias"),
    )  # type: ignore[arg-type]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's LlamaRMSNorm: float32, x * rsqrt(mean(x^2) + eps), cast back, times the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)

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
    projection's output; Qwen3's per-head norms applied). ``matvec``: see :func:`in_kernels`."""
    h_in = x if d is None else x + d  # [B, H]
    B, Hkv, D = h_in.shape[0], kv_heads, head_dim
    Hq = w.o.shape[1] // D
    sizes = (Hq * D, Hkv * D, Hkv * D)
    if in_kernels(matvec, h_in):  # the norm in the product's kernel
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
    (where :func:`in_kernels`: the gate/up output [B, 2I], SiLU(gate) * up done in the down
    product's kernel). ``matvec``: see :func:`in_kernels`. ``sdpa``: attention as one
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
    cache a step: ``benchmarks/results/2026-12-02-split-kv-h200.md``)."""
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
    its residual add, the post-attention norm, gate/up and SiLU(gate) * up (where :func:`in_kernels`:
    the o product with its residual add, then gate/up with its norm, two kernels; one row leaves the
    SiLU to :func:`_down`'s kernel and returns the gate/up output [1, 2I], more rows of a fused
    gate/up compute SiLU(gate) * up [B, I] in the gate/up kernel's epilogue, ``glu``)."""
    I = w.down.shape[1]
    if in_kernels(matvec, out):
        h = fused_matvec(out.contiguous(), w.o, bias=w.o_bias, residual=h_in)
        if h.shape[0] > 1 and len(w.gate_up) == 1:  # few rows: the SiLU once, in the gate/up kernel
            return h_in, h, fused_matvec(h, w.gate_up[0], prologue="rms", norm=w.post_norm, eps=eps,
                                          bias=None if w.gate_up_bias is None else w.gate_up_bias[0], glu=True)
        return h_in, h, stacked_products(h, w.gate_up, w.gate_up_bias, prologue="rms", norm=w.post_norm,
                                         eps=eps)  # [B, 2I]
    by_reduction = matvec == "reduce"
    h = h_in + linear(out, w.o, w.o_bias, matvec=by_reduction)
    gate, up = project(rms_norm(h, w.post_norm, eps), w.gate_up, w.gate_up_bias, (I, I),
                       matvec=by_reduction)  # [B, I] each
    return h_in, h, F.silu(gate) * up

def _down(h: Tensor, act: Tensor, down: Tensor, down_bias: Tensor | None, *,
          matvec: OneRow = "gemm") -> tuple[Tensor, Tensor | None]:
    """A block's last product: the MLP's activation act [B, I] by down [H, I], m [B, H]. Returns the
    block's output as (x, d) for the next block: (h, m), the add left to the next norm, or with
    ``matvec="reduce"`` and one row, or where :func:`in_kernels`, (h + m, None), the add done in
    this product's kernel (with the Triton kernels, act may be the gate/up output [B, 2I], and the
    kernel computes SiLU(gate) * up: see :func:`_after_attention`).

    A function of its own (compiled apart from :func:`_layer`) so that act reaches it as a buffer:
    compiled together, inductor inlines SiLU(gate) * up into the down reduction's loads, and every
    program of that weight-streaming kernel recomputes the exponentials of the whole [I] vector (on
    the 8B shape, in one H200 call: 34.5 us a block, against 29.2 us with act read from a buffer,
    written by a 1.2 us kernel; ``benchmarks/results/2026-12-02-llama8b-h200.md``). Saving that kernel by
    computing gate and up as two reductions that inductor fuses with SiLU was slower (63.5 us for
    gate/up against 56.1 us as one reduction of the fused weight, in one call)."""
    if in_kernels(matvec, act):  # act: the gate/up output [B, 2I] (SiLU in this kernel), or SiLU(gate) * up
        prologue = "silu" if act.shape[1] == 2 * down.shape[1] else None
        return fused_matvec(act, down, prologue=prologue, bias=down_bias, residual=h), None
    m = linear(act, down, down_bias, matvec=matvec == "reduce")
    if matvec == "reduce" and act.shape[0] == 1:
        return h + m, None
    return h, m


def _head(x: Tensor, d: Tensor | None, norm: Tensor, lm_head: Tensor, lm_bias: Tensor | None, *,
          eps: float, matvec: OneRow = "gemm") -> tuple[Tensor, Tensor]:
    """The last block's output x + d [B, H] (boundary L; d None: x) and the logits [B, V]."""
    h = x if d is None else x + d
    if in_kernels(matvec, h):
        return h, fused_matvec(h, lm_head, prologue="rms", norm=norm, eps=eps, bias=lm_bias)
    return h, linear(rms_norm(h, norm, eps), lm_head, lm_bias, matvec=matvec == "reduce")


class StepFunctions(NamedTuple):
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


def step_functions(consts: dict[str, float], backend: str | None, matvec: str = "gemm",
                   attention: str = "eager") -> StepFunctions:
    """The step's functions (prologue, layer, down, head) with a model's constants ``consts`` (eps,
    qk_eps, scaling, rope_scaling), ``matvec`` and ``attention`` bound; compiled with ``backend``
    (None: eager). Compiled, every call with a bucket's shapes hits the same compilation."""
    c = consts
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
        # Each function's shapes (_layer: per (token bucket, key bucket) pair; _prologue, _down and
        # _head: per token bucket; per model) are separate compilations of one code object
        # (functools.partial's): 6 token buckets x 4 key buckets = 24 of _layer for C = 4096.
        raise_recompile_limits()
        options = {"coordinate_descent_tuning": True} if matvec == "reduce-tuned" else None
        fns = [torch.compile(f, backend=backend, fullgraph=True, dynamic=False, options=options) for f in fns]
    return StepFunctions(*fns[:4], whole_rows, fns[4] if split_rows else None, split_rows)
