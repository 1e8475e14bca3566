"""When a request alone decodes speculatively: measured, not assumed.

Speculation pays when a round's accepted tokens outweigh its cost over a plain step; both depend
on the drafter's acceptance on the traffic served (its prompts, its temperatures), on the tree and on
the hardware, so a fixed rule is wrong somewhere (the shipped SmolLM2 drafter, tree 2,2,3, on the 2-core
CPU: 1.19x a lone plain row at temperature 0, 0.95x at 1; on the H200 with tree 4,8,15, 1.33x and
0.95x eyas plain decoding). :class:`SpeculationPolicy` keeps, per kind of request (greedy, sampled), the decode rate
of each path a lone request can take, as decayed sums of tokens and seconds:

    speculative  a lone request's rounds: tokens emitted / wall seconds of its rounds
    plain        batched steps with one busy row: 1 token / wall seconds of the step

and sends a lone request down the faster one. A path with no measurement yet is tried first
(speculation first), and every ``explore_every``-th lone request of a kind takes the path it would
not take, so a rate that drifts (other prompts, other lengths) is measured again; the cost is
bounded by one request in ``explore_every`` on the slower path. ``margin``: speculation must be
that much faster to be chosen (it also costs a second prefill when others arrive and it joins
the batch). ``mode``: ``auto`` as above, ``on`` (a lone request always speculates), ``off`` (never).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODES = ("auto", "on", "off")
KINDS = ("greedy", "sampled")
PATHS = ("speculative", "plain")


@dataclass
class Rate:
    """Tokens per second as decayed sums: each sample scales the past by ``decay``."""

    decay: float
    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        if seconds <= 0:
            return
        self.tokens = self.tokens * self.decay + tokens
        self.seconds = self.seconds * self.decay + seconds
        self.samples += 1

    @property
    def per_s(self) -> float | None:
        return self.tokens / self.seconds if self.samples else None


@dataclass
class SpeculationPolicy:
    """Chooses the path of a lone request (module docstring)."""

    mode: str = "auto"
    explore_every: int = 16
    margin: float = 1.02
    rates: dict[tuple[str, str], Rate] = field(default_factory=dict)
    _lone: dict[str, int] = field(default_factory=dict)  # lone requests seen per kind

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculation: expected one of {list(MODES)}, found {self.mode!r}")
        for kind in KINDS:
            self.rates[(kind, "speculative")] = Rate(decay=0.9)  # a sample per request: the last ~10
            self.rates[(kind, "plain")] = Rate(decay=0.99)  # a sample per step: the last ~100
            self._lone[kind] = 0

    @staticmethod
    def kind(sampling: Any) -> str:
        return "greedy" if sampling.greedy else "sampled"

    def speculate(self, sampling: Any) -> bool:
        """Whether a lone request with ``sampling`` decodes speculatively (module docstring)."""
        if self.mode != "auto":
            return self.mode == "on"
        kind = self.kind(sampling)
        self._lone[kind] += 1
        spec, plain = self.rates[(kind, "speculative")].per_s, self.rates[(kind, "plain")].per_s
        if spec is None:
            return True
        if plain is None:
            return False
        choice = spec >= plain * self.margin
        if self._lone[kind] % self.explore_every == 0:
            return not choice
        return choice

    def measured(self, sampling: Any, path: str, tokens: float, seconds: float) -> None:
        self.rates[(self.kind(sampling), path)].add(tokens, seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "tokens_per_s": {
            f"{kind}/{path}": (None if self.rates[(kind, path)].per_s is None else round(self.rates[(kind, path)].per_s, 2))
            for kind in KINDS for path in PATHS}}
