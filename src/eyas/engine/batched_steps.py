"""The batched engine's step functions: pure functions of device tensors, eager on the CPU and
compiled (inductor, then one CUDA graph per step) on a GPU; :class:`eyas.engine.batched.BatchedLlama`
and :class:`eyas.engine.continuous.RowBatch` run them.

Numerics are ``llama._layer``'s: RMSNorm in float32, rotate-half rope, grouped-query attention with
the scores q.k in the model's dtype, scaled and softmaxed in float32, cast back; a prefill's causal
attention over its own prompt is torch's fused SDPA instead (the scores are P x P per head there,
too many to materialise for long prompts). Shapes: R rows, H
hidden, Hq/Hkv query/key-value heads, D head dim, C the cache's positions per row, V the vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.engine.llama import BlockWeights, project, rms_norm, rope
from eyas.engine.sampling import counter_uniform, cumsum_last
from eyas.targets.structure import find_decoder_blocks, text_config

MODES = ("greedy", "sample", "top_p")


def key_ladder(capacity: int, start: int = 128) -> list[int]:
    """The decode step's key buckets up to ``capacity``: start, 1.5 start, 2 start, 3 start, 4 start, ...
    (at most 1.5x the entries in use are read), capacity last."""
    out, b = [], start
    while b < capacity:
        out += [b] + ([b * 3 // 2] if b * 3 // 2 < capacity else [])
        b *= 2
    return out + [capacity]


def model_constants(model: nn.Module, head_dim: int) -> dict[str, float]:
    """eps, qk_eps, scaling and rope_scaling, read from the model as LlamaTarget reads them."""
    cfg = text_config(model)
    blocks = find_decoder_blocks(model)
    attn = blocks[0].self_attn

    def eps_of(norm: nn.Module) -> float:
        return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", getattr(cfg, "rms_norm_eps", 1e-6))))

    q_norm = getattr(attn, "q_norm", None)
    return {"eps": eps_of(blocks[0].input_layernorm), "qk_eps": eps_of(q_norm) if q_norm is not None else 0.0,
            "scaling": float(getattr(attn, "scaling", head_dim ** -0.5)),
            "rope_scaling": float(getattr(model.model.rotary_emb, "attention_scaling", 1.0))}

# -- the pure functions (eager on the CPU, compiled on a GPU) -----------------------------------------


class Rows(NamedTuple):
    """The decode state on the device (module docstring, State); one buffer each, at fixed addresses
    (the CUDA graphs' inputs and outputs)."""

    ids: Tensor  # [R] long
    pos: Tensor  # [R] long
    active: Tensor  # [R] bool
    n_gen: Tensor  # [R] long
    out: Tensor  # [R, M+1] long
    limit: Tensor  # [R] long: max_new_tokens
    key: Tensor  # [R] long: the random key of the row's prompt (sampling)
    temperature: Tensor  # [R] float32
    drop_mass: Tensor  # [R] float32: 1 - top_p
    is_eos: Tensor  # [V] bool
    greedy: Tensor  # [R] bool: the row takes the argmax in a sampled step (a server's rows mix both)


def _project_qkv(a: Tensor, w: BlockWeights) -> tuple[Tensor, Tensor, Tensor]:
    """q [..., Hq*D], k, v [..., Hkv*D] of the normed stream a [..., H]: the one place that reads the
    attention's input projections (fused q/k/v weights: one GEMM, split into views)."""
    q_rows = w.o.shape[1]  # Hq*D
    kv_rows = (sum(t.shape[0] for t in w.qkv) - q_rows) // 2  # Hkv*D
    q, k, v = project(a, w.qkv, w.qkv_bias, (q_rows, kv_rows, kv_rows))
    return q, k, v


def _mlp(a: Tensor, w: BlockWeights) -> Tensor:
    """The SiLU MLP of the normed stream a [..., H]: the one place that reads gate/up (fused: one GEMM,
    split into views)."""
    width = w.down.shape[1]  # I
    gate, up = project(a, w.gate_up, w.gate_up_bias, (width, width))
    return F.linear(F.silu(gate) * up, w.down, w.down_bias)


def _rotated_qkv(a: Tensor, w: BlockWeights, cos: Tensor, sin: Tensor, Hkv: int, D: int,
                 qk_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """q [..., Hq, D], k, v [..., Hkv, D] of the normed stream a [..., H]: projected, per-head
    RMSNorm (Qwen3), rotated (k and q; v as projected)."""
    q, k, v = _project_qkv(a, w)
    lead = a.shape[:-1]
    q, k, v = q.view(*lead, _heads(w, D), D), k.view(*lead, Hkv, D), v.view(*lead, Hkv, D)
    if w.q_norm is not None:  # Qwen3: RMSNorm per head, before the rotation
        q, k = rms_norm(q, w.q_norm, qk_eps), rms_norm(k, w.k_norm, qk_eps)
    return rope(q, cos, sin), rope(k, cos, sin), v


def _heads(w: BlockWeights, D: int) -> int:
    """Hq, from o [H, Hq*D] (o is never fused)."""
    return w.o.shape[1] // D


def rotary(pos: Tensor, inv_freq: Tensor, rope_scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Hugging Face's rotary cos, sin [..., D] of positions pos [...] (float32, attention scaling
    included, cast to the model's dtype), as ``llama._prologue`` computes them."""
    freqs = pos.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope_scaling).to(dtype), (emb.sin() * rope_scaling).to(dtype)


def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scaling: float) -> Tensor:
    """Grouped-query attention of B rows: q [B, Hkv, G, T, D] (query head j = the (j % G)-th of group
    j // G, reading key/value head j // G), keys, values [B, Hkv, n, D], mask broadcastable to [B, Hkv,
    G, T, n] (True = attend). A group's G x T queries form the rows of one product against their
    shared keys (no copy of the cache). Scores in the model's dtype, scaled and softmaxed in float32,
    cast back. Returns [B, Hkv, G, T, D]."""
    B, Hkv, G, T, D = q.shape
    n = keys.shape[-2]
    scores = torch.matmul(q.reshape(B, Hkv, G * T, D), keys.transpose(-1, -2))  # [B, Hkv, G*T, n]
    scores = (scores.float() * scaling).view(B, Hkv, G, T, n).masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(values.dtype).view(B, Hkv, G * T, n)
    return torch.matmul(p, values).view(B, Hkv, G, T, D)


def decode_prologue(ids: Tensor, pos: Tensor, embed: Tensor, inv_freq: Tensor, n_keys: int, *,
                    rope_scaling: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A decode step's inputs: ids, pos [R] long. Returns x [R, H] (the embeddings), d [R, H] (the
    residual still to add: zero), cos, sin [R, 1, D], mask [R, n_keys] (entry j attended iff j <= pos:
    the row's own entries, the new one included)."""
    x = F.embedding(ids, embed)
    cos, sin = rotary(pos, inv_freq, rope_scaling, x.dtype)
    mask = torch.arange(n_keys, device=ids.device)[None, :] <= pos[:, None]
    return x, torch.zeros_like(x), cos[:, None], sin[:, None], mask


def decode_layer(x: Tensor, d: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, mask: Tensor, keys: Tensor,
                 values: Tensor, w: BlockWeights, *, eps: float, qk_eps: float,
                 scaling: float) -> tuple[Tensor, Tensor]:
    """One decoder block for one token per row. The stream entering it is x + d [R, H] (the previous
    block's last residual add, fused here with this block's norm); keys, values [R, Hkv, C, D] this
    block's cache: row r's new key/value is written at entry pos[r], then row r attends its first
    n = mask.shape[1] entries under mask [R, n]. Returns (h, m): the block's output is h + m."""
    h_in = x + d
    R = h_in.shape[0]
    _, Hkv, _, D = keys.shape
    Hq = _heads(w, D)
    n = mask.shape[1]
    a = rms_norm(h_in, w.input_norm, eps)
    q, k, v = _project_qkv(a, w)
    q, k, v = q.view(R, Hq, D), k.view(R, Hkv, D), v.view(R, Hkv, D)
    if w.q_norm is not None:  # Qwen3: RMSNorm per head, before the rotation
        q, k = rms_norm(q, w.q_norm, qk_eps), rms_norm(k, w.k_norm, qk_eps)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    rows = torch.arange(R, device=pos.device)[:, None]  # [R, 1]
    heads = torch.arange(Hkv, device=pos.device)[None, :]  # [1, Hkv]
    keys.index_put_((rows, heads, pos[:, None]), k)  # entry (r, h, pos[r]) <- k[r, h]
    values.index_put_((rows, heads, pos[:, None]), v)
    # query head j reads key/value head j // G: q [R, Hkv, G, 1, D]
    out = _attend(q.view(R, Hkv, Hq // Hkv, 1, D), keys[:, :, :n], values[:, :, :n], mask[:, None, None, None, :],
                  scaling)
    h = h_in + F.linear(out.reshape(R, Hq * D), w.o, w.o_bias)
    return h, _mlp(rms_norm(h, w.post_norm, eps), w)


def choose(logits: Tensor, key: Tensor, count: Tensor, temperature: Tensor, drop_mass: Tensor, mode: str,
           greedy: Tensor | None = None) -> Tensor:
    """The next token of each row, long [B], from logits [B, V]. ``greedy``: the argmax. ``sample``,
    ``top_p``: Hugging Face's distribution (float32 logits / temperature; with top_p, the smallest
    tokens whose cumulative mass is <= 1 - top_p dropped, the most likely always kept), drawn by
    inverse CDF with :func:`counter_uniform` (key, count); rows where ``greedy`` [B] bool is set take
    the argmax all the same (their temperature is a placeholder, never 0)."""
    if mode == "greedy":
        return logits.argmax(-1)
    drawn = draw(row_probabilities(logits, temperature, drop_mass, mode == "top_p"), counter_uniform(key, count))
    return drawn if greedy is None else torch.where(greedy, logits.argmax(-1), drawn)


def row_probabilities(logits: Tensor, temperature: Tensor, drop_mass: Tensor, top_p: bool) -> Tensor:
    """Each row's sampling distribution, float32 [R, ..., V], of logits [R, ..., V]: Hugging Face's
    order, float32 logits / temperature [R], then (``top_p``) the smallest tokens whose cumulative
    mass is <= drop_mass [R] (1 - top_p) dropped, the most likely always kept."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    x = logits.float() / temperature.view(shape)
    if top_p:
        sorted_x, order = x.sort(dim=-1)
        cum = cumsum_last(sorted_x.softmax(-1))
        drop_sorted = cum <= drop_mass.view(shape)
        drop_sorted[..., -1] = False
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return x.softmax(-1)


def draw(p: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draws, long [...], from distributions p [..., V] (not necessarily normalised)
    with uniforms u [...] in (0, 1)."""
    cdf = cumsum_last(p)
    threshold = u * cdf[..., -1]
    return (cdf <= threshold[..., None]).sum(-1).clamp(max=p.shape[-1] - 1)


def decode_epilogue(x: Tensor, d: Tensor, norm: Tensor, lm_head: Tensor, lm_bias: Tensor | None, rows: Rows, *,
                    eps: float, mode: str) -> None:
    """The step's end, in place on ``rows``: the logits of the last block's output x + d [R, H], the
    chosen token, recorded in ``out`` at column n_gen (an idle row's write goes to the bin column M);
    an active row advances (ids = the token, pos + 1, n_gen + 1) and stops at an eos token or at its
    limit."""
    logits = F.linear(rms_norm(x + d, norm, eps), lm_head, lm_bias)
    tok = choose(logits, rows.key, rows.n_gen, rows.temperature, rows.drop_mass, mode, rows.greedy)
    active = rows.active
    R, bin_col = rows.out.shape[0], rows.out.shape[1] - 1
    rows.out.index_put_((torch.arange(R, device=tok.device), torch.where(active, rows.n_gen, bin_col)), tok)
    n_gen = rows.n_gen + active.long()
    stop = rows.is_eos[tok] | (n_gen >= rows.limit)
    rows.ids.copy_(torch.where(active, tok, rows.ids))
    rows.pos.add_(active.long())
    rows.n_gen.copy_(n_gen)
    rows.active.copy_(active & ~stop)


def prefill_prologue(ids: Tensor, embed: Tensor, inv_freq: Tensor, *,
                     rope_scaling: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A prefill group's inputs: ids [g, P] long (right-padded prompts, positions 0..P-1). Returns x,
    d [g, P, H] (the embeddings, a zero residual) and cos, sin [P, 1, D]."""
    x = F.embedding(ids, embed)
    cos, sin = rotary(torch.arange(ids.shape[1], device=ids.device), inv_freq, rope_scaling, x.dtype)
    return x, torch.zeros_like(x), cos[:, None], sin[:, None]


def prefill_layer(x: Tensor, d: Tensor, cos: Tensor, sin: Tensor, rows: Tensor, keys: Tensor, values: Tensor,
                  w: BlockWeights, *, eps: float, qk_eps: float, scaling: float) -> tuple[Tensor, Tensor]:
    """One decoder block over a prefill group: x + d [g, P, H]; rows [g] long, the cache rows the
    group's prompts go to; keys, values [R, Hkv, C, D]. Each prompt attends itself causally (its row is
    empty) and its keys/values are written into entries 0..P-1 of its row. Returns (h, m)."""
    h_in = x + d
    g, P, _ = h_in.shape
    _, Hkv, _, D = keys.shape
    Hq = _heads(w, D)
    q, k, v = _rotated_qkv(rms_norm(h_in, w.input_norm, eps), w, cos, sin, Hkv, D, qk_eps)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [g, Hkv, P, D]
    keys[:, :, :P].index_copy_(0, rows, k)
    values[:, :, :P].index_copy_(0, rows, v)
    # Causal SDPA (pads come last: no real token sees one): a fused kernel (flash on a GPU) never
    # materialises the g x Hq x P x P scores, which _attend writes, reads and softmaxes in float32:
    # ~2.5 GB a block for 2 prompts of 2,304 tokens. Query head j reads key/value head j // G, as
    # repeat_interleave lays them out.
    G = Hq // Hkv
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                         is_causal=True, scale=scaling)  # [g, Hq, P, D]
    out = out.transpose(1, 2).reshape(g, P, Hq * D)
    h = h_in + F.linear(out, w.o, w.o_bias)
    return h, _mlp(rms_norm(h, w.post_norm, eps), w)


def prefill_head(x: Tensor, d: Tensor, last: Tensor, norm: Tensor, lm_head: Tensor, lm_bias: Tensor | None, *,
                 eps: float) -> Tensor:
    """The logits [g, V] at each prompt's last real token (index last [g]) of the group's output x + d."""
    h = (x + d)[torch.arange(x.shape[0], device=x.device), last]
    return F.linear(rms_norm(h, norm, eps), lm_head, lm_bias)


# -- a chain of T tokens per row (batched speculative rounds: eyas.engine.row_speculation) ------------


def chain_prologue(ids: Tensor, pos: Tensor, embed: Tensor, inv_freq: Tensor, n_keys: int, capacity: int, *,
                   rope_scaling: float) -> tuple[Tensor, ...]:
    """The inputs of T tokens per row: ids [R, T] long, row r's at positions pos[r] .. pos[r] + T - 1.
    Returns x [R, T, H] (the embeddings: boundary 0), d (a zero residual), cos, sin [R, T, 1, D],
    at [R, T] long (the cache entries written: the positions, clamped to the capacity, since an
    idle row's stale position may lie near its end) and mask [R, T, n_keys] (token t of row r
    attends entry j iff j <= pos[r] + t: its row's committed entries, the chain up to itself)."""
    T = ids.shape[1]
    at = pos[:, None] + torch.arange(T, device=ids.device)[None, :]
    x = F.embedding(ids, embed)
    cos, sin = rotary(at, inv_freq, rope_scaling, x.dtype)
    mask = torch.arange(n_keys, device=ids.device)[None, None, :] <= at[:, :, None]
    return x, torch.zeros_like(x), cos[:, :, None], sin[:, :, None], at.clamp(max=capacity - 1), mask


def chain_layer(x: Tensor, d: Tensor, cos: Tensor, sin: Tensor, at: Tensor, mask: Tensor, keys: Tensor,
                values: Tensor, w: BlockWeights, *, eps: float, qk_eps: float, scaling: float) -> tuple[Tensor, Tensor]:
    """One decoder block for T tokens per row (:func:`decode_layer` with T > 1): x + d [R, T, H]; row
    r's token t writes its key/value at entry at[r, t] of its own row, then attends the first
    n = mask.shape[-1] entries under mask [R, T, n]. Returns (h, m): the block's output is h + m."""
    h_in = x + d
    R, T, _ = h_in.shape
    _, Hkv, _, D = keys.shape
    Hq = _heads(w, D)
    n = mask.shape[-1]
    q, k, v = _rotated_qkv(rms_norm(h_in, w.input_norm, eps), w, cos, sin, Hkv, D, qk_eps)
    rows = torch.arange(R, device=at.device)[:, None, None]  # [R, 1, 1]
    heads = torch.arange(Hkv, device=at.device)[None, None, :]  # [1, 1, Hkv]
    keys.index_put_((rows, heads, at[:, :, None]), k)  # entry (r, h, at[r, t]) <- k[r, t, h]
    values.index_put_((rows, heads, at[:, :, None]), v)
    qg = q.view(R, T, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)  # [R, Hkv, G, T, D]
    out = _attend(qg, keys[:, :, :n], values[:, :, :n], mask[:, None, None], scaling)
    h = h_in + F.linear(out.permute(0, 3, 1, 2, 4).reshape(R, T, Hq * D), w.o, w.o_bias)
    return h, _mlp(rms_norm(h, w.post_norm, eps), w)
