"""``--tree auto`` end to end, for the commands that serve a drafter (``eyas generate``, ``eyas bench``).

    cost       = measure_cost(target, drafter)                         (eyas.tune.cost)
    acceptance = measure_acceptance(target, drafter, calibration)      (eyas.tune.acceptance)
                 or, when the calibration measured nothing (or there is none), the top-1
                 accuracies training wrote into the drafter's contract (acceptance_from_metrics)
    shortlist  = the model's best 6 trees and 2 chains
    rounds     = time_rounds(target, drafter, shortlist)                 (eyas.tune.cost: real rounds)
    choice     = choose_tree(cost with those rounds, acceptance, shortlist)  (eyas.tune.choose)

The commands only pick the calibration prompts (``generate``: the prompt itself; ``bench``: the first
:data:`CALIBRATION_PROMPTS` of the first set), call :func:`tune_tree` and print the choice. The
target is reset when this returns.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from eyas.contract import Contract
from eyas.drafter.model import Eagle3Drafter
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.tune.acceptance import acceptance_from_metrics, measure_acceptance
from eyas.tune.choose import TreeChoice, choose_tree
from eyas.tune.cost import measure_cost, time_rounds
from eyas.tune.reason import sampling_caveat

CALIBRATION_PROMPTS = 3  # prompts `eyas bench --tree auto` calibrates on
SHORTLIST = 8  # candidates whose rounds are timed end to end (the best 2 chains and 6 trees of the model)


class TreeAutoError(EyasError, ValueError):
    """``--tree auto`` has no acceptance to predict from."""


def tune_tree(target: Target, drafter: Eagle3Drafter, calibration: Sequence[Sequence[int] | Tensor],
              contract: Contract | None, *, eos_token_ids: Sequence[int] = (), temperature: float = 0.0) -> TreeChoice:
    """Measure this hardware and this drafter and choose the tree with the best predicted speedup.

    ``calibration``: prompt token ids for the greedy calibration (may be empty); ``contract``: the
    drafter's, whose training metrics stand in when the calibration measures no draft position;
    ``temperature`` > 0 adds to the reason that acceptance was measured greedily. Raises
    :class:`TreeAutoError` when neither source gives an acceptance profile."""
    cost = measure_cost(target, drafter)
    acceptance = measure_acceptance(target, drafter, calibration, eos_token_ids=eos_token_ids) if calibration else None
    if acceptance is None:
        acceptance = acceptance_from_metrics(contract.metrics if contract is not None else None)
    if acceptance is None:
        raise TreeAutoError("--tree auto: the calibration measured no draft position and the drafter's eyas.json has "
                            "no training metrics (metrics.conditional_accuracy_per_position); pass --tree "
                            "DEPTH,TOPK,TOTAL")
    # The parts model ranks every candidate; the shortlist's rounds are then timed end to end and
    # the choice is made on those (the parts, timed apart with a sync each, can be far from a real
    # round on a GPU, where a round's launches overlap its host work).
    ranked = choose_tree(cost, acceptance).candidates
    chains = [c.spec for c in ranked if c.spec.top_k == 1][:2]
    trees = [c.spec for c in ranked if c.spec.top_k > 1][:SHORTLIST - len(chains)]
    shortlist = list(dict.fromkeys(trees + chains))
    cost.round_s_by_tree = time_rounds(target, drafter, shortlist)
    choice = choose_tree(cost, acceptance, specs=[s for s in shortlist if s in cost.round_s_by_tree] or None)
    choice.reason += sampling_caveat(temperature)
    return choice
