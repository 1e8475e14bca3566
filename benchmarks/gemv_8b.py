"""Which batch-1 matrix-vector product streams an 8B-shaped Llama's weights fastest (H200).

One decoder step of a Llama-3-8B at batch 1 is a row of GEMVs, y[1, N] = x[1, K] @ w[N, K]^T, each
bound by how fast it reads w. This script times five implementations on the step's matrices (bf16,
w row-major like ``nn.Linear.weight``, normal(0, 0.02); x bf16):

    qkv fused [6144, 4096] x32, o [4096, 4096] x32, gate_up fused [28672, 4096] x32,
    down [4096, 14336] x32, lm_head [128256, 4096] x1

Candidates (run in this order; each is checked against ``F.linear(x.float(), w.float())``, max abs
error / max abs value < 1e-2, before it is timed):

- ``cublas``: ``F.linear(x, w)``;
- ``triton``: the engine's Triton GEMV (``eyas.engine.matvec``, no prologue or residual: each
  program computes BLOCK_N outputs, loops over K in BLOCK_K chunks with a float32 [BLOCK_N, BLOCK_K]
  accumulator, reduces along K at the end), ``triton.autotune`` over ~50 configs keyed on (N, K);
  the chosen config per matrix is reported. (Until 2026-12-02 this script had its own copy of the
  kernel, which the 2026-12-01 results used; the engine's is the same loop.)
- ``triton_op``: the same kernel, with the config ``triton`` chose for that (N, K), registered as the
  custom op ``eyas_bench::gemv`` (``torch.library.triton_op`` + ``wrap_triton``) and called inside
  ``torch.compile(fullgraph=True)``: does it compose with compilation, and at what cost;
- ``reduce_default``: ``torch.compile(dynamic=False, fullgraph=True)`` of
  ``(w.float() * x.float()).sum(-1)[None].to(x.dtype)`` (inductor's reduction kernel reads w once);
- ``reduce_cdt``: the same with ``coordinate_descent_tuning``.

Timing: per candidate and matrix, 20 back-to-back calls are captured into one CUDA graph, replayed
``--reps`` times, the median per call taken (CUDA events). The 20 calls cycle through enough distinct
copies of the matrix (``--working-set-mb``, 512 MB by default) that the weights come from HBM, not
from the 50 MB L2, as in a real step. If capture fails the 20 calls run eagerly between the events
(the method is recorded). Reported per matrix: ms per call, GB/s (weight bytes / time) and the
fraction of the copy bandwidth (a device-to-device ``copy_`` of 2 GiB, bytes read + written / time,
median: the definition of ``llama_8b_cost.py``); per candidate the step's matrix time
(sum of count x ms) against the floor (the step's weight bytes / copy bandwidth), and the best
candidate per matrix mixed. Every candidate is wrapped: a failure is recorded and the run goes on.
``--budget-s`` is a soft limit: past it the remaining (candidate, matrix) pairs are skipped. The
JSON (``--out``) is rewritten after each candidate.

    PYTHONPATH=src python benchmarks/gemv_8b.py --out gemv.json          # on the GPU (~2-4 min)
    PYTHONPATH=src python benchmarks/gemv_8b.py --tiny --out tiny.json   # shapes / 32, a smoke run

Without a GPU: ``--check-cpu`` runs the plain Triton kernel (fixed configs, no autotune) under the
Triton interpreter on small shapes, N and K not multiples of the blocks included, against F.linear
(it sets ``TRITON_INTERPRET=1`` itself). ``--tiny --device cpu --calls 2 --reps 2`` runs the whole
harness on the CPU (host clock, no graphs; the ``triton`` candidates use one fixed config under the
interpreter, which ``--device cpu`` turns on too).
"""

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback


def _cpu_requested(argv: list[str]) -> bool:
    if "--check-cpu" in argv or "--device=cpu" in argv:
        return True
    return any(a == "--device" and i + 1 < len(argv) and argv[i + 1] == "cpu" for i, a in enumerate(argv))


if _cpu_requested(sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton on CPU tensors; set before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llama_8b_cost import bandwidth  # noqa: E402 (the sibling scripts: the same floor, the same clock)
from llama_target_gpu import timed  # noqa: E402

try:
    import triton
    import triton.language as tl
    import triton.testing  # noqa: F401 (the autotuner's timing)
except ImportError:  # --help and the non-Triton candidates still work
    triton = tl = None

# name, N, K, count per decoder step (Llama-3-8B: hidden 4096, 32/8 heads of 128, intermediate 14336)
MATRICES = (("qkv", 6144, 4096, 32), ("o", 4096, 4096, 32), ("gate_up", 28672, 4096, 32),
            ("down", 4096, 14336, 32), ("lm_head", 128256, 4096, 1))
CANDIDATES = ("cublas", "triton", "triton_op", "reduce_default", "reduce_cdt")
TOLERANCE = 1e-2
DEFAULT_META = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1}  # triton_op's fallback
TUNED: dict[tuple[int, int], dict] = {}  # (N, K) -> the config the `triton` candidate's autotune chose

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------- kernel

# The engine's one-row kernel (eyas.engine.matvec) with no prologue, bias, residual or eviction hint:
# y[n] = sum_k w[n, k] * x[k] for BLOCK_N rows n, BLOCK_K columns at a time, float32 accumulator.
PLAIN = dict(EPS=0.0, PROLOGUE=0, HAS_BIAS=False, HAS_RES=False, EVICT="")
if triton is not None:
    from eyas.engine.matvec import _matvec_kernel as gemv_kernel


def launch(kernel, x: torch.Tensor, w: torch.Tensor, grid, **meta) -> torch.Tensor:
    """y [1, N] = x @ w^T by ``kernel`` (gemv_kernel, autotuned or wrapped) on ``grid``, ``meta`` its tiling."""
    N, K = w.shape
    y = torch.empty((1, N), device=w.device, dtype=w.dtype)
    kernel[grid](x, w, y, x, x, x, w.stride(0), N=N, K=K, **PLAIN, **meta)
    return y


META_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def config_grid() -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): tiles of 16 or 32 elements per thread (BLOCK_N = 1
    also 8: it needs a long BLOCK_K), each with 1 or 3 stages. 50 configs."""
    grid = []
    for bn in (1, 2, 4, 8, 16, 32):
        for bk in (128, 256, 512, 1024):
            for nw in (2, 4, 8):
                per_thread = bn * bk // (32 * nw)
                if per_thread in (16, 32) or (bn == 1 and per_thread >= 8):
                    grid += [(bn, bk, nw, ns) for ns in (1, 3)]
    return grid


def screen_configs(grid: list, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> tuple[list, dict]:
    """Launch every config once on (x, w): compiles them all (the autotuner then finds them in
    Triton's cache), and drops any that fails to compile or to give the right answer."""
    t = time.perf_counter()
    kept, dropped = [], {}
    for g in grid:
        meta = dict(zip(META_KEYS, g))
        try:
            y = gemv_fixed(x, w, meta)
            sync(w.device)
            err = rel_error(y, ref)
            if err < TOLERANCE:
                kept.append(g)
            else:
                dropped[json.dumps(meta)] = f"wrong: rel error {err:.3g}"
        except Exception as e:  # noqa: BLE001 (leave the config out)
            dropped[json.dumps(meta)] = short_error(e)
    if not kept:
        raise RuntimeError(f"no Triton config compiled and gave the right answer: {dropped}")
    return kept, {"kept": len(kept), "dropped": dropped, "seconds": time.perf_counter() - t}


def make_autotuned(grid: list[tuple[int, int, int, int]]):
    """triton.autotune keyed on (N, K). Each config is timed by triton.testing.do_bench (it flushes
    the L2 before each run) for 25 ms rather than its default 100: 50 configs x 5 shapes."""
    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=nw, num_stages=ns)
               for bn, bk, nw, ns in grid]

    def bench(kernel_call, quantiles):
        return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)

    try:
        return triton.autotune(configs=configs, key=["N", "K"], do_bench=bench)(gemv_kernel)
    except TypeError:  # a Triton without autotune(do_bench=...): its default timing
        return triton.autotune(configs=configs, key=["N", "K"])(gemv_kernel)


def _check_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    N, K = w.shape
    assert x.shape == (1, K) and x.is_contiguous() and w.stride(1) == 1, (x.shape, x.stride(), w.stride())
    return N, K


def gemv_fixed(x: torch.Tensor, w: torch.Tensor, meta: dict = DEFAULT_META) -> torch.Tensor:
    """The plain kernel with one config (no autotune)."""
    N, _ = _check_operands(x, w)
    return launch(gemv_kernel, x, w, (triton.cdiv(N, meta["BLOCK_N"]),), **meta)


def gemv_autotuned_fn(kernel):
    def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        N, _ = _check_operands(x, w)
        return launch(kernel, x, w, lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),))
    return gemv


def config_dict(cfg) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


_OP_REGISTERED = False


def register_triton_op() -> None:
    """``eyas_bench::gemv``: the kernel through torch.library.triton_op + wrap_triton. The config is
    looked up (at trace time, shapes static) in TUNED, else DEFAULT_META."""
    global _OP_REGISTERED
    if _OP_REGISTERED:
        return
    from torch.library import triton_op, wrap_triton

    @triton_op("eyas_bench::gemv", mutates_args={})
    def gemv_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        N, K = w.shape
        meta = TUNED.get((N, K), DEFAULT_META)
        return launch(wrap_triton(gemv_kernel), x, w, (triton.cdiv(N, meta["BLOCK_N"]),), **meta)

    _OP_REGISTERED = True


# ------------------------------------------------------------------------------------ candidates

def reduce_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w.float() * x.float()).sum(-1)[None].to(x.dtype)


def op_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.eyas_bench.gemv(x, w)


def build_candidate(name: str, device: torch.device, grid: list, info: dict, sample: dict):
    """The callable fn(x, w) -> y[1, N] of a candidate; notes go to ``info``. ``sample`` (x, ws,
    ref of the first matrix) is what the Triton configs are screened on."""
    if name == "cublas":
        return F.linear
    if name in ("reduce_default", "reduce_cdt"):
        torch._dynamo.reset()  # each compiled candidate starts with its own recompile budget
        options = {"coordinate_descent_tuning": True} if name == "reduce_cdt" else None
        return torch.compile(reduce_fn, dynamic=False, fullgraph=True, options=options)
    if triton is None:
        raise RuntimeError("triton is not importable")
    if name == "triton":
        if device.type != "cuda":  # the interpreter: one fixed config
            info["config_grid"] = "fixed (not on a GPU): " + json.dumps(DEFAULT_META)
            return gemv_fixed
        info["config_grid_size"] = len(grid)
        grid, info["config_screen"] = screen_configs(grid, sample["x"], sample["ws"][0], sample["ref"])
        log(f"  triton: {len(grid)} of {info['config_grid_size']} configs compiled and right "
            f"({info['config_screen']['seconds']:.1f} s); dropped: {list(info['config_screen']['dropped'])}")
        kernel = make_autotuned(grid)
        info["_kernel"] = kernel
        return gemv_autotuned_fn(kernel)
    if name == "triton_op":
        register_triton_op()
        torch._dynamo.reset()
        return torch.compile(op_fn, dynamic=False, fullgraph=True)
    raise ValueError(name)


# ---------------------------------------------------------------------------------------- timing

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_per_call(fn, x: torch.Tensor, ws: list[torch.Tensor], calls: int, reps: int,
                  device: torch.device) -> dict:
    """Median ms per call of ``calls`` back-to-back calls (cycling through ws): replaying one CUDA
    graph of them, or eagerly if the capture fails (or not on a GPU)."""
    seq = [ws[i % len(ws)] for i in range(calls)]

    def burst():
        for w in seq:
            fn(x, w)

    out: dict = {"calls_per_timing": calls, "reps": reps}
    run = burst
    graph = None
    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
            burst()
            burst()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                burst()
            torch.cuda.synchronize()
            run, out["method"] = graph.replay, "cuda-graph"
        except Exception as e:  # noqa: BLE001 (time it eagerly instead)
            graph = None
            out["method"], out["capture_error"] = "eager", f"{type(e).__name__}: {e}"[:2000]
            log(f"    graph capture failed ({out['capture_error'][:200]}): eager timing")
            torch.cuda.synchronize()
    else:
        out["method"] = "host-clock"
    out["ms"] = timed(run, device, reps, warm=3) / calls
    del graph
    return out


# ------------------------------------------------------------------------------------------- run

def shapes(tiny: bool) -> list[tuple[str, int, int, int]]:
    if not tiny:
        return list(MATRICES)

    def shrink(v: int) -> int:
        return max(128, round(v / 32 / 128) * 128)

    return [(name, shrink(N), shrink(K), count) for name, N, K, count in MATRICES]


def short_error(e: BaseException) -> str:
    """The exception's type and first lines (torch.compile's messages run long)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {' | '.join(lines[:3])}"[:500]


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float().reshape(ref.shape)
    return ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def run_candidate(name: str, mats: list, data: dict, args, device: torch.device, grid: list,
                  copy_gbps: float) -> dict:
    entry: dict = {"matrices": {}}
    info: dict = {}
    try:
        fn = build_candidate(name, device, grid, info, data[mats[0][0]])
    except Exception as e:  # noqa: BLE001
        entry.update(info)
        entry["error"], entry["error_short"] = traceback.format_exc(), short_error(e)
        log(f"  {name}: setup failed: {entry['error_short']}")
        sync_quietly(device)
        return entry
    kernel = info.pop("_kernel", None)
    entry.update(info)
    for mname, N, K, _count in mats:
        r: dict = {}
        entry["matrices"][mname] = r
        if time.perf_counter() - T0 > args.budget_s:
            r["skipped"] = f"past --budget-s {args.budget_s}"
            log(f"  {name} {mname}: skipped (budget)")
            continue
        x, ws, ref = data[mname]["x"], data[mname]["ws"], data[mname]["ref"]
        try:
            t = time.perf_counter()
            y = fn(x, ws[0])
            sync(device)
            r["first_call_s"] = time.perf_counter() - t  # compilation / autotuning included
            if kernel is not None and getattr(kernel, "best_config", None) is not None:
                r["config"] = config_dict(kernel.best_config)  # the config of this (N, K)
                r["autotune_s"] = getattr(kernel, "bench_time", None)  # benchmarking (compiles before)
                TUNED[(N, K)] = dict(r["config"])
            r["rel_error"] = rel_error(y, ref)
            r["correct"] = bool(r["rel_error"] < TOLERANCE)
            del y
            if not r["correct"]:
                log(f"  {name} {mname}: WRONG, rel error {r['rel_error']:.3g}: not timed")
                continue
            r.update(time_per_call(fn, x, ws, args.calls, args.reps, device))
            r["GBps"] = N * K * 2 / r["ms"] / 1e6
            r["x_copy_bw"] = r["GBps"] / copy_gbps
            extra = f", {r['config']}" if "config" in r else ""
            log(f"  {name} {mname} [{N}x{K}]: {r['ms'] * 1e3:8.1f} us  {r['GBps']:7.0f} GB/s  "
                f"{r['x_copy_bw']:.2f} of copy  ({r['method']}, rel err {r['rel_error']:.1e}, "
                f"first call {r['first_call_s']:.1f} s{extra})")
        except Exception as e:  # noqa: BLE001 (record it, go on with the next matrix)
            r["error"], r["error_short"] = traceback.format_exc(), short_error(e)
            log(f"  {name} {mname}: failed: {r['error_short']}")
            sync_quietly(device)
    if name == "triton_op":
        entry["configs_used"] = {m: TUNED.get((N, K), DEFAULT_META) for m, N, K, _ in mats}
    return entry


def sync_quietly(device: torch.device) -> None:
    try:
        sync(device)
    except Exception:  # noqa: BLE001
        pass


def summarize(report: dict, mats: list) -> None:
    """Per candidate the step's matrix time (sum of count x ms) and its ratio to the floor; the best
    candidate per matrix and the step with those mixed."""
    floor = report["floor_ms"]
    for entry in report["candidates"].values():
        rows = entry["matrices"]
        if all("ms" in rows.get(m, {}) for m, *_ in mats):
            entry["step_ms"] = sum(c * rows[m]["ms"] for m, _, _, c in mats)
            entry["step_x_floor"] = entry["step_ms"] / floor
    best: dict = {}
    for m, _, _, c in mats:
        timed = {name: e["matrices"][m]["ms"] for name, e in report["candidates"].items()
                 if "ms" in e["matrices"].get(m, {})}
        if timed:
            winner = min(timed, key=timed.get)
            best[m] = {"candidate": winner, "ms": timed[winner], "count": c}
    report["best_per_matrix"] = best
    if len(best) == len(mats):
        report["best_mix_step_ms"] = sum(b["count"] * b["ms"] for b in best.values())
        report["best_mix_x_floor"] = report["best_mix_step_ms"] / floor


def print_tables(report: dict, mats: list) -> None:
    copy = report["bandwidth"]["copy_GBps"]
    print(f"\ncopy bandwidth {copy:.0f} GB/s (read-only {report['bandwidth']['read_GBps']:.0f} GB/s); "
          f"{report['device']}, torch {report['torch']}, triton {report['triton']}")
    print(f"{'matrix':<8} {'N x K':>13} {'MB':>7} {'candidate':<15} {'us/call':>9} {'GB/s':>7} "
          f"{'x copy':>7}  method / note")
    for m, N, K, _ in mats:
        for name, e in report["candidates"].items():
            r = e["matrices"].get(m, {})
            head = f"{m:<8} {f'{N}x{K}':>13} {N * K * 2 / 1e6:7.1f} {name:<15}"
            if "ms" in r:
                note = r["method"] + (f" {r['config']}" if "config" in r else "")
                print(f"{head} {r['ms'] * 1e3:9.1f} {r['GBps']:7.0f} {r['x_copy_bw']:7.2f}  {note}")
            else:
                why = (r.get("skipped") or (f"wrong (rel err {r['rel_error']:.2g})" if r.get("correct") is False
                       else None) or r.get("error_short") or e.get("error_short") or "not run")
                print(f"{head} {'-':>9} {'-':>7} {'-':>7}  {why[:120]}")
        print()
    floor = report["floor_ms"]
    print(f"step of matrices ({report['step_weight_bytes'] / 1e9:.3f} GB): floor {floor:.3f} ms at copy bandwidth")
    for name, e in report["candidates"].items():
        if "step_ms" in e:
            print(f"  {name:<15} {e['step_ms']:8.3f} ms  {e['step_x_floor']:.3f}x floor")
        else:
            print(f"  {name:<15} incomplete")
    if "best_mix_step_ms" in report:
        mix = ", ".join(f"{m}: {b['candidate']}" for m, b in report["best_per_matrix"].items())
        print(f"  {'best per matrix':<15} {report['best_mix_step_ms']:8.3f} ms  "
              f"{report['best_mix_x_floor']:.3f}x floor  ({mix})")


def write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


@torch.no_grad()
def bench(args) -> None:
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: --check-cpu checks the kernel, --tiny --device cpu the harness")
    names = [c.strip() for c in args.candidates.split(",") if c.strip()]
    unknown = [c for c in names if c not in CANDIDATES]
    if unknown:
        raise SystemExit(f"--candidates: unknown {unknown}; known: {', '.join(CANDIDATES)}")
    names = [c for c in CANDIDATES if c in names]  # `triton` before `triton_op` (its configs)
    for attr in ("cache_size_limit", "recompile_limit"):  # 5 shapes per compiled candidate
        if hasattr(torch._dynamo.config, attr):
            setattr(torch._dynamo.config, attr, max(64, getattr(torch._dynamo.config, attr)))
    mats = shapes(args.tiny)
    grid = config_grid()
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": getattr(triton, "__version__", None) if triton is not None else None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "args": vars(args), "tolerance": TOLERANCE,
        "matrices": {m: {"N": N, "K": K, "count": c, "bytes": N * K * 2} for m, N, K, c in mats},
        "triton_config_grid": [dict(zip(META_KEYS, g)) for g in grid],
    }
    log(f"{report['device']}, torch {report['torch']} (CUDA {report['cuda']}), triton {report['triton']}; "
        f"candidates {names}; {len(grid)} triton configs")

    nbytes = (64 << 20) if args.tiny else (2 << 30)
    report["bandwidth"] = bw = bandwidth(device, nbytes, max(5, args.reps // 2))
    log(f"copy {bw['copy_GBps']:.0f} GB/s, read-only {bw['read_GBps']:.0f} GB/s ({nbytes >> 20} MiB)")
    step_bytes = sum(c * N * K * 2 for _, N, K, c in mats)
    report["step_weight_bytes"] = step_bytes
    report["floor_ms"] = step_bytes / bw["copy_GBps"] / 1e6
    log(f"step weight bytes {step_bytes / 1e9:.3f} GB: floor {report['floor_ms']:.3f} ms")

    gen = torch.Generator(device=device).manual_seed(0)
    data: dict = {}
    for m, N, K, _ in mats:
        copies = min(args.calls, max(1, math.ceil(args.working_set_mb * 1e6 / (N * K * 2))))
        ws = [torch.empty(N, K, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
              for _ in range(copies)]
        x = torch.randn(1, K, dtype=torch.bfloat16, device=device, generator=gen)
        ref = F.linear(x.float(), ws[0].float())
        data[m] = {"x": x, "ws": ws, "ref": ref}
        report["matrices"][m]["copies"] = copies
    sync(device)
    log("weights built: " + ", ".join(f"{m} x{len(d['ws'])}" for m, d in data.items()))

    report["candidates"] = {}
    for name in names:
        log(f"{name}:")
        t = time.perf_counter()
        report["candidates"][name] = run_candidate(name, mats, data, args, device, grid, bw["copy_GBps"])
        report["candidates"][name]["wall_s"] = time.perf_counter() - t
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        summarize(report, mats)
        report["elapsed_s"] = time.perf_counter() - T0
        write(report, args.out)
    print_tables(report, mats)
    log(f"wrote {args.out}")


# ------------------------------------------------------------------------------------ cpu check

def check_cpu() -> int:
    """The plain kernel under the Triton interpreter, fixed configs, small shapes (N, K not
    multiples of the blocks too), against F.linear in float32."""
    if triton is None:
        print("triton is not importable (PYTHONPATH=<dir with triton>)")
        return 2
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("TRITON_INTERPRET=1 is needed (it must be set before triton is imported)")
        return 2
    torch.manual_seed(0)
    metas = [DEFAULT_META, {"BLOCK_N": 1, "BLOCK_K": 128, "num_warps": 2, "num_stages": 1},
             {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
             {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 1}]
    cases = [(1, 128), (37, 200), (130, 1000), (64, 256), (5, 1500), (256, 4096), (33, 129)]
    worst = 0.0
    failed = 0
    for meta in metas:
        for N, K in cases:
            w = (torch.randn(N, K) * 0.02).to(torch.bfloat16)
            x = torch.randn(1, K).to(torch.bfloat16)
            y = gemv_fixed(x, w, meta)
            ref = F.linear(x.float(), w.float())
            err = rel_error(y, ref)
            ok = y.shape == (1, N) and y.dtype == torch.bfloat16 and err < TOLERANCE
            worst = max(worst, err)
            failed += not ok
            print(f"BLOCK_N {meta['BLOCK_N']:2d} BLOCK_K {meta['BLOCK_K']:4d}  N {N:4d} K {K:4d}: "
                  f"rel err {err:.2e} {'ok' if ok else 'FAILED'}", flush=True)
    print(f"{'all ok' if not failed else f'{failed} FAILED'}; worst rel err {worst:.2e}; "
          f"{len(config_grid())} configs in the GPU grid")
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gemv_8b.json", help="the JSON report (default gemv_8b.json)")
    ap.add_argument("--reps", type=int, default=50, help="graph replays timed (median), default 50")
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per graph, default 20")
    ap.add_argument("--working-set-mb", type=float, default=512.0,
                    help="distinct weight copies per matrix up to this many MB (at most --calls copies), "
                         "so that the timed calls read HBM, not L2; default 512")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="soft limit: past it the remaining (candidate, matrix) pairs are skipped; default 240")
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated subset of "
                    + ", ".join(CANDIDATES))
    ap.add_argument("--tiny", action="store_true", help="shapes divided by 32 (multiples of 128): a smoke run")
    ap.add_argument("--device", default=None,
                    help="default cuda; cpu (with --tiny) runs the harness on the host clock, a smoke test")
    ap.add_argument("--check-cpu", action="store_true",
                    help="only check the plain Triton kernel under the interpreter (no GPU needed)")
    args = ap.parse_args()
    if args.check_cpu:
        raise SystemExit(check_cpu())
    bench(args)


if __name__ == "__main__":
    main()
