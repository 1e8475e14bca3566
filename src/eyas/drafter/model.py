"""The EAGLE-3 drafter, with the module and weight names SGLang and vLLM load
(``llama_eagle3.py`` in both engines):

    fc               Linear(num_slots * H_t -> H, no bias)      projects the captured target features
    input_norm       RMSNorm(num_slots * H_t)                   only with norm_before_fc
    fc_norm.{i}      RMSNorm(H_t) per slot                      only with fc_norm
    midlayer         one Llama decoder layer; q/k/v read cat(input_layernorm(embed), hidden_norm(h))
    norm             final RMSNorm
    lm_head          Linear(H -> draft_vocab_size)
    embed_tokens     the target's token embedding (frozen copy)
    d2t              int64 [draft_vocab]: target id = draft id + d2t[draft id]
    t2d              bool  [vocab]: whether a target id is in the draft vocabulary

One step maps (token ids, hidden, positions) to (draft-vocab logits, hidden to feed back). The
hidden input is either target features (num_slots * H_t wide: projected by ``fc``) or the
drafter's own fed-back state (H wide).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.drafter.config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Computed in float32 like every HF Llama-family norm, so bf16 serving matches training.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: DrafterConfig) -> Tensor:
    """Inverse frequencies [head_dim // 2] for the default and the llama3 RoPE.

    Computed in float32 with the same operations as transformers, SGLang and vLLM, so the drafter
    rotates by bit-identical angles in training and in every engine.
    """
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(is_mid, mid, scaled)
    raise NotImplementedError(
        f"rope_scaling.rope_type: eyas drafters support 'default' and 'llama3', found {rope_type!r}"
    )


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, heads, T, hd]; cos/sin: [B, 1, T, hd]. The HF "rotate_half" layout.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache(nn.Module):
    """A static, preallocated KV cache written by index (gpt-fast style).

    One buffer ``kv`` [2, B, n_kv_heads, max_len, head_dim] holds the keys (``kv[0]``) and the
    values (``kv[1]``); ``k`` and ``v`` [B, n_kv_heads, max_len, head_dim] are views of it. One
    tensor, so that a batch's cache ``kv[:, b]`` [2, n_kv_heads, max_len, head_dim] is what the
    split-KV attention kernel takes (values at keys + ``kv.stride(0)``:
    :func:`eyas.engine.decode_attention.decode_attention`, the drafter's Triton step in
    :mod:`eyas.engine.draft_kernels`). ``update`` writes T new entries at cache slots ``slots`` [T]
    and returns the whole cache (k, v); the caller's mask says which slots a query sees.
    """

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = (2, batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("kv", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    # Properties, not attributes: views taken at each use follow the buffer through .to() and _apply.
    @property
    def k(self) -> Tensor:
        return self.kv[0]  # [B, n_kv_heads, max_len, head_dim]

    @property
    def v(self) -> Tensor:
        return self.kv[1]

    @property
    def max_len(self) -> int:
        return self.kv.shape[3]

    def update(self, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # k, v [B, n_kv_heads, T, head_dim] -> kv[:, :, :, slots]: one write into the buffer itself
        # (not through a view: a compiler then writes the T entries in place)
        self.kv[:, :, :, slots] = torch.stack([k, v]).to(self.kv.dtype)
        return self.k, self.v


class ConcatKVCache:
    """A growing cache for training-time test: each step's K/V are appended (no in-place writes,
    so autograd can keep every step's keys). ``update`` ignores slots: order is append order."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, slots: Tensor | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Grouped-query attention of a few queries over a static cache, under a bool mask.

    q [B, Hq, T, D]; k, v [B, Hkv, N, D] (the whole cache: N slots, most of them masked); mask
    [B or 1, 1, T, N], True = may attend. Returns [B, Hq, T, D]. Query head j reads key/value head
    j // G (G = Hq / Hkv): the G query heads of a group become G*T rows against their shared keys,
    so the cache is read once and never copied per head. Scores are scaled by 1/sqrt(D) and
    softmaxed in float32.

    Why not ``scaled_dot_product_attention``: serving steps have T <= 16 queries and N in the
    thousands. A flash kernel gives each block of queries one thread block that walks all N keys
    (on the H200, 120 us per call over 8,192 slots), and SDPA needs the cache repeated per query
    head first; these two matmuls and one fused softmax cost a few microseconds. Training (no
    static cache) keeps SDPA."""
    B, Hq, T, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * T, D)  # rows (g, t)
    scores = torch.matmul(qg, k.to(q.dtype).transpose(-1, -2))  # [B, Hkv, G*T, N]
    scores = (scores.float() * D ** -0.5).view(B, Hkv, G, T, N).masked_fill(~mask[:, :, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype).view(B, Hkv, G * T, N)
    return torch.matmul(p, v.to(q.dtype)).view(B, Hq, T, D)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        in_dim = 2 * cfg.hidden_size  # cat(embeds, hidden)
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                cache: KVCache | ConcatKVCache | None, slots: Tensor | None) -> Tensor:
        B, T, _ = x.shape  # x: [B, T, 2H]
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, KVCache):  # serving: a few queries against the whole static cache
            k, v = cache.update(slots, k, v)  # [B, n_kv, max_len, hd]
            out = cached_attention(q, k, v, mask)  # type: ignore[arg-type]  (a cache needs a mask)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        if cache is not None:
            k, v = cache.update(slots, k, v)  # [B, n_kv, T so far, hd]
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=mask is None and cache is None
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act: eyas drafters support 'silu', found {cfg.hidden_act!r}")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single EAGLE-3 decoder layer."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the fed hidden state
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                cache: KVCache | ConcatKVCache | None, slots: Tensor | None) -> Tensor:
        # embeds, hidden: [B, T, H] -> [B, T, H] pre-norm output
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)  # [B, T, 2H]
        h = residual + self.self_attn(x, cos, sin, mask, cache, slots)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DraftOutput:
    logits: Tensor  # [B, T, draft_vocab_size]; [N, draft_vocab_size] at the N positions of a bool ``logits_at``,
    # [B, draft_vocab_size] at a long one's
    hidden: Tensor  # [B, T, H]: the state to feed back (pre-norm unless norm_output)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, never trained
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.fc_in_features, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(
                [RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_slots)]
            )
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Identity vocabulary map until a training run supplies one.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    # -- vocabulary ------------------------------------------------------------------------

    def set_vocab_map(self, draft_to_target: Tensor) -> None:
        """Install the draft vocabulary: ``draft_to_target[i]`` is the target id of draft id i."""
        ids = draft_to_target.to(torch.long).cpu()
        if ids.shape != (self.config.draft_vocab_size,):
            raise ValueError(f"draft vocab: expected {self.config.draft_vocab_size} ids, found {tuple(ids.shape)}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size or len(ids.unique()) != len(ids):
            raise ValueError(
                f"draft vocab: expected {len(ids)} distinct target ids in 0..{self.config.vocab_size - 1}, "
                f"found {len(ids.unique())} distinct in {ids.min().item()}..{ids.max().item()}"
            )
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- the step ---------------------------------------------------------------------------

    def fc_input(self, features: Tensor) -> Tensor:
        """What ``fc`` reads of target features [..., num_slots * H_t]: the features after the
        configured norms (``fc_norm`` per slot, then ``input_norm``), else the features themselves."""
        cfg = self.config
        if cfg.fc_norm:
            slots = features.split(cfg.target_hidden_size, dim=-1)
            features = torch.cat([n(s) for n, s in zip(self.fc_norm, slots)], dim=-1)
        if cfg.norm_before_fc:
            features = self.input_norm(features)
        return features

    def project(self, features: Tensor) -> Tensor:
        """Target features [B, T, num_slots * H_t] -> [B, T, H] (fc, with the configured norms)."""
        return self.fc(self.fc_input(features))

    def rope(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: Tensor,  # [B, T] target-vocab token ids
        hidden: Tensor,  # [B, T, num_slots * H_t] target features, or [B, T, H] fed back
        position_ids: Tensor,  # [B, T]
        cache: KVCache | ConcatKVCache | None = None,
        cache_slots: Tensor | None = None,  # [T] where this step's K/V go in a KVCache
        mask: Tensor | None = None,  # bool [B or 1, 1, T, T or max_len], True = may attend
        from_target: bool | None = None,  # None: decided by the width of `hidden`
        logits_at: Tensor | None = None,  # bool [B, T]: the lm_head only there (evaluation that reads a few),
        # or long [B]: one position per row (no host read: a CUDA graph can hold it), logits [B, V]
    ) -> DraftOutput:
        cfg = self.config
        if from_target is None:
            if cfg.fc_in_features == cfg.hidden_size:
                raise ValueError("num_slots * target_hidden_size == hidden_size: pass from_target explicitly")
            from_target = hidden.shape[-1] == cfg.fc_in_features
        if from_target and hidden.shape[-1] == cfg.fc_in_features:
            hidden = self.project(hidden)
        elif from_target or hidden.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"drafter hidden input: expected {cfg.fc_in_features} (num_slots={cfg.num_slots} x "
                f"target_hidden_size={cfg.target_hidden_size}) or {cfg.hidden_size} features, "
                f"found {hidden.shape[-1]}"
            )
        if isinstance(cache, KVCache) and cache_slots is None:
            raise ValueError("cache_slots is required when a KV cache is given")
        if cache is not None and mask is None:
            # Without a mask, queries would attend to every cache entry (future and unwritten ones).
            raise ValueError("mask is required when a KV cache is given")
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(position_ids, hidden.dtype)
        h = self.midlayer(embeds, hidden, cos, sin, mask, cache, cache_slots)
        normed = self.norm(h)
        if logits_at is None:
            logits = self.lm_head(normed)
        elif logits_at.dtype == torch.bool:
            logits = self.lm_head(normed[logits_at])
        else:
            logits = self.lm_head(normed[torch.arange(normed.shape[0], device=normed.device), logits_at])
        return DraftOutput(logits=logits, hidden=normed if cfg.norm_output else h)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        cfg = self.config
        return KVCache(batch, max_len, cfg.num_key_value_heads, cfg.head_dim,
                       dtype=dtype or self.fc.weight.dtype, device=self.fc.weight.device)
