"""A plain step's products alone, in CUDA graphs: cuBLAS against eyas's Triton matvec per tiling.

Each product of an 8B-shaped Llama block (and of SmolLM2-135M's) is timed as LlamaTarget's
``matvec="triton"`` runs it, with its prologue and epilogue (``eyas.engine.matvec``):

    qkv      rmsnorm(x) [1, H]   by [(Hq+2Hkv)*D, H]
    o        attention [1, H]    by [H, Hq*D], plus the residual
    gate_up  rmsnorm(h) [1, H]   by [2I, H]
    down     SiLU(gate) * up     by [H, I], plus the residual
    head     rmsnorm(x) [1, H]   by [V, H]

beside ``F.linear`` on the same row (cuBLAS, the product alone: no norm, no add), and the
bandwidth floor: the weight's bytes / the copy bandwidth.

The tilings are ``--tilings`` (rows/columns/warps/evict-first, e.g. ``2/1024/4/1``), or else
``--block-n`` x ``--block-k`` x ``--warps`` (evict-first), plus the one the engine would use
(``eyas.engine.matvec``: measured, or the default). To read the weights from memory and not from
L2, each product cycles through enough copies of its weight (at least ``--min-bytes`` in all)
within one captured CUDA graph; a call's time is the graph's over the copies, the gaps between
kernels included, as in a step: the fastest of ``--trials`` runs of ``--reps`` replays. Prints
microseconds a call and x floor, the best tiling per product, and ``--json`` the report.
``--write-tilings FILE`` adds the best tiling of each product, under this GPU's name, to a table
of tilings that the engine reads (``src/eyas/engine/matvec_tilings.json``, or any file named by
``EYAS_MATVEC_TILINGS``).

``--rows R`` (2 to 64) times the few-row kernel instead (a tree's verification: R rows through
the same products, cuBLAS on the same R rows beside it; a grid such as ``--block-n 16,32,64
--block-k 64,128``). Its best tilings go to the table under the few-row keys (``/r`` and R padded
to 16, 32 or 64; ``/glu`` for ``gate_up_glu``, the gate/up product with its SiLU(gate) * up
epilogue, its N the gate's rows), which the engine reads before ``eyas.engine.matvec.rows_tiling``.

On the CPU, ``--tiny`` runs a toy shape and one tiling in Triton's interpreter (``TRITON_INTERPRET=1``,
set here before triton is imported): a smoke test, not a timing.

    PYTHONPATH=src python benchmarks/matvec_gpu.py --out matvec.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

# shape -> product -> (rows N, columns K, prologue, residual)
# (down_glu: the down product after a glu gate/up product, which hands it SiLU(gate) * up: no prologue;
# gate_up_glu: the gate/up product with that epilogue, as verification runs it: the few-row kernel only)
SHAPES = {
    "8b": {"qkv": (6144, 4096, "rms", False), "o": (4096, 4096, None, True), "gate_up": (28672, 4096, "rms", False),
           "gate_up_glu": (28672, 4096, "rms", False), "down": (4096, 14336, "silu", True),
           "down_glu": (4096, 14336, None, True), "head": (128256, 4096, "rms", False)},
    "smollm2": {"qkv": (960, 576, "rms", False), "o": (576, 576, None, True), "gate_up": (3072, 576, "rms", False),
                "gate_up_glu": (3072, 576, "rms", False), "down": (576, 1536, "silu", True),
                "down_glu": (576, 1536, None, True), "head": (49152, 576, "rms", False)},
    # the shipped SmolLM2 drafter's own products (its fc over 3 x 576 features, q/k/v over [embeds | hidden],
    # the head over its 12,288-token vocabulary); its o, gate/up and down are SmolLM2's
    "smollm2_drafter": {"fc": (576, 1728, None, False), "qkv": (960, 1152, None, False),
                        "head": (12288, 576, "rms", False)},
    "tiny": {"qkv": (48, 64, "rms", False), "down": (64, 40, "silu", True)},
}


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """A device-to-device copy_ of ``nbytes``: bytes read + written / time, GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9


def operands(N: int, K: int, prologue: str | None, residual: bool, copies: int, dtype: torch.dtype,
             device: torch.device, seed: int = 0, rows: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = [(torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype) for _ in range(min(copies, 2))]
    w += [w[i % 2].clone() for i in range(2, copies)]  # copies: distinct memory, the same values
    x = torch.randn(rows, 2 * K if prologue == "silu" else K, generator=g).to(device, dtype)
    return {"w": w, "x": x, "norm": torch.rand(K, generator=g).to(device, dtype) + 0.5,
            "residual": torch.randn(rows, N, generator=g).to(device, dtype) if residual else None}


def triton_call(ops: dict, prologue: str | None, tile, glu: bool = False):
    from eyas.engine.matvec import matvec

    def call():
        for w in ops["w"]:
            matvec(ops["x"], w, prologue=prologue, norm=ops["norm"] if prologue == "rms" else None, eps=1e-5,
                   residual=ops["residual"], tile=tile, glu=glu)
    return call


def cublas_call(ops: dict):
    K = ops["w"][0].shape[1]
    x = ops["x"][:, :K].contiguous()

    def call():
        for w in ops["w"]:
            F.linear(x, w)
    return call


def time_call(call, device: torch.device, reps: int, trials: int = 3) -> float:
    """Microseconds of one call of ``call`` (all its launches), replayed from a CUDA graph: the
    fastest of ``trials`` runs of ``reps`` replays (on the CPU: the host clock)."""
    for _ in range(2):  # compile and allocate before capturing
        call()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        return (time.perf_counter() - t0) / reps * 1e6
    from eyas.engine.graphs import capture, replay_us

    graph, _ = capture(call, torch.cuda.graph_pool_handle())
    return replay_us(graph, reps, trials)


def write_tiling(path: str, device_name: str, key: str, best: dict) -> None:
    """Add one product's tiling to a table of them ({GPU name: {key: [rows, columns, warps, evict]}}),
    written to a temporary file and renamed (a table read meanwhile is whole)."""
    table = json.loads(open(path).read()) if os.path.exists(path) else {}
    table.setdefault(device_name, {})[key] = [best["block_n"], best["block_k"], best["warps"], best["evict_first"]]
    with open(path + ".tmp", "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8b,smollm2", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--products", default="gate_up,down,qkv,o,head")
    ap.add_argument("--tilings", default=None, help="comma-separated rows/columns/warps/evict, e.g. 2/1024/4/1")
    ap.add_argument("--block-n", default="1,2,4,8,16")
    ap.add_argument("--block-k", default="256,512,1024")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--min-bytes", type=int, default=400 << 20, help="the weight copies a call cycles through, in all")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--write-tilings", default=None, help="add each product's best tiling to this table (JSON)")
    ap.add_argument("--rows", type=int, default=1, help="rows a product takes: 1 (a plain step), or 2..64 (the few-row kernel)")
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke test: a toy shape, one tiling, the interpreter")
    ap.add_argument("--out", default=None, help="write the report as JSON here (after every product)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON alone")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not a.tiny:
        raise SystemExit("matvec_gpu.py: no GPU; --tiny runs the CPU smoke test")
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's import (lazy, through eyas' kernels)
        tilings = "4/32/4/1,2/64/4/0" if a.rows == 1 else "16/32/4/1,32/16/4/0"  # (tl.dot: 16 rows at least)
        a.shapes, a.products, a.tilings, a.reps, a.trials = "tiny", "qkv,down", tilings, 2, 1
    say = (lambda *p, **k: None) if a.json else print
    from eyas.engine.matvec import MAX_ROWS, Tiling, _key, _tiling_on

    if not 1 <= a.rows <= MAX_ROWS:
        raise SystemExit(f"--rows: expected 1..{MAX_ROWS}, found {a.rows}")
    block_r = max(16, 1 << (a.rows - 1).bit_length()) if a.rows > 1 else 0  # the few-row kernel's padded rows

    def ints(text: str) -> list[int]:
        return [int(t) for t in text.split(",") if t]

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bw = copy_bandwidth(device) if device.type == "cuda" else None
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "copy_GBps": bw, "reps": a.reps, "x_rows": a.rows, "rows": []}
    say(f"copy bandwidth {bw:.0f} GB/s" if bw else "cpu (interpreter): no timing worth reading")
    for shape in a.shapes.split(","):
        for product in a.products.split(","):
            glu = product.endswith("_glu") and product.startswith("gate_up")
            if product not in SHAPES[shape] or (glu and not block_r):
                continue
            N, K, prologue, residual = SHAPES[shape][product]
            nbytes = N * K * torch.tensor([], dtype=dtype).element_size()
            copies = 1 if device.type == "cpu" else max(2, -(-a.min_bytes // nbytes))
            ops = operands(N, K, prologue, residual, copies, dtype, device, rows=a.rows)
            floor_us = nbytes / (bw * 1e9) * 1e6 if bw else None
            row = {"shape": shape, "product": product, "N": N, "K": K, "prologue": prologue, "residual": residual,
                   "copies": copies, "floor_us": floor_us,
                   "cublas_us": time_call(cublas_call(ops), device, a.reps, a.trials) / copies, "tilings": []}
            default = _tiling_on(device, N // 2 if glu else N, K, prologue, block_r, glu)  # what the engine runs
            grid = ([Tiling(*(int(v) for v in t.split("/"))) for t in a.tilings.split(",")] if a.tilings else
                    [Tiling(*t) for t in itertools.product(ints(a.block_n), ints(a.block_k), ints(a.warps))])
            grid = [t._replace(evict_first=bool(t.evict_first)) for t in grid]
            for tile in [default] + [t for t in grid if t != default]:
                r = {"block_n": tile.block_n, "block_k": tile.block_k, "warps": tile.num_warps,
                     "evict_first": tile.evict_first, "default": tile == default}
                try:
                    r["us"] = time_call(triton_call(ops, prologue, tile, glu), device, a.reps, a.trials) / copies
                except Exception as e:  # a tiling that does not compile or fit: say so, go on
                    r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row["tilings"].append(r)
            ok = [r for r in row["tilings"] if "us" in r]
            row["default_us"] = next((r["us"] for r in ok if r["default"]), None)
            row["best"] = min(ok, key=lambda r: r["us"]) if ok else None
            x = (lambda us: f" ({us / floor_us:.2f}x floor)") if floor_us else (lambda us: "")
            say(f"{shape} {product} [{N}, {K}]: floor {floor_us or 0:.2f} us, cublas {row['cublas_us']:.2f}"
                f"{x(row['cublas_us'])}, default {default} " + (f"{row['default_us']:.2f}{x(row['default_us'])}"
                                                                if row["default_us"] else "failed")
                + (f", best {row['best']['us']:.2f}{x(row['best']['us'])} at block_n {row['best']['block_n']} "
                   f"block_k {row['best']['block_k']} warps {row['best']['warps']} evict_first "
                   f"{row['best']['evict_first']}" if row["best"] else ""))
            report["rows"].append(row)
            del ops
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(report, f, indent=1)
            if a.write_tilings and row["best"]:
                write_tiling(a.write_tilings, report["device"], _key(N // 2 if glu else N, K, prologue, block_r, glu),
                             row["best"])
    if a.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
