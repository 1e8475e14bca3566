"""The prose of ``--tree auto``: the one line that says why a tree was chosen.

No model lives here: every number in the sentence comes from the candidates (:mod:`eyas.tune.predict`)
and the cost model (:mod:`eyas.tune.cost`). The sentence, in order:

    chose D,K,N because it has the best predicted speedup, S x: tau tokens per round (predicted
    accept length) for a R ms round (draft .., verify N+1 tokens ..) vs P ms per plain token;
    verifying Tmax tokens costs G x one token here
    [; the best chain|tree (whichever kind did not win), D',K',N', would give tau .. at .. ms per round (..x)]
    [; no candidate is predicted to beat plain decoding ...]         (when S < 1)
    [; acceptance from <the profile's source>]
    [; acceptance was measured greedily, sampling at temperature T usually accepts less]
                                (sampling, with acceptance not measured at T: training metrics)
"""

from __future__ import annotations

import math
from typing import Sequence

from eyas.engine.tree import TreeSpec
from eyas.tune.acceptance import AcceptanceProfile
from eyas.tune.cost import CostModel
from eyas.tune.predict import Candidate


def tree_label(spec: TreeSpec) -> str:
    """The ``--tree`` text of ``spec`` (:attr:`TreeSpec.label`): 'DEPTH,TOPK,TOTAL', 'DEPTH' for a chain."""
    return spec.label


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def explain_choice(best: Candidate, candidates: Sequence[Candidate], cost: CostModel,
                   acceptance: AcceptanceProfile) -> str:
    """The "chose ... because ..." line for ``best`` among ``candidates`` (sorted, best first)."""
    s = best.spec
    big = max(cost.verify_s_by_tokens)
    growth = cost.verify_s(big) / cost.verify_s(1) if cost.verify_s(1) > 0 else math.inf
    text = (f"chose {tree_label(s)} because it has the best predicted speedup, {best.speedup:.2f}x: "
            f"{best.tau:.2f} tokens per round (predicted accept length) for a {_ms(best.round_s)} round "
            f"(draft {_ms(best.draft_s)}, verify {s.total_tokens + 1} tokens {_ms(best.verify_s)}) vs "
            f"{_ms(cost.plain_s)} per plain token; verifying {big} tokens costs {growth:.1f}x one token here")
    chains = [c for c in candidates if c.spec.top_k == 1]
    trees = [c for c in candidates if c.spec.top_k > 1]
    other = trees[0] if s.top_k == 1 and trees else chains[0] if s.top_k > 1 and chains else None
    if other is not None:
        kind = "tree" if other.spec.top_k > 1 else "chain"
        text += (f"; the best {kind}, {tree_label(other.spec)}, would give tau {other.tau:.2f} at "
                 f"{_ms(other.round_s)} per round ({other.speedup:.2f}x)")
    if best.speedup < 1:
        text += "; no candidate is predicted to beat plain decoding on this hardware with this drafter"
    return text + f"; acceptance from {acceptance.source}" if acceptance.source else text


def sampling_caveat(temperature: float, acceptance: AcceptanceProfile | None = None) -> str:
    """What to add to the line when the tree serves sampled requests but its acceptance was not
    measured at their temperature (a profile from training metrics, or a greedy calibration)."""
    if temperature <= 0 or (acceptance is not None and acceptance.temperature == temperature):
        return ""
    return f"; acceptance was measured greedily, sampling at temperature {temperature} usually accepts less"
