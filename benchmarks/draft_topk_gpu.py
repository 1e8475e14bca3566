"""The drafter's per-depth selection alone, in CUDA graphs: top-k by torch.topk against top-k by sort.

Each depth of a greedy EAGLE-2 draft (``eyas.engine.draft_state.DraftState._grow``) takes the K best
children of each of r expanded nodes over the drafter's vocabulary, ``top_k(log_softmax(logits))``,
then the K best of the level's r*K candidates by cumulative score, a stable sort. On the H200 a
SmolLM2 round of depth 4 spent 112 us in these (``gatherTopK`` 10.35 us a call, the sorts 4.3 us:
``benchmarks/results/2026-12-02-few-row-tilings-h200.md``), 11% of its kernel time. The variants:

- ``topk-chunked``: what the engine runs (``tree.top_k``: the top K of every chunk of 256, then of those);
- ``topk``: ``torch.topk`` over the whole row;
- ``sort-chunked``: the same two stages by a stable descending sort of each chunk, then of the candidates;
- ``sort``: one stable descending sort of the whole row;

and for the level: ``level-sort`` (the engine's stable sort of r*K scores) against ``level-topk``
(not stable: ties may leave creation order, which the tree's topological order needs; timed only).

Each runs eagerly and compiled by inductor (``--compile``), captured once as a CUDA graph and replayed
``--reps`` times between two CUDA events: microseconds a call. Every variant's values are checked
against torch.topk's (``same``). Rows r: ``--rows`` (1: the root; K: a frontier); vocabulary
``--vocab`` (12,288: the shipped SmolLM2 drafter's; 32,000: a Llama-2-sized one). On the CPU,
``--tiny`` runs a toy shape eagerly, timed by the host clock: a smoke test, not a timing.

    PYTHONPATH=src python benchmarks/draft_topk_gpu.py --compile --out draft_topk.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_gpu import atomic_write  # noqa: E402  (a sibling benchmark script: temp file, then rename)


def variants(k: int) -> dict[str, Callable[[Tensor], tuple[Tensor, Tensor]]]:
    """name -> fn(logits [r, V]) -> (values [r, k], indices [r, k]) as a depth of the draft runs it."""
    from eyas.engine.tree import by_sort, largest, top_k

    def children(select: Callable[[Tensor, int], tuple[Tensor, Tensor]]) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
        return lambda logits: select(torch.log_softmax(logits.float(), dim=-1), k)

    return {"topk-chunked": children(top_k), "topk": children(largest),
            "sort-chunked": children(lambda x, n: top_k(x, n, select=by_sort)), "sort": children(by_sort)}


def level_variants(k: int) -> dict[str, Callable[[Tensor], tuple[Tensor, Tensor]]]:
    """name -> fn(scores [r*k]) -> the k best (values, indices), as a depth picks its frontier."""
    from eyas.engine.tree import by_sort

    return {"level-sort": lambda s: by_sort(s, k), "level-topk": lambda s: s.topk(k)}


def time_us(fn: Callable[[Tensor], tuple[Tensor, Tensor]], x: Tensor, reps: int) -> float:
    """Microseconds of fn(x): a CUDA graph's replays between two events (on the CPU: the host clock)."""
    for _ in range(2):
        fn(x)
    if x.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(x)
        return (time.perf_counter() - t0) / reps * 1e6
    from eyas.engine.graphs import capture, replay_us

    graph, _ = capture(lambda: fn(x), torch.cuda.graph_pool_handle())
    return replay_us(graph, reps, trials=3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8", help="expanded nodes r (comma-separated)")
    ap.add_argument("--vocab", default="12288,32000", help="drafter vocabularies (comma-separated)")
    ap.add_argument("--k", type=int, default=8, help="children per node (the tree's top-k)")
    ap.add_argument("--compile", action="store_true", help="also each variant compiled by inductor, then captured")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke test: a toy shape, eager, host clock")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ap.add_argument("--json", action="store_true", help="print the report as JSON alone")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    if device.type == "cpu" and not a.tiny:
        raise SystemExit("draft_topk_gpu.py: no GPU; --tiny runs the CPU smoke test")
    if a.tiny:
        a.rows, a.vocab, a.k, a.reps, a.compile = "1,4", "2048", 4, 3, False
    say = (lambda *p, **k: None) if a.json else print
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "k": a.k, "reps": a.reps, "rows": []}
    modes = ["eager"] + (["compiled"] if a.compile else [])
    g = torch.Generator().manual_seed(0)
    for V in (int(v) for v in a.vocab.split(",")):
        for r in (int(v) for v in a.rows.split(",")):
            logits = (4 * torch.randn(r, V, generator=g)).to(device, torch.bfloat16)  # the drafter head's output
            reference = torch.log_softmax(logits.float(), dim=-1).topk(a.k, dim=-1).values
            scores = torch.randn(r * a.k, generator=g).to(device)
            cases = [(name, fn, logits, reference) for name, fn in variants(a.k).items()]
            cases += [(name, fn, scores, scores.topk(a.k).values) for name, fn in level_variants(a.k).items()]
            for name, fn, x, ref in cases:
                for mode in modes:
                    run = torch.compile(fn, fullgraph=True, dynamic=False) if mode == "compiled" else fn
                    row = {"variant": name, "mode": mode, "rows": r, "vocab": V}
                    try:
                        values, _ = run(x)
                        row["same"] = bool(torch.equal(values, ref))
                        row["us"] = time_us(run, x, a.reps)
                    except Exception as e:  # a variant that does not compile or capture: say so, go on
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    report["rows"].append(row)
                    say(f"V {V:6d} r {r:2d} {name:13s} {mode:8s} " + (f"{row['us']:8.2f} us  same {row['same']}"
                                                                         if "us" in row else row["error"]))
            if a.out:  # after every shape: a run cut short keeps what it measured
                atomic_write(Path(a.out), json.dumps(report, indent=1))
    if a.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
