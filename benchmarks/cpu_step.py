"""What a speculative round's parts cost on the CPU: SmolLM2-135M-Instruct (the embedded GGUF, float32)
and the shipped drafter, as `eyas bench --device cpu` loads them.

- the target's forward of 1, 4 and 8 tokens after a 200-token prompt (a plain step; verifying a tree
  of 3 or 7 drafts), its cache rolled back after each;
- the drafter's draft of a tree and its re-read of 3 accepted tokens, in bf16 (what the CPU serves
  with native bf16) and in float32.

Medians of ``--reps`` calls after two warm-ups, in ms.

    PYTHONPATH=src python benchmarks/cpu_step.py [--tree 2,2,3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eyas.cli.engine_commands import load_for_serving
from eyas.engine import SamplingParams, TreeSpec
from eyas.engine.draft_state import DraftState
from eyas.interop import resolve_draft


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default="2,2,3")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    _, drafter, target, _ = load_for_serving("smollm2", resolve_draft("default", "smollm2"), "cpu", False)
    g = torch.Generator().manual_seed(0)
    V = target.vocab_size
    ids = torch.randint(0, V, (1, 200), generator=g)
    _, features = target.prefill(ids, capture=True)
    L = target.cache_len

    def forward(T: int):
        def run():
            target.forward(torch.randint(0, V, (1, T), generator=g), torch.arange(L, L + T)[None], None)
            target.truncate(L)
        return run

    report: dict = {"implementation": target.implementation, "threads": torch.get_num_threads(), "tree": args.tree,
                    "target_forward_ms": {T: timed(forward(T), args.reps) for T in (1, 4, 8)}, "drafter_ms": {}}
    spec = TreeSpec.parse(args.tree)
    for dtype in (torch.bfloat16, torch.float32):
        state = DraftState(drafter.to(dtype), 512)
        state.extend(ids[0, 1:], features[0, :-1])

        def reread():
            state.extend(ids[0, :3], features[0, :3])
            state.length -= 3  # undo: the same 3 entries again next time

        report["drafter_ms"][str(dtype).removeprefix("torch.")] = {
            "draft": timed(lambda: state.draft(spec, spec.depth, SamplingParams(), None, V), args.reps),
            "reread_3": timed(reread, args.reps)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"target ({report['implementation']}, {report['threads']} threads), forward of T tokens:")
    for T, ms in report["target_forward_ms"].items():
        print(f"  T={T}: {ms:.1f} ms")
    for dtype, r in report["drafter_ms"].items():
        print(f"drafter {dtype}: draft {args.tree} {r['draft']:.1f} ms, re-read of 3 tokens {r['reread_3']:.1f} ms")


if __name__ == "__main__":
    main()
