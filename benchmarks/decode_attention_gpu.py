"""One block's attention in a fixed-shape step, alone, in CUDA graphs: LlamaTarget's two ways.

- ``eager``: ``eyas.engine.llama_steps._attend`` (rope of q and k, the two cache writes, QK, a float32
  softmax under the mask, PV), compiled by inductor as the target compiles it;
- ``split-kv``: ``eyas.engine.decode_attention.decode_attention`` (two Triton kernels that also
  rotate and write), once per tiling of ``--block-n`` x ``--warps`` x ``--max-splits`` x
  ``--prefetch``.

The shapes are an 8B-shaped block (32/8 heads of 128) and a SmolLM2-shaped one (9/3 heads of 64),
bf16. Each is timed for a plain step (1 token) and a tree bucket (``--tree`` tokens), at cache_len
``--cache-len`` in key bucket ``--keys``. Inputs are random. Each variant is captured once as a
CUDA graph and replayed ``--reps`` times between two CUDA events. It prints microseconds a call,
and with ``--profile`` the kernels a call. ``--json`` prints the report as JSON alone.

Which tiling makes the partial kernel cheapest is the question it answers (issue 10: the 8B plain
step's 1.3x bar, ``benchmarks/results/2026-12-02-split-kv-h200.md``), along with the kernels' cost against
the eager order's. On the CPU, ``--tiny`` runs a toy shape and one tiling in Triton's interpreter
(``TRITON_INTERPRET=1``, set here before triton is imported): a smoke test, not a timing.

    PYTHONPATH=src python benchmarks/decode_attention_gpu.py --profile --out decode_attention.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_gpu import atomic_write  # noqa: E402  (a sibling benchmark script: temp file, then rename)

SHAPES = {"8b": (8, 4, 128), "smollm2": (3, 3, 64), "tiny": (2, 2, 16)}  # (Hkv, G, D)


def inputs(shape: str, B: int, cache_len: int, n_keys: int, capacity: int, dtype: torch.dtype,
           device: torch.device, seed: int = 0) -> dict:
    """A step of B tokens at ``cache_len`` attending ``n_keys`` entries: q/k/v as views of one fused
    projection output, the rotary tables, the cache as one tensor kv [2, Hkv, C, D] (and its two
    views), a causal block's mask [B, n] and slots, as LlamaTarget's prologue builds them."""
    Hkv, G, D = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, (Hkv * G + 2 * Hkv) * D, generator=g).to(device, dtype)
    q, k, v = qkv.split([Hkv * G * D, Hkv * D, Hkv * D], dim=-1)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2).float() / D)
    freqs = torch.arange(cache_len, cache_len + B).float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    kv = torch.randn(2, Hkv, capacity, D, generator=g).to(device, dtype)
    rel = torch.arange(n_keys) - cache_len
    block = torch.ones(B, B, dtype=torch.bool).tril()
    mask = (rel < 0) | ((rel < B) & block[:, rel.clamp(0, B - 1)])
    slots = cache_len + torch.arange(B)
    return {"q": q, "k": k, "v": v, "cos": emb.cos().to(device, dtype), "sin": emb.sin().to(device, dtype), "kv": kv,
            "mask": mask.to(device), "slots": slots.to(device), "scaling": D ** -0.5, "shape": (Hkv, G, D)}


def eager_call(x: dict, compile_: bool):
    """LlamaTarget's eager attention on these inputs (compiled by inductor on a GPU)."""
    from eyas.engine.llama_steps import _attend

    Hkv, G, D = x["shape"]
    B = x["q"].shape[0]
    fn = functools.partial(_attend, scaling=x["scaling"])
    if compile_:
        fn = torch.compile(fn, fullgraph=True, dynamic=False)
    q, k, v = x["q"].view(B, Hkv * G, D), x["k"].view(B, Hkv, D), x["v"].view(B, Hkv, D)
    cos, sin = x["cos"][:, None], x["sin"][:, None]
    return lambda: fn(q, k, v, cos, sin, x["slots"], x["mask"], x["kv"][0], x["kv"][1])


def split_kv_call(x: dict, block_n: int, warps: int, max_splits: int, prefetch: bool):
    from eyas.engine.decode_attention import decode_attention

    return lambda: decode_attention(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["kv"], x["mask"], x["slots"],
                                    x["scaling"], block_n=block_n, max_splits=max_splits, num_warps=warps,
                                    prefetch=prefetch)


def time_call(call, device: torch.device, reps: int, profile: bool) -> dict:
    """Microseconds a call, replayed from one CUDA graph (on the CPU: the host clock, no graph)."""
    import time

    for _ in range(2):  # compile, autotune and allocate before capturing
        call()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        return {"us": (time.perf_counter() - t0) / reps * 1e6}
    from eyas.engine.graphs import capture, replay_us

    graph, _ = capture(call, torch.cuda.graph_pool_handle())
    out = {"us": replay_us(graph, reps)}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["kernels_per_call"] = len(kernels) / 10
        out["kernel_us_per_call"] = sum(e.device_time for e in kernels) / 10
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8b,smollm2", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--tree", type=int, default=32, help="the tree bucket's tokens (beside a plain step's 1)")
    ap.add_argument("--cache-len", type=int, default=512)
    ap.add_argument("--keys", type=int, default=1024, help="the key bucket attended")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--max-splits", default="16,32,64")
    ap.add_argument("--prefetch", default="0,1", help="the cache loads issued before start is read (1) or not (0)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="also count the kernels a call (torch.profiler)")
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke test: a toy shape, one tiling, the interpreter")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ap.add_argument("--json", action="store_true", help="print the report as JSON alone")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not a.tiny:
        raise SystemExit("decode_attention_gpu.py: no GPU; --tiny runs the CPU smoke test")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's import (lazy, through eyas' kernels)
        a.shapes, a.block_n, a.warps, a.max_splits, a.prefetch, a.reps, a.tree = "tiny", "16", "4", "4", "0", 2, 4
        a.cache_len, a.keys = 40, 64
    say = (lambda *p, **k: None) if a.json else print

    def ints(text: str) -> list[int]:
        return [int(t) for t in text.split(",") if t]

    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "cache_len": a.cache_len, "keys": a.keys, "reps": a.reps, "rows": []}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for shape in a.shapes.split(","):
        for B in (1, a.tree):
            x = inputs(shape, B, a.cache_len, a.keys, a.keys, dtype, device)
            row = {"shape": shape, "tokens": B, "eager": time_call(eager_call(x, device.type == "cuda"), device,
                                                                  a.reps, a.profile), "split_kv": []}
            say(f"{shape} B={B}: eager {row['eager']['us']:.2f} us"
                + (f", {row['eager']['kernels_per_call']:.0f} kernels" if "kernels_per_call" in row["eager"] else ""))
            for block_n, warps, max_splits, prefetch in itertools.product(ints(a.block_n), ints(a.warps),
                                                                           ints(a.max_splits), ints(a.prefetch)):
                r = {"block_n": block_n, "warps": warps, "max_splits": max_splits, "prefetch": bool(prefetch)}
                try:
                    r.update(time_call(split_kv_call(x, block_n, warps, max_splits, bool(prefetch)), device, a.reps,
                                       a.profile))
                except Exception as e:  # a tiling that does not compile or fit: say so, go on
                    r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row["split_kv"].append(r)
                say(f"  split-kv block_n {block_n:3d} warps {warps} max_splits {max_splits:2d} prefetch {prefetch}: "
                    + (f"{r['us']:.2f} us" if "us" in r else r["error"]))
            ok = [r for r in row["split_kv"] if "us" in r]
            if ok:
                row["best_split_kv"] = min(ok, key=lambda r: r["us"])
                say(f"  best: {row['best_split_kv']}")
            report["rows"].append(row)
            if a.out:  # after every row: a run cut short keeps what it measured
                atomic_write(Path(a.out), json.dumps(report, indent=1))
    if a.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
