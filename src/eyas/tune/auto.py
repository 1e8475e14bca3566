"""``--tree auto`` end to end, for the commands that serve a drafter (``eyas generate``, ``eyas bench``).

    cost       = measure_cost(target, drafter)                  once, shared by every temperature
    for each temperature T tuned:
      acceptance = measure_acceptance(target, drafter, calibration, temperature=T, positions=P)
                   the target's continuation decoded at T (greedy at 0, plain sampling with a seeded
                   generator above it), the drafter's ranks along it; or, when the calibration
                   measured nothing (or there is none), the top-1 accuracies training wrote into the
                   drafter's contract (acceptance_from_metrics)
      ranked     = choose_tree(cost, acceptance): every tree of the space, depths 1..8, top-k up to
                   10, total tokens up to 63 (eyas.tune.space), under the parts model
      timed      = time_rounds(shortlist(ranked), at T)       (eyas.tune.rounds: real rounds; 14 trees,
                   5 where a tree's first round compiles: rounds.shortlist_for)
      scaled     = the model put on the timed rounds' scale (CostModel.fit_round_scale); the best
                   REFINE_TREES (4; 1 where rounds compile) trees not yet timed are timed too
      choice     = choose_tree(cost with those rounds, acceptance, the timed trees)
    plan       = TreePlanChoice(choices, cost).plan                 (eyas.tune.plan)

Calibration: by default the prompts shipped with eyas (:mod:`eyas.tune.calibration`, five training
sets, never an evaluation set) until :data:`~eyas.tune.calibration.CALIBRATION_POSITIONS` positions
are measured at each temperature. The predicted tau at T is a replay of the engine's rounds over
text the target decoded at T: exact for a chain, and distributed as the engine's sampled rounds
(``eyas.tune.acceptance``). The target is reset when this returns.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from torch import Tensor

from eyas.contract import Contract
from eyas.drafter.model import Eagle3Drafter
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.tune.acceptance import CALIBRATION_TOKENS, AcceptanceProfile, acceptance_from_metrics, measure_acceptance
from eyas.tune.calibration import CALIBRATION_POSITIONS
from eyas.tune.choose import TreeChoice, choose_tree
from eyas.tune.cost import CostModel, measure_cost
from eyas.tune.plan import TreePlanChoice
from eyas.tune.reason import sampling_caveat
from eyas.tune.rounds import (  # noqa: F401 (REFINE_TREES: the tests read it here)
    REFINE_TREES, SHORTLIST_CHAINS, SHORTLIST_TREES, Shortlist, shortlist, shortlist_for, time_rounds,
)

CALIBRATION_PROMPTS = 3  # kept for callers that calibrate on a prompt set's first prompts (eyas serve)
SHORTLIST = SHORTLIST_TREES + SHORTLIST_CHAINS  # trees timed first (eyas.tune.rounds.shortlist)


class TreeAutoError(EyasError, ValueError):
    """``--tree auto`` has no acceptance to predict from."""


def _acceptance(target: Target, drafter: Eagle3Drafter, calibration: Sequence[Sequence[int] | Tensor],
                contract: Contract | None, temperature: float, *, eos_token_ids: Sequence[int], positions: int | None,
                new_tokens: int, seed: int, progress: bool) -> AcceptanceProfile:
    acceptance = (measure_acceptance(target, drafter, calibration, eos_token_ids=eos_token_ids, temperature=temperature,
                                     seed=seed, positions=positions, new_tokens=new_tokens, progress=progress)
                  if calibration else None)
    if acceptance is None:
        acceptance = acceptance_from_metrics(contract.metrics if contract is not None else None)
    if acceptance is None:
        raise TreeAutoError("--tree auto: the calibration measured no draft position and the drafter's eyas.json has "
                            "no training metrics (metrics.conditional_accuracy_per_position); pass --tree "
                            "DEPTH,TOPK,TOTAL")
    return acceptance


def choose_at(target: Target, drafter: Eagle3Drafter, cost: CostModel, acceptance: AcceptanceProfile,
              temperature: float, *, seed: int = 0, sizes: Shortlist | None = None,
              progress: bool = False, sampled_drafts: str = "top-k") -> TreeChoice:
    """The tree for ``temperature`` from the shared parts ``cost`` and that temperature's
    ``acceptance``: the shortlist's rounds timed at the temperature, the model scaled to them, the
    best ``sizes.refine`` trees not yet timed timed too, and the best timed tree chosen (module
    docstring). ``sizes``: how many trees are timed (default: :func:`eyas.tune.rounds.shortlist_for`
    the target). ``sampled_drafts``: how the served sampled requests draft (their rounds are timed so;
    the replay models top-k drafts). ``cost`` is not changed: the choice holds a copy with its rounds."""
    sizes = sizes if sizes is not None else shortlist_for(target)
    refine = sizes.refine
    cost = dataclasses.replace(cost, round_s_by_tree={}, round_scale=1.0)
    sampling = SamplingParams(temperature)
    ranked = choose_tree(cost, acceptance, temperature=temperature).candidates
    first = shortlist(ranked, sizes.trees, sizes.chains, sizes.per_depth)
    cost.round_s_by_tree.update(time_rounds(target, drafter, first, sampling=sampling, seed=seed, progress=progress,
                                            sampled_drafts=sampled_drafts))
    cost.fit_round_scale({c.spec: c.tau for c in ranked})
    if refine > 0 and cost.round_s_by_tree:
        rescaled = choose_tree(cost, acceptance, temperature=temperature).candidates
        second = [c.spec for c in rescaled if c.spec not in cost.round_s_by_tree][:refine]
        cost.round_s_by_tree.update(time_rounds(target, drafter, second, sampling=sampling, seed=seed,
                                                progress=progress, sampled_drafts=sampled_drafts))
    timed = [c.spec for c in ranked if c.spec in cost.round_s_by_tree]
    choice = choose_tree(cost, acceptance, specs=timed or None, temperature=temperature)
    choice.searched = len(ranked)
    choice.reason += sampling_caveat(temperature, acceptance)
    if temperature > 0 and sampled_drafts != "top-k":
        choice.reason += (f"; tau was replayed for top-k drafts, the served requests draw theirs ({sampled_drafts}): "
                          f"they accept otherwise")
    return choice


def tune_trees(target: Target, drafter: Eagle3Drafter, calibration: Sequence[Sequence[int] | Tensor],
               contract: Contract | None = None, *, temperatures: Sequence[float] = (0.0, 1.0),
               eos_token_ids: Sequence[int] = (), positions: int | None = CALIBRATION_POSITIONS,
               new_tokens: int = CALIBRATION_TOKENS, seed: int = 0, progress: bool = False,
               cost: CostModel | None = None, sampled_drafts: str = "top-k") -> TreePlanChoice:
    """Measure this hardware once and this drafter at every temperature in ``temperatures``, and
    choose each temperature's tree with the best predicted speedup (module docstring).

    ``calibration``: prompt token ids (may be empty: training metrics stand in; see
    :func:`eyas.tune.calibration.calibration_prompts` for the shipped ones), decoded up to
    ``new_tokens`` each until ``positions`` positions are measured per temperature (None: all of
    them); ``contract``: the drafter's, whose training metrics stand in when the calibration
    measures no draft position; ``seed``: the sampled calibration's and the timed rounds'; ``cost``:
    a measurement to reuse instead of timing the parts again; ``sampled_drafts``: how sampled requests
    draft (``speculative_generate``'s). Raises :class:`TreeAutoError` when neither source gives an
    acceptance profile."""
    temps = list(dict.fromkeys(float(t) for t in temperatures))
    if not temps:
        raise TreeAutoError("--tree auto: expected at least one temperature to tune, found none")
    for t in temps:
        SamplingParams(t)  # a bad temperature fails before anything is timed
    cost = cost if cost is not None else measure_cost(target, drafter)
    choices = []
    for t in temps:
        acceptance = _acceptance(target, drafter, calibration, contract, t, eos_token_ids=eos_token_ids,
                                 positions=positions, new_tokens=new_tokens, seed=seed, progress=progress)
        choices.append(choose_at(target, drafter, cost, acceptance, t, seed=seed, progress=progress,
                                 sampled_drafts=sampled_drafts))
    return TreePlanChoice(choices, cost)


def tune_tree(target: Target, drafter: Eagle3Drafter, calibration: Sequence[Sequence[int] | Tensor],
              contract: Contract | None, *, eos_token_ids: Sequence[int] = (), temperature: float = 0.0,
              positions: int | None = None, new_tokens: int = CALIBRATION_TOKENS, seed: int = 0,
              progress: bool = False) -> TreeChoice:
    """:func:`tune_trees` at one temperature, every calibration prompt used (``positions`` None), its
    :class:`TreeChoice`."""
    return tune_trees(target, drafter, calibration, contract, temperatures=(temperature,), eos_token_ids=eos_token_ids,
                      positions=positions, new_tokens=new_tokens, seed=seed, progress=progress).choices[0]
