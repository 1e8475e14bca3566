"""When a request alone decodes speculatively: measured, not assumed.

Speculation pays when a round's accepted tokens outweigh its cost over a plain step; both depend
on the drafter's acceptance on the traffic served (its prompts, its temperatures), on the tree and on
the hardware, so a fixed rule is wrong somewhere (the shipped SmolLM2 drafter, tree 2,2,3, on the 2-core
CPU: 1.19x a lone plain row at temperature 0, 0.95x at 1; on the H200 with tree 4,8,15, 1.33x and
0.95x eyas plain decoding). :class:`SpeculationPolicy` keeps, per kind of request (greedy, sampled), the decode rate
of each path a lone request can take, as decayed sums of tokens and seconds:

    speculative  a lone request's tree rounds: tokens emitted / wall seconds of its rounds
    row          a row of the batch alone: its tokens / wall seconds of its steps (plain steps or
                 chain rounds, as :class:`BatchSpeculation` chooses for one row)

and sends a lone request down the faster one. A path with no measurement yet is tried first
(speculation first), and every ``explore_every``-th lone request of a kind takes the path it would
not take, so a rate that drifts (other prompts, other lengths) is measured again; the cost is
bounded by one request in ``explore_every`` on the slower path. ``margin``: speculation must be
that much faster to be chosen (it also costs a second prefill when others arrive and it joins
the batch). ``mode``: ``auto`` as above, ``on`` (a lone request always speculates), ``off`` (never).

With lanes (``eyas serve --lone-sessions N``, :mod:`eyas.serve.lanes`) k > 1 requests in flight may
each decode alone side by side, or all share the batch. The same choice is then made per bucket of k
(1, 2-3, 4-7: its bit length) from aggregate rates: ``speculative`` a pass of the k lone sessions'
rounds (every session's tokens / the pass's wall seconds), ``row`` a batched step of k rows (every
row's tokens / its seconds); lanes untried first, then the batch, then the faster, the other explored
every ``explore_every``-th decision. A request alone (k = 1) is decided as above, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eyas.engine.tree import TreeSpec

MODES = ("auto", "on", "off")
KINDS = ("greedy", "sampled")
PATHS = ("speculative", "row")


def batch_mode(speculation: str, batch_speculation: str | None = None) -> str:
    """What a batch of several rows does (:class:`BatchSpeculation`'s mode): ``batch_speculation``
    where given (never speculative with ``speculation`` off), else ``on`` with ``speculation`` on and
    ``off`` otherwise. Off by default because it pays little where it pays: on the H100 (SmolLM2
    and its drafter, every shape warm, ``benchmarks/results/2026-12-06-row-speculation-h100.md``) a
    chain round of depth 2-3 gave 1.12-1.14x plain steps at temperature 0 for 1-64 rows and
    0.6-0.9x at temperature 1 (a chain's tau is 2.1-2.3; a round costs 1.7-1.9 plain steps), and a
    server learning that online also compiles and captures each round shape it tries (117 s in
    ``2026-12-06-serve-load-h100-engine-process.md``; now prepared while idle, and a round waits
    for its compilation by rent or buy); a request alone still speculates (its tree rounds: 1.7-3.1x).
    Batched trees accept more (tau 2.7-3.1 against a chain's 2.1-2.3) but a round costs 2.3-3.8
    plain steps: 1.17-1.30x plain at 1-4 rows, 0.82-1.04x at 16-64, where a chain of 3 gave
    1.07-1.27x (H100, temperature 0, ``2026-12-07-row-trees-h100.md``)."""
    for name, value in (("speculation", speculation), ("batch_speculation", batch_speculation)):
        if value is not None and value not in MODES:
            raise ValueError(f"{name}: expected one of {list(MODES)}, found {value!r}")
    if speculation == "off":
        return "off"
    return batch_speculation or ("on" if speculation == "on" else "off")


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
    crowd: dict[tuple[str, str, int], Rate] = field(default_factory=dict)  # (kind, path, bucket of k > 1)
    _lone: dict[str, int] = field(default_factory=dict)  # lone requests seen per kind
    _decided: dict[tuple[str, int], int] = field(default_factory=dict)  # decisions per (kind, bucket of k > 1)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculation: expected one of {list(MODES)}, found {self.mode!r}")
        for kind in KINDS:
            self.rates[(kind, "speculative")] = Rate(decay=0.9)  # a sample per request: the last ~10
            self.rates[(kind, "row")] = Rate(decay=0.99)  # a sample per step: the last ~100
            self._lone[kind] = 0

    @staticmethod
    def kind(sampling: Any) -> str:
        return "greedy" if sampling.greedy else "sampled"

    def speculate(self, sampling: Any, in_flight: int = 1) -> bool:
        """Whether a request with ``sampling`` decodes speculatively alone, ``in_flight`` requests
        (itself included) decoding or waiting (module docstring)."""
        if self.mode != "auto":
            return self.mode == "on"
        kind = self.kind(sampling)
        if in_flight > 1:
            return self._lanes(kind, in_flight)
        self._lone[kind] += 1
        spec, row = self.rates[(kind, "speculative")].per_s, self.rates[(kind, "row")].per_s
        if spec is None:
            return True
        if row is None:
            return False
        choice = spec >= row * self.margin
        if self._lone[kind] % self.explore_every == 0:
            return not choice
        return choice

    def measured(self, sampling: Any, path: str, tokens: float, seconds: float) -> None:
        self.rates[(self.kind(sampling), path)].add(tokens, seconds)

    @staticmethod
    def bucket(in_flight: int) -> int:
        return max(int(in_flight), 1).bit_length()

    def crowd_rate(self, kind: str, path: str, in_flight: int) -> Rate:
        """The aggregate rate of ``path`` with ``in_flight`` requests (module docstring)."""
        return self.crowd.setdefault((kind, path, self.bucket(in_flight)), Rate(decay=0.9))

    def measured_in_flight(self, kind: str, path: str, tokens: float, seconds: float, in_flight: int) -> None:
        """A pass of ``in_flight`` lone sessions (``speculative``) or a batched step of as many rows (``row``)."""
        if in_flight > 1:
            self.crowd_rate(kind, path, in_flight).add(tokens, seconds)

    def _lanes(self, kind: str, in_flight: int) -> bool:
        key = (kind, self.bucket(in_flight))
        self._decided[key] = n = self._decided.get(key, 0) + 1
        lanes = self.crowd_rate(kind, "speculative", in_flight).per_s
        batch = self.crowd_rate(kind, "row", in_flight).per_s
        if lanes is None:
            return True
        if batch is None:
            return False
        choice = lanes >= batch * self.margin
        return (not choice) if n % self.explore_every == 0 else choice

    def to_dict(self) -> dict[str, Any]:
        crowd = sorted((b, kind, path, r) for (kind, path, b), r in self.crowd.items() if r.per_s is not None)
        return {"mode": self.mode, "tokens_per_s": {
            f"{kind}/{path}": (None if self.rates[(kind, path)].per_s is None else round(self.rates[(kind, path)].per_s, 2))
            for kind in KINDS for path in PATHS},
            "in_flight_tokens_per_s": {f"{2 ** (b - 1)}+/{kind}/{path}": round(r.per_s, 2)
                                       for b, kind, path, r in crowd}}


DEPTHS = (2, 3)  # a batched round's chain depths (1 and 4 were slower on the H100)
TREES = (TreeSpec(3, 4, 12), TreeSpec(4, 4, 16))  # its trees for greedy steps (eyas.engine.row_trees)
Arm = TreeSpec | None  # what a batched step drafts: a round of that tree (a chain: top_k 1), or None: a plain step


def arm_size(arm: Arm) -> int:
    """The drafts a row verifies in a step of ``arm`` (0: a plain step)."""
    return int(arm.total_tokens) if arm is not None else 0


def arm_label(arm: Arm) -> str:
    """``arm`` as /health and the benchmarks name it: '0' (plain), a chain's depth, a tree's DEPTH,TOPK,TOTAL."""
    return arm.label if arm is not None else "0"


@dataclass
class BatchSpeculation:
    """What each batched step drafts (an :data:`Arm`: None, a plain step; a chain, TreeSpec.chain(depth);
    a tree: :meth:`eyas.engine.continuous.RowBatch.speculate`), measured per batch size.

    A round costs a target forward over rows x (drafts + 1) positions and a few drafter steps; it
    pays while the target's forward is bound by reading its weights (few rows), and stops paying as
    the batch grows and the forward becomes bound by arithmetic, at a size that depends on the
    hardware, the drafter's acceptance on the traffic and the temperature (vLLM's dynamic speculative
    decoding and SGLang turn speculation down with the batch for the same reason). A tree verifies
    more positions than a chain of its depth and accepts more (its runners-up), so it is the better
    arm while positions are nearly free, and the first to lose as the batch grows. Sampled steps
    get ``sampled_trees`` (none by default): a tree's children are the drafter's top k, accepted
    with the target's own probability of each, where a chain's drafts are drawn from the drafter
    and accepted with min(1, p/q); at temperature 1 the chain accepted more (SmolLM2, 4 rows:
    tau 1.82 at depth 3 against 1.75 for tree 3,4,12; greedy: 2.08 against 2.69). So the rate of
    each arm (plain, ``depths``, the trees of its kind), in tokens per second of the step
    (every row's new tokens), is kept per batch-size bucket (1, 2-3, 4-7, 8-15, ...: the bit length
    of the busy rows) and per kind of step (greedy: every row greedy; sampled), as decayed sums. An
    arm measured fewer than twice in a bucket is tried first (the middle arm by drafts verified,
    then plain, then the rest, smallest first); after that the fastest is chosen (speculation must
    beat plain by ``margin``), and now and then a step of a bucket tries one of the other arms, each
    in turn (plain first), so a drift is seen and an arm whose first steps were slow (a busy host, a
    cold cache) is measured again. The first exploration comes at the ``explore_every``-th step; the
    interval doubles each time the best arm is still the one it was at the last exploration, up to
    ``explore_every * max_backoff``, and falls back to ``explore_every`` when it has changed. So a
    bucket whose best arm is settled (plain at a large batch, sampled) pays one step in 256 on a
    slower arm, not one in 16 (on the H100 a sampled chain round of depth 2-3 gave 0.7-0.9x plain and
    took about 2.2 plain steps, ``benchmarks/results/2026-12-06-row-speculation-h100.md``: explored
    every 16th step, that costs up to about 4% of the batch's tokens, derived), and a drift is still found.
    ``mode``: ``auto`` as above, ``on`` (always a round; its arm measured), ``off`` (plain steps).
    ``max_rows``: batches of more busy rows take plain steps, never measuring a round (each round
    shape tried is a compilation and a capture at its first use; None: no limit)."""

    mode: str = "auto"
    depths: tuple[int, ...] = DEPTHS
    trees: tuple[TreeSpec, ...] = TREES
    sampled_trees: tuple[TreeSpec, ...] = ()
    max_rows: int | None = None
    explore_every: int = 16
    max_backoff: int = 16
    margin: float = 1.02
    rates: dict[tuple[int, str, Arm], Rate] = field(default_factory=dict)
    last: Arm = None  # what the last step drafted (/metrics)
    _steps: dict[tuple[int, str], int] = field(default_factory=dict)
    _explored: dict[tuple[int, str], int] = field(default_factory=dict)  # exploring steps per bucket and kind
    _interval: dict[tuple[int, str], int] = field(default_factory=dict)  # steps between its explorations
    _settled: dict[tuple[int, str], Arm] = field(default_factory=dict)  # its best arm at the last exploration

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculation: expected one of {list(MODES)}, found {self.mode!r}")
        if not self.depths or min(self.depths) < 1:
            raise ValueError(f"depths: expected depths >= 1, found {list(self.depths)}")
        for name, trees in (("trees", self.trees), ("sampled_trees", self.sampled_trees)):
            if any(t.top_k < 2 for t in trees):
                raise ValueError(f"{name}: expected top_k >= 2 (a chain is a depth), found {[t.label for t in trees]}")

    def drafts(self, kind: str = "greedy") -> tuple[TreeSpec, ...]:
        """The rounds a ``kind`` of step (greedy | sampled) may run: chains, then trees."""
        return (*map(TreeSpec.chain, self.depths), *(self.trees if kind == "greedy" else self.sampled_trees))

    @staticmethod
    def bucket(rows: int) -> int:
        return max(int(rows), 1).bit_length()

    def arms(self, kind: str = "greedy") -> list[Arm]:
        """The arms of a ``kind`` of step, fewest drafts verified first (plain, in ``auto``, first)."""
        arms: set[Arm] = set(self.drafts(kind)) | ({None} if self.mode == "auto" else set())
        return sorted(arms, key=lambda d: (arm_size(d), arm_label(d)))

    def rate(self, rows: int, kind: str, arm: Arm) -> Rate:
        return self.rates.setdefault((self.bucket(rows), kind, arm), Rate(decay=0.9))

    def choose(self, rows: int, kind: str) -> Arm:
        """What the next step of ``rows`` busy rows of ``kind`` (greedy | sampled) drafts."""
        if self.mode == "off" or (self.max_rows is not None and rows > self.max_rows):
            self.last = None
            return None
        arms = self.arms(kind)
        key = (self.bucket(rows), kind)
        self._steps[key] = n = self._steps.get(key, 0) + 1
        middle = arms[len(arms) // 2]
        first = sorted(arms, key=lambda d: (d != middle, d is not None, arm_size(d)))  # the middle arm, plain, ...
        untried = [d for d in first if self.rate(rows, kind, d).samples < 2]
        if untried:
            choice = untried[0]
        else:
            speed = {d: self.rate(rows, kind, d).per_s or 0.0 for d in arms}
            choice = max(arms, key=lambda d: speed[d] * (self.margin if d is None else 1.0))
            interval = self._interval.get(key, self.explore_every)
            if n % interval == 0:  # the others in turn, plain first: none is judged once for all
                settled = key in self._settled and self._settled[key] == choice
                self._interval[key] = min(interval * 2, self.explore_every * self.max_backoff) if settled \
                    else self.explore_every
                self._settled[key] = choice
                others = [d for d in arms if d != choice]
                self._explored[key] = k = self._explored.get(key, 0) + 1
                choice = others[(k - 1) % len(others)] if others else choice
        self.last = choice
        return choice

    def measured(self, rows: int, kind: str, arm: Arm, tokens: int, seconds: float) -> None:
        self.rate(rows, kind, arm).add(tokens, seconds)

    def to_dict(self) -> dict[str, Any]:
        order = sorted(self.rates.items(), key=lambda item: (item[0][0], item[0][1], arm_size(item[0][2]),
                                                              arm_label(item[0][2])))
        measured = [(f"{2 ** (b - 1)}+/{kind}/{arm_label(d)}", r) for (b, kind, d), r in order if r.per_s is not None]
        return {"mode": self.mode, "last_depth": arm_label(self.last),
                "trees": {"greedy": [t.label for t in self.trees], "sampled": [t.label for t in self.sampled_trees]},
                "tokens_per_s": {key: round(r.per_s, 2) for key, r in measured},
                "steps": {key: r.samples for key, r in measured}}  # steps measured (compiling ones are not)
