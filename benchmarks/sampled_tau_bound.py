"""The most any drafter could accept at a temperature: an oracle bound on tau from the target alone.

Why. Issue 34 asks for tau >= 2.6 at temperature 1 with tree 4,8,15 on SmolLM2. Under sampled
verification a drafted path is accepted exactly when the target's own sample follows it (the
rejection rule emits a sample of the target's distribution p, and accepts it when it is a drafted
child). So text the target samples, read back with the target's distributions, bounds every
drafter: a node can hold at most ``top_k`` children, and the best children a drafter could draft
are the target's own ``top_k`` tokens. With y_j the j-th token sampled, p_j its distribution and
r_j = rank of y_j under p_j (0 = the most likely), a round that starts at token j accepts

    a = max { d <= depth : r_j < top_k, r_{j+1} < top_k, .., r_{j+d-1} < top_k }

drafted tokens and emits a + 1 (the bonus is y_{j+a}); the next round starts at j + a + 1, and
tau = the mean of a + 1 over rounds. This is an upper bound for a tree of that depth whose every
node on the path has ``top_k`` children: a real tree of ``total_tokens`` nodes (15 for 4,8,15)
expands fewer, and a real drafter drafts tokens other than the target's best. ``top_k = 1`` is
exactly the best chain of ``depth`` tokens.

    python benchmarks/sampled_tau_bound.py --target smollm2 --temperature 1 --depth 4 --top-k 1,2,4,8 \
        --limit 24 --max-new-tokens 128 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eyas.bench.prompts import NAMED_SETS, load_prompts  # noqa: E402
from eyas.data.render import render_prompt  # noqa: E402
from eyas.targets.loading import load_target  # noqa: E402


def ranks_of_samples(model, input_ids: torch.Tensor, temperature: float, max_new: int, eos: set[int],
                     generator: torch.Generator) -> list[int]:
    """Sample up to ``max_new`` tokens at ``temperature`` (no top-k/top-p), one step at a time with a
    KV cache; -> the rank of each sampled token under the distribution it was drawn from."""
    ranks: list[int] = []
    out = model(input_ids=input_ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    for _ in range(max_new):
        p = torch.softmax(logits.float() / temperature, -1)
        y = int(torch.multinomial(p, 1, generator=generator))
        ranks.append(int((p > p[y]).sum()))
        if y in eos:
            break
        out = model(input_ids=torch.tensor([[y]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return ranks


def tau_bound(ranks: list[int], depth: int, top_k: int) -> tuple[float, int]:
    """The module docstring's rounds over one text: -> (sum of tokens emitted, rounds)."""
    j = emitted = rounds = 0
    while j < len(ranks):
        a = 0
        while a < depth and j + a < len(ranks) - 1 and ranks[j + a] < top_k:
            a += 1
        emitted += min(a + 1, len(ranks) - j)
        rounds += 1
        j += a + 1
    return emitted, rounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--sets", default=",".join(NAMED_SETS))
    ap.add_argument("--limit", type=int, default=24, help="prompts a set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--top-k", default="1,2,4,8", help="children a node on the path may hold")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.temperature <= 0:
        ap.error("--temperature: expected > 0 (at temperature 0 an oracle accepts every drafted token)")
    torch.manual_seed(a.seed)
    t0 = time.time()
    target = load_target(a.target, dtype=torch.float32, device="cpu")
    tok, model = target.tokenizer, target.model
    gen = torch.Generator().manual_seed(a.seed)
    ks = [int(x) for x in a.top_k.split(",")]
    report = {"target": a.target, "temperature": a.temperature, "depth": a.depth, "limit": a.limit,
              "max_new_tokens": a.max_new_tokens, "seed": a.seed, "sets": {}}
    with torch.inference_mode():
        for name in a.sets.split(","):
            totals = {k: [0, 0] for k in ks}
            top1 = n = 0
            for conv in load_prompts(name, a.limit):
                ids = render_prompt(conv, tok)[None]  # [1, T]: the prefix eyas bench and regenerate give
                ranks = ranks_of_samples(model, ids, a.temperature, a.max_new_tokens, set(target.eos_ids), gen)
                top1 += sum(r == 0 for r in ranks)
                n += len(ranks)
                for k in ks:
                    e, r = tau_bound(ranks, a.depth, k)
                    totals[k][0] += e
                    totals[k][1] += r
            report["sets"][name] = {"tokens": n, "share_sampled_top1": round(top1 / max(n, 1), 4),
                                    "tau_bound": {str(k): round(e / max(r, 1), 3) for k, (e, r) in totals.items()}}
            print(f"{name:10s} {n:5d} tokens, top-1 sampled {top1 / max(n, 1):.2f}, tau bound "
                  + ", ".join(f"top-{k} {e / max(r, 1):.2f}" for k, (e, r) in totals.items()), file=sys.stderr)
    sets = report["sets"].values()
    report["mean_tau_bound"] = {str(k): round(sum(s["tau_bound"][str(k)] for s in sets) / len(report["sets"]), 3)
                                for k in ks}
    report["seconds"] = round(time.time() - t0, 1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2) if a.json else f"mean tau bound: {report['mean_tau_bound']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
