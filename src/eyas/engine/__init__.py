"""The serving engine: speculative decoding with an EAGLE-3 drafter over any Hugging Face target.

    from eyas.engine import HFTarget, TreeSpec, SamplingParams, speculative_generate, plain_generate

    target = HFTarget(model, CaptureSpec(tuple(contract.capture.boundaries), num_blocks))
    result = speculative_generate(target, drafter, prompt_ids, tree=TreeSpec(6, 10, 60),
                                  sampling=SamplingParams(temperature=0.7), max_new_tokens=256,
                                  eos_token_ids=[tok.eos_token_id])
    result.tokens, result.stats.tau, result.stats.tokens_per_s

Modules: target.py (the target interface and HFTarget), llama.py (LlamaTarget: our own forward for
Llama-family targets, a static KV cache written by index and capture inside the forward; its pure step
functions in llama_steps.py, its products' and attention's dispatch in llama_kernels.py), tree.py (the
tree's shape, TreeSpec and TreePlan, and a drafted tree's tensors), draft_state.py (the drafter's cache
and the drafting of a tree), sampling.py (distributions, random draws and acceptance rules),
verdict.py (a round's acceptance on the device, captured), speculative.py (the decoding loops: a
Session per request, ``start`` and ``step``), batched.py (BatchedLlama: many prompts at once with
continuous batching, for ``eyas regenerate --engine fast``), graphs.py (CUDA graphs of fixed-shape
steps), observe.py (what an observer such as ``eyas trace`` is shown each round), stopping.py (stop
conditions), stats.py (per-request statistics and phase timing), errors.py (the engine's user
errors). Choosing a tree for this hardware and this drafter (``--tree auto``) is a tuning tool, not
the runtime: see :mod:`eyas.tune`.
"""

from eyas.engine.errors import RequestError, SessionError
from eyas.engine.build import TARGET_IMPLEMENTATIONS, build_target
from eyas.engine.llama import LlamaTarget
from eyas.engine.observe import RoundObserver
from eyas.engine.sampling import GREEDY, AcceptRule, SamplingParams, rejection_rule
from eyas.engine.speculative import GenerationResult, Session, plain_generate, speculative_generate, start, step
from eyas.engine.stats import GenerationStats
from eyas.engine.target import HFTarget, Target
from eyas.engine.tree import DraftTree, TreePlan, TreeSpec

__all__ = [
    "GREEDY", "AcceptRule", "DraftTree", "GenerationResult", "GenerationStats", "HFTarget", "LlamaTarget",
    "RequestError", "RoundObserver", "SamplingParams", "Session", "SessionError", "TARGET_IMPLEMENTATIONS", "Target",
    "TreePlan", "TreeSpec", "build_target", "plain_generate", "rejection_rule", "speculative_generate", "start", "step",
]
