"""What ``--tree auto`` returns when it tunes several temperatures, and how its prediction is held
against what a run then measured.

:class:`TreePlanChoice`: one :class:`~eyas.tune.choose.TreeChoice` per temperature tuned (each on text
the target decoded at that temperature, each from real rounds timed at it) and the hardware
measurement they share, turned into the engine's :class:`~eyas.engine.tree.TreePlan`:

    greedy   the choice at temperature 0 (when tuned; else the sampled tree)
    sampled  the choice at the one sampled temperature tuned; with several, the tree with the best
             mean predicted speedup over them among the trees every one of them considered (their
             timed shortlists); when none was tuned, the greedy tree

:class:`PredictionCheck`: per temperature, the predicted tau, round and speedup against the measured
ones, with the relative errors predicted / measured - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eyas.engine.tree import TreePlan, TreeSpec
from eyas.tune.choose import TreeChoice
from eyas.tune.cost import CostModel


def _rel(predicted: float | None, measured: float | None) -> float | None:
    return round(predicted / measured - 1, 4) if predicted is not None and measured else None


@dataclass
class PredictionCheck:
    """A tree's predicted figures against the ones a run measured with it, at one temperature.

    tau: tokens per round; round_ms: one round after the prefill as a request pays it; speedup:
    speculative over eyas plain decoding (tokens/s). ``*_error`` = predicted / measured - 1."""

    temperature: float
    tree: TreeSpec
    predicted_tau: float
    measured_tau: float
    predicted_round_ms: float
    measured_round_ms: float | None
    predicted_speedup: float
    measured_speedup: float | None

    @property
    def tau_error(self) -> float | None:
        return _rel(self.predicted_tau, self.measured_tau)

    @property
    def round_error(self) -> float | None:
        return _rel(self.predicted_round_ms, self.measured_round_ms)

    @property
    def speedup_error(self) -> float | None:
        return _rel(self.predicted_speedup, self.measured_speedup)

    def to_dict(self) -> dict[str, Any]:
        r = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return {"temperature": self.temperature, "tree": self.tree.label,
                "predicted_tau": r(self.predicted_tau), "measured_tau": r(self.measured_tau),
                "tau_error": self.tau_error,
                "predicted_round_ms": r(self.predicted_round_ms), "measured_round_ms": r(self.measured_round_ms),
                "round_prediction_error": self.round_error,
                "predicted_speedup": r(self.predicted_speedup), "measured_speedup": r(self.measured_speedup),
                "speedup_error": self.speedup_error}


def check_prediction(choice: TreeChoice, measured_tau: float, measured_round_ms: float | None,
                     measured_speedup: float | None) -> PredictionCheck:
    """``choice``'s prediction (its tree's tau, round and speedup) against a run's measurements."""
    return PredictionCheck(choice.temperature, choice.spec, choice.predicted_tau, measured_tau,
                           choice.round_s * 1e3, measured_round_ms, choice.predicted_speedup, measured_speedup)


@dataclass
class TreePlanChoice:
    """``--tree auto`` over several temperatures: one choice per temperature (in the order tuned) and
    the hardware measurement they share (each choice's ``cost`` is a copy of it holding the rounds
    timed at its own temperature)."""

    choices: list[TreeChoice]
    cost: CostModel

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError("TreePlanChoice: expected a choice for at least one temperature, found none")

    @property
    def temperatures(self) -> list[float]:
        return [c.temperature for c in self.choices]

    def for_temperature(self, temperature: float) -> TreeChoice:
        """The choice tuned at ``temperature``; else the one tuned nearest to it on the same side
        of 0 (greedy or sampled); else the nearest of all."""
        exact = [c for c in self.choices if c.temperature == temperature]
        if exact:
            return exact[0]
        side = [c for c in self.choices if (c.temperature > 0) == (temperature > 0)] or self.choices
        return min(side, key=lambda c: abs(c.temperature - temperature))

    @property
    def plan(self) -> TreePlan:
        """The engine's TreePlan (module docstring)."""
        greedy = [c for c in self.choices if c.temperature == 0]
        sampled = [c for c in self.choices if c.temperature > 0]
        g = greedy[0].spec if greedy else None
        s = _shared_best(sampled) if sampled else None
        return TreePlan(g or s, s or g)  # type: ignore[arg-type]  (one of them is set: choices is not empty)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "temperatures": self.temperatures,
                "choices": [c.to_dict() for c in self.choices], "cost": self.cost.to_dict()}


def _shared_best(choices: list[TreeChoice]) -> TreeSpec:
    """The tree with the best mean predicted speedup over ``choices``, among the trees each of them
    considered; the first choice's tree when they share none (or there is one choice)."""
    if len(choices) == 1:
        return choices[0].spec
    by_choice = [{c.spec: c.speedup for c in ch.candidates} for ch in choices]
    common = set(by_choice[0]).intersection(*by_choice[1:])
    if not common:
        return choices[0].spec
    return max(sorted(common, key=lambda s: (s.total_tokens, s.depth, s.top_k)),
               key=lambda s: sum(d[s] for d in by_choice) / len(by_choice))
