"""What a speculative round costs on the fast path, next to a plain step: a SmolLM2-shaped Llama with
random weights (bf16) and an untrained drafter (cost only: acceptance is not measured here).

For each tree: the round timed end to end through the engine (``eyas.tune.time_rounds``: draft,
verify, accept, commit, the round's one read), and the phase split with CUDA events (timing
"events") over a short generation. Then a torch.profiler table of one round of the first tree:
kernels launched, CUDA time by op, and the host's time. Prints and writes JSON (``--out``).

    PYTHONPATH=src python benchmarks/round_cost_gpu.py --out round_cost.json [--profile-out prof.txt]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eyas.convention import CaptureSpec
from eyas.drafter.build import new_drafter
from eyas.engine import TreeSpec, build_target, plain_generate, speculative_generate
from eyas.engine.speculative import start, step
from eyas.tune import time_rounds

TREES = ["1", "4", "6", "6,4,24", "6,8,32", "6,10,60", "8,8,48"]


def smollm2_shaped(device: torch.device, tiny: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    big = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3)
    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2)
    cfg = LlamaConfig(**(small if tiny else big), max_position_embeddings=8192, rope_theta=100000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=" ".join(TREES))
    ap.add_argument("--tiny", action="store_true", help="a toy config on the CPU (smoke test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-out", default=None)
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    model = smollm2_shaped(device, args.tiny)
    L = model.config.num_hidden_layers
    spec = CaptureSpec((0, L // 2, L) if L < 8 else (2, L // 2, L - 3), L)
    drafter = new_drafter(model, boundaries=spec.boundaries, draft_vocab_size=8192 if not args.tiny else 256)[0]
    drafter = drafter.to(device=device, dtype=next(model.parameters()).dtype).eval()
    target = build_target(model, spec, "fast")
    t0 = time.perf_counter()
    if hasattr(target, "warmup"):
        target.warmup()
    warm_s = time.perf_counter() - t0
    print(f"target: {target.implementation}; warm-up (compile + capture) {warm_s:.1f} s", flush=True)
    trees = [TreeSpec.parse(t) for t in args.trees.split()]
    prompt = torch.randint(0, model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0)).tolist()

    plain = [plain_generate(target, prompt, max_new_tokens=64, timing="off").stats for _ in range(3)]
    plain_ms = statistics.median(1e3 * s.time_rounds / max(1, s.rounds - 1) for s in plain)
    print(f"plain step: {plain_ms:.3f} ms ({1e3 / plain_ms:.0f} tok/s)", flush=True)

    t0 = time.perf_counter()
    rounds = time_rounds(target, drafter, trees, rounds=20, warmup=3, context=200)
    print(f"time_rounds over {len(trees)} trees: {time.perf_counter() - t0:.1f} s (graph captures included)")
    rows = []
    for tree in trees:
        st = speculative_generate(target, drafter, prompt, tree=tree, max_new_tokens=64, timing="events").stats
        n = len(st.accept_lengths)
        row = {"tree": [tree.depth, tree.top_k, tree.total_tokens], "round_ms": round(rounds[tree] * 1e3, 4),
               "round_over_plain_step": round(rounds[tree] * 1e3 / plain_ms, 3),
               "events_ms_per_round": {k: round(1e3 * getattr(st, f"time_{k}") / max(1, n), 4)
                                       for k in ("draft", "verify", "bookkeeping")},
               "wall_round_ms_with_events": round(1e3 * st.round_s, 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    prof_table = ""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        s = start(target, prompt, drafter, tree=trees[min(3, len(trees) - 1)], max_new_tokens=64, timing="off")
        for _ in range(3):
            step(s)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(s)
            torch.cuda.synchronize()
        prof_table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        print(prof_table)
        print(f"CUDA kernels in one round: {kernels}")
        if args.profile_out:
            with open(args.profile_out, "w") as f:
                f.write(prof_table + f"\nCUDA kernels in one round: {kernels}\n")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "target_impl": target.implementation, "warmup_s": round(warm_s, 2),
              "plain_step_ms": round(plain_ms, 4), "trees": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
