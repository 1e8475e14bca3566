"""How much of the target's greedy text a drafter's vocabulary can express, set by set.

Why. An EAGLE-3 drafter proposes only tokens of its draft vocabulary (``t2d``: the target ids it
keeps, 12,288 of SmolLM2's 49,152 for the shipped drafter). At temperature 0 a drafted token is
accepted only when it is the target's argmax, so a position whose argmax is outside the draft
vocabulary is a miss for every drafter with that vocabulary: the share of the target's answer tokens
inside it bounds first-draft acceptance from above, whatever the training. Summaries and RAG answers
copy names and rare words from the prompt, so the bound may sit lower on them than on chat.

What. The target answers each set's prompts greedily (``eyas.engine.batched.BatchedLlama``, float32
on the CPU; the prompts rendered as ``eyas bench`` renders them), and each answer token is counted:
in the draft vocabulary or not, and whether it occurs in its own prompt (copied). The most frequent
tokens outside the vocabulary are listed per set. ``oracle_tau`` is the tau of a drafter that always
drafts the target's next tokens when its vocabulary holds them, ``--depth`` deep (3 for tree 4,8,15):
a round at answer token j accepts while tokens j, j+1, .. are inside, at most depth of them, and emits
one more (:func:`sampled_tau_bound.tau_bound` with rank 0 inside the vocabulary, 1 outside). It bounds
every drafter with that vocabulary and depth at temperature 0.

Widening the vocabulary (``eyas train --init-from DIR --draft-vocab N``) gives each added id an lm_head
row fitted from the target's head (``eyas.training.init_from.fit_head_rows``). ``head_fit`` says how
well: the map fitted on 80% of the drafter's rows, the cosine similarity of its prediction with each of
the other 20% (a seeded split).

    python benchmarks/draft_vocab_coverage.py --target smollm2 --limit 24 --max-new-tokens 128 \
        --out benchmarks/results/DATE-draft-vocab-coverage-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eyas.bench.prompts import NAMED_SETS, load_prompts  # noqa: E402
from eyas.data.render import render_prompts  # noqa: E402
from sampled_tau_bound import tau_bound  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "src/eyas/interop/embedded/smollm2-135m-instruct"


def head_fit(drafter_head: torch.Tensor, draft_ids: torch.Tensor, target_head: torch.Tensor, seed: int = 0) -> dict:
    """The module docstring's ``head_fit``: fit_head_rows' map on a seeded 80% of the drafter's rows,
    the cosine similarity of its prediction with each held-out row (mean, median)."""
    from eyas.training.init_from import fit_head_rows

    perm = torch.randperm(len(draft_ids), generator=torch.Generator().manual_seed(seed))
    fit, held = perm[:int(0.8 * len(perm))], perm[int(0.8 * len(perm)):]
    rows = fit_head_rows(drafter_head[fit].float(), draft_ids[fit], draft_ids[held], target_head.float())
    cos = torch.nn.functional.cosine_similarity(rows, drafter_head[held].float(), dim=1)
    return {"held_out_rows": len(held), "cosine_mean": round(float(cos.mean()), 4),
            "cosine_median": round(float(cos.median()), 4)}


def coverage(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], in_vocab: torch.Tensor,
             decode=None, top: int = 10, depth: int = 3) -> dict:
    """Counts over the answers' tokens: ``tokens``; ``in_vocab`` (share in the draft vocabulary: the
    bound on first-draft acceptance at temperature 0); ``copied`` (share occurring in their own
    prompt); ``in_vocab_of_copied`` and ``in_vocab_of_rest``; ``oracle_tau`` at ``depth`` (module
    docstring); the ``top`` most frequent tokens outside the vocabulary (decoded with ``decode``)."""
    n = inside = copied = copied_inside = emitted = rounds = 0
    missing: Counter[int] = Counter()
    for prompt, answer in zip(prompts, answers):
        e, r = tau_bound([0 if in_vocab[t] else 1 for t in answer], depth, top_k=1)
        emitted, rounds = emitted + e, rounds + r
        seen = set(prompt)
        for t in answer:
            ok = bool(in_vocab[t])
            n, inside = n + 1, inside + ok
            if t in seen:
                copied, copied_inside = copied + 1, copied_inside + ok
            if not ok:
                missing[t] += 1
    share = (lambda a, b: round(a / b, 4) if b else None)
    return {"tokens": n, "in_vocab": share(inside, n), "copied": share(copied, n),
            "in_vocab_of_copied": share(copied_inside, copied),
            "in_vocab_of_rest": share(inside - copied_inside, n - copied), "oracle_tau": share(emitted, rounds),
            "top_missing": [{"id": t, "count": c, **({"text": decode([t])} if decode else {})}
                            for t, c in missing.most_common(top)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", type=Path, default=SHIPPED, help="drafter directory (its t2d)")
    ap.add_argument("--sets", default=",".join(NAMED_SETS))
    ap.add_argument("--limit", type=int, default=24, help="prompts a set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, default=24, help="rows the batched engine decodes together")
    ap.add_argument("--top", type=int, default=10, help="tokens outside the vocabulary listed per set")
    ap.add_argument("--depth", type=int, default=3, help="draft depth of oracle_tau (3: tree 4,8,15)")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from eyas.engine.batched import BatchedLlama
    from eyas.interop import load_drafter
    from eyas.targets.loading import load_target

    t0 = time.time()
    drafter, _ = load_drafter(a.draft)  # no target: its embedding is unknown (NaN), and not read here
    in_vocab = drafter.t2d
    target = load_target(a.target, dtype=torch.float32, device="cpu")
    tok = target.tokenizer
    if in_vocab.numel() != target.model.config.vocab_size:
        ap.error(f"--draft {a.draft}: t2d has {in_vocab.numel()} entries, expected the target's vocabulary "
                 f"{target.model.config.vocab_size}")
    draft_ids = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))
    fit = head_fit(drafter.lm_head.weight.detach(), draft_ids, target.model.get_output_embeddings().weight.detach())
    engine = BatchedLlama(target.model, rows=a.rows)
    report = {"target": a.target, "draft": str(a.draft), "draft_vocab_size": int(in_vocab.sum()),
              "limit": a.limit, "max_new_tokens": a.max_new_tokens, "depth": a.depth, "head_fit": fit, "sets": {}}
    for name in a.sets.split(","):
        convs = load_prompts(name, a.limit)
        prompts = [ids for batch in render_prompts([c.messages for c in convs], tok) for ids in batch]
        answers = [ids for ids, _ in engine.run(prompts, a.max_new_tokens, target.eos_ids).answers]
        report["sets"][name] = row = coverage(prompts, answers, in_vocab, tok.decode, a.top, a.depth)
        print(f"{name:10s} {row['tokens']:5d} tokens: in the draft vocabulary {row['in_vocab']:.3f}, copied from the "
              f"prompt {row['copied']:.3f} (of those in it {row['in_vocab_of_copied']}), the rest in it "
              f"{row['in_vocab_of_rest']}; oracle tau at depth {a.depth} {row['oracle_tau']}", file=sys.stderr)
    print(f"head fit from the target's head: held-out rows' cosine mean {fit['cosine_mean']}", file=sys.stderr)
    report["seconds"] = round(time.time() - t0, 1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(report, indent=2, ensure_ascii=False) if a.json else
          "in the draft vocabulary (oracle tau): " + ", ".join(f"{k} {v['in_vocab']:.3f} ({v['oracle_tau']:.2f})"
                                                              for k, v in report["sets"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
