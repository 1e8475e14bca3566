"""The EAGLE-3 drafter (docs/drafter-and-training.md): shapes, cache equivalence, variant flags, engine
weight names, vocabulary map, config from a target, and RoPE against transformers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eyas.drafter import DrafterConfig, Eagle3Drafter, KVCache
from tests.support.tiny import tiny_config

pytestmark = pytest.mark.unit

H, H_T, SLOTS, VOCAB, DRAFT_VOCAB = 32, 48, 3, 100, 40

BASE = dict(
    hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=H_T, num_slots=SLOTS,
)


def make_cfg(**kw) -> DrafterConfig:
    return DrafterConfig(**{**BASE, **kw})


def make_drafter(seed: int = 0, **kw) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d = Eagle3Drafter(make_cfg(**kw)).eval()
    with torch.no_grad():  # random, non-trivial norm weights so every norm matters
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm."):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return d


def inputs(B: int = 2, T: int = 7, width: int = SLOTS * H_T, seed: int = 1, offset: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    feats = 3.0 * torch.randn(B, T, width, generator=g)  # RMS far from 1: input norms matter
    pos = torch.arange(offset, offset + T).expand(B, T)
    return ids, feats, pos


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------------------------------------
# a reference step written from the EAGLE-3 definition with plain ops (only the weights shared)
# ---------------------------------------------------------------------------------------------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_step(d: Eagle3Drafter, ids, feats, pos):
    cfg, ml = d.config, d.midlayer
    eps, nh, nkv, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    B, T = ids.shape
    x = feats
    if cfg.fc_norm:
        x = torch.cat([_rms(s, n.weight, eps) for s, n in zip(x.split(cfg.target_hidden_size, -1), d.fc_norm)], -1)
    if cfg.norm_before_fc:
        x = _rms(x, d.input_norm.weight, eps)
    h_in = x @ d.fc.weight.T
    e = d.embed_tokens.weight[ids]
    hn = _rms(h_in, ml.hidden_norm.weight, eps)
    residual = hn if cfg.norm_before_residual else h_in
    a_in = torch.cat([_rms(e, ml.input_layernorm.weight, eps), hn], -1)
    at = ml.self_attn
    q = (a_in @ at.q_proj.weight.T).view(B, T, nh, hd)
    k = (a_in @ at.k_proj.weight.T).view(B, T, nkv, hd)
    v = (a_in @ at.v_proj.weight.T).view(B, T, nkv, hd)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).double() / hd))
    ang = pos[..., None].double() * inv  # [B, T, hd/2]
    cos, sin = ang.cos().float()[:, :, None], ang.sin().float()[:, :, None]

    def rot(t):  # rotate pairs (i, i + hd/2)
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

    q, k = rot(q), rot(k)
    out = torch.empty(B, T, nh, hd)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for head in range(nh):
        kvh = head // (nh // nkv)  # grouped-query attention
        s = q[:, :, head] @ k[:, :, kvh].transpose(1, 2) / math.sqrt(hd)
        s = s.masked_fill(~causal, float("-inf"))
        out[:, :, head] = s.softmax(-1) @ v[:, :, kvh]
    h = residual + out.reshape(B, T, nh * hd) @ at.o_proj.weight.T
    m = ml.mlp
    y = _rms(h, ml.post_attention_layernorm.weight, eps)
    h = h + (F.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    normed = _rms(h, d.norm.weight, eps)
    return normed @ d.lm_head.weight.T, (normed if cfg.norm_output else h)


FLAG_SETS = [
    {},
    {"norm_before_residual": True},
    {"norm_before_fc": True},
    {"fc_norm": True},
    {"norm_output": True},
    {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
    {"norm_before_residual": True, "fc_norm": True, "norm_output": True},
]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "+".join(f) or "base")
def test_step_matches_reference(flags):
    d = make_drafter(**flags)
    ids, feats, pos = inputs(offset=5)
    with torch.no_grad():
        out = d(ids, feats, pos)
        ref_logits, ref_hidden = reference_step(d, ids, feats, pos)
    assert maxdiff(out.logits, ref_logits) < 1e-4
    assert maxdiff(out.hidden, ref_hidden) < 1e-4


# ---------------------------------------------------------------------------------------------
# shapes and inputs
# ---------------------------------------------------------------------------------------------


def test_output_shapes():
    d = make_drafter()
    ids, feats, pos = inputs(B=3, T=5)
    with torch.no_grad():
        out = d(ids, feats, pos)
        assert out.logits.shape == (3, 5, DRAFT_VOCAB)
        assert out.hidden.shape == (3, 5, H)
        fed = d(ids, out.hidden, pos + 1)  # the drafter's own state fed back (H wide)
    assert fed.logits.shape == (3, 5, DRAFT_VOCAB) and fed.hidden.shape == (3, 5, H)
    assert d.project(feats).shape == (3, 5, H)
    cache = d.new_cache(3, 16)
    assert cache.k.shape == cache.v.shape == (3, 2, 16, 8)
    assert cache.max_len == 16 and cache.k.dtype == torch.float32


def test_logits_at_one_position_per_row_equals_the_full_logits_there():
    d = make_drafter()
    ids, feats, pos = inputs(B=3, T=5)
    at = torch.tensor([4, 0, 2])
    with torch.no_grad():
        full = d(ids, feats, pos).logits
        one = d(ids, feats, pos, logits_at=at).logits  # long [B]: no host read (a CUDA graph holds it)
        chosen = d(ids, feats, pos, logits_at=torch.arange(5)[None, :] == at[:, None]).logits  # bool [B, T]
    assert one.shape == (3, DRAFT_VOCAB)
    torch.testing.assert_close(one, full[torch.arange(3), at])
    torch.testing.assert_close(chosen, one)


def test_target_hidden_size_differs_from_hidden_size():
    d = make_drafter()
    assert d.fc.in_features == SLOTS * H_T == 144 and d.fc.out_features == H
    assert tuple(d.fc.weight.shape) == (H, SLOTS * H_T)
    assert d.embed_tokens.weight.shape == (VOCAB, H)


@pytest.mark.parametrize("width", [50, H_T, 2 * H_T, 4 * H_T])
def test_hidden_of_wrong_width(width):
    d = make_drafter()
    ids, feats, pos = inputs(width=width)
    with pytest.raises(ValueError) as e:
        d(ids, feats, pos)
    msg = str(e.value)
    assert "expected 144 (num_slots=3 x target_hidden_size=48) or 32 features" in msg
    assert f"found {width}" in msg


def test_from_target_flag():
    d = make_drafter()
    ids, feats, pos = inputs()
    with torch.no_grad():
        h = d(ids, feats, pos).hidden
        with pytest.raises(ValueError, match="found 32"):
            d(ids, h, pos, from_target=True)  # H wide but said to be target features
        with pytest.raises(ValueError, match="found 144"):
            d(ids, feats, pos, from_target=False)  # target features said to be fed back
        torch.testing.assert_close(d(ids, h, pos, from_target=False).logits, d(ids, h, pos).logits)


def test_ambiguous_width_needs_from_target():
    # 1 slot of H: target features and fed-back state have the same width.
    d = Eagle3Drafter(make_cfg(num_slots=1, target_hidden_size=H)).eval()
    ids, feats, pos = inputs(width=H)
    with pytest.raises(ValueError, match="pass from_target explicitly"):
        d(ids, feats, pos)
    with torch.no_grad():
        a, b = d(ids, feats, pos, from_target=True), d(ids, feats, pos, from_target=False)
    assert not torch.allclose(a.logits, b.logits)  # fc applied vs not


# ---------------------------------------------------------------------------------------------
# KV cache: incremental decoding equals one causal step over all tokens
# ---------------------------------------------------------------------------------------------


def _step_masks(T: int, max_len: int) -> list[torch.Tensor]:
    return [(torch.arange(max_len) <= t)[None, None, None, :] for t in range(T)]  # [1, 1, 1, max_len]


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True, "fc_norm": True}], ids=["base", "flags"])
def test_cache_single_steps_equal_full_step(flags):
    d = make_drafter(**flags)
    B, T, max_len = 2, 8, 12
    ids, feats, pos = inputs(B=B, T=T, offset=3)
    with torch.no_grad():
        full = d(ids, feats, pos)  # no cache, no mask: causal
        cache = d.new_cache(B, max_len)
        steps = [
            d(ids[:, t : t + 1], feats[:, t : t + 1], pos[:, t : t + 1], cache=cache,
              cache_slots=torch.tensor([t]), mask=m)
            for t, m in enumerate(_step_masks(T, max_len))
        ]
    logits = torch.cat([s.logits for s in steps], 1)
    hidden = torch.cat([s.hidden for s in steps], 1)
    assert maxdiff(logits, full.logits) < 1e-5
    assert maxdiff(hidden, full.hidden) < 1e-5
    # the cache holds the K of the T tokens, zeros beyond
    assert cache.k[:, :, :T].abs().sum() > 0 and cache.k[:, :, T:].abs().sum() == 0


def test_cache_prefill_chunk_then_steps_and_explicit_causal_mask():
    d = make_drafter()
    B, T, P, max_len = 2, 9, 5, 9
    ids, feats, pos = inputs(B=B, T=T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        full = d(ids, feats, pos)
        # an explicit causal mask without a cache is the same as the default
        assert maxdiff(d(ids, feats, pos, mask=causal).logits, full.logits) < 1e-6
        cache = d.new_cache(B, max_len)
        pre = d(ids[:, :P], feats[:, :P], pos[:, :P], cache=cache, cache_slots=torch.arange(P),
                mask=causal[:, :, :P, :])
        rest = [
            d(ids[:, t : t + 1], feats[:, t : t + 1], pos[:, t : t + 1], cache=cache,
              cache_slots=torch.tensor([t]), mask=causal[:, :, t : t + 1, :])
            for t in range(P, T)
        ]
    logits = torch.cat([pre.logits] + [r.logits for r in rest], 1)
    assert maxdiff(logits, full.logits) < 1e-5


def test_cache_needs_slots_and_mask():
    d = make_drafter()
    ids, feats, pos = inputs(T=1)
    cache = d.new_cache(2, 4)
    with pytest.raises(ValueError, match="cache_slots is required"):
        d(ids, feats, pos, cache=cache, mask=torch.ones(1, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask is required"):
        d(ids, feats, pos, cache=cache, cache_slots=torch.tensor([0]))


def test_kvcache_update_writes_slots():
    c = KVCache(1, 6, 2, 4)
    k = torch.randn(1, 2, 2, 4)
    v = torch.randn(1, 2, 2, 4)
    K, V = c.update(torch.tensor([4, 1]), k, v)
    assert torch.equal(K[:, :, 4], k[:, :, 0]) and torch.equal(K[:, :, 1], k[:, :, 1])
    assert torch.equal(V[:, :, 4], v[:, :, 0]) and K[:, :, [0, 2, 3, 5]].abs().sum() == 0
    assert "k" not in c.state_dict()  # scratch space, never saved


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 2)])
def test_cached_attention_equals_sdpa_with_repeated_heads(heads, kv_heads):
    """The serving attention (grouped, over the whole static cache, float32 softmax) is SDPA over
    the cache repeated per query head, under the same mask (rows with some masked slots, one row
    seeing a single slot)."""
    from eyas.drafter.model import cached_attention

    g = torch.Generator().manual_seed(0)
    B, T, N, D = 2, 3, 11, 8
    q = torch.randn(B, heads, T, D, generator=g)
    k, v = torch.randn(B, kv_heads, N, D, generator=g), torch.randn(B, kv_heads, N, D, generator=g)
    mask = torch.rand(B, 1, T, N, generator=g) < 0.6
    mask[..., 0] = True
    mask[0, 0, 1] = False
    mask[0, 0, 1, 5] = True  # a row that sees one slot only
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    got = cached_attention(q, k, v, mask)
    assert got.shape == (B, heads, T, D)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[0, :, 1], v[0, :, 5].repeat_interleave(rep, 0), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# variant flags
# ---------------------------------------------------------------------------------------------


def _run_with_base_weights(flags: dict):
    base = make_drafter()
    var = make_drafter(seed=5, **flags)
    missing, unexpected = var.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected
    ids, feats, pos = inputs()
    with torch.no_grad():
        return base, var, base(ids, feats, pos), var(ids, feats, pos), (ids, feats, pos), missing


def test_norm_before_residual_changes_output():
    _, var, b, v, _, missing = _run_with_base_weights({"norm_before_residual": True})
    assert missing == []  # same weights, different wiring
    assert maxdiff(b.logits, v.logits) > 1e-3 and maxdiff(b.hidden, v.hidden) > 1e-3


def test_norm_before_fc_creates_input_norm():
    base, var, b, v, (ids, feats, pos), missing = _run_with_base_weights({"norm_before_fc": True})
    assert missing == ["input_norm.weight"]
    assert var.state_dict()["input_norm.weight"].shape == (SLOTS * H_T,)
    assert "input_norm.weight" not in base.state_dict()
    assert maxdiff(b.logits, v.logits) > 1e-3
    with torch.no_grad():
        torch.testing.assert_close(var.project(feats), var.fc(var.input_norm(feats)))


def test_fc_norm_creates_one_norm_per_slot():
    base, var, b, v, (ids, feats, pos), missing = _run_with_base_weights({"fc_norm": True})
    assert sorted(missing) == [f"fc_norm.{i}.weight" for i in range(SLOTS)]
    for i in range(SLOTS):
        assert var.state_dict()[f"fc_norm.{i}.weight"].shape == (H_T,)
    assert not any(k.startswith("fc_norm") for k in base.state_dict())
    assert maxdiff(b.logits, v.logits) > 1e-3
    with torch.no_grad():
        per_slot = [var.fc_norm[i](feats[..., i * H_T : (i + 1) * H_T]) for i in range(SLOTS)]
        torch.testing.assert_close(var.project(feats), var.fc(torch.cat(per_slot, -1)))


def test_norm_output_feeds_back_the_normed_state():
    base, var, b, v, _, missing = _run_with_base_weights({"norm_output": True})
    assert missing == []
    assert torch.equal(b.logits, v.logits)  # logits do not depend on what is fed back
    with torch.no_grad():
        assert torch.equal(v.hidden, var.norm(b.hidden))  # hidden = norm(h) ...
        assert torch.equal(b.logits, base.lm_head(base.norm(b.hidden)))  # ... default: h pre-norm
    assert maxdiff(b.hidden, v.hidden) > 1e-3


# ---------------------------------------------------------------------------------------------
# weight names: exactly what SGLang's and vLLM's llama_eagle3.py load
# ---------------------------------------------------------------------------------------------


ENGINE_NAMES = {
    "embed_tokens.weight", "fc.weight",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def test_state_dict_names_and_shapes():
    sd = make_drafter().state_dict()
    assert set(sd) == ENGINE_NAMES
    assert sd["fc.weight"].shape == (H, SLOTS * H_T)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * H)  # q/k/v read 2H
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 8, 2 * H)
    assert sd["midlayer.self_attn.v_proj.weight"].shape == (2 * 8, 2 * H)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (H, 4 * 8)
    assert sd["midlayer.hidden_norm.weight"].shape == (H,)
    assert sd["midlayer.input_layernorm.weight"].shape == (H,)
    assert sd["norm.weight"].shape == (H,)
    assert sd["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    assert sd["embed_tokens.weight"].shape == (VOCAB, H)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (DRAFT_VOCAB,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (VOCAB,)
    d = make_drafter()
    assert d.midlayer.self_attn.q_proj.in_features == 2 * H
    assert not d.embed_tokens.weight.requires_grad  # the target's embedding, frozen


def test_state_dict_roundtrip():
    a, b = make_drafter(seed=0), make_drafter(seed=1)
    b.load_state_dict(a.state_dict())  # strict: names match both ways
    ids, feats, pos = inputs()
    with torch.no_grad():
        assert torch.equal(a(ids, feats, pos).logits, b(ids, feats, pos).logits)


# ---------------------------------------------------------------------------------------------
# vocabulary map
# ---------------------------------------------------------------------------------------------


def test_identity_vocab_map_by_default():
    d = make_drafter()
    assert torch.equal(d.d2t, torch.zeros(DRAFT_VOCAB, dtype=torch.long))
    assert torch.equal(d.draft_to_target(torch.arange(DRAFT_VOCAB)), torch.arange(DRAFT_VOCAB))
    assert d.t2d.sum() == DRAFT_VOCAB and d.t2d[:DRAFT_VOCAB].all()


@pytest.mark.parametrize("sort", [True, False])
def test_set_vocab_map(sort):
    d = make_drafter()
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]
    if sort:
        ids = ids.sort().values
    d.set_vocab_map(ids)
    assert torch.equal(d.d2t, ids - torch.arange(DRAFT_VOCAB))  # target id = draft id + d2t
    assert torch.equal(d.draft_to_target(torch.arange(DRAFT_VOCAB)), ids)
    assert d.t2d.sum() == DRAFT_VOCAB
    assert d.t2d[ids].all()
    assert torch.equal(d.t2d.nonzero().flatten(), ids.sort().values)
    # draft argmax -> target token, batched
    draft = torch.tensor([[0, 5], [DRAFT_VOCAB - 1, 7]])
    assert torch.equal(d.draft_to_target(draft), ids[draft])
    # persisted in the state dict
    assert torch.equal(d.state_dict()["d2t"], d.d2t) and torch.equal(d.state_dict()["t2d"], d.t2d)


@pytest.mark.parametrize(
    "ids, match",
    [
        (torch.arange(DRAFT_VOCAB - 1), f"expected {DRAFT_VOCAB} ids, found \\({DRAFT_VOCAB - 1},\\)"),
        (torch.cat([torch.arange(DRAFT_VOCAB - 1), torch.tensor([0])]), "distinct"),
        (torch.arange(VOCAB - DRAFT_VOCAB + 1, VOCAB + 1), f"0\\.\\.{VOCAB - 1}"),
        (torch.arange(-1, DRAFT_VOCAB - 1), f"0\\.\\.{VOCAB - 1}"),
    ],
)
def test_set_vocab_map_errors(ids, match):
    d = make_drafter()
    with pytest.raises(ValueError, match=match):
        d.set_vocab_map(ids)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
        ({"draft_vocab_size": VOCAB + 1}, "draft_vocab_size: expected 1..vocab_size"),
        ({"draft_vocab_size": 0}, "draft_vocab_size"),
        ({"num_slots": 0}, "num_slots: expected >= 1"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}, "Extra inputs are not permitted"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        make_cfg(**kw)


def test_config_flags_default_false_and_explicit():
    cfg = make_cfg()
    dumped = cfg.model_dump()
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert dumped[flag] is False
    assert DrafterConfig.model_validate(dumped) == cfg
    assert cfg.fc_in_features == SLOTS * H_T


def test_unsupported_activation_and_rope():
    with pytest.raises(NotImplementedError, match="'gelu'"):
        Eagle3Drafter(make_cfg(hidden_act="gelu"))
    with pytest.raises(NotImplementedError, match="'yarn'"):
        Eagle3Drafter(make_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


@pytest.mark.parametrize(
    "kind, head_dim, kv_heads",
    [("llama", 16, 2), ("qwen3", 16, 2), ("deepseek_v3", 16, 4)],  # MLA -> dense heads of H / heads
)
def test_for_target(kind, head_dim, kv_heads):
    tc = tiny_config(kind, num_blocks=10)
    cfg = DrafterConfig.for_target(tc, draft_vocab_size=32)
    assert cfg.hidden_size == cfg.target_hidden_size == 64
    assert cfg.num_attention_heads == 4 and cfg.head_dim == head_dim and cfg.num_key_value_heads == kv_heads
    assert cfg.vocab_size == 128 and cfg.draft_vocab_size == 32 and cfg.num_slots == 3
    assert cfg.intermediate_size == 128 and cfg.rope_scaling is None
    assert not (cfg.norm_before_residual or cfg.norm_before_fc or cfg.fc_norm or cfg.norm_output)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg).eval()
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        out = d(ids, torch.randn(2, 6, 3 * 64), torch.arange(6).expand(2, 6))
        out2 = d(ids, out.hidden, torch.arange(1, 7).expand(2, 6))
    assert out.logits.shape == out2.logits.shape == (2, 6, 32)
    assert torch.isfinite(out2.logits).all()


def test_for_target_overrides_and_slots():
    cfg = DrafterConfig.for_target(tiny_config("llama"), num_slots=4, norm_before_residual=True,
                                   intermediate_size=96)
    assert cfg.num_slots == 4 and cfg.fc_in_features == 4 * 64
    assert cfg.norm_before_residual and cfg.intermediate_size == 96
    assert cfg.draft_vocab_size == 128  # default: the full target vocabulary


# ---------------------------------------------------------------------------------------------
# RoPE against transformers
# ---------------------------------------------------------------------------------------------


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _hf_llama_config(rope_scaling):
    from transformers import LlamaConfig

    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
              num_hidden_layers=2, vocab_size=128, max_position_embeddings=131072, rope_theta=500000.0)
    if rope_scaling is not None:
        kw["rope_scaling"] = dict(rope_scaling)
    return LlamaConfig(**kw)  # head_dim 128, like Llama 3


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_rope_matches_transformers(rope_scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf_cfg = _hf_llama_config(rope_scaling)
    cfg = DrafterConfig.for_target(hf_cfg, draft_vocab_size=64)
    assert cfg.rope_theta == 500000.0 and cfg.head_dim == 128
    if rope_scaling is None:
        assert cfg.rope_scaling is None
    else:
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    d = Eagle3Drafter(cfg)
    hf = LlamaRotaryEmbedding(hf_cfg)
    assert torch.equal(d.inv_freq, hf.inv_freq)
    if rope_scaling is not None:  # the test spans all three llama3 bands
        plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
        ratio = d.inv_freq / plain
        assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(1 / 8)).any()
        assert ((ratio > 1 / 8 + 1e-4) & (ratio < 1 - 1e-4)).any()
    pos = torch.tensor([[0, 1, 2, 17, 1000, 8191, 8192, 50000, 131071]])
    cos, sin = d.rope(pos, torch.float32)
    hf_cos, hf_sin = hf(torch.zeros(1, pos.shape[1], 8), pos)
    assert torch.equal(cos[:, 0], hf_cos) and torch.equal(sin[:, 0], hf_sin)
    # ... and q/k rotated the same way
    from eyas.drafter.model import apply_rope

    q = torch.randn(1, 2, pos.shape[1], 128)
    k = torch.randn(1, 1, pos.shape[1], 128)
    hq, hk = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), hq, atol=0, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), hk, atol=0, rtol=0)


def test_norm_before_fc_and_fc_norm_together_are_refused():
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm: expected at most one of them"):
        DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=64, draft_vocab_size=32, target_hidden_size=32,
                      norm_before_fc=True, fc_norm=True)
