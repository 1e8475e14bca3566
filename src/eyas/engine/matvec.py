"""One-row products by a weight matrix in Triton, with the norm before them and the residual add after.

A plain decoding step multiplies ONE row by every weight matrix of the model, so its time is the time
to read the weights once: a matrix-vector product (matvec) is bound by memory bandwidth, and the
kernels between the products (norms, SiLU, residual adds) cost little work but a launch and a gap
each. On an 8B-shaped Llama in CUDA graphs on an H200 the step compiled by inductor runs 12 to 16
kernels a block, ~1 us of gap each (``benchmarks/2026-12-02-split-kv-h200.md``). Here a block's
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
columns at a time, into a float32 accumulator [BLOCK_N, BLOCK_K] (x's tile broadcast against W's),
summed over its columns at the end: no two programs share a row, so no atomics and no second pass.

Numerics are Hugging Face's, rounding where the model rounds (the model's dtype DT, float32
arithmetic in between): rmsnorm(x) = DT(w_norm * DT(x * rsqrt(mean(x^2) + eps))); SiLU(gate) * up =
DT(DT(SiLU(gate)) * up); the product and its bias in float32, rounded to DT; the residual add of two
DT values, rounded. The float32 sums' order differs from cuBLAS's (and from one tiling to another).

The tiling (rows a program, columns a step, warps, eviction) is the one measured for the GPU and
the product in ``matvec_tilings.json`` (``benchmarks/matvec_gpu.py --write-tilings`` times the
choices and writes the fastest), else :func:`tiling`'s default for the shape. The kernels need
Triton (a GPU, or ``TRITON_INTERPRET=1`` on the CPU, as the tests run them).

Measured (``benchmarks/2026-12-02-matvec-triton-h200.md``): with split-KV attention, 6 kernels a
block, an 8B-shaped plain step took 4.21-4.24 ms on two H200s, 1.19x the bandwidth floor, against
5.07-5.19 ms (1.44-1.46x) for cuBLAS and inductor's kernels; its gate/up product alone runs at the
floor, down and q/k/v at 1.20x, o at 1.26x.
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


class Tiling(NamedTuple):
    """How :func:`matvec` cuts a product: rows per program, columns per loop step, warps per program,
    and whether the weight's loads are marked evict-first (read once: keep x and the rest in L2)."""

    block_n: int
    block_k: int
    num_warps: int
    evict_first: bool = True


def tiling(n_rows: int, n_cols: int, prologue: str | None = None, sms: int = 132) -> Tiling:
    """The default tiling of W [n_rows, n_cols] (for a GPU and shape without a measured one in
    ``matvec_tilings.json``), from two H200 calls (``benchmarks/2026-12-02-matvec-triton-h200.md``):

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


def _key(n_rows: int, n_cols: int, prologue: str | None) -> str:
    """A product's key in a table of tilings: "rows x columns / prologue"."""
    return f"{n_rows}x{n_cols}/{prologue or 'none'}"


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


_CHOSEN: dict[tuple, Tiling] = {}  # (device, rows, columns, prologue) -> its tiling


@torch.compiler.assume_constant_result  # a constant of the compiled step: torch.compile calls it once, tracing
def _tiling_on(device: torch.device, n_rows: int, n_cols: int, prologue: str | None) -> Tiling:
    """The tiling of a product on ``device``: the measured one for its GPU, else :func:`tiling` (on
    the CPU, for Triton's interpreter, which runs programs one by one: 16 rows a program, few
    programs). Chosen once per product and device: an eager step calls this for every product."""
    key = (device, n_rows, n_cols, prologue)
    if key not in _CHOSEN:
        if device.type != "cuda":
            _CHOSEN[key] = tiling(n_rows, n_cols, prologue)._replace(block_n=16)
        else:
            found = _measured(torch.cuda.get_device_name(device)).get(_key(n_rows, n_cols, prologue))
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            _CHOSEN[key] = found or tiling(n_rows, n_cols, prologue, sms)
    return _CHOSEN[key]


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


def matvec(x: Tensor, w: Tensor, *, prologue: str | None = None, norm: Tensor | None = None, eps: float = 0.0,
           bias: Tensor | None = None, residual: Tensor | None = None, tile: Tiling | None = None) -> Tensor:
    """One row through W [N, K]: y [1, N] = residual + W @ prologue(x) + bias (see the module's
    docstring for the prologues and the rounding).

    x [1, K] (``prologue="silu"``: [1, 2K], gate then up), contiguous; w [N, K] with unit stride
    along K (a row slice of a fused weight is fine); norm [K] (``"rms"``) with ``eps``; bias [N],
    residual [1, N]. y has x's dtype. ``tile``: the tiling (default: the one measured for this GPU
    and product, else :func:`tiling`)."""
    N, K = w.shape
    if prologue not in PROLOGUES:
        raise ValueError(f"matvec: prologue must be one of {list(PROLOGUES)}, found {prologue!r}")
    width = 2 * K if prologue == "silu" else K
    if x.shape != (1, width) or not x.is_contiguous():
        raise ValueError(f"matvec: x must be a contiguous [1, {width}] row for w {tuple(w.shape)} and prologue "
                         f"{prologue!r}, found {tuple(x.shape)} with strides {x.stride()}")
    if w.stride(1) != 1:
        raise ValueError(f"matvec: w must have unit stride along its columns, found strides {w.stride()}")
    if prologue == "rms" and (norm is None or norm.shape != (K,)):
        found = None if norm is None else tuple(norm.shape)
        raise ValueError(f"matvec: prologue 'rms' needs norm [{K}], found {found}")
    tile = tile or _tiling_on(x.device, N, K, prologue)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _matvec_kernel[(triton.cdiv(N, tile.block_n),)](
        x, w, y, x if norm is None else norm, x if bias is None else bias,
        x if residual is None else residual, w.stride(0),
        N=N, K=K, EPS=float(eps), PROLOGUE=PROLOGUES.index(prologue), HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVICT="evict_first" if tile.evict_first else "", num_warps=tile.num_warps)
    return y
