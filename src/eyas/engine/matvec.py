"""Products of one row, or a few, by a weight matrix in Triton, with the norm before them and the
residual add after.

A plain decoding step multiplies ONE row by every weight matrix of the model, so its time is the time
to read the weights once: a matrix-vector product (matvec) is bound by memory bandwidth, and the
kernels between the products (norms, SiLU, residual adds) cost little work but a launch and a gap
each. On an 8B-shaped Llama in CUDA graphs on an H200 the step compiled by inductor runs 12 to 16
kernels a block, ~1 us of gap each (``benchmarks/results/2026-12-02-split-kv-h200.md``). Here a block's
four products are four kernels that also do what lies between them:

- ``prologue="rms"``: y = W @ rmsnorm(x) (the block's input norm before q/k/v, its post-attention
  norm before gate/up, the final norm before the head). Every program computes the norm's
  sum of squares over the whole x [K] itself (K reads from L2, against its BLOCK_N x K weight
  reads from memory): no kernel, and no gap, before the product.
- ``prologue="silu"``: y = W @ (SiLU(gate) * up), x = [gate | up] [2K], the gate/up product's
  output as it is (the down projection).
- ``prologue=None``: y = W @ x (the o projection).
- ``residual``: y = r + W @ x (the o and down projections: the block's two residual adds).
- ``bias``: y = W @ x + b, before the residual (Qwen2's q/k/v).

Program p owns the rows n in [p*BLOCK_N, (p+1)*BLOCK_N) of W [N, K] and streams them once, BLOCK_K
columns at a time, into a float32 accumulator: no two programs share a row, so no atomics and no
second pass.

- One row (``_matvec_kernel``, CUDA cores): the accumulator is [BLOCK_N, BLOCK_K] (x's tile
  broadcast against W's), summed over its columns at the end.
- R rows, 2 <= R <= ``MAX_ROWS`` (``_rows_kernel``: the verification of a tree, a drafter's
  frontier): the accumulator is [R', BLOCK_N] (R' = R padded to a power of two, at least 16), and
  each step adds prologue(x)'s tile [R', BLOCK_K] times W's tile transposed on the tensor cores
  (``tl.dot``): the weights are read once for all R rows. The rms prologue's per-row 1 / rms is
  a first pass over x [R, K] (from L2) by every program.

Numerics are Hugging Face's, rounding where the model rounds (the model's dtype DT, float32
arithmetic in between): rmsnorm(x) = DT(w_norm * DT(x * rsqrt(mean(x^2) + eps))); SiLU(gate) * up =
DT(DT(SiLU(gate)) * up); the product and its bias in float32, rounded to DT; the residual add of two
DT values, rounded. The float32 sums' order differs from cuBLAS's (and from one tiling to another).

The tiling (rows a program, columns a step, warps, eviction) is the one measured for the GPU and
the product in ``matvec_tilings.json`` (``benchmarks/matvec_gpu.py --write-tilings`` times the
choices and writes the fastest; ``--rows R`` those of the few-row kernel, keyed by R padded), else
:func:`tiling`'s default for the shape (one row) or :func:`rows_tiling`'s (a few). The kernels need
Triton (a GPU, or ``TRITON_INTERPRET=1`` on the CPU, as the tests run them).

Measured (``benchmarks/results/2026-12-02-matvec-triton-h200.md``, the one-row kernel): with split-KV
attention, 6 kernels a block, an 8B-shaped plain step took 4.21-4.24 ms on two H200s, 1.19x the
bandwidth floor, against 5.07-5.19 ms (1.44-1.46x) for cuBLAS and inductor's kernels; its gate/up
product alone runs at the floor, down and q/k/v at 1.20x, o at 1.26x.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

PROLOGUES = (None, "rms", "silu")
MAX_ROWS = 64  # the most rows a product takes (the few-row kernel holds them all in one tile)


class Tiling(NamedTuple):
    """How :func:`matvec` cuts a product: rows per program, columns per loop step, warps per program,
    and whether the weight's loads are marked evict-first (read once: keep x and the rest in L2)."""

    block_n: int
    block_k: int
    num_warps: int
    evict_first: bool = True


def tiling(n_rows: int, n_cols: int, prologue: str | None = None, sms: int = 132) -> Tiling:
    """The default tiling of W [n_rows, n_cols] (for a GPU and shape without a measured one in
    ``matvec_tilings.json``), from two H200 calls (``benchmarks/results/2026-12-02-matvec-triton-h200.md``):

    - at least 2048 columns: 4 rows a program, 2048 columns a step (4 KB of bf16 a row), 8 warps,
      the fastest of 32 tilings for gate/up, q/k/v and the head of an 8B-shaped step, 2% off it
      for o (call 2);
    - fewer columns: 2 rows of 1024 columns, 4 warps (the SmolLM2-shaped step of call 3 ran so);
    - ``prologue="silu"`` (whose loads and exponentials every program repeats for its columns, so
      more rows share them): 8 rows of 1024 columns, 4 warps, the fastest for down (call 2);

    then fewer rows while there are under 2 programs per SM (``sms``)."""
    if prologue == "silu":
        block_n, block_k, warps = 8, 1024, 4
    elif n_cols >= 2048:
        block_n, block_k, warps = 4, 2048, 8
    else:
        block_n, block_k, warps = 2, 1024, 4
    block_k = min(block_k, triton.next_power_of_2(n_cols))
    while block_n > 1 and triton.cdiv(n_rows, block_n) < 2 * sms:
        block_n //= 2
    return Tiling(block_n, block_k, warps)


def _key(n_rows: int, n_cols: int, prologue: str | None, block_r: int = 0, glu: bool = False) -> str:
    """A product's key in a table of tilings: "rows x columns / prologue" for the one-row kernel; the
    few-row kernel's adds "/r" and its padded row count (16, 32, 64), and "/glu" for a gate/up
    product with its SiLU(gate) * up epilogue (``n_rows``: the gate's rows)."""
    few = f"/r{block_r}{'/glu' if glu else ''}" if block_r else ""
    return f"{n_rows}x{n_cols}/{prologue or 'none'}{few}"


TILINGS_FILE = Path(__file__).with_name("matvec_tilings.json")  # per GPU name: product key -> tiling
_TABLES: dict[str, dict] = {}


def _measured(device_name: str) -> dict[str, Tiling]:
    """The tilings measured on a GPU of this name (``benchmarks/matvec_gpu.py --write-tilings``):
    those shipped in ``matvec_tilings.json``, updated by the file ``EYAS_MATVEC_TILINGS`` names."""
    if device_name not in _TABLES:
        table: dict[str, Tiling] = {}
        for path in (TILINGS_FILE, os.environ.get("EYAS_MATVEC_TILINGS")):
            if path:
                table.update(read_tilings(Path(path)).get(device_name, {}))
        _TABLES[device_name] = table
    return _TABLES[device_name]


def read_tilings(path: Path) -> dict[str, dict[str, Tiling]]:
    """A table of tilings, {GPU name: {"ROWSxCOLUMNS/PROLOGUE": [rows, columns, warps, evict_first]}},
    checked: a bad entry raises ValueError naming the file, the entry, what was expected and found."""
    expected = 'a JSON object {GPU name: {"ROWSxCOLUMNS/PROLOGUE": [rows, columns, warps, evict_first]}}'
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: expected {expected}, found {type(e).__name__}: {e}") from e
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ValueError(f"{path}: expected {expected}, found {type(raw).__name__} {str(raw)[:80]}")
    tables: dict[str, dict[str, Tiling]] = {}
    for gpu, entries in raw.items():
        for key, value in entries.items():
            ok = (isinstance(value, list) and len(value) in (3, 4) and all(isinstance(v, int) for v in value)
                  and all(v > 0 and v & (v - 1) == 0 for v in value[:3]))
            if not ok:
                raise ValueError(f"{path}: entry {gpu!r} / {key!r}: expected [rows, columns, warps, evict_first] "
                                 f"(powers of two, then true or false), found {value!r}")
            tables.setdefault(gpu, {})[key] = Tiling(*value[:3], *(bool(v) for v in value[3:]))
    return tables


_CHOSEN: dict[tuple, Tiling] = {}  # (device, rows, columns, prologue, block_r, glu) -> its tiling


@torch.compiler.assume_constant_result  # a constant of the compiled step: torch.compile calls it once, tracing
def _tiling_on(device: torch.device, n_rows: int, n_cols: int, prologue: str | None, block_r: int = 0,
               glu: bool = False) -> Tiling:
    """The tiling of a product on ``device``: the one measured for its GPU (``matvec_tilings.json``),
    else a default. One row (``block_r`` 0): :func:`tiling` (on the CPU, for Triton's interpreter,
    which runs programs one by one: 16 rows a program, few programs). The few-row kernel (``block_r``:
    its rows padded, 16 to 64): :func:`rows_tiling` for the GPU's SM count. Chosen once per product
    and device: an eager step calls this for every product."""
    key = (device, n_rows, n_cols, prologue, block_r, glu)
    if key not in _CHOSEN:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        found = (_measured(torch.cuda.get_device_name(device)).get(_key(n_rows, n_cols, prologue, block_r, glu))
                 if device.type == "cuda" else None)
        if found:
            _CHOSEN[key] = found
        elif block_r:
            _CHOSEN[key] = rows_tiling(n_rows, n_cols, sms)
        elif device.type != "cuda":
            _CHOSEN[key] = tiling(n_rows, n_cols, prologue)._replace(block_n=16)
        else:
            _CHOSEN[key] = tiling(n_rows, n_cols, prologue, sms)
    return _CHOSEN[key]


def rows_tiling(n_rows: int, n_cols: int, sms: int = 132) -> Tiling:
    """The few-row kernel's tiling of W [n_rows, n_cols], from one H200 call's grid at 24 rows
    (``benchmarks/results/2026-12-02-verify-kernels-h200.md``): 128 columns a step (fewer columns: all of
    them), 8 warps, and 128 weight rows a program, fewer (down to 16, a tl.dot's least) while there are
    under half as many programs as SMs. Of the 10 products of the 8B- and SmolLM2-shaped steps it
    is the grid's fastest for 6, within 12% for the two o products, 29% off for SmolLM2's head
    (which 64 columns a step suited) and 55% off for SmolLM2's down product with its SiLU
    prologue (which :func:`matvec`'s ``glu`` replaces)."""
    block_k = 128 if n_cols >= 128 else max(16, triton.next_power_of_2(n_cols))
    block_n = 128
    while block_n > 16 and triton.cdiv(n_rows, block_n) < sms // 2:
        block_n //= 2
    return Tiling(block_n, block_k, 8)


SHARED_BYTES = 160 << 10  # what the few-row kernel's pipelined tiles may take (an H200 SM has 227 KB)


def rows_stages(tile: Tiling, block_r: int, glu: bool, itemsize: int) -> int:
    """How many tiles deep the few-row kernel pipelines its loads (Triton's num_stages, at most 3):
    as many as fit ``SHARED_BYTES``, a stage holding W's tile [BLOCK_N, BLOCK_K] (two with ``glu``)
    and x's [BLOCK_R, BLOCK_K]. Three stages of the 8B gate/up's tiles with glu (128 rows, 128
    columns, 32 x rows) needed 246 KB, past the H200's 227 KB, and inductor's compilation failed
    (``benchmarks/results/2026-12-02-verify-kernels-h200.md``)."""
    stage = ((2 if glu else 1) * tile.block_n + block_r) * tile.block_k * itemsize
    return max(1, min(3, SHARED_BYTES // stage))


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, y_ptr, norm_ptr, bias_ptr, res_ptr, stride_w,
                   N: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr, PROLOGUE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVICT: tl.constexpr):
    # PROLOGUE: 0 none, 1 rms, 2 silu. EPS a constexpr: inductor passes a float argument as fp64.
    DT = y_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W
    n_ok = n < N
    row = n * stride_w  # [BLOCK_N] offsets of the rows (int32 holds them up to 2^31 elements)
    if N * K >= 2**31:
        row = n.to(tl.int64) * stride_w
    EVEN_K: tl.constexpr = K % BLOCK_K == 0  # then no column mask (its loads vectorise for sure)
    if PROLOGUE == 1:  # the norm's 1 / rms over all of x [K], by every program (x is in L2)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            squares += xk * xk
        inv_rms = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + EPS)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K] columns
        if EVEN_K:
            k_ok = tl.full([BLOCK_K], 1, tl.int1)
        else:
            k_ok = k < K
        if PROLOGUE == 1:
            xk = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            scale = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            a = (scale * (xk * inv_rms).to(DT).to(tl.float32)).to(DT).to(tl.float32)
        elif PROLOGUE == 2:  # x = [gate | up]
            gate = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + k, mask=k_ok, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)
            a = (silu * up).to(DT).to(tl.float32)
        else:
            a = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + row[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy=EVICT)
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, 1)  # [BLOCK_N] float32
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    y = y.to(DT)
    if HAS_RES:
        y = (y.to(tl.float32) + tl.load(res_ptr + n, mask=n_ok, other=0.0).to(tl.float32)).to(DT)
    tl.store(y_ptr + n, y, mask=n_ok)


@triton.jit
def _rows_kernel(x_ptr, w_ptr, y_ptr, norm_ptr, bias_ptr, res_ptr, stride_w,
                 N: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr, PROLOGUE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr, PRECISION: tl.constexpr,
                 GLU: tl.constexpr):
    # The few-row kernel: R rows of x (padded to BLOCK_R >= 16 for tl.dot) against BLOCK_N rows of W,
    # acc [BLOCK_R, BLOCK_N] += a [BLOCK_R, BLOCK_K] @ w^T [BLOCK_K, BLOCK_N] on the tensor cores,
    # a = prologue(x) rounded to DT as the model rounds it (the one-row kernel's roundings).
    # GLU: W is [gate; up] [2N, K]; the program also streams the up rows n + N into a second
    # accumulator, and its epilogue is SiLU(gate) * up, so no later kernel recomputes the SiLU.
    DT = y_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of W
    n_ok = n < N
    row = n * stride_w
    if N * K >= 2**31:
        row = n.to(tl.int64) * stride_w
    r = tl.arange(0, BLOCK_R)  # [BLOCK_R] rows of x
    r_ok = r < R
    WIDTH: tl.constexpr = 2 * K if PROLOGUE == 2 else K  # x's row length
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    if PROLOGUE == 1:  # each row's 1 / rms over all of x [R, K] (x is in L2), before the product
        squares = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + r[:, None] * WIDTH + k[None, :], mask=r_ok[:, None] & (k < K)[None, :],
                         other=0.0).to(tl.float32)
            squares += xk * xk
        inv_rms = 1.0 / tl.sqrt(tl.sum(squares, 1) / K + EPS)  # [BLOCK_R]
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)  # (GLU only)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K] columns
        if EVEN_K:
            k_ok = tl.full([BLOCK_K], 1, tl.int1)
        else:
            k_ok = k < K
        x_at = x_ptr + r[:, None] * WIDTH + k[None, :]  # [BLOCK_R, BLOCK_K]
        x_ok = r_ok[:, None] & k_ok[None, :]
        if PROLOGUE == 1:
            xk = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
            scale = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            a = (scale[None, :] * (xk * inv_rms[:, None]).to(DT).to(tl.float32)).to(DT)
        elif PROLOGUE == 2:  # x = [gate | up]
            gate = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
            up = tl.load(x_at + K, mask=x_ok, other=0.0).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)
            a = (silu * up).to(DT)
        else:
            a = tl.load(x_at, mask=x_ok, other=0.0).to(DT)
        w = tl.load(w_ptr + row[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy=EVICT)  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(a, tl.trans(w.to(DT)), input_precision=PRECISION)
        if GLU:
            w_up = tl.load(w_ptr + N * stride_w + row[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                           other=0.0, eviction_policy=EVICT)
            acc_up += tl.dot(a, tl.trans(w_up.to(DT)), input_precision=PRECISION)
    y = acc  # [BLOCK_R, BLOCK_N] float32
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y.to(DT)
    if GLU:  # DT(DT(SiLU(gate)) * up), gate and up rounded to DT first (with their biases)
        up = acc_up
        if HAS_BIAS:
            up += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        gate = y.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)
        y = (silu * up.to(DT).to(tl.float32)).to(DT)
    at = r[:, None] * N + n[None, :]
    ok = r_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        y = (y.to(tl.float32) + tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32)).to(DT)
    tl.store(y_ptr + at, y, mask=ok)


def matvec(x: Tensor, w: Tensor, *, prologue: str | None = None, norm: Tensor | None = None, eps: float = 0.0,
           bias: Tensor | None = None, residual: Tensor | None = None, glu: bool = False,
           tile: Tiling | None = None) -> Tensor:
    """R rows through W [N, K] (1 <= R <= ``MAX_ROWS``): y [R, N] = residual + W @ prologue(x) + bias,
    row by row (see the module's docstring for the prologues and the rounding).

    ``glu``: W is [gate; up] [2N', K] (the fused gate/up projection, bias [2N']) and y [R, N'] =
    SiLU(gate) * up, computed in the product's epilogue (rounded as the model rounds: gate and up
    to x's dtype, SiLU(gate) to it, the product to it); always the few-row kernel (any R), no
    residual. The down product then takes y with no prologue, where ``prologue="silu"`` would make
    every program of the down product recompute the SiLU of all of x (6-8x cuBLAS's time for R = 24
    on an H200, ``benchmarks/results/2026-12-02-verify-kernels-h200.md``).

    x [R, K] (``prologue="silu"``: [R, 2K], gate then up), contiguous; w [N, K] with unit stride
    along K (a row slice of a fused weight is fine); norm [K] (``"rms"``) with ``eps``; bias [N],
    residual [R, N] contiguous. y has x's dtype. One row runs the one-row kernel (CUDA cores, its
    tiling measured per GPU); more rows run the few-row kernel (tensor cores, the rows padded to
    16). ``tile``: the tiling (default: the one measured for this GPU and product, else
    :func:`tiling` for one row, :func:`rows_tiling` for more)."""
    N, K = w.shape
    if prologue not in PROLOGUES:
        raise ValueError(f"matvec: prologue must be one of {list(PROLOGUES)}, found {prologue!r}")
    if glu and (N % 2 or prologue == "silu" or residual is not None):
        raise ValueError(f"matvec: glu needs w [gate; up] with an even number of rows, no silu prologue and no "
                         f"residual, found w {tuple(w.shape)}, prologue {prologue!r}, residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    width = 2 * K if prologue == "silu" else K
    R = x.shape[0] if x.dim() == 2 else 0
    if x.dim() != 2 or x.shape[1] != width or not 1 <= R <= MAX_ROWS or not x.is_contiguous():
        raise ValueError(f"matvec: x must be contiguous [R, {width}] rows (1 <= R <= {MAX_ROWS}) for w "
                         f"{tuple(w.shape)} and prologue {prologue!r}, found {tuple(x.shape)} with strides {x.stride()}")
    if w.stride(1) != 1:
        raise ValueError(f"matvec: w must have unit stride along its columns, found strides {w.stride()}")
    if prologue == "rms" and (norm is None or norm.shape != (K,)):
        found = None if norm is None else tuple(norm.shape)
        raise ValueError(f"matvec: prologue 'rms' needs norm [{K}], found {found}")
    if residual is not None and (residual.shape != (R, N) or not residual.is_contiguous()):
        raise ValueError(f"matvec: residual must be contiguous [{R}, {N}], found {tuple(residual.shape)} with "
                         f"strides {residual.stride()}")
    N = N // 2 if glu else N  # the output's width (GLU: the gate's rows)
    y = torch.empty(R, N, dtype=x.dtype, device=x.device)
    common = dict(N=N, K=K, EPS=float(eps), PROLOGUE=PROLOGUES.index(prologue), HAS_BIAS=bias is not None,
                  HAS_RES=residual is not None)
    pointers = (x, w, y, x if norm is None else norm, x if bias is None else bias, x if residual is None else residual)
    if R == 1 and not glu:
        tile = tile or _tiling_on(x.device, N, K, prologue)
        _matvec_kernel[(triton.cdiv(N, tile.block_n),)](
            *pointers, w.stride(0), **common, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            EVICT="evict_first" if tile.evict_first else "", num_warps=tile.num_warps)
        return y
    block_r = max(16, triton.next_power_of_2(R))
    tile = tile or _tiling_on(x.device, N, K, prologue, block_r, glu)
    _rows_kernel[(triton.cdiv(N, tile.block_n),)](
        *pointers, w.stride(0), **common, R=R, BLOCK_R=block_r, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, EVICT="evict_first" if tile.evict_first else "",
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GLU=glu, num_warps=tile.num_warps,
        num_stages=rows_stages(tile, block_r, glu, x.element_size()))
    return y
