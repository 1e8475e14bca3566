"""The serving engine: speculative decoding with an EAGLE-3 drafter over any Hugging Face target.

    from eyas.engine import HFTarget, TreeSpec, SamplingParams, speculative_generate, plain_generate

    target = HFTarget(model, CaptureSpec(tuple(contract.capture.boundaries), num_blocks))
    result = speculative_generate(target, drafter, prompt_ids, tree=TreeSpec(6, 10, 60),
                                  sampling=SamplingParams(temperature=0.7), max_new_tokens=256,
                                  eos_token_ids=[tok.eos_token_id])
    result.tokens, result.stats.tau, result.stats.tokens_per_s

Modules: target.py (the target interface and HFTarget), tree.py (drafting and masks),
sampling.py (distributions and acceptance rules), speculative.py (the decoding loops),
stopping.py (stop conditions), stats.py (per-request statistics), autotree.py (``--tree auto``: measure
the hardware and the drafter, choose the tree).
"""

from eyas.engine.autotree import (
    AcceptanceProfile, CostModel, TreeChoice, acceptance_from_metrics, choose_tree, measure_acceptance, measure_cost,
    predict_tau,
)
from eyas.engine.sampling import GREEDY, AcceptRule, SamplingParams, rejection_rule
from eyas.engine.speculative import GenerationResult, plain_generate, speculative_generate
from eyas.engine.stats import GenerationStats
from eyas.engine.target import HFTarget, Target
from eyas.engine.tree import DraftTree, TreeSpec

__all__ = [
    "GREEDY", "AcceptRule", "AcceptanceProfile", "CostModel", "DraftTree", "GenerationResult", "GenerationStats",
    "HFTarget", "SamplingParams", "Target", "TreeChoice", "TreeSpec", "acceptance_from_metrics", "choose_tree",
    "measure_acceptance", "measure_cost", "plain_generate", "predict_tau", "rejection_rule", "speculative_generate",
]
