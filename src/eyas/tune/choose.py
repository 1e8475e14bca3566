"""The choice of ``--tree auto``: the candidate tree with the highest predicted speedup.

    best = argmax over candidate_trees(...) of  speedup = tau * plain_s / round_s

ties broken by the cheaper round, then the smaller tree (total_tokens, depth, top-k), so the choice
is deterministic for a given cost model and profile. The candidates are those of
:mod:`eyas.tune.space`, each predicted by :mod:`eyas.tune.predict`; the sentence that explains the
choice is written by :mod:`eyas.tune.reason`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from eyas.engine.tree import TreeSpec
from eyas.tune.acceptance import AcceptanceProfile
from eyas.tune.cost import CostModel
from eyas.tune.predict import Candidate, predict_candidate
from eyas.tune.reason import explain_choice
from eyas.tune.space import DEFAULT_DEPTHS, DEFAULT_TOPKS, DEFAULT_TOTALS, candidate_trees


@dataclass
class TreeChoice:
    """The chosen tree, what the model predicts for it, every candidate (best first), the reason,
    the two measurements it came from and the temperature it was chosen for."""

    candidates: list[Candidate]  # every candidate considered, best first: the choice is candidates[0]
    reason: str
    cost: CostModel
    acceptance: AcceptanceProfile
    temperature: float = 0.0
    searched: int = 0  # trees the model ranked before the timed ones were chosen from (0: candidates only)

    @property
    def spec(self) -> TreeSpec:
        return self.candidates[0].spec

    @property
    def predicted_tau(self) -> float:
        return self.candidates[0].tau

    @property
    def predicted_speedup(self) -> float:
        return self.candidates[0].speedup

    @property
    def round_s(self) -> float:
        return self.candidates[0].round_s

    def to_dict(self, top: int = 5) -> dict[str, Any]:
        """The JSON ``tree_auto`` entry."""
        cost = self.cost.to_dict()
        return {
            "temperature": self.temperature, "tree": self.spec.label,
            "depth": self.spec.depth, "top_k": self.spec.top_k, "total_tokens": self.spec.total_tokens,
            "predicted_tau": round(self.predicted_tau, 4), "predicted_speedup": round(self.predicted_speedup, 4),
            "round_ms": round(self.round_s * 1e3, 4), "plain_ms": round(self.cost.plain_s * 1e3, 4),
            "verify_ms_by_tokens": cost["verify_ms_by_tokens"],
            "reason": self.reason,
            "cost": cost,
            "acceptance": self.acceptance.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates[:top]],
            "candidates_considered": len(self.candidates),
            "trees_searched": max(self.searched, len(self.candidates)),
        }


def choose_tree(cost: CostModel, acceptance: AcceptanceProfile, depths: Sequence[int] | None = None,
                topks: Sequence[int] = DEFAULT_TOPKS, totals: Sequence[int] = DEFAULT_TOTALS,
                specs: Sequence[TreeSpec] | None = None, temperature: float | None = None) -> TreeChoice:
    """The candidate with the highest predicted speedup tau * plain_s / round_s (ties: the cheaper
    round, then the smaller tree). The candidates are ``specs`` when given, else the space of
    ``depths`` (default :data:`~eyas.tune.space.DEFAULT_DEPTHS`, 1 .. 8, whatever depth the profile
    measured: a depth past it reuses its last depth's hit rates, and the replay falls back to the
    expectation where no round of that depth fits) x topks x totals. ``temperature``: the choice's
    (default: the acceptance profile's)."""
    space = list(specs) if specs is not None else candidate_trees(depths or DEFAULT_DEPTHS, topks, totals)
    cands = [predict_candidate(spec, cost, acceptance) for spec in space]
    cands.sort(key=lambda c: (-round(c.speedup, 9), c.round_s, c.spec.total_tokens, c.spec.depth, c.spec.top_k))
    t = acceptance.temperature if temperature is None else float(temperature)
    return TreeChoice(cands, explain_choice(cands[0], cands, cost, acceptance), cost, acceptance, t)
