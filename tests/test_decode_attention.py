"""eyas.engine.decode_attention: the split-KV Triton kernels compute softmax(rope(q) k^T * scaling
under the step's mask) v, for one token and for a tree of several, over caches longer than the
entries attended, with strided queries and grouped heads; and LlamaTarget with attention="split-kv"
equals the Hugging Face model through prefill, a tree, keep and decode.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before triton's import; CI installs triton for this); on a GPU they are compiled."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_kernels import DEVICE, require_triton

require_triton("the split-KV kernels")

from eyas.engine.decode_attention import decode_attention, splits, supported_head_dim  # noqa: E402
from eyas.engine.llama_steps import rope  # noqa: E402


def _written(k, v, cos, sin, kv, start) -> torch.Tensor:
    """The cache after the step: rope(k) and v at entries start .. start+B-1, in float64."""
    B = k.shape[0]
    Hkv, _, D = kv.shape[1:]
    s = int(start)
    kv = kv.double().clone()
    rotated = rope(k.reshape(B, Hkv, D).double(), cos[:, None].double(), sin[:, None].double())  # [B, Hkv, D]
    kv[0, :, s:s + B] = rotated.transpose(0, 1)
    kv[1, :, s:s + B] = v.reshape(B, Hkv, D).double().transpose(0, 1)
    return kv


def _reference(q, k, v, cos, sin, kv, mask, start, scaling) -> torch.Tensor:
    """The same attention in float64, eagerly, over the first n entries of the cache after the step
    under the mask: each query head j reads key-value head j // G."""
    B = q.shape[0]
    Hkv, _, D = kv.shape[1:]
    n = mask.shape[1]
    HQ = q.shape[1] // D
    keys, values = _written(k, v, cos, sin, kv, start)  # [Hkv, C, D] each
    q = rope(q.reshape(B, HQ, D).double(), cos[:, None].double(), sin[:, None].double())
    k = keys[:, :n].repeat_interleave(HQ // Hkv, 0)  # [HQ, n, D]
    v = values[:, :n].repeat_interleave(HQ // Hkv, 0)
    scores = torch.einsum("bhd,hnd->bhn", q, k) * scaling
    p = scores.masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bhn,hnd->bhd", p, v).reshape(B, HQ * D)


def _case(B, Hkv, G, D, C, n, start, dtype, tree: bool, seed: int = 0):
    """The kernels' arguments for a step of B tokens at cache_len ``start``, the cache random (its
    entries from ``start`` on stale), q/k/v strided views of one fused projection output."""
    g = torch.Generator().manual_seed(seed)
    HQ = Hkv * G
    qkv = torch.randn(B, (HQ + 2 * Hkv) * D, generator=g)
    q, k, v = qkv.split([HQ * D, Hkv * D, Hkv * D], dim=-1)
    kv = torch.randn(2, Hkv, C, D, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    freqs = torch.arange(start, start + B).float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    block = torch.ones(B, B, dtype=torch.bool).tril()
    if tree:  # a random tree: each token's parent an earlier one
        block = torch.eye(B, dtype=torch.bool)
        for i in range(1, B):
            block[i] |= block[int(torch.randint(0, i, (1,), generator=g))]
    rel = torch.arange(n) - start
    mask = (rel < 0) | ((rel < B) & block[:, rel.clamp(0, B - 1)])  # as LlamaTarget's prologue builds it
    qkv = qkv.to(DEVICE, dtype)
    q, k, v = qkv.split([HQ * D, Hkv * D, Hkv * D], dim=-1)
    args = [q, k, v] + [t.to(DEVICE, dtype) for t in (emb.cos(), emb.sin(), kv)]
    return (*args, mask.to(DEVICE), torch.tensor([start], device=DEVICE), D ** -0.5)


def _run_and_check(args, scaling, atol: float, rtol: float) -> torch.Tensor:
    """Run the kernels; their output equals the reference attention, and the cache afterwards holds
    rope(k) and v at the step's entries, every other entry untouched. Returns the output."""
    q, k, v, cos, sin, kv, mask, start = args
    expected = _reference(*args, scaling).cpu()  # from the cache before the step
    kv_after = _written(k, v, cos, sin, kv, start).cpu()
    out = decode_attention(*args, scaling)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double().cpu(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(kv[0].double().cpu(), kv_after[0], atol=atol, rtol=rtol)  # rotated keys
    torch.testing.assert_close(kv[1].double().cpu(), kv_after[1], atol=0, rtol=0)  # values: copied
    return out


@pytest.mark.unit
@pytest.mark.parametrize("B,Hkv,G,D,C,n,start,tree", [
    (1, 2, 4, 32, 300, 256, 100, False),  # one token, Llama's grouping
    (1, 3, 3, 64, 600, 512, 511, False),  # SmolLM2's grouping and head size; the last entry of its bucket
    (1, 1, 1, 16, 64, 64, 0, False),  # an empty cache: the token attends itself alone
    (8, 2, 2, 32, 2200, 2112, 1500, True),  # a tree; more chunks than MAX_SPLITS, n not a power of two
    (24, 2, 4, 16, 200, 128, 40, True),  # 96 query rows: several row tiles; the new entries span two tiles
])
def test_split_kv_attention_equals_softmax_attention_in_float32(B, Hkv, G, D, C, n, start, tree):
    *args, scaling = _case(B, Hkv, G, D, C, n, start, torch.float32, tree)
    _run_and_check(args, scaling, atol=2e-6, rtol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("tiling", [dict(prefetch=True), dict(block_n=16, max_splits=8, num_warps=2),
                                    dict(block_n=128, max_splits=4, prefetch=True)], ids=str)
def test_every_tiling_computes_the_same_attention(tiling):
    """The tiling the benchmark compares (decode_attention_gpu.py), on a tree over stale entries
    (NaN past the step's own: prefetch loads them, and must zero them)."""
    *args, scaling = _case(8, 2, 4, 32, 1100, 1024, 700, torch.float32, tree=True)
    expected = _reference(*args, scaling).cpu()
    args[5][:, :, 708:] = float("nan")
    out = decode_attention(*args, scaling, **tiling)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-6, rtol=1e-5)


# Half precision: bfloat16 on a GPU; float16 in the interpreter, whose tl.dot multiplies bfloat16
# operands' raw bits (Triton 3.9: a 16 x 16 product off by 1e10), while float16 it converts.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.mark.unit
@pytest.mark.parametrize("B", [1, 4])
def test_split_kv_attention_in_half_precision_is_within_its_rounding_of_the_exact_result(B):
    *args, scaling = _case(B, 2, 4, 64, 1100, 1024, 700, HALF, tree=True)
    tol = 2e-2 if HALF == torch.bfloat16 else 2e-3
    _run_and_check(args, scaling, atol=tol, rtol=tol)


@pytest.mark.unit
def test_entries_past_the_steps_own_are_never_read():
    """The cache past start + B holds stale values (NaN here): they must not reach the output."""
    *args, scaling = _case(2, 2, 2, 32, 256, 256, 60, torch.float32, tree=False)
    kv = args[5]
    expected = _reference(*args, scaling).cpu()
    kv[:, :, 62:] = float("nan")
    out = decode_attention(*args, scaling)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.unit
def test_splits_cover_the_keys_with_whole_tiles():
    assert splits(1024) == (16, 64) and splits(2048) == (32, 64) and splits(4096) == (32, 128)
    assert splits(64) == (1, 64) and splits(3000) == (24, 128)
    for n in (1, 63, 64, 65, 2112, 3000, 8192):
        S, chunk = splits(n)
        assert chunk % 64 == 0 and S * chunk >= n > (S - 1) * chunk and S <= 32
    assert [d for d in (8, 16, 64, 80, 96, 128, 256) if supported_head_dim(d)] == [16, 64, 128, 256]


@pytest.mark.integration
@pytest.mark.parametrize("kind,matvec", [("llama", "gemm"), ("qwen2", "gemm"), ("qwen3", "gemm"), ("llama", "triton"),
                                         ("qwen2", "triton-verify")])
def test_the_target_with_split_kv_attention_equals_the_hf_model(kind, matvec):
    """Fixed shapes (the buckets a GPU compiles), float32: prefill 9 tokens, a 5-token tree, keep a
    path of it, decode; logits and boundaries equal the Hugging Face model's at every step. With
    matvec="triton" the one-token steps are what a GPU runs with both options: per block, 4
    products (eyas.engine.matvec) and the 2 attention kernels; with "triton-verify" every fixed-shape
    step (the few-row kernel for more rows)."""
    from eyas.engine import HFTarget, LlamaTarget
    from tests.support.tiny import tiny_model
    from tests.support.walk import KEYS, SPEC, walk

    model = tiny_model(kind, 4).to(DEVICE)
    fast = LlamaTarget(model, SPEC, max_length=64, fixed_shapes=True, key_buckets=KEYS, matvec=matvec,
                       attention="split-kv")
    assert fast.implementation == "fast" + (f"+matvec-{matvec}" if matvec != "gemm" else "") + "+attention-split-kv"
    walk(fast, HFTarget(model, SPEC, max_length=64), torch.Generator().manual_seed(0), device=DEVICE)


@pytest.mark.slow
def test_greedy_speculative_with_split_kv_attention_is_token_identical_to_plain(llama, trained_drafter):
    """Every fixed-shape step (one token, and trees of up to 16 tokens, bucket 16) attends through
    the kernels and multiplies through eyas.engine.matvec's (matvec="triton-verify": what a GPU runs
    with both options; the drafter's steps too, eyas.engine.draft_kernels), and keep() moves the accepted entries between rounds; the output is the Hugging
    Face model's greedy output, token for token (float32). Slow on the CPU: Triton's interpreter."""
    from eyas.engine import HFTarget, LlamaTarget, TreeSpec, plain_generate, speculative_generate
    from tests.support.tiny import SPEC4, random_prompts

    llama = llama.to(DEVICE)
    fast = LlamaTarget(llama, SPEC4, max_length=128, fixed_shapes=True, key_buckets=(32, 64), attention="split-kv",
                       matvec="triton-verify")
    hf = HFTarget(llama, SPEC4)
    accepted = 0
    for prompt in random_prompts(3, 128, seed=11):
        plain = plain_generate(hf, prompt, max_new_tokens=16)
        assert plain_generate(fast, prompt, max_new_tokens=16).tokens == plain.tokens
        out = speculative_generate(fast, trained_drafter.to(DEVICE), prompt, tree=TreeSpec(4, 4, 16), max_new_tokens=16)
        assert out.tokens == plain.tokens, prompt
        accepted += sum(out.stats.accept_lengths) - len(out.stats.accept_lengths)
    assert accepted > 5  # drafts were accepted: keep() moved tree paths the kernels then read


@pytest.mark.integration
def test_a_failed_compilation_with_split_kv_falls_back_to_the_eager_step(monkeypatch):
    """The eager step takes a block's cache as two views, split-kv's steps as one tensor: after the
    fallback the step still equals the model, and says it runs eagerly."""
    from eyas.engine import HFTarget, LlamaTarget
    from tests.support.tiny import tiny_model
    from tests.support.walk import KEYS, SPEC, walk

    def no_compiler(gm, example_inputs):
        raise RuntimeError("Failed to find C compiler")

    model = tiny_model("llama", 4).to(DEVICE)
    fast = LlamaTarget(model, SPEC, max_length=64, fixed_shapes=True, key_buckets=KEYS, attention="split-kv")
    assert fast._fixed.split_kv_layer is not None and fast._eager.split_kv_layer is None
    torch._dynamo.reset()
    fast._fixed, fast.compile = fast._functions(no_compiler, attention="split-kv"), True
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # (the compiled path is a GPU's)
    with pytest.warns(UserWarning, match="(?s)torch.compile failed .*Failed to find C compiler.*runs eagerly"):
        walk(fast, HFTarget(model, SPEC, max_length=64), torch.Generator().manual_seed(0), device=DEVICE)
    assert fast.implementation == "fast" and fast._fixed is fast._eager
