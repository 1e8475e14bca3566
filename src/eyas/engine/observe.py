"""What the decoding loop shows an observer: the target's features as its forward returned them, and
the features the drafter reads, at the two places per round where they cross between the models.

The engine calls an observer only when given one (``start(..., observer=)``,
``speculative_generate(..., observer=)``); without one it calls nothing and computes nothing for it.
A plain session (no drafter) captures no features and calls nothing either.
The calls come from the loop, not from hooks on modules, so they see the same tensors whatever the
target computes them with (:class:`~eyas.engine.target.HFTarget`, :class:`~eyas.engine.llama.LlamaTarget`
with or without CUDA graphs). ``eyas trace`` (:class:`eyas.doctor.trace.Tracer`) is one.

Rounds are numbered as in the statistics: round 0 is the prefill (phase ``"prefill"``: the target
reads the prompt, the drafter reads its features), round r >= 1 the r-th verification (phase
``"verify"``: the target reads the drafted tree, the drafter re-reads the accepted path). The round
in which generation stops has no ``drafter_reads``: the drafter never reads it.

The tensors are the engine's own, on its device: read them, do not modify or keep them across
calls without a copy. Reading a value (``.item()``, ``.tolist()``) synchronises with the device:
that is the observer's cost, paid only when observing.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

Phase = Literal["prefill", "verify"]


class RoundObserver:
    """Receives a speculative session's features, round by round. Every method is a no-op here:
    subclass and override what you need."""

    def target_forward(self, round: int, phase: Phase, positions: Tensor, features: Tensor) -> None:
        """The target's forward of this round: ``features`` [1, T, S*H] as it returned them (the
        captured boundaries of every token it appended, in the spec's slot order), ``positions``
        long [T] the position ids the engine passed for them."""

    def drafter_reads(self, round: int, phase: Phase, positions: Tensor, tokens: Tensor, features: Tensor) -> None:
        """What the drafter read from the target this round (``DraftState.extend``): ``features``
        [n, S*H] (entry i reads ``features[i]`` with ``tokens[i]``, long [n]: the token that follows
        the feature's position) at drafter positions ``positions`` long [n] (the target positions
        of the features)."""
