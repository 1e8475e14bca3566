"""The cost of LlamaTarget's steps on an 8B-shaped Llama, against the bandwidth floor.

A Llama-3-8B-shaped model with random weights (hidden 4096, intermediate 14336, 32 blocks, 32 query
/ 8 key-value heads of 128, vocab 128256, rope theta 500000, untied lm_head), bf16, built directly
on the GPU (normal(0, 0.02) weights, unit norms). No acceptance, just cost:

- the copy bandwidth (a device-to-device ``copy_`` of 2 GiB: bytes read + written / time) and a
  read-only estimate (a float32 sum of the same 2 GiB: bytes read / time);
- the weight bytes a step must read: the 32 blocks + the final norm + lm_head. The embedding table is
  left out (a step's lookup reads B rows of it); a tied embedding would be counted once, as lm_head;
- the floor = weight bytes / copy bandwidth (and / the read-only bandwidth, for reference), and
  ``gemv_ms``: every weight matrix of the step multiplied by one token's vector with cuBLAS, one
  after the other (what the matrix products alone cost at batch 1);
- with the cache pre-filled with 512 tokens (capacity 2048; a fixed-shape step attends its key
  bucket, the smallest rung of 512, 1024, 2048 that holds cache_len + its token bucket: 1024 keys
  here, reported per step as ``keys``), the time (CUDA events, median of ``--reps``; the forward
  alone, inputs already on the device, the rollback ``keep([])`` untimed) of a plain step (1 token)
  and of verifying a random tree of 8, 16, 24, 32 and 64 tokens, for LlamaTarget compiled + CUDA
  graphs ("compiled", the default on a GPU) and with CUDA graphs only ("graphs"). Each target's
  warm-up (every token bucket with the key buckets of a 2048-token sequence compiled and captured)
  is timed apart and left out of the step times.

It prints a table and two checks (issue 10): the plain step within 1.3x of the floor; a round that
verifies 24 tree tokens at most 1.5x a plain step. Writes everything as JSON (``--out``).

    PYTHONPATH=src python benchmarks/llama_8b_cost.py --out llama_8b_cost.json

``--tiny`` runs a toy config (4 blocks, hidden 128) with few repetitions: a smoke test, on the CPU
unless ``--device cuda`` (there it compiles and captures like the real run, in a minute or so).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from eyas.convention import CaptureSpec
from eyas.engine import LlamaTarget
from eyas.engine.llama import key_ladder
from llama_target_gpu import timed, tree_mask  # the sibling script (run from benchmarks/ or the repo root)

SIZES = (1, 8, 16, 24, 32, 64)


def llama_8b_shaped(device: torch.device, tiny: bool, seed: int = 0, shape: str = "8b") -> torch.nn.Module:
    if shape == "smollm2":  # SmolLM2-135M's shapes (tied embeddings): a launch-bound model, for comparison
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    elif tiny:
        cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=448, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=8192,
                          rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                          rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):  # allocated (and initialised) where it runs: no 16 GB host copy
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if next(model.parameters()).device.type != device.type:  # a transformers that ignored the context
        print(f"from_config built the model on {next(model.parameters()).device}: moving it", flush=True)
        model = model.to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)  # the RMSNorm weights
    model.eval()
    param = next(model.parameters())
    assert param.device.type == device.type and param.dtype == torch.bfloat16, (param.device, param.dtype)
    return model


def bandwidth(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """Copy bandwidth (read + written) and a read-only estimate (a sum), in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src), device, reps)
    read_ms = timed(lambda: src.sum(dtype=torch.float32), device, reps)
    return {"bytes": nbytes, "copy_ms": copy_ms, "copy_GBps": 2 * nbytes / copy_ms / 1e6,
            "read_ms": read_ms, "read_GBps": nbytes / read_ms / 1e6}


def step_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every weight matrix a step multiplies by: each block's q, k, v, o, gate, up, down; lm_head."""
    mats = []
    for b in model.model.layers:
        a, m = b.self_attn, b.mlp
        mats += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
                 m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
    return mats + [model.get_output_embeddings().weight]


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes a step reads: blocks + final norm + lm_head (the embedding lookup reads B rows; a tied
    embedding is lm_head, counted once)."""
    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    blocks = nbytes(model.model.layers.parameters())
    norm = nbytes(model.model.norm.parameters())
    lm_head = nbytes(model.get_output_embeddings().parameters())
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    return {"blocks": blocks, "final_norm": norm, "lm_head": lm_head, "counted": blocks + norm + lm_head,
            "embedding_not_counted": 0 if tied else embed.numel() * embed.element_size(), "tied": int(tied)}


# variant -> (compile, matvec, attention): how LlamaTarget runs the step (matvec: how a one-token step
# multiplies, "triton": eyas.engine.matvec's kernels with the norms, SiLU and residual adds in them;
# attention: eager's three steps, one SDPA kernel, or the split-KV Triton kernels)
VARIANTS = {"compiled": (True, "gemm", "eager"), "compiled-reduce": (True, "reduce", "eager"),
            "compiled-reduce-tuned": (True, "reduce-tuned", "eager"), "graphs": (False, "gemm", "eager"),
            "compiled-sdpa": (True, "gemm", "sdpa"), "compiled-reduce-tuned-sdpa": (True, "reduce-tuned", "sdpa"),
            "compiled-split-kv": (True, "gemm", "split-kv"),
            "compiled-reduce-tuned-split-kv": (True, "reduce-tuned", "split-kv"),
            "compiled-triton": (True, "triton", "eager"), "compiled-triton-split-kv": (True, "triton", "split-kv"),
            "compiled-triton-verify-split-kv": (True, "triton-verify", "split-kv")}


@torch.no_grad()
def measure(model, spec, device, capacity: int, prefill: int, reps: int, variant: str, all_keys: bool,
            profile: bool = False) -> dict:
    """Warm-up seconds and the median ms of each step size for one LlamaTarget variant. The warm-up
    compiles and captures the token buckets of SIZES with the key bucket the steps attend (every
    key bucket of a 2048-token sequence with ``all_keys``, as a server does)."""
    V = model.config.vocab_size
    compile_, matvec, attention = VARIANTS[variant]
    target = LlamaTarget(model, spec, max_length=capacity, cuda_graphs=True, compile=compile_, matvec=matvec,
                         attention=attention)
    out: dict = {"implementation": target.implementation, "matvec": matvec, "attention": attention}
    buckets = sorted({min(b for b in target.buckets if b >= n) for n in SIZES})  # the token buckets timed
    keys = _step_keys(target, prefill)
    out["warmed"] = "every bucket and key bucket" if all_keys else f"buckets {buckets}, keys {keys}"
    out["warmup_s"] = target.warmup() if all_keys else target.warmup(buckets=buckets, keys=[keys])
    print(f"  {target.implementation}: warm-up {out['warmup_s']:.1f} s", flush=True)
    g = torch.Generator().manual_seed(0)
    target.prefill(torch.randint(0, V, (1, prefill), generator=g).to(device), capture=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    out["ms"], out["step_shape"] = {}, {}
    for n in SIZES:
        ids = torch.randint(0, V, (1, n), generator=g).to(device)
        if n == 1:  # a plain step: one token, causal
            pos, mask = torch.tensor([[prefill]], device=device), None
        else:
            m, depth = tree_mask(n, g)
            pos, mask = (prefill + depth)[None].to(device), m.to(device)

        def step(ids=ids, pos=pos, mask=mask):
            target.forward(ids, pos, mask)

        out["step_shape"][n] = target.step_shape(n)  # (token bucket, key bucket) its graph runs
        out["ms"][n] = timed(step, device, reps, after=lambda: target.keep([]))
        assert target.cache_len == prefill
        print(f"    {n:3d} tokens: {out['ms'][n]:.3f} ms (bucket, keys {out['step_shape'][n]})", flush=True)
        if n in PROFILED and profile and device.type == "cuda":
            out[PROFILED[n]] = kernel_profile(step, lambda: target.keep([]), what=PROFILED[n])
    out["compile_seconds"], out["compile_error"] = target.compile_seconds, target.compile_error
    out["implementation"] = target.implementation  # without "compile" when compilation failed
    return out  # the target (its cache and graphs) is freed with this frame


PROFILED = {1: "plain_profile", 24: "verify_24_profile"}  # step sizes whose kernels --profile lists


def kernel_profile(step, after, steps: int = 10, what: str = "plain_profile") -> dict:
    """The GPU kernels of ``steps`` replays of a step (torch.profiler): per kernel name, its calls
    and microseconds per step, longest first, and the kernels per step in all."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
            after()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(e.name, [0, 0.0])
            r[0] += 1
            r[1] += e.device_time
    table = sorted(({"kernel": k[:120], "calls": c / steps, "us": t / steps} for k, (c, t) in rows.items()),
                   key=lambda r: -r["us"])
    total = {"kernels": sum(r["calls"] for r in table), "us": sum(r["us"] for r in table)}
    print(f"    {what.replace('_', ' ')}: {total['kernels']:.0f} kernels a step, {total['us']:.0f} us of kernel time")
    for r in table[:25]:
        print(f"      {r['calls']:6.1f} x {r['us'] / max(r['calls'], 1):7.2f} us = {r['us']:8.1f} us  {r['kernel'][:90]}")
    return {"per_step": total, "kernels": table}


def _step_keys(target: LlamaTarget, prefill: int) -> int:
    """The key bucket every timed step attends (cache_len = prefill, at most max(SIZES) new tokens)."""
    keys = {next(k for k in target.key_buckets if k >= prefill + b) for b in target.buckets if b <= 64}
    assert len(keys) == 1, f"the timed steps span key buckets {sorted(keys)}: change --prefill"
    return keys.pop()


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="llama_8b_cost.json")
    ap.add_argument("--tiny", action="store_true", help="a toy config and few repetitions (smoke test)")
    ap.add_argument("--shape", default="8b", choices=["8b", "smollm2"], help="smollm2: SmolLM2-135M's shapes instead")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--capacity", type=int, default=2048, help="the KV cache's capacity")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 50; 3 with --tiny)")
    ap.add_argument("--variants", default="compiled,graphs", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--warm-all-keys", action="store_true",
                    help="warm every bucket with every key bucket of a 2048-token sequence (a server's start-up)")
    ap.add_argument("--profile", action="store_true", help="also profile the GPU kernels of a plain step and of verifying 24 tokens (torch.profiler)")
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        torch.set_num_threads(1)  # toy shapes: a second thread only adds contention
    reps = args.reps or (3 if args.tiny else 50)
    capacity, prefill = (256, 64) if args.tiny else (args.capacity, args.prefill)
    if prefill + max(SIZES) > capacity:
        raise SystemExit(f"--prefill {prefill} + {max(SIZES)} tokens do not fit --capacity {capacity}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--variants: expected some of {', '.join(VARIANTS)}, found {args.variants!r}")

    t0 = time.perf_counter()
    model = llama_8b_shaped(dev, args.tiny, shape=args.shape)
    cfg = model.config
    L = cfg.num_hidden_layers
    spec = CaptureSpec.create(L, None) if L >= 7 else CaptureSpec((1, L // 2, L - 1), L)
    report: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "model": (f"{'toy' if args.tiny else args.shape + '-shaped'} Llama, random weights, bf16: hidden {cfg.hidden_size}, "
                  f"intermediate {cfg.intermediate_size}, {L} blocks, {cfg.num_attention_heads}/"
                  f"{cfg.num_key_value_heads} heads, vocab {cfg.vocab_size}"),
        "parameters": sum(p.numel() for p in model.parameters()), "build_s": time.perf_counter() - t0,
        "boundaries": list(spec.boundaries), "capacity": capacity, "prefill": prefill, "reps": reps}
    wb = weight_bytes(model)
    keys = next(k for k in key_ladder(capacity) if k >= prefill + 1)  # the plain step's key bucket
    kv = 2 * L * cfg.num_key_value_heads * keys * (cfg.hidden_size // cfg.num_attention_heads) * 2
    report["weight_bytes"] = wb
    report["kv_cache_bytes_attended"] = kv  # keys and values read by the plain step (its key bucket)
    print(f"model built in {report['build_s']:.1f} s: {report['model']}; weight bytes counted "
          f"{wb['counted'] / 1e9:.3f} GB", flush=True)

    bw = bandwidth(dev, (64 << 20) if args.tiny else (2 << 30), reps)
    report["bandwidth"] = bw
    floor_ms = wb["counted"] / bw["copy_GBps"] / 1e6
    report["floor_ms"] = {"weights_at_copy_bw": floor_ms,
                          "weights_at_read_bw": wb["counted"] / bw["read_GBps"] / 1e6,
                          "weights_and_kv_at_copy_bw": (wb["counted"] + kv) / bw["copy_GBps"] / 1e6}
    mats = step_matrices(model)
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16, device=dev) for k in {w.shape[1] for w in mats}}
    report["gemv_ms"] = timed(lambda: [F.linear(xs[w.shape[1]], w) for w in mats], dev, max(3, reps // 5))
    print(f"copy {bw['copy_GBps']:.0f} GB/s, read {bw['read_GBps']:.0f} GB/s: floor {floor_ms:.3f} ms; "
          f"cuBLAS GEMVs alone {report['gemv_ms']:.3f} ms", flush=True)

    report["variants"] = {}
    for v in variants:
        print(f"{v}:", flush=True)
        try:
            report["variants"][v] = measure(model, spec, dev, capacity, prefill, reps, v, args.warm_all_keys,
                                              args.profile)
        except Exception:  # noqa: BLE001 (report it and go on with the next variant)
            report.setdefault("errors", {})[v] = traceback.format_exc()
            print(f"{v} failed:\n{report['errors'][v]}", flush=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\nfloor (weights {wb['counted'] / 1e9:.2f} GB / copy {bw['copy_GBps']:.0f} GB/s) = {floor_ms:.3f} ms; "
          f"GEMVs alone {report['gemv_ms']:.3f} ms ({report['gemv_ms'] / floor_ms:.2f}x floor)")
    print(f"{'variant':<21} {'tokens':>6} {'ms':>9} {'x plain':>8} {'x floor':>8}")
    for v, r in report["variants"].items():
        plain = r["ms"][1]
        r["x_plain"] = {n: ms / plain for n, ms in r["ms"].items()}
        r["x_floor"] = {n: ms / floor_ms for n, ms in r["ms"].items()}
        for n, ms in r["ms"].items():
            print(f"{v:<21} {n:>6} {ms:9.3f} {r['x_plain'][n]:8.2f} {r['x_floor'][n]:8.2f}")
        r["checks"] = {"plain_step_within_1.3x_floor": r["x_floor"][1] <= 1.3,
                       "verify_24_at_most_1.5x_plain": r["x_plain"][24] <= 1.5}
        print(f"{v}: plain step {r['x_floor'][1]:.2f}x the floor (<= 1.3: {r['checks']['plain_step_within_1.3x_floor']}); "
              f"verifying 24 = {r['x_plain'][24]:.2f}x a plain step (<= 1.5: {r['checks']['verify_24_at_most_1.5x_plain']}); "
              f"warm-up {r['warmup_s']:.1f} s ({r['implementation']})")
        if r["compile_error"]:
            print(f"{v}: compilation failed, the step ran eagerly: {r['compile_error'][:300]}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
