"""How the fast Llama-family target's step multiplies by its weights and attends over its cache (the
dispatch behind :class:`~eyas.engine.llama.LlamaTarget`'s ``matvec`` and ``attention`` options), and the
fused q/k/v and gate/up weights its products read.

The options. ``matvec`` (LlamaTarget's) says how the fixed-shape steps multiply by the weights:
``"gemm"`` (``F.linear``: cuBLAS), ``"reduce"`` (steps of one token: a float32 reduction that inductor
compiles into one weight-streaming kernel, see :func:`linear`), ``"reduce-tuned"`` (the same, with
inductor's coordinate-descent tuning of every kernel's block sizes: a longer compilation),
``"triton"`` (steps of one token, plain decoding: :mod:`eyas.engine.matvec`'s one-row kernel, one
Triton kernel per product that also does the norm before it, SiLU(gate) * up and the residual add, 4
kernels a block; it needs Triton, like split-kv), ``"triton-verify"`` (those kernels for every
fixed-shape step of up to ``KERNEL_ROWS`` = 64 tokens, the verification of a tree included, more rows
by the few-row kernel; with split-kv attention, verification attends through it too; and the drafter's
steps run the same kernels, :mod:`eyas.engine.draft_kernels`), or ``"auto"`` (the default: where the
steps are compiled on a GPU and triton is installed, ``"triton-verify"`` for a model of hidden size up
to ``FEW_ROW_KERNELS_UP_TO_HIDDEN`` (1024) with split-kv attention, ``"triton"`` for larger ones, else
``"gemm"``; :func:`auto_kernels`). Other steps use ``F.linear``.

Measured on an H200 in bf16 (``benchmarks/results/2026-12-01-matvec-h200.md``): a SmolLM2-shaped plain step
1.229 ms (gemm), 0.976 (reduce), 0.933 (reduce-tuned); an 8B-shaped one 4.949, 6.458 and 4.849 ms,
warm-up 27, 4 and 89 s; with the down product compiled apart (:func:`~eyas.engine.llama_steps._down`),
4.878 (gemm) and 4.427 ms (reduce-tuned) on one machine (``benchmarks/results/2026-12-02-llama8b-h200.md``:
1.37x and 1.24x the floor). Not the default: the float32 greedy identity test with the HF model failed
once on that GPU with ``"reduce"`` and passed on 2026-12-02. With ``"triton"`` and split-kv attention
the 8B-shaped plain step took 4.244 and 4.206 ms on two machines, 1.19x the floor, against 5.190 and
5.073 ms with cuBLAS (``benchmarks/results/2026-12-02-matvec-triton-h200.md``); a SmolLM2-shaped one 0.614 ms
against 1.404. ``"triton-verify"`` (``benchmarks/results/2026-12-02-verify-kernels-h200.md``): its first
version verified 24 tokens in 13.02 ms on the 8B shape against 5.49 with cuBLAS, and on SmolLM2's
MT-bench speculative decoding ran at 1164.5 tok/s against 1299.9 (one call; the down product's SiLU
prologue took 4-7x cuBLAS's time). With the SiLU in the gate/up kernel (glu) and measured tilings,
SmolLM2-shaped verification of 24 tokens took 1.146 ms against 1.365 with cuBLAS (another call), while
the 8B step's compilation ran out of shared memory (since fixed, measured since: 7.25 ms, against 5.45
with cuBLAS). With ``"triton"``, eyas plain decoded SmolLM2 at 1415.6 tok/s against 860.4 with cuBLAS,
and speculative decoding (cuBLAS verification) at 1299.9; with ``"triton-verify"`` and the drafter's
round functions compiled whole, speculative decoding ran at 1556.7 tok/s against 1410.0 plain, 1.10x
(``benchmarks/results/2026-12-02-round-compile-h200.md``).

``attention`` (LlamaTarget's) says how the steps attend over the cache: ``"auto"`` (the default:
``"split-kv"`` where ``matvec``'s auto picks eyas' kernels and the head dimension is a power of two of
at least 16, else ``"eager"``), ``"eager"`` (Hugging Face's eager order: QK, a float32 softmax under
the mask, PV; three kernels a block on a GPU), ``"sdpa"`` (one ``scaled_dot_product_attention`` call a
block, a fused kernel on a GPU; equal to the model in float32 on the CPU), or ``"split-kv"`` (the
fixed-shape steps of one token, and with ``matvec="triton-verify"`` those of up to 64: two Triton
kernels a block that also rotate q and k and write the cache, :mod:`eyas.engine.decode_attention`; it
needs Triton, a GPU or ``TRITON_INTERPRET=1``, and a power-of-two head dimension). On an H200,
8B-shaped, bf16 (``benchmarks/results/2026-12-02-split-kv-h200.md``): SDPA 6.245 ms a plain step against 5.391
eager (gemm, one call); split-kv with gemm 4.769 ms and 400 kernels (1.34x the floor, another
machine); verifying 24 tokens with gemm, 5.98 ms split-kv against 5.59 eager (one call). SDPA is
opt-in (slower); split-kv goes with ``matvec="triton"`` (above).

Dispatch. ``MATVEC_CHOICES`` and ``ATTENTION_CHOICES`` are the options' values, and
:func:`auto_kernels` what ``"auto"`` picks. :func:`why_no_triton` and :func:`why_not_split_kv` say
where eyas' Triton kernels cannot run (the target refuses an option that needs them there; the
drafter's kernels, :mod:`eyas.engine.draft_kernels`, ask the same). A product of a step's rows runs
through :func:`linear` (``F.linear``; one row as a float32 reduction with ``matvec="reduce"``; a few
rows transposed on the CPU) or :func:`project` (stacked projections, one GEMM by a fused weight),
or, where :func:`in_kernels` says so, through :mod:`eyas.engine.matvec`'s kernels
(:func:`stacked_products`, :func:`fused_matvec`), which also do the norm before the product,
SiLU(gate) * up and the residual add. The kernels are imported at their first use, so this module
imports without Triton. The step's functions (:mod:`eyas.engine.llama_steps`) call these.

Fused projections. A step at batch 1 is launch-bound on a small model (SmolLM2-135M on an H200:
~2.7 us a kernel, each of a block's 7 GEMMs ~3.5 us), so a block runs q/k/v as ONE GEMM and gate/up
as ONE GEMM (4 GEMMs a block instead of 7). :func:`fuse_projections`, which
:class:`~eyas.engine.llama.LlamaTarget` calls first, stores each block's q/k/v weights as consecutive
rows of one tensor [(Hq+2Hkv)*D, H] and gate/up as rows of one [2I, H] (biases likewise) and makes
the Hugging Face model's own parameters views into it: no weight is held twice, the model computes
exactly as before (HFTarget, capture and training use it), and its state_dict is unchanged. The step
splits the GEMM's output into views. A model whose parameters cannot be stacked (on the ``meta``
device, quantized or other tensor subclasses) keeps its separate GEMMs, with the reason in
``LlamaTarget.unfused_reason``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.targets.structure import find_decoder_blocks

# How the fixed-shape steps multiply by the weights (LlamaTarget's matvec).
MATVEC_CHOICES = ("auto", "gemm", "reduce", "reduce-tuned", "triton", "triton-verify")
# What the step's functions do with their rows (see in_kernels): "reduce-tuned" is "reduce" with
# other compiler options; "auto" is "triton" or "triton-verify" on the compiled GPU path, else "gemm"
# (see auto_kernels).
OneRow = Literal["gemm", "reduce", "triton", "triton-verify"]
# With matvec="triton-verify", the fixed-shape steps of up to this many tokens run every product
# through eyas.engine.matvec's kernels (its MAX_ROWS): a plain step, and trees of up to 63 drafted
# tokens (with "triton", the plain steps only).
KERNEL_ROWS = 64

# How a step attends over the cache (LlamaTarget's attention; see llama_steps._layer).
ATTENTION_CHOICES = ("auto", "eager", "sdpa", "split-kv")  # auto: split-kv with matvec's auto kernels, else eager

# Products of at most this many rows run transposed on the CPU (see linear).
CPU_TRANSPOSED_ROWS = 7


def why_no_triton(device: torch.device, holder: str = "model") -> str | None:
    """None where eyas' Triton kernels can run on ``device`` (the ``holder``'s: "model", "drafter");
    else why not, as the end of a sentence that starts with what asked for them."""
    if importlib.util.find_spec("triton") is None:
        return "runs Triton kernels, and triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"runs Triton kernels, on a GPU (the {holder} is on {device.type}) or under TRITON_INTERPRET=1"
    return None


def why_not_split_kv(head_dim: int) -> str | None:
    """None when the split-KV attention kernels take this head dimension; else why not (call after
    :func:`why_no_triton`: the check imports them)."""
    from eyas.engine.decode_attention import supported_head_dim

    if supported_head_dim(head_dim):
        return None
    return f"needs a power-of-two head dimension of at least 16, found {head_dim}"


# Models up to this hidden size also verify and draft through eyas' kernels by default ("auto" picks
# "triton-verify"): their steps are bound by kernel launches, which the kernels' fused products cut,
# while a large model's few-row products are bound by the weights' bytes, where cuBLAS is faster.
# Measured on an H200 in bf16 (benchmarks/results/2026-12-02-round-compile-h200.md): SmolLM2-135M (hidden
# 576) verified 24 tokens in 1.120 ms through them against 1.365 with cuBLAS (two calls), and on
# MT-bench its rounds of tree 4,8,24 verified in 0.97 ms against 1.12 (one call); an 8B-shaped
# Llama (hidden 4096) verified 24 tokens in 7.25 ms through them against 5.45 with cuBLAS.
FEW_ROW_KERNELS_UP_TO_HIDDEN = 1024


def auto_kernels(compiled: bool, head_dim: int, hidden_size: int) -> tuple[str, str]:
    """(matvec, attention) for "auto": eyas' Triton kernels where the fixed-shape steps are compiled
    on a GPU (the fast path) and triton is installed, else cuBLAS and the eager order ("gemm",
    "eager"). With the kernels: split-kv attention where the head dimension is one its kernels take
    (else "eager"); "triton" (the one-token steps through the kernels, verification on cuBLAS) and,
    for a model of hidden size up to FEW_ROW_KERNELS_UP_TO_HIDDEN with split-kv, "triton-verify"
    (verification and the drafter's steps through them too). The kernels make a plain step's
    block 6 kernels instead of 16, which is what a launch-bound step needs."""
    if not compiled or importlib.util.find_spec("triton") is None:
        return "gemm", "eager"
    if why_not_split_kv(head_dim) is not None:
        return "triton", "eager"
    return ("triton-verify" if hidden_size <= FEW_ROW_KERNELS_UP_TO_HIDDEN else "triton"), "split-kv"


# -- products ------------------------------------------------------------------------------------


def linear(a: Tensor, w: Tensor, bias: Tensor | None = None, *, matvec: bool = False) -> Tensor:
    """a [B, in] times w [out, in] transposed, plus bias [out] -> [B, out] (``F.linear``; a [..., in]
    with more dimensions -> [..., out], by F.linear).

    ``matvec`` (for compiled steps; B = 1 only, else ignored): the product written as a float32
    reduction, sum_k w[n, k] * a[k], which inductor turns into one Triton kernel that streams w once,
    with a's cast and any cheap pointwise producer of a (a norm's scaling) fused into its loads (not
    an expensive one: every program would recompute it, see :func:`~eyas.engine.llama_steps._down`). On an H200,
    in CUDA graphs, an 8B-shaped step's matrices take 1.11x the bandwidth floor with cuBLAS and
    1.00x as tuned reductions (``benchmarks/results/2026-12-01-matvec-h200.md``); a small model's step
    gains more, from fewer kernels. Run eagerly it would materialise w * a: compiled functions
    only. The sum is float32 like cuBLAS's accumulator; only its order differs."""
    if matvec and a.shape[0] == 1:
        y = (w.float() * a.float()).sum(-1)[None]  # [1, out], float32
        return (y if bias is None else y + bias.float()).to(a.dtype)
    B = a.shape[0]
    if a.device.type == "cpu" and a.dim() == 2 and B <= CPU_TRANSPOSED_ROWS:
        # On the CPU, y^T = w a^T (a GEMM whose second operand has B columns) streams w faster than
        # F.linear for a few rows, and one row runs as two (MKL's GEMV is slower still). The
        # products of SmolLM2's step (540 MB of float32 weights, from DRAM) on the 2-core EPYC,
        # medians of 3 rounds: 1, 2, 4, 7 rows 52, 94, 85, 108 ms with F.linear and 27, 30, 43,
        # 66 ms so (benchmarks/results/2026-12-02-cpu-demo.md).
        rows = a if B > 1 else torch.cat([a, a])  # [max(B, 2), in]
        y = (w @ rows.T).T[:B].contiguous()  # [B, out]
        return y if bias is None else y + bias
    return F.linear(a, w, bias)


def project(a: Tensor, weights: tuple[Tensor, ...], biases: tuple[Tensor, ...] | None,
            sizes: Sequence[int], *, matvec: bool = False) -> tuple[Tensor, ...]:
    """a [B, H] through stacked projections of output widths ``sizes``: one GEMM by the fused weight
    [sum(sizes), H] whose output [B, sum(sizes)] is split into views [B, size] (no copy), or one
    GEMM by each separate weight [size, H]. ``matvec``: see :func:`linear`."""
    if len(weights) == 1:
        return linear(a, weights[0], None if biases is None else biases[0], matvec=matvec).split(list(sizes), dim=-1)
    return tuple(linear(a, w, None if biases is None else biases[j], matvec=matvec) for j, w in enumerate(weights))


def fused_matvec(x: Tensor, w: Tensor, **options) -> Tensor:
    """:func:`eyas.engine.matvec.matvec`, imported at its first use: Triton is needed only where
    ``matvec="triton"`` is asked for (and checked then, by :func:`eyas.engine.llama._check_triton`)."""
    from eyas.engine.matvec import matvec

    return matvec(x, w, **options)


def in_kernels(matvec: OneRow, a: Tensor) -> bool:
    """Whether a product of a [B, ...] runs our Triton kernels (:mod:`eyas.engine.matvec`, the norms,
    SiLU and residual adds in the products' kernels): with ``matvec="triton"`` and B = 1 (the
    one-row kernel), or ``"triton-verify"`` and B <= ``KERNEL_ROWS`` (more rows by the few-row
    kernel). ``"gemm"``: F.linear; ``"reduce"``: one row as a float32 reduction (see :func:`linear`).
    Other steps use F.linear."""
    B = a.shape[0]
    return (matvec == "triton" and B == 1) or (matvec == "triton-verify" and B <= KERNEL_ROWS)


def stacked_products(a: Tensor, weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...] | None,
                     **options) -> Tensor:
    """The rows a [B, K] through stacked projections with eyas' kernels (:func:`eyas.engine.matvec.matvec`
    and its ``options``, e.g. the norm as an "rms" prologue): [B, sum of their rows], one kernel for
    a fused weight, else one per separate weight (each repeating the prologue), concatenated. The
    target's q/k/v and gate/up, and the drafter's (:mod:`eyas.engine.draft_kernels`)."""
    rows = [fused_matvec(a, w, bias=None if biases is None else biases[j], **options) for j, w in enumerate(weights)]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=-1)


# -- fused projections ---------------------------------------------------------------------------


def stacked_rows(parts: Sequence[Tensor]) -> Tensor | None:
    """The rows of ``parts`` (weights [r_i, H] or biases [r_i]) as one tensor [sum r_i, ...] when
    they already lie one after another in one storage (as :func:`fuse_projections` leaves them): a
    view, no copy. None when they do not."""
    first = parts[0]
    if first.dim() not in (1, 2) or first.device.type == "meta":
        return None
    ptr, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if (p.dim() != first.dim() or p.shape[1:] != first.shape[1:] or p.dtype != first.dtype
                or p.device != first.device or not p.is_contiguous()
                or p.untyped_storage().data_ptr() != ptr or p.storage_offset() != offset):
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    shape, stride = ((rows, first.shape[1]), (first.shape[1], 1)) if first.dim() == 2 else ((rows,), (1,))
    return torch.as_strided(first.detach(), shape, stride)  # from first's storage offset on


def why_not_stackable(linears: Sequence[nn.Module]) -> str | None:
    """None when these projections' weights (and biases) can be stacked into one tensor; else why not."""
    for m in linears:
        if not isinstance(m, nn.Linear):
            return f"{type(m).__name__} is not an nn.Linear"
    for name in ("weight", "bias"):
        params = [getattr(m, name) for m in linears]
        if all(p is None for p in params):
            continue
        if any(p is None for p in params):
            return f"only some of them have a {name}"
        for p in params:
            if p.device.type == "meta":
                return "its parameters are on the meta device (not loaded)"
            if type(p) is not nn.Parameter or p.layout != torch.strided:
                return f"its {name} is a {type(p).__name__}, not a plain nn.Parameter (quantized?)"
            if not p.dtype.is_floating_point or not p.is_contiguous():
                return f"its {name} is {p.dtype}{'' if p.is_contiguous() else ', not contiguous'}"
        if len({(p.dtype, p.device, p.shape[1:]) for p in params}) > 1:
            return f"their {name}s differ in dtype, device or width"
    return None


def projection_groups(block: nn.Module) -> tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]:
    """A decoder block's (q_proj, k_proj, v_proj) and (gate_proj, up_proj), in row order."""
    attn, mlp = block.self_attn, block.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)


def fuse_projections(model: nn.Module) -> str | None:
    """Stack each decoder block's q/k/v projections into one weight and gate/up into another, in
    place, so that a step runs one GEMM where it ran three (two), without a second copy of any weight.

    For every block: one new contiguous tensor [(Hq+2Hkv)*D, H] holds the rows of q_proj.weight,
    k_proj.weight and v_proj.weight one after another, one [2I, H] those of gate_proj.weight and
    up_proj.weight (and the biases likewise, [(Hq+2Hkv)*D] for Qwen2's q/k/v), and each of the
    model's parameters becomes a view of its rows (``param.data = fused[rows]``: the same Parameter
    objects, their storage shared, the old tensors freed). The Hugging Face model computes exactly
    as before (it still multiplies by q_proj.weight, now a view), its ``state_dict`` keys and values
    are unchanged, in-place writes (an optimizer, ``load_state_dict``) reach the fused tensors, and
    ``save_pretrained`` writes the same tensors. Converting or moving the model afterwards
    (``.to``, ``.half()``) gives every parameter its own storage again: fuse again then.

    Idempotent: projections whose rows already lie one after another in one storage are left alone.
    All or nothing: when some block's projections cannot be stacked (parameters on the ``meta``
    device, not plain ``nn.Parameter``s as with quantized weights, mixed dtypes, a bias on some of
    them only), nothing changes and the reason is returned. Returns None when every block is fused.
    """
    blocks = find_decoder_blocks(model)
    groups = []
    for i, block in enumerate(blocks):
        try:
            qkv, gate_up = projection_groups(block)
        except AttributeError as e:
            return f"block {i}: {e}"
        for group, names in ((qkv, "q/k/v"), (gate_up, "gate/up")):
            why = why_not_stackable(group)
            if why is not None:
                return f"block {i} {names}: {why}"
            groups.append(group)
    stack_rows(groups)
    return None


def stack_rows(groups: Sequence[Sequence[nn.Module]]) -> None:
    """For each group of projections (checked stackable: :func:`why_not_stackable`), one new
    contiguous tensor holding their weights' rows one after another (and their biases'), each
    parameter becoming a view of its rows (``param.data = fused[rows]``: the same Parameter, its
    old tensor freed). Groups already stacked are left alone (:func:`fuse_projections`; the
    drafter's, :func:`eyas.engine.draft_kernels.fuse_drafter_projections`)."""
    with torch.no_grad():
        for group in groups:
            for name in ("weight", "bias"):
                params = [getattr(m, name) for m in group]
                if params[0] is None or stacked_rows(params) is not None:  # no bias, or already stacked
                    continue
                fused = torch.cat([p.detach() for p in params])  # [sum of rows, in] (or [sum of rows])
                start = 0
                for p in params:
                    p.data = fused[start:start + p.shape[0]]  # a contiguous row slice: a view
                    start += p.shape[0]
