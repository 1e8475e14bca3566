"""The products of a SmolLM2-shaped step on the CPU: F.linear against eyas' transposed product.

A step of SmolLM2-135M in float32 multiplies by 540 MB of weights (30 blocks of qkv [960, 576],
o [576, 576], gate/up [3072, 576], down [576, 1536], then lm_head [49152, 576]), more than any CPU
cache holds, so every step streams them from DRAM. This times those 121 products, one after the
other over distinct random matrices (median of ``--reps``), for B = 1 .. 8 rows, two ways:

- ``F.linear(a, w)``, what PyTorch's nn.Linear does;
- ``eyas.engine.llama_kernels.linear(a, w)``, which on the CPU computes y^T = w a^T for at most
  ``CPU_TRANSPOSED_ROWS`` rows (one row as two) and F.linear past that.

    PYTHONPATH=src python benchmarks/cpu_products.py [--reps 5] [--rounds 2] [--json]

Rounds alternate the two ways, so that a noisy machine shows in the spread of the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from eyas.engine.llama_kernels import CPU_TRANSPOSED_ROWS, linear

BLOCK = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
SHAPES = BLOCK * 30 + [(49152, 576)]  # 30 blocks, lm_head


def timed(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for n, k in SHAPES]
    gb = sum(w.numel() for w in weights) * 4 / 1e9
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[int, dict[str, list[float]]] = {B: {"f_linear_ms": [], "eyas_linear_ms": []} for B in rows}
    for _ in range(args.rounds):
        for B in rows:
            xs = {k: torch.randn(B, k, generator=g) for k in (576, 1536)}
            results[B]["f_linear_ms"].append(timed(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], args.reps))
            results[B]["eyas_linear_ms"].append(timed(lambda: [linear(xs[w.shape[1]], w) for w in weights], args.reps))
    report = {"weights_GB": gb, "threads": torch.get_num_threads(), "cpu_transposed_rows": CPU_TRANSPOSED_ROWS,
              "torch": torch.__version__, "rows": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{len(weights)} products, {gb:.2f} GB of float32 weights, {report['threads']} threads; ms per round")
    print(f"{'rows':>4}  {'F.linear':>20}  {'eyas linear':>20}")
    for B, r in results.items():
        fl = ", ".join(f"{x:.0f}" for x in r["f_linear_ms"])
        el = ", ".join(f"{x:.0f}" for x in r["eyas_linear_ms"])
        print(f"{B:>4}  {fl:>20}  {el:>20}")


if __name__ == "__main__":
    main()
