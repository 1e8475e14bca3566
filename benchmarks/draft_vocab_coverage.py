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
tokens outside the vocabulary are listed per set.

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

from eyas.bench.prompts import NAMED_SETS, load_prompts  # noqa: E402
from eyas.data.render import render_prompts  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "src/eyas/interop/embedded/smollm2-135m-instruct"


def draft_vocabulary(drafter_dir: Path) -> torch.Tensor:
    """``t2d`` [V] bool of a drafter directory: whether each target id is in the draft vocabulary."""
    from safetensors import safe_open

    index = drafter_dir / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"]["t2d"] if index.exists() else "model.safetensors"
    with safe_open(str(drafter_dir / shard), framework="pt") as f:
        return f.get_tensor("t2d").bool()


def coverage(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], in_vocab: torch.Tensor,
             decode=None, top: int = 10) -> dict:
    """Counts over the answers' tokens: ``tokens``; ``in_vocab`` (share in the draft vocabulary: the
    bound on first-draft acceptance at temperature 0); ``copied`` (share occurring in their own
    prompt); ``in_vocab_of_copied`` and ``in_vocab_of_rest``; the ``top`` most frequent tokens outside
    the vocabulary (decoded with ``decode`` when given)."""
    n = inside = copied = copied_inside = 0
    missing: Counter[int] = Counter()
    for prompt, answer in zip(prompts, answers):
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
            "in_vocab_of_rest": share(inside - copied_inside, n - copied),
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
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from eyas.engine.batched import BatchedLlama
    from eyas.targets.loading import load_target

    t0 = time.time()
    in_vocab = draft_vocabulary(a.draft)
    target = load_target(a.target, dtype=torch.float32, device="cpu")
    tok = target.tokenizer
    if in_vocab.numel() != target.model.config.vocab_size:
        ap.error(f"--draft {a.draft}: t2d has {in_vocab.numel()} entries, expected the target's vocabulary "
                 f"{target.model.config.vocab_size}")
    engine = BatchedLlama(target.model, rows=a.rows)
    report = {"target": a.target, "draft": str(a.draft), "draft_vocab_size": int(in_vocab.sum()),
              "limit": a.limit, "max_new_tokens": a.max_new_tokens, "sets": {}}
    for name in a.sets.split(","):
        convs = load_prompts(name, a.limit)
        prompts = [ids for batch in render_prompts([c.messages for c in convs], tok) for ids in batch]
        answers = [ids for ids, _ in engine.run(prompts, a.max_new_tokens, target.eos_ids).answers]
        report["sets"][name] = row = coverage(prompts, answers, in_vocab, tok.decode, a.top)
        print(f"{name:10s} {row['tokens']:5d} tokens: in the draft vocabulary {row['in_vocab']:.3f}, copied from the "
              f"prompt {row['copied']:.3f} (of those in it {row['in_vocab_of_copied']}), the rest in it "
              f"{row['in_vocab_of_rest']}", file=sys.stderr)
    report["seconds"] = round(time.time() - t0, 1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(report, indent=2, ensure_ascii=False) if a.json else
          "in the draft vocabulary: " + ", ".join(f"{k} {v['in_vocab']:.3f}" for k, v in report["sets"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
