"""Split-KV ("flash-decoding") attention of a step's new tokens over the static cache, in Triton.

A fixed-shape step of B new tokens attends the first n entries of a block's cache under the mask
the step's prologue builds ([B, n] bool: every committed entry, then the step's own block). In the
eager order that is three kernels a block on a GPU (QK, a float32 softmax, PV), each with only
Hkv x G*B rows of work, plus three that rotate q and k and write the step's keys and values to
the cache: on an 8B-shaped Llama in CUDA graphs on an H200, 11.8 us a block of a 4.9 ms step. Here
it is two kernels, 7.7 us (``benchmarks/results/2026-12-02-split-kv-h200.md``):

1. ``_partial_kernel``, grid (Hkv, S, row tiles). The n entries are cut into S chunks of ``chunk``
   keys. Program (h, s, t) takes the query rows r = b*G + g of key-value head h (token b, the g-th
   query head of the group: head h*G + g), t's tile of them, and

   - rotates their queries (rotate-half rope: q*cos + rotate_half(q)*sin, in float32, rounded to the
     cache's dtype as the compiled step rounds its own q);
   - for the chunk's entries p < start + B (none past them belongs to this step), in tiles of
     ``BLOCK_N`` keys: entries p < start are read from the cache; the step's own, p = start + j,
     are token j's key (rotated the same way) and value, taken from the step's projections and
     written to the cache (by each program whose tile holds them: the same values; no program
     reads them from the cache, so no program waits for another). Then scores = q . k_p *
     scaling in float32, -inf where mask[b, p] is False, and the online-softmax state m (running
     max), l (sum of exp(score - m)), acc (sum of exp(score - m) v_p, the probabilities rounded
     to the cache's dtype for the product, as flash attention does);
   - writes (m, l, acc) of its rows and chunk, float32. A chunk with no entry to read writes
     m = -inf, l = 0, acc = 0.

2. ``_combine_kernel``, grid (B * Hq,): merges the S partial states of one (token, head),
   M = max_s m_s, out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, and writes it in the
   layout the o projection reads, [B, Hq*D] in the cache's dtype.

Invariants: every row has at least one allowed entry (a token always attends itself), so M is
finite and empty chunks weigh e^-inf = 0; a masked tile leaves the state unchanged (the running max
-inf is replaced by 0 in the exponentials, so no -inf - -inf); the result is softmax(q k^T * scaling
under the mask) v up to float32 summation order and the rounding of q and of the probabilities.

The kernels need Triton (a GPU, or ``TRITON_INTERPRET=1`` on the CPU, as the tests run them). The
head dimension must be a power of two (``supported_head_dim``). They take any B; LlamaTarget runs
them on its steps of one token (``attention="split-kv"``), where they are faster than the eager
order, and verifies trees in the eager order, which was faster at 24 tokens.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch
from torch import Tensor

BLOCK_N = 64  # keys per tile (a tl.dot operand needs at least 16)
BLOCK_R = 16  # query rows per program (the same)
MAX_SPLITS = 32  # chunks per key-value head: 8 heads x 16 chunks fill an H200's 132 SMs at 1024 keys


def supported_head_dim(head_dim: int) -> bool:
    """A tile's width is the head dimension (tl.arange needs a power of two, tl.dot at least 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def splits(n_keys: int, block_n: int = BLOCK_N, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(S, chunk) for n cache entries: chunks of whole tiles of ``block_n`` keys, at most
    ``max_splits`` of them, S * chunk >= n."""
    tiles = triton.cdiv(n_keys, block_n)
    per_chunk = triton.cdiv(tiles, max_splits)
    chunk = per_chunk * block_n
    return triton.cdiv(n_keys, chunk), chunk


@triton.jit
def _partial_kernel(q_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, kv_ptr, mask_ptr, start_ptr, m_ptr, l_ptr,
                    acc_ptr, stride_qb, stride_knb, stride_vnb, stride_cb, stride_sb, stride_kv, stride_kh, stride_kp,
                    stride_mb, n_keys,
                    SCALING: tl.constexpr, B: tl.constexpr, G: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                    S: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, PREFETCH: tl.constexpr):
    h = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R] rows b*G + g of key-value head h
    row_ok = r < G * B
    b = r // G
    hq = h * G + r % G  # [R] query heads
    d = tl.arange(0, D)
    # rotate_half(q)[d] = -q[d + D/2] for d < D/2, q[d - D/2] after
    partner = (d + D // 2) % D
    sign = tl.where(d < D // 2, -1.0, 1.0)
    q_row = q_ptr + b[:, None] * stride_qb + hq[:, None] * D  # [R, 1]
    x = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)  # [R, D]
    x_half = tl.load(q_row + partner[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + b[:, None] * stride_cb + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + b[:, None] * stride_sb + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q = (x * cos + sign[None, :] * x_half * sin).to(kv_ptr.dtype.element_ty)  # [R, D]

    start = tl.load(start_ptr).to(tl.int32)
    lo = s * CHUNK
    hi = tl.minimum(tl.minimum(lo + CHUNK, start + B), n_keys)  # entries [lo, hi) read
    end = hi
    if PREFETCH:  # every tile of the chunk: its loads need not wait for start (see below)
        end = lo + CHUNK
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for p0 in range(lo, end, BLOCK_N):
        p = p0 + tl.arange(0, BLOCK_N)  # [N]
        p_ok = p < hi
        j = p - start  # [N]: the step's own token j at entry start + j
        new = p_ok & (j >= 0)
        old = p_ok & (j < 0)
        # Which entries the cache and mask loads read: those attended (waiting for start's load),
        # or, with PREFETCH, all of the tile within the key bucket (issued at once; the entries
        # past the step's own are stale and zeroed, and no row attends them).
        loaded, loaded_old = p_ok, old
        if PREFETCH:
            loaded = p < n_keys
            loaded_old = loaded
        k_at = kv_ptr + h * stride_kh + p[:, None] * stride_kp + d[None, :]  # [N, D]: kv[0, h, p]
        v_at = k_at + stride_kv  # kv[1, h, p]
        # Loads before the stores below (the compiler keeps a load after a store it may alias)
        k_old = tl.load(k_at, mask=loaded_old[:, None], other=0.0)
        v_old = tl.load(v_at, mask=loaded_old[:, None], other=0.0)
        allowed = tl.load(mask_ptr + b[:, None] * stride_mb + p[None, :], mask=row_ok[:, None] & loaded[None, :],
                          other=False) & p_ok[None, :]  # [R, N] (a bool tensor: Triton's int1)
        # The step's own keys, rotated here, and values, from its projections; written to the cache
        # by every program whose tile holds them (the same values), read from it by none.
        kn_row = kn_ptr + j[:, None] * stride_knb + h * D  # [N, 1]
        kx = tl.load(kn_row + d[None, :], mask=new[:, None], other=0.0).to(tl.float32)
        kx_half = tl.load(kn_row + partner[None, :], mask=new[:, None], other=0.0).to(tl.float32)
        k_cos = tl.load(cos_ptr + j[:, None] * stride_cb + d[None, :], mask=new[:, None], other=0.0).to(tl.float32)
        k_sin = tl.load(sin_ptr + j[:, None] * stride_sb + d[None, :], mask=new[:, None], other=0.0).to(tl.float32)
        k_new = (kx * k_cos + sign[None, :] * kx_half * k_sin).to(kv_ptr.dtype.element_ty)
        v_new = tl.load(vn_ptr + j[:, None] * stride_vnb + h * D + d[None, :], mask=new[:, None], other=0.0)
        tl.store(k_at, k_new, mask=new[:, None])
        tl.store(v_at, v_new.to(kv_ptr.dtype.element_ty), mask=new[:, None])
        zero = tl.full([BLOCK_N, D], 0.0, kv_ptr.dtype.element_ty)  # (prefetched stale entries must not reach PV)
        k = tl.where(new[:, None], k_new, tl.where(old[:, None], k_old, zero))  # [N, D]
        v = tl.where(new[:, None], v_new.to(kv_ptr.dtype.element_ty), tl.where(old[:, None], v_old, zero))
        # SCALING a constexpr: inductor passes a float argument as fp64, which would make the state fp64
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALING  # [R, N] float32
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet: exp(-inf) = 0
        alpha = tl.exp(m_i - m_use)  # [R]
        prob = tl.exp(scores - m_use[:, None])  # [R, N]
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    part = (b * HQ + hq) * S + s  # [R]: the (token, head, chunk) of each row's state
    tl.store(m_ptr + part, m_i, mask=row_ok)
    tl.store(l_ptr + part, l_i, mask=row_ok)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob,
                    HQ: tl.constexpr, D: tl.constexpr, S: tl.constexpr, S_POW2: tl.constexpr):
    row = tl.program_id(0)  # b * HQ + head
    b = row // HQ
    head = row % HQ
    s = tl.arange(0, S_POW2)
    s_ok = s < S
    m = tl.load(m_ptr + row * S + s, mask=s_ok, other=float("-inf"))  # [S]
    l = tl.load(l_ptr + row * S + s, mask=s_ok, other=0.0)
    weight = tl.exp(m - tl.max(m, 0))  # [S], 0 for empty chunks
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + (row * S + s)[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)  # [S, D]
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)  # [D]
    tl.store(out_ptr + b * stride_ob + head * D + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kv: Tensor, mask: Tensor,
                     start: Tensor, scaling: float, *, block_n: int = BLOCK_N, max_splits: int = MAX_SPLITS,
                     num_warps: int = 4, prefetch: bool = False) -> Tensor:
    """Attention of B new tokens over a block's cache; their keys and values written to it here.

    q [B, Hq*D], k, v [B, Hkv*D]: the step's projections, q and k not yet rotated (rows may be
    strided: views of the fused q/k/v output); cos, sin [B, D] (the step's rotary tables, the
    attention scaling included); kv [2, Hkv, C, D] the block's cache (keys, values), into which
    rope(k) and v go at entries start .. start+B-1; mask [B, n] bool (start + B <= n <= C: entry
    p allowed for token b); start [1] long (cache_len, on the device: the step's shapes do not
    depend on it). Returns [B, Hq*D] in q's dtype, query head j attending key-value head j // G.
    ``block_n``, ``max_splits``, ``num_warps``: the partial kernel's tiling (a power of two >= 16
    keys a tile); ``prefetch``: its cache loads issued without waiting for start's (reading the
    whole chunk, stale entries included, then zeroed). ``benchmarks/decode_attention_gpu.py``
    times the choices."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("kv", kv)):
        assert t.stride(-1) == 1, f"decode_attention: {name} must be contiguous in its last dimension"
    B = q.shape[0]
    Hkv, _, D = kv.shape[1:]
    n = mask.shape[1]
    HQ = q.shape[1] // D
    G = HQ // Hkv
    S, chunk = splits(n, block_n, max_splits)
    dev = q.device
    m = torch.empty(B * HQ * S, dtype=torch.float32, device=dev)
    l = torch.empty(B * HQ * S, dtype=torch.float32, device=dev)
    acc = torch.empty(B * HQ * S * D, dtype=torch.float32, device=dev)
    out = torch.empty(B, HQ * D, dtype=q.dtype, device=dev)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # float32: exact products, no TF32
    _partial_kernel[(Hkv, S, triton.cdiv(G * B, BLOCK_R))](
        q, k, v, cos, sin, kv, mask, start, m, l, acc,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), sin.stride(0), kv.stride(0), kv.stride(1),
        kv.stride(2), mask.stride(0), n,
        SCALING=float(scaling), B=B, G=G, HQ=HQ, D=D, S=S, CHUNK=chunk, BLOCK_R=BLOCK_R, BLOCK_N=block_n,
        PRECISION=precision, PREFETCH=bool(prefetch), num_warps=num_warps,
        num_stages=1)  # a chunk is one or two tiles: nothing to pipeline (float32 stages overflowed shared memory)
    _combine_kernel[(B * HQ,)](m, l, acc, out, out.stride(0), HQ=HQ, D=D, S=S, S_POW2=triton.next_power_of_2(S))
    return out
