"""Real rounds: the engine's own rounds of a shortlist of trees, timed end to end, which is what
``--tree auto`` finally chooses by.

The parts of :mod:`eyas.tune.cost` are timed apart, each with a sync; on a GPU a real round overlaps
its launches with its host work, so their sum can be far from the round a request pays. So:

    ranked     every candidate of the space under the parts model, best first (eyas.tune.choose)
    shortlist  the best tree of each depth (1 .. 8: no depth is left out because the parts model
               mis-costs it), then the best trees overall up to SHORTLIST_TREES trees, and the
               best SHORTLIST_CHAINS chains                                          (:func:`shortlist`)
    timed      time_rounds(shortlist) at the temperature tuned
    scale      CostModel.fit_round_scale: the model's rounds put on the timed rounds' scale
    second     the best REFINE_TREES candidates not yet timed, ranked again under the scaled model,
               are timed too                                                  (eyas.tune.auto)
    choice     the best of the timed trees, on their timed rounds

A round at fixed shapes (the fast target) costs the same whatever it accepts, so a round timed on a
random context is the round a request pays. Sampled rounds draft the same tree as greedy ones and
verify it by another rule (EAGLE's rule for top-k drafts), so they are timed at the temperature
tuned, with a seeded generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from eyas.drafter.model import Eagle3Drafter
from eyas.engine.sampling import GREEDY, SamplingParams
from eyas.engine.speculative import start, step
from eyas.engine.stats import synchronize
from eyas.engine.target import Target
from eyas.engine.tree import TreeSpec
from eyas.tune.predict import Candidate

SHORTLIST_TREES = 12  # trees (top-k > 1) timed first: the best of each depth, then the best overall
SHORTLIST_CHAINS = 2  # chains timed first
REFINE_TREES = 4  # candidates timed second: the best not yet timed once the model is scaled to the timed rounds


@dataclass(frozen=True)
class Shortlist:
    """How many trees ``--tree auto`` times end to end, per temperature: ``trees`` (top-k > 1) and
    ``chains`` first (the best tree of every depth among them when ``per_depth``), then ``refine``
    more once the model is scaled to them."""

    trees: int = SHORTLIST_TREES
    chains: int = SHORTLIST_CHAINS
    refine: int = REFINE_TREES
    per_depth: bool = True


# Where a tree's first round compiles its draft, re-read and acceptance (the fast target on a GPU), a
# tree new to the process costs about 30 s on an H200 before its first timed round (7 trees in 208 s,
# benchmarks/results/2026-12-04-sampling-h200.md), and 18 trees a temperature did not finish in 390 s: there,
# the model's best 4 trees and best chain, then 1 more (about 3 minutes for two temperatures, derived).
COMPILED_SHORTLIST = Shortlist(trees=4, chains=1, refine=1, per_depth=False)


def shortlist_for(target: Target) -> Shortlist:
    """The shortlist's size for ``target``: :data:`COMPILED_SHORTLIST` where its rounds compile."""
    compiles = getattr(target, "cuda_graphs", False) and getattr(target, "compile", False)
    return COMPILED_SHORTLIST if compiles else Shortlist()


def shortlist(ranked: Sequence[Candidate], trees: int = SHORTLIST_TREES,
              chains: int = SHORTLIST_CHAINS, per_depth: bool = True) -> list[TreeSpec]:
    """The trees whose rounds are timed first, from ``ranked`` (best first): the best tree
    (top-k > 1) of every depth present (``per_depth``), then the best trees overall until ``trees``
    trees (more when there are more depths than that), then the best ``chains`` chains. In rank
    order, once each."""
    tree_cands = [c for c in ranked if c.spec.top_k > 1]
    best_of_depth: dict[int, TreeSpec] = {}
    for c in tree_cands if per_depth else ():
        best_of_depth.setdefault(c.spec.depth, c.spec)
    picked = set(best_of_depth.values())
    for c in tree_cands:
        if len(picked) >= trees:
            break
        picked.add(c.spec)
    picked |= set([c.spec for c in ranked if c.spec.top_k == 1][:chains])
    return [c.spec for c in ranked if c.spec in picked]


@torch.no_grad()
def time_rounds(target: Target, drafter: Eagle3Drafter, specs: Sequence[TreeSpec], *, sampling: SamplingParams = GREEDY,
                rounds: int = 6, warmup: int = 2, context: int = 128, seed: int = 0,
                sampled_drafts: str = "top-k", progress: bool = False) -> dict[TreeSpec, float]:
    """spec -> seconds of one round of the engine (``speculative.step``: draft, verify, accept,
    commit, with the round's one read of the device) at ``sampling`` on a random context, the mean
    of ``rounds`` rounds after ``warmup`` untimed ones (which compile and capture what a new tree
    needs). No phase clock runs (timing "off"): the round is timed as a request pays it. A sampled
    request's generator is seeded ``seed``. The target is reset at the end. ``progress``: a tqdm
    bar of the trees (a tree new to the process compiles and captures its round functions first)."""
    if not specs:
        return {}
    ctx = max(2, min(int(context), target.max_length - (warmup + rounds + 1) * (max(s.depth for s in specs) + 1) - 2))
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, target.vocab_size, (ctx,), generator=g).tolist()
    out: dict[TreeSpec, float] = {}
    try:
        for spec in tqdm(specs, desc=f"--tree auto: rounds at temperature {sampling.temperature:g}", unit="tree",
                         disable=not progress, dynamic_ncols=True, leave=False):
            gen = None if sampling.greedy else torch.Generator(device=target.device).manual_seed(seed)
            s = start(target, prompt, drafter, tree=spec, sampling=sampling, generator=gen, timing="off",
                      max_new_tokens=(warmup + rounds) * (spec.depth + 1) + 1, sampled_drafts=sampled_drafts)
            for _ in range(warmup):
                step(s)
            synchronize(target.device)
            t0, n = time.perf_counter(), 0
            while n < rounds and not s.done:
                step(s)
                n += 1
            synchronize(target.device)
            if n:
                out[spec] = (time.perf_counter() - t0) / n
    finally:
        target.reset()
    return out
