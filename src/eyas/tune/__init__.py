"""Tuning tools that sit above the runtime engine: ``--tree auto`` measures this hardware and this
drafter and chooses the draft tree with the best predicted speedup.

Modules, one concern each (each docstring states its model and formulas):

    space.py       the candidate trees (chains and EAGLE-2 trees, total_tokens cut to what fits)
    cost.py        timing the hardware: CostModel (verify, draft, extend, bookkeeping, overhead) and
                   measure_cost, one small timer per phase plus the end-to-end anchors;
                   time_rounds, real rounds of a shortlist of trees, timed end to end
    acceptance.py  calibration: AcceptanceProfile (conditional top-k hit rates per depth) from a
                   greedy teacher-forced pass, or from the contract's training metrics
    predict.py     the model: kept nodes of a tree, its tau (replay or expectation), its speedup
    choose.py      the choice: the candidate with the best predicted speedup, as a TreeChoice
    reason.py      the prose: the "chose ... because ..." line
    auto.py        the whole of ``--tree auto`` for generate and bench (tune_tree)

Nothing in :mod:`eyas.engine` imports this package: the runtime serves whatever TreeSpec it gets.
"""

from eyas.tune.acceptance import (
    CALIBRATION_TOKENS, AcceptanceProfile, acceptance_from_metrics, hit_rates, measure_acceptance,
    teacher_forced_ranks,
)
from eyas.tune.auto import CALIBRATION_PROMPTS, TreeAutoError, tune_tree
from eyas.tune.choose import TreeChoice, choose_tree
from eyas.tune.cost import CostMeasurementError, CostModel, measure_cost, time_rounds
from eyas.tune.predict import Candidate, expected_tau, predict_candidate, predict_tau, simulate_rounds, tree_nodes
from eyas.tune.reason import explain_choice, tree_label
from eyas.tune.space import DEFAULT_DEPTHS, DEFAULT_TOPKS, DEFAULT_TOTALS, candidate_trees

__all__ = [
    "CALIBRATION_PROMPTS", "CALIBRATION_TOKENS", "DEFAULT_DEPTHS", "DEFAULT_TOPKS", "DEFAULT_TOTALS",
    "AcceptanceProfile", "Candidate", "CostMeasurementError", "CostModel", "TreeAutoError", "TreeChoice",
    "acceptance_from_metrics", "candidate_trees", "choose_tree", "expected_tau", "explain_choice", "hit_rates",
    "measure_acceptance", "measure_cost", "predict_candidate", "predict_tau", "simulate_rounds", "time_rounds",
    "teacher_forced_ranks", "tree_label", "tree_nodes", "tune_tree",
]
