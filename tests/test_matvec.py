"""eyas.engine.matvec: one row (the one-row kernel) or a few (the few-row kernel) through a weight
matrix with the norm before it (rms), SiLU(gate) * up (silu) or nothing, bias and residual add after,
equal to the Hugging Face order of operations; and LlamaTarget with matvec="triton" (one-token
steps) and "triton-verify" (fixed-shape steps of up to 64 tokens) equal to the Hugging Face model,
those steps calling no GEMM.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before triton's import; CI installs triton for this); on a GPU they are compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_kernels import DEVICE, require_triton

require_triton("the matvec kernels")

from eyas.engine.llama_steps import rms_norm  # noqa: E402
from eyas.engine.matvec import (  # noqa: E402
    MAX_ROWS, Tiling, matvec, rows_stages, rows_tiling, tiling,
)


def _reference(x, w, prologue, norm, eps, bias, residual) -> torch.Tensor:
    """The Hugging Face order: the prologue in x's dtype (rms_norm, F.silu(gate) * up), the product
    and bias in float64 rounded to x's dtype, then the residual add rounded."""
    K = w.shape[1]
    a = rms_norm(x, norm, eps) if prologue == "rms" else F.silu(x[:, :K]) * x[:, K:] if prologue == "silu" else x
    y = F.linear(a.double(), w.double(), None if bias is None else bias.double()).to(x.dtype)
    return y if residual is None else y + residual


CASES = [  # (R, N, K, prologue, bias, residual, tiling): uneven rows and columns, every prologue, 1 to 64 rows
    (1, 40, 96, None, False, True, Tiling(8, 32, 4)),
    (1, 37, 100, "rms", True, False, Tiling(16, 64, 4)),
    (1, 33, 64, "silu", False, True, Tiling(4, 64, 2)),
    (1, 64, 128, "rms", False, False, None),
    (1, 48, 80, "silu", True, True, Tiling(1, 16, 1)),
    (3, 40, 96, None, True, True, Tiling(16, 32, 4)),
    (8, 37, 100, "rms", True, True, None),
    (17, 33, 64, "silu", False, True, Tiling(32, 16, 2)),
    (64, 70, 576, "rms", False, False, None),
    (5, 40, 2500, "rms", False, True, None),  # the rms pass: 20 steps of 128 columns
]


@pytest.mark.unit
@pytest.mark.parametrize("R,N,K,prologue,with_bias,with_residual,tile", CASES)
def test_matvec_equals_the_reference_in_float32(R, N, K, prologue, with_bias, with_residual, tile):
    g = torch.Generator().manual_seed(N)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(R, 2 * K if prologue == "silu" else K, generator=g)
    norm, bias, residual = torch.randn(K, generator=g), torch.randn(N, generator=g), torch.randn(R, N, generator=g)
    args = dict(prologue=prologue, norm=norm if prologue == "rms" else None, eps=1e-5,
                bias=bias if with_bias else None, residual=residual if with_residual else None)
    y = matvec(x.to(DEVICE), w.to(DEVICE), tile=tile, **{k: v.to(DEVICE) if torch.is_tensor(v) else v
                                                           for k, v in args.items()})
    assert y.shape == (R, N) and y.dtype == torch.float32
    expected = _reference(x.double(), w.double(), **{k: v.double() if torch.is_tensor(v) else v
                                                     for k, v in args.items()})
    # float32 sums in another order: a few ulps of the sum's magnitude (sqrt(K) here)
    torch.testing.assert_close(y.double().cpu(), expected, atol=2e-6 * K ** 0.5, rtol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("R,N,K,prologue,with_bias,with_residual,tile", CASES[:3] + CASES[5:8])
def test_matvec_rounds_where_the_model_rounds_in_half_precision(R, N, K, prologue, with_bias, with_residual, tile):
    """float16 (the interpreter's Triton multiplies bfloat16 as raw bits in tl.dot, which the
    few-row kernel uses): the prologue's roundings are the model's, so the result is the
    reference's up to one rounding of the float32 sum (1 ulp)."""
    dt = torch.float16
    g = torch.Generator().manual_seed(N)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dt)
    x = torch.randn(R, 2 * K if prologue == "silu" else K, generator=g).to(dt)
    norm, bias, residual = (torch.randn(K, generator=g).to(dt), torch.randn(N, generator=g).to(dt),
                            torch.randn(R, N, generator=g).to(dt))
    args = dict(prologue=prologue, norm=norm if prologue == "rms" else None, eps=1e-5,
                bias=bias if with_bias else None, residual=residual if with_residual else None)
    y = matvec(x.to(DEVICE), w.to(DEVICE), tile=tile, **{k: v.to(DEVICE) if torch.is_tensor(v) else v
                                                           for k, v in args.items()}).cpu()
    expected = _reference(x, w, **args)
    assert y.dtype == dt
    ulp = torch.finfo(dt).eps * expected.float().abs().clamp_min(1.0)
    assert ((y.float() - expected.float()).abs() <= 2 * ulp).all()


@pytest.mark.unit
@pytest.mark.parametrize("R,I,K,dtype", [(1, 40, 96, torch.float32), (7, 33, 64, torch.float32),
                                         (24, 70, 576, torch.float16)])
def test_glu_computes_silu_of_gate_times_up_in_the_gate_up_products_epilogue(R, I, K, dtype):
    """glu: w = [gate; up] [2I, K] (and its bias), y [R, I] = SiLU(gate) * up with the model's
    roundings: gate and up (bias added) rounded to the dtype, then SiLU, then the product. float16:
    the interpreter's tl.dot multiplies bfloat16 as raw bits."""
    g = torch.Generator().manual_seed(R)
    w = (torch.randn(2 * I, K, generator=g) / K ** 0.5).to(dtype)
    x, norm, bias = torch.randn(R, K, generator=g).to(dtype), torch.randn(K, generator=g).to(dtype), \
        torch.randn(2 * I, generator=g).to(dtype)
    y = matvec(x.to(DEVICE), w.to(DEVICE), prologue="rms", norm=norm.to(DEVICE), eps=1e-5, bias=bias.to(DEVICE),
               glu=True).cpu()
    wide = torch.float64 if dtype == torch.float32 else dtype
    gate_up = F.linear(rms_norm(x.to(wide), norm.to(wide), 1e-5).double(), w.double(), bias.double()).to(wide)
    expected = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    assert y.shape == (R, I) and y.dtype == dtype
    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp_min(1.0)
    assert ((y.double() - expected.double()).abs() <= 2 * ulp.double() + 1e-6).all()
    with pytest.raises(ValueError, match=r"glu needs w \[gate; up\] with an even number of rows, no silu prologue and "
                                         r"no residual, found w \(139, 96\)"):
        matvec(torch.zeros(R, 96, dtype=dtype, device=DEVICE), torch.zeros(139, 96, dtype=dtype, device=DEVICE), glu=True)


@pytest.mark.unit
def test_matvec_reads_a_row_slice_of_a_fused_weight_and_refuses_bad_input():
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(96, 64, generator=g).to(DEVICE)
    x = torch.randn(1, 64, generator=g).to(DEVICE)
    torch.testing.assert_close(matvec(x, fused[32:80]), x @ fused[32:80].T, atol=2e-5, rtol=1e-5)
    rows = torch.randn(5, 64, generator=g).to(DEVICE)
    torch.testing.assert_close(matvec(rows, fused[32:80]), rows @ fused[32:80].T, atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"x must be contiguous \[R, 128\] rows \(1 <= R <= 64\) for w \(96, 64\) "
                                         r"and prologue 'silu', found \(1, 64\)"):
        matvec(x, fused, prologue="silu")
    with pytest.raises(ValueError, match=r"x must be contiguous \[R, 64\] rows \(1 <= R <= 64\) .* found \(65, 64\)"):
        matvec(torch.zeros(MAX_ROWS + 1, 64, device=DEVICE), fused)
    with pytest.raises(ValueError, match=r"residual must be contiguous \[5, 96\], found \(1, 96\)"):
        matvec(rows, fused, residual=torch.zeros(1, 96, device=DEVICE))
    with pytest.raises(ValueError, match=r"prologue 'rms' needs norm \[64\], found None"):
        matvec(x, fused, prologue="rms")
    with pytest.raises(ValueError, match=r"prologue must be one of \[None, 'rms', 'silu'\], found 'gelu'"):
        matvec(x, fused, prologue="gelu")
    with pytest.raises(ValueError, match=r"w must have unit stride along its columns, found strides \(1, 64\)"):
        matvec(x, fused[:64].T)  # a transposed matrix


@pytest.mark.unit
def test_the_default_tiling_and_the_measured_ones(tmp_path, monkeypatch):
    """4 rows of 2048 columns with 8 warps (2 of 1024 with 4 for fewer columns, 8 of 1024 with 4
    under SiLU), fewer rows until there are 2 programs per SM. A table of measured tilings (per GPU name, as benchmarks/matvec_gpu.py writes
    it) wins for the products it names; EYAS_MATVEC_TILINGS adds a file of them."""
    import json

    import eyas.engine.matvec as mv

    assert tiling(4096, 4096) == Tiling(4, 2048, 8) and tiling(4096, 14336, "silu") == Tiling(8, 1024, 4)
    assert tiling(576, 1536, "silu") == Tiling(2, 1024, 4) and tiling(960, 576) == Tiling(2, 1024, 4)
    assert tiling(400, 4096) == Tiling(1, 2048, 8)  # 400 programs of one row (of 2 rows, 200 < 2 x 132)
    assert tiling(4096, 14336, "silu", sms=1) == Tiling(8, 1024, 4) and tiling(64, 100).block_k == 128
    # the few-row kernel: 128 columns a step, 8 warps, 128 rows down to 16 for half as many programs as SMs
    assert rows_tiling(28672, 4096) == Tiling(128, 128, 8) and rows_tiling(576, 576) == Tiling(16, 128, 8)
    assert rows_tiling(6144, 4096) == Tiling(64, 128, 8) and rows_tiling(40, 20).block_k == 32
    # pipelined as deep as 160 KB of shared memory holds: the 8B gate/up with glu (2 x 128 + 32 rows of 128 bf16) 2 deep
    assert rows_stages(Tiling(128, 128, 8), 32, True, 2) == 2 and rows_stages(Tiling(32, 128, 8), 32, True, 2) == 3
    assert rows_stages(Tiling(128, 128, 8), 64, True, 4) == 1
    path = tmp_path / "tilings.json"
    path.write_text(json.dumps({"GPU X": {"4096x4096/none": [4, 512, 8, False], "6144x4096/rms": [16, 1024, 4, True],
                                          "1536x576/rms/r32/glu": [32, 256, 4, True]}}))
    monkeypatch.setenv("EYAS_MATVEC_TILINGS", str(path))
    monkeypatch.setattr(mv, "_TABLES", {})
    table = mv._measured("GPU X")
    assert table["4096x4096/none"] == Tiling(4, 512, 8, False) and table[mv._key(6144, 4096, "rms")].block_n == 16
    # the few-row kernel's products: keyed by their padded rows too, and glu (N: the gate's rows)
    assert mv._key(1536, 576, "rms", 32, True) == "1536x576/rms/r32/glu"
    assert mv._key(576, 576, None, 16) == "576x576/none/r16"
    assert table[mv._key(1536, 576, "rms", 32, True)] == Tiling(32, 256, 4)
    assert mv._key(1536, 576, "rms", 16, True) not in table
    assert mv._measured("GPU Y") == {}  # a GPU no table names: the default tiling
    shipped = mv.read_tilings(mv.TILINGS_FILE)["NVIDIA H200"]  # the 8B-shaped step's five products, and
    assert shipped[mv._key(28672, 4096, "rms")] == Tiling(4, 2048, 8, True)
    # SmolLM2's few-row products without a prologue: 16 rows, 256 or 512 columns a step, 4 warps (the rule: 128, 8)
    assert shipped[mv._key(576, 1536, None, 32)] == Tiling(16, 512, 4) != rows_tiling(576, 1536)
    path.write_text(json.dumps({"GPU X": {"4096x4096/none": [3, 512, 8]}}))
    with pytest.raises(ValueError, match=r"tilings.json: entry 'GPU X' / '4096x4096/none': expected \[rows, columns, "
                                         r"warps, evict_first\] \(powers of two, then true or false\), found \[3, 512, 8\]"):
        mv.read_tilings(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"tilings.json: expected a JSON object .* found JSONDecodeError"):
        mv.read_tilings(path)


@pytest.mark.integration
@pytest.mark.parametrize("kind,matvec", [("llama", "triton"), ("qwen2", "triton"), ("qwen3", "triton"),
                                         ("llama", "triton-verify"), ("qwen3", "triton-verify")])
def test_steps_through_the_triton_kernels_equal_the_hf_model_and_call_no_gemm(kind, matvec, monkeypatch):
    """Every product of a fixed-shape step of one token (matvec="triton"), or of up to 64 tokens
    ("triton-verify": more rows by the few-row kernel), is a Triton kernel with the norms, SiLU and
    residual adds in it, with the model's results (qwen2: q/k/v biases; qwen3: per-head norms);
    other steps keep F.linear. The walk: prefill, a tree, keep, decode, then a prompt past the
    largest bucket (exact shapes)."""
    import eyas.engine.llama_kernels as kernels
    from eyas.engine import HFTarget, LlamaTarget
    from tests.support.tiny import tiny_model
    from tests.support.walk import KEYS, SPEC, same, walk

    model = tiny_model(kind, 4).to(DEVICE)
    fast = LlamaTarget(model, SPEC, max_length=64, fixed_shapes=True, key_buckets=KEYS, matvec=matvec,
                       buckets=(1, 8, 16))
    hf = HFTarget(model, SPEC, max_length=64)
    assert fast.implementation == f"fast+matvec-{matvec}"
    g = torch.Generator().manual_seed(0)
    rows: list[int] = []  # the rows of every F.linear the fast target calls
    real, real_forward = kernels.F.linear, fast.forward

    def fast_forward(*args, **kwargs):  # F.linear counted in the fast target's forward only
        with monkeypatch.context() as m:
            m.setattr(kernels.F, "linear", lambda a, *w: rows.append(a.shape[0]) or real(a, *w))
            return real_forward(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(fast, "forward", fast_forward)
        walk(fast, hf, g, device=DEVICE)  # token buckets 16 (the prompt of 9), 8 (the tree; 2 tokens), 1
        assert set(rows) == (set() if matvec == "triton-verify" else {16, 8})
        rows.clear()
        for pos in range(fast.cache_len, fast.cache_len + 3):
            ids = torch.randint(0, 128, (1, 1), generator=g).to(DEVICE)
            position = torch.tensor([[pos]], device=DEVICE)
            same(fast.forward(ids, position), hf.forward(ids, position))
        assert rows == []  # not one GEMM in the one-token steps
        ids = torch.randint(0, 128, (1, 20), generator=g).to(DEVICE)  # past the largest bucket: exact shapes
        positions = torch.arange(fast.cache_len, fast.cache_len + 20, device=DEVICE)[None]
        same(fast.forward(ids, positions), hf.forward(ids, positions))
    assert rows and set(rows) == {20}


@pytest.mark.integration
def test_triton_products_of_unfused_projections_equal_the_hf_model():
    """fuse=False: q, k and v are three kernels (each with the norm), gate and up two, concatenated
    for the down kernel's SiLU."""
    from eyas.engine import HFTarget, LlamaTarget
    from tests.support.tiny import tiny_model
    from tests.support.walk import KEYS, SPEC, walk

    model = tiny_model("qwen2", 4).to(DEVICE)
    fast = LlamaTarget(model, SPEC, max_length=64, fixed_shapes=True, key_buckets=KEYS, matvec="triton", fuse=False)
    assert fast.unfused_reason == "fuse=False" and len(fast.weights[0].qkv) == 3
    walk(fast, HFTarget(model, SPEC, max_length=64), torch.Generator().manual_seed(2), device=DEVICE)


@pytest.mark.unit
@pytest.mark.parametrize("option,fallback", [("matvec='triton'", "matvec='gemm'"),
                                             ("attention='split-kv'", "attention='eager'")])
def test_the_triton_options_are_refused_where_their_kernels_cannot_run(monkeypatch, option, fallback):
    """matvec="triton" (this module's kernels) and attention="split-kv" (eyas.engine.decode_attention's)
    on a CPU without Triton's interpreter: refused, saying where they run and what to use instead."""
    import re

    from eyas.engine.llama import LlamaTarget, UnsupportedTarget
    from tests.support.tiny import tiny_model
    from tests.support.walk import SPEC

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    name, value = option.split("=")
    with pytest.raises(UnsupportedTarget, match=re.escape(f"{option} runs Triton kernels, on a GPU (the model is on "
                                                          f"cpu) or under TRITON_INTERPRET=1; use {fallback}")):
        LlamaTarget(tiny_model("llama", 4), SPEC, max_length=64, fixed_shapes=True, **{name: value.strip("'")})
