"""Tuning tools that sit above the runtime engine: ``--tree auto`` measures this hardware and this
drafter and chooses, per temperature served, the draft tree with the best predicted speedup.

Modules, one concern each (each docstring states its model and formulas):

    space.py        the candidate trees (chains and EAGLE-2 trees, depths 1..8, total_tokens cut to what fits)
    cost.py         timing the hardware: CostModel (verify, draft, extend, bookkeeping, overhead) and
                    measure_cost, one small timer per phase plus the end-to-end anchors
    rounds.py       real rounds: the shortlist of trees and time_rounds, timed end to end at a temperature
    calibration.py  the calibration prompts shipped with eyas (training sets only) and CALIBRATION_POSITIONS
    acceptance.py   calibration: AcceptanceProfile (conditional top-k hit rates per depth) from a
                    teacher-forced pass over text the target decoded at the temperature served, or
                    from the contract's training metrics
    predict.py      the model: kept nodes of a tree, its tau (replay or expectation), its speedup
    choose.py       the choice: the candidate with the best predicted speedup, as a TreeChoice
    reason.py       the prose: the "chose ... because ..." line
    plan.py         TreePlanChoice (a choice per temperature -> the engine's TreePlan) and
                    PredictionCheck (the prediction against what a run measured)
    auto.py         the whole of ``--tree auto`` for generate and bench (tune_trees, tune_tree)

Nothing in :mod:`eyas.engine` imports this package: the runtime serves whatever TreeSpec or TreePlan it gets.
"""

from eyas.tune.acceptance import (
    CALIBRATION_TOKENS, AcceptanceProfile, acceptance_from_metrics, hit_rates, measure_acceptance,
    teacher_forced_ranks,
)
from eyas.tune.auto import CALIBRATION_PROMPTS, TreeAutoError, choose_at, tune_tree, tune_trees
from eyas.tune.calibration import (
    CALIBRATION_POSITIONS, calibration_conversations, calibration_prompts, calibration_sets,
)
from eyas.tune.choose import TreeChoice, choose_tree
from eyas.tune.cost import CostMeasurementError, CostModel, measure_cost
from eyas.tune.plan import PredictionCheck, TreePlanChoice, check_prediction
from eyas.tune.predict import Candidate, expected_tau, predict_candidate, predict_tau, simulate_rounds, tree_nodes
from eyas.tune.reason import explain_choice, tree_label
from eyas.tune.rounds import shortlist, time_rounds
from eyas.tune.space import DEFAULT_DEPTHS, DEFAULT_TOPKS, DEFAULT_TOTALS, candidate_trees

__all__ = [
    "CALIBRATION_POSITIONS", "CALIBRATION_PROMPTS", "CALIBRATION_TOKENS", "DEFAULT_DEPTHS", "DEFAULT_TOPKS",
    "DEFAULT_TOTALS", "AcceptanceProfile", "Candidate", "CostMeasurementError", "CostModel", "PredictionCheck",
    "TreeAutoError", "TreeChoice", "TreePlanChoice", "acceptance_from_metrics", "calibration_conversations",
    "calibration_prompts", "calibration_sets", "candidate_trees", "check_prediction", "choose_at", "choose_tree",
    "expected_tau", "explain_choice", "hit_rates", "measure_acceptance", "measure_cost", "predict_candidate",
    "predict_tau", "shortlist", "simulate_rounds", "teacher_forced_ranks", "time_rounds", "tree_label", "tree_nodes",
    "tune_tree", "tune_trees",
]
