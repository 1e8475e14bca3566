"""A drafter widened to the target's whole vocabulary, without training: what the widening of
``eyas train --init-from DIR --draft-vocab N`` starts from (``eyas.training.init_from.init_weights``),
written as a drafter directory that ``eyas bench --draft`` reads.

Every id the drafter had keeps its lm_head row; every other id gets its row fitted from the target's
head (``fit_head_rows``). The whole vocabulary needs no training targets to choose the added ids;
a narrower widening does (the most frequent ones outside the vocabulary): that is ``eyas train``'s.

    python benchmarks/widen_drafter.py --target smollm2 --out /tmp/wide
    eyas bench --target smollm2 --draft /tmp/wide --prompts sum --temperatures 0 --tree 4,8,15 --no-hf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHIPPED = Path(__file__).resolve().parents[1] / "src/eyas/interop/embedded/smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", type=Path, default=SHIPPED, help="the drafter directory to widen")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    from eyas.convention.boundaries import CaptureSpec
    from eyas.drafter.build import new_drafter
    from eyas.drafter.config import NORM_FLAGS
    from eyas.interop import load_drafter
    from eyas.interop.eyas_format import save_drafter
    from eyas.targets.loading import load_target
    from eyas.training.init_from import init_weights
    from eyas.training.state import SHARD_BYTES

    target = load_target(a.target, dtype=torch.float32, device="cpu")
    old, contract = load_drafter(a.draft, target=target, tokenizer=target.tokenizer)
    V = target.text_config.vocab_size
    boundaries = list(contract.capture.boundaries)
    drafter, _ = new_drafter(target, target.tokenizer, boundaries, V, source=target.name,
                             **{flag: getattr(old.config, flag) for flag in NORM_FLAGS})
    spec = CaptureSpec.create(target.num_blocks, boundaries)
    init_weights(drafter, str(a.draft), target, spec, False, torch.zeros(V, dtype=torch.long))
    contract = contract.model_copy(deep=True)
    contract.drafter.draft_vocab_size = V
    save_drafter(drafter.to(torch.bfloat16), contract, a.out, max_file_bytes=SHARD_BYTES)
    report = {"draft": str(a.draft), "out": str(a.out), "draft_vocab_size": {"before": old.config.draft_vocab_size,
                                                                             "after": V}}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
