"""Tuning tools that sit above the runtime engine: ``--tree auto`` measures this hardware and this
drafter and chooses the draft tree with the best predicted speedup."""

from eyas.tune.autotree import (
    AcceptanceProfile, CostModel, TreeChoice, acceptance_from_metrics, choose_tree, measure_acceptance, measure_cost,
    predict_tau,
)

__all__ = ["AcceptanceProfile", "CostModel", "TreeChoice", "acceptance_from_metrics", "choose_tree",
           "measure_acceptance", "measure_cost", "predict_tau"]
