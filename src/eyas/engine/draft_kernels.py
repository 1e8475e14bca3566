"""The drafter's fixed-shape step through the target's Triton kernels: 10 kernels a step, not 20.

On a GPU, speculative decoding's drafting is launch-bound. Each of the drafter's fixed-shape steps
(the expansion of the tree frontier at each depth, r = top_k rows; the re-read of a round's accepted
tokens, depth + 1 rows) is :class:`~eyas.drafter.model.Eagle3Drafter`'s forward, which inductor
compiles into ~20 kernels (a cuBLAS GEMM per product, norms, rope, the cache write, attention over
the whole cache in three kernels). :func:`draft_step` computes the same step with the kernels the
fast target runs its one-token steps with:

    prologue (torch; inductor fuses it)  x = cat(input_layernorm(embed(tokens)), hidden_norm(hidden))
                                         [r, 2H], the residual, rope's cos/sin [r, D]
    fc            matvec                 only from target features: [r, S*H_t] -> [r, H] (with
                                         norm_before_fc, input_norm as its "rms" prologue)
    q/k/v         matvec                 x @ [Wq; Wk; Wv]^T (stacked: one product), bias if any
    attention     decode_attention (2)   rotates q and k, writes rope(k) and v at the step's slots,
                                         attends the cache under the step's mask
    o             matvec                 h = residual + o(attn)
    gate/up       matvec, "rms", glu     SiLU(gate) * up, gate/up = post_attention_layernorm(h) @ [Wgate; Wup]^T
    down          matvec                 h = h + down(SiLU(gate) * up) (unstacked gate/up: "silu" here)
    head          matvec, "rms"          logits = lm_head(norm(h))

The hidden state fed back is h (pre-norm), or norm(h) with ``norm_output`` (then computed in torch).
Compiled by inductor, the prologue is 3 kernels, so a step is 10 kernels from fed-back states and 11
from target features, against 20 and 21 for the compiled forward. The drafter runs them where the
target verifies through its kernels (``matvec="triton-verify"``, the default for small targets:
:func:`eyas.engine.llama_kernels.auto_kernels`). On SmolLM2's MT-bench, drafting through them cost 0.86
ms a round against 0.82 with the forward, before the gate/up kernel's glu and before the round
functions were compiled whole (``benchmarks/results/2026-12-02-verify-kernels-h200.md``); with both, a
round of tree 4,8,31 drafted in 0.60 ms (``benchmarks/results/2026-12-02-round-compile-h200.md``, call 2).

Invariants the callers keep (``draft_state.DraftState``: the expansion writes slots m + scratch + arange(r),
the re-read and extend length + arange(B)): the step's r tokens write the consecutive cache slots
start .. start + r - 1 (start = slots[0]), and every entry its mask allows below start was written
before (the committed entries, the node's ancestors); decode_attention reads entries p < start from
the cache and takes the step's own from its projections, so it needs exactly that.

Numerics: the kernels round where Hugging Face's order rounds (see :mod:`eyas.engine.matvec`), which
is where the module rounds, except inside attention (float32 scores, q and k rotated in float32:
:mod:`eyas.engine.decode_attention`) and the float32 sums' order; in float32 the step equals the
module's forward to ~1e-5 (tests/test_draft_kernels.py).

The products take at most ``matvec.MAX_ROWS`` (64) rows: :func:`kernel_step` runs the module for a
step of more. Everything here is a pure function of tensors with shapes fixed by the inputs' (no host
read), so a step can be compiled with ``torch.compile(fullgraph=True)`` (Triton kernels launched
from Python are wrapped by dynamo; on a GPU only: dynamo cannot trace Triton's interpreter, so a step
compiled on the CPU falls back to eager, ``graphs.CompiledOrEager``) and captured in a CUDA graph.
The kernels need Triton: a GPU, or
``TRITON_INTERPRET=1`` on the CPU (:func:`why_not_kernels` says where they cannot run); this module
imports them at their first use, so it imports without Triton.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.drafter.model import Eagle3Drafter, KVCache
from eyas.engine.llama_kernels import (stack_rows, stacked_products, stacked_rows, why_no_triton, why_not_split_kv,
                                       why_not_stackable)
from eyas.engine.llama_steps import rms_norm
from eyas.errors import EyasError

KERNELS = ("torch", "triton")  # DraftState's choices: the module's forward, or draft_step


class UnsupportedDraftKernels(EyasError, ValueError):
    """kernels="triton" asked for where the drafter's Triton step cannot run."""


def why_not_kernels(drafter: Eagle3Drafter) -> str | None:
    """None when :func:`draft_step` can run ``drafter`` where it is; else why not, naming what it
    needs: Triton installed, the drafter on a GPU (or ``TRITON_INTERPRET=1`` on the CPU), and a
    head dimension decode_attention supports (a power of two, at least 16)."""
    why = why_no_triton(drafter.fc.weight.device, "drafter")
    if why is not None:
        return f"it {why}"
    why = why_not_split_kv(drafter.config.head_dim)
    return None if why is None else f"its attention kernel {why}"


def kernels_for(target_matvec: str | None, drafter: Eagle3Drafter) -> str:
    """The drafter's ``kernels`` on a target whose products run ``target_matvec``: "triton" where the
    target verifies through eyas' kernels ("triton-verify") and :func:`draft_step` can run the
    drafter; else "torch" (its forward), with a warning saying why when the target's kernels were
    there to follow."""
    if target_matvec != "triton-verify":
        return "torch"
    why = why_not_kernels(drafter)
    if why is None:
        return "triton"
    warnings.warn(f"the drafter's steps run its forward, not the Triton kernels of the target's "
                  f"matvec='triton-verify': {why}", stacklevel=4)
    return "torch"


def check_kernels(kernels: str, drafter: Eagle3Drafter) -> None:
    """Refuse a ``kernels`` choice that is unknown, or "triton" where it cannot run (with the reason
    and what to use instead): :class:`UnsupportedDraftKernels`."""
    if kernels not in KERNELS:
        raise UnsupportedDraftKernels(f"drafter kernels: expected one of {list(KERNELS)}, found {kernels!r}")
    if kernels == "triton":
        why = why_not_kernels(drafter)
        if why is not None:
            raise UnsupportedDraftKernels(f"drafter kernels='triton': {why}; use kernels='torch'")


# -- weights ---------------------------------------------------------------------------------------


def _projection_groups(drafter: Eagle3Drafter) -> tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]:
    """The midlayer's (q_proj, k_proj, v_proj) and (gate_proj, up_proj), in row order."""
    attn, mlp = drafter.midlayer.self_attn, drafter.midlayer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)


def fuse_drafter_projections(drafter: Eagle3Drafter) -> str | None:
    """Stack the midlayer's q/k/v projections into one weight [(Hq+2Hkv)*D, 2H] and gate/up into one
    [2I, H] (biases likewise), in place, as :func:`eyas.engine.llama.fuse_projections` does for a
    target: each Parameter becomes a view of its rows of the new tensor (``param.data = fused[rows]``),
    so no weight is held twice, the module computes exactly as before and its state_dict is
    unchanged. Idempotent (rows already stacked are left alone). All or nothing: when a group cannot
    be stacked (meta or quantized parameters, mixed dtypes, a bias on some only), nothing changes
    and the reason is returned; None when both groups are stacked."""
    groups = _projection_groups(drafter)
    for group, names in zip(groups, ("q/k/v", "gate/up")):
        why = why_not_stackable(group)
        if why is not None:
            return f"{names}: {why}"
    stack_rows(groups)
    return None


class DraftWeights(NamedTuple):
    """The drafter's tensors a step reads (detached references to its parameters, no copies; None =
    absent). ``qkv`` and ``gate_up`` hold one stacked tensor when the projections are stacked
    (:func:`fuse_drafter_projections`: one product each), else the separate matrices."""

    embed: Tensor  # [V, H] the target's token embedding
    fc: Tensor  # [H, S*H_t]
    fc_input_norm: Tensor | None  # [S*H_t] (norm_before_fc: RMSNorm over all slots, before fc)
    fc_slot_norms: tuple[Tensor, ...] | None  # S x [H_t] (fc_norm: RMSNorm per slot, before fc)
    input_norm: Tensor  # [H] midlayer.input_layernorm (on the token embeddings)
    hidden_norm: Tensor  # [H] midlayer.hidden_norm (on the fed hidden state)
    qkv: tuple[Tensor, ...]  # ([(Hq+2Hkv)*D, 2H],) stacked, or (q [Hq*D, 2H], k [Hkv*D, 2H], v [Hkv*D, 2H])
    qkv_bias: tuple[Tensor | None, ...] | None  # likewise (attention_bias; separate: None where one has none)
    o: Tensor  # [H, Hq*D]
    o_bias: Tensor | None
    post_norm: Tensor  # [H]
    gate_up: tuple[Tensor, ...]  # ([2I, H],) stacked, or (gate [I, H], up [I, H])
    gate_up_bias: tuple[Tensor | None, ...] | None  # likewise (mlp_bias)
    down: Tensor  # [H, I]
    down_bias: Tensor | None
    norm: Tensor  # [H] the final norm
    lm_head: Tensor  # [Vd, H]
    inv_freq: Tensor  # [D/2] rope's inverse frequencies (float32)


class DraftShape(NamedTuple):
    """The drafter's sizes and constants a step needs (host values: fixed when a step is traced)."""

    hidden_size: int  # H
    fc_in_features: int  # S * H_t
    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # D
    eps: float  # every RMSNorm's
    norm_before_residual: bool
    norm_output: bool


def draft_weights(drafter: Eagle3Drafter) -> DraftWeights:
    """The drafter's tensors as :func:`draft_step` reads them: references, no copies; the q/k/v and
    gate/up weights (biases) as one stacked tensor where their rows already lie one after another
    (after :func:`fuse_drafter_projections`), else separate."""
    ml = drafter.midlayer

    def w(module: nn.Module | None, name: str = "weight") -> Tensor | None:
        t = getattr(module, name, None) if module is not None else None
        return None if t is None else t.detach()

    def rows(group: Sequence[nn.Module], name: str = "weight") -> tuple[Tensor | None, ...] | None:
        """(the stacked tensor,) where the group's rows lie one after another, else the parts (a
        bias on some of them only: None for the others); None where none has one."""
        parts = [w(m, name) for m in group]
        if all(p is None for p in parts):
            return None
        stacked = None if any(p is None for p in parts) else stacked_rows(parts)  # type: ignore[arg-type]
        return tuple(parts) if stacked is None else (stacked,)

    qkv, gate_up = _projection_groups(drafter)
    cfg = drafter.config
    return DraftWeights(
        embed=w(drafter.embed_tokens), fc=w(drafter.fc),
        fc_input_norm=w(drafter.input_norm) if cfg.norm_before_fc else None,
        fc_slot_norms=tuple(w(n) for n in drafter.fc_norm) if cfg.fc_norm else None,  # type: ignore[misc]
        input_norm=w(ml.input_layernorm), hidden_norm=w(ml.hidden_norm),
        qkv=rows(qkv), qkv_bias=rows(qkv, "bias"),
        o=w(ml.self_attn.o_proj), o_bias=w(ml.self_attn.o_proj, "bias"),
        post_norm=w(ml.post_attention_layernorm),
        gate_up=rows(gate_up), gate_up_bias=rows(gate_up, "bias"),
        down=w(ml.mlp.down_proj), down_bias=w(ml.mlp.down_proj, "bias"),
        norm=w(drafter.norm), lm_head=w(drafter.lm_head), inv_freq=drafter.inv_freq,
    )  # type: ignore[arg-type]


def draft_shape(drafter: Eagle3Drafter) -> DraftShape:
    cfg = drafter.config
    return DraftShape(hidden_size=cfg.hidden_size, fc_in_features=cfg.fc_in_features,
                      heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                      eps=float(cfg.rms_norm_eps), norm_before_residual=cfg.norm_before_residual,
                      norm_output=cfg.norm_output)


# -- the step ----------------------------------------------------------------------------------------


def draft_step(w: DraftWeights, s: DraftShape, tokens: Tensor, hidden: Tensor, positions: Tensor, kv: Tensor,
               slots: Tensor, mask: Tensor, *, from_target: bool) -> tuple[Tensor, Tensor]:
    """One drafter step of r tokens (1 <= r <= matvec.MAX_ROWS) through the Triton kernels: what
    ``Eagle3Drafter.forward(tokens, hidden, positions, cache, slots, mask, from_target=from_target)``
    returns for a :class:`~eyas.drafter.model.KVCache` (batch 1), as (logits, hidden).

    tokens [1, r] long (target ids); hidden [1, r, S*H_t] target features (``from_target``) or
    [1, r, H] fed-back states; positions [1, r] long; kv [2, Hkv, C, D] the cache (``cache.kv[:, 0]``),
    into which rope(k) and v go at ``slots`` [r] long, which must be consecutive (slots[0] .. slots[0]
    + r - 1; see the module's docstring); mask [1, 1, r, C] bool (True = may attend), which must allow
    no entry at or past slots[0] + r and at least the token's own. Returns logits [1, r, Vd] and the
    hidden state to feed back [1, r, H] (pre-norm, or normed with ``norm_output``), in the drafter's
    dtype. Seven kernels from fed-back states (five products, two for attention), eight from target
    features (fc), plus the prologue's torch ops (the embedding gather, two norms, the concatenation,
    rope's cos/sin: three kernels compiled by inductor)."""
    from eyas.engine.decode_attention import decode_attention
    from eyas.engine.matvec import matvec

    H, D = s.hidden_size, s.head_dim
    h = hidden[0]  # [r, S*H_t] or [r, H]
    if from_target:
        if h.shape[-1] != s.fc_in_features:
            raise ValueError(f"drafter hidden input from the target: expected {s.fc_in_features} features, "
                             f"found {h.shape[-1]}")
        if w.fc_slot_norms is not None:  # fc_norm: one RMSNorm per slot [r, H_t], in torch
            slots_in = h.split(w.fc_slot_norms[0].shape[0], dim=-1)
            h = torch.cat([rms_norm(part, n, s.eps) for part, n in zip(slots_in, w.fc_slot_norms)], dim=-1)
        h = h.contiguous()
        if w.fc_input_norm is not None:  # norm_before_fc: the norm in the product's kernel
            h = matvec(h, w.fc, prologue="rms", norm=w.fc_input_norm, eps=s.eps)  # [r, H]
        else:
            h = matvec(h, w.fc)  # [r, H]
    elif h.shape[-1] != H:
        raise ValueError(f"drafter hidden input fed back: expected {H} features, found {h.shape[-1]}")

    # The prologue, in torch (MidLayer.forward's order)
    normed = rms_norm(h, w.hidden_norm, s.eps)  # [r, H]
    residual = normed if s.norm_before_residual else h
    embeds = F.embedding(tokens[0], w.embed).to(h.dtype)  # [r, H]
    x = torch.cat([rms_norm(embeds, w.input_norm, s.eps), normed], dim=-1)  # [r, 2H]
    freqs = positions[0].float()[:, None] * w.inv_freq[None, :]  # [r, D/2] (Eagle3Drafter.rope)
    emb = torch.cat([freqs, freqs], dim=-1)  # [r, D]
    cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)

    # Attention: q/k/v, then the split-KV kernels (rope, the cache write at slots, attention)
    q_width, kv_width = s.heads * D, s.kv_heads * D
    q, k, v = stacked_products(x, w.qkv, w.qkv_bias).split([q_width, kv_width, kv_width], dim=-1)  # strided views
    attn = decode_attention(q, k, v, cos, sin, kv, mask[0, 0].contiguous(), slots[:1], D ** -0.5)  # [r, Hq*D]
    h = matvec(attn, w.o, bias=w.o_bias, residual=residual.contiguous())  # [r, H] residual + o(attn)

    # MLP: gate/up with the post-attention norm, down with SiLU(gate) * up and the residual add
    if len(w.gate_up) == 1:  # stacked: SiLU(gate) * up [r, I] in the gate/up kernel's epilogue (glu)
        act = matvec(h, w.gate_up[0], prologue="rms", norm=w.post_norm, eps=s.eps,
                     bias=None if w.gate_up_bias is None else w.gate_up_bias[0], glu=True)
        h = matvec(act, w.down, bias=w.down_bias, residual=h)  # [r, H]
    else:  # separate: [gate | up] [r, 2I], the SiLU in the down kernel
        gate_up = stacked_products(h, w.gate_up, w.gate_up_bias, prologue="rms", norm=w.post_norm, eps=s.eps)
        h = matvec(gate_up, w.down, prologue="silu", bias=w.down_bias, residual=h)  # [r, H]

    logits = matvec(h, w.lm_head, prologue="rms", norm=w.norm, eps=s.eps)  # [r, Vd]
    return logits[None], (rms_norm(h, w.norm, s.eps) if s.norm_output else h)[None]


def kernel_step(drafter: Eagle3Drafter, cache: KVCache,
                from_target: bool) -> Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``DraftState``'s step through :func:`draft_step`: ``fn(tokens [1, r], hidden [1, r, W],
    positions [1, r], slots [r], mask [1, 1, r, C]) -> (logits [1, r, Vd], hidden [1, r, H])``,
    writing batch 0 of ``cache``. The drafter's tensors are gathered once, here (moving or converting
    the drafter afterwards is not followed: build the step after). A step of more rows than the
    products take (``matvec.MAX_ROWS``) runs the module's forward instead (a host decision on the
    step's shape, fixed when it is traced)."""
    from eyas.engine.matvec import MAX_ROWS

    weights, shape = draft_weights(drafter), draft_shape(drafter)
    kv = cache.kv[:, 0]  # [2, Hkv, C, D]: keys, then values at keys + kv.stride(0)

    def step(tokens: Tensor, hidden: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        if tokens.shape[1] > MAX_ROWS:
            out = drafter(tokens, hidden, positions, cache=cache, cache_slots=slots, mask=mask, from_target=from_target)
            return out.logits, out.hidden
        return draft_step(weights, shape, tokens, hidden, positions, kv, slots, mask, from_target=from_target)

    return step
