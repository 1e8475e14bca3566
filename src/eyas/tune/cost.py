"""The cost side of ``--tree auto``: what each phase of a speculative round costs on this hardware.

The model (seconds; every table holds medians of timed repeats and is read by :func:`interpolate`):

    verify_s(T)         building the ancestor mask of a T-node tree + one target forward over those T
                        tokens with feature capture (the engine's verify phase)
    draft_s(D, K)     = draft_base_s(K) + (D - 1) * draft_step_s(K)
                        base: the root's top-k (no drafter forward); step: one drafter forward over
                        K nodes + their top-k
    extend_s(n)         the drafter's re-run over the n tokens of an accepted path
    bookkeeping_s(T)    the acceptance walk over T verified rows (an argmax per row, one sync) +
                        compacting the target's cache to the accepted path
    parts_s(spec, tau) = draft_s(D, K) + verify_s(N + 1) + extend_s(tau) + bookkeeping_s(N + 1)
    round_s(spec, tau) = the round timed end to end when it was (round_s_by_tree, eyas.tune.rounds),
                         else (parts_s(spec, tau) + round_overhead_s) * round_scale
    plain_s             one token of the engine's plain decoding loop

(N = spec.total_tokens draft nodes; the root is verified too, hence N + 1.)

Measurement (:func:`measure_cost`) prefills one random context and runs four timers over it, each a
small function: :func:`time_verification`, :func:`time_bookkeeping`, :func:`time_drafting` and the
end-to-end anchors :func:`time_plain_token` and :func:`time_round_overhead`. The anchors run the
engine's own loops, so syncs, host copies and Python between the phases are counted on both sides
of the speedup ratio: ``round_overhead_s`` is a real chain-of-1 round minus the model's parts_s of
that round (never negative). The target's cache is rolled back after every timed verification and
reset at the end: the target is as clean as after construction.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from eyas.drafter.model import Eagle3Drafter
from eyas.engine.sampling import GREEDY, accept_greedy
from eyas.engine.speculative import plain_generate, speculative_generate, start, step
from eyas.engine.stats import synchronize
from eyas.engine.target import Target
from eyas.engine.draft_state import DraftState
from eyas.engine.tree import DraftTree, TreeSpec
from eyas.errors import EyasError
from eyas.tune.space import DEFAULT_DEPTHS, DEFAULT_TOPKS

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)  # tokens per verification forward that are timed
BOOKKEEPING_SIZES = (2, 16, 64)  # verified tokens at which the acceptance walk + keep are timed
EXTEND_SIZES = (1, 4, 8)  # accepted tokens at which the drafter's re-run is timed
END_TO_END_TOKENS = 16  # tokens of the plain and chain-of-1 runs that anchor the component timings


class CostMeasurementError(EyasError, ValueError):
    """The target cannot be timed as asked (its context is too short for the sizes)."""


def interpolate(table: dict[int, float], x: float, monotone: bool = True) -> float:
    """Piecewise-linear in x through the measured points; flat below the smallest, extrapolated
    with the last segment's slope above the largest. ``monotone``: each point is raised to the
    running maximum first (more tokens never cost less; timing noise can say otherwise)."""
    xs = sorted(table)
    ys = [table[k] for k in xs]
    if monotone:
        for i in range(1, len(ys)):
            ys[i] = max(ys[i], ys[i - 1])
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


@dataclass
class CostModel:
    """Measured seconds of each part of a speculative round on this hardware (medians).

    verify_s_by_tokens  T -> building the ancestor mask of a T-node tree and one target forward over
                        those T new tokens with feature capture (the engine's verify phase)
    plain_s             one token of the engine's plain decoding loop (plain_generate, end to end)
    draft_base_s        K -> DraftState.draft of depth 1 (the root's top-k; no drafter forward)
    draft_step_s_by_topk K -> each further depth: one drafter forward over K nodes + their top-k
    extend_s_by_tokens  n -> the drafter's re-run over the n tokens of an accepted path
    bookkeeping_s_by_tokens  T -> the acceptance walk over T verified tokens (an argmax per row, one
                        sync) + compacting the target's cache to the path
    round_overhead_s    what a real round costs beyond the sum of the parts above (syncs, small host
                        copies, Python between the phases): a chain-of-1 request's rounds, per round
                        (its start not timed), minus the model's round of that chain; never negative
    round_s_by_tree     TreeSpec -> one real round of that tree (:func:`eyas.tune.rounds.time_rounds`,
                        at the temperature tuned): what ``--tree auto`` ranks its shortlist by. At
                        fixed shapes (the fast target) a round costs the same whatever it accepts, so
                        a round timed on random context is the round a request will pay
    round_scale         the model's rounds scaled to the timed ones (:meth:`fit_round_scale`: the
                        median of timed / modelled over the timed trees; 1 until rounds are timed),
                        so that trees not timed are ranked on the timed rounds' scale
    """

    verify_s_by_tokens: dict[int, float]
    plain_s: float
    draft_base_s: dict[int, float] = field(default_factory=lambda: {1: 0.0})
    draft_step_s_by_topk: dict[int, float] = field(default_factory=lambda: {1: 0.0})
    extend_s_by_tokens: dict[int, float] = field(default_factory=lambda: {1: 0.0})
    bookkeeping_s_by_tokens: dict[int, float] = field(default_factory=lambda: {1: 0.0})
    round_overhead_s: float = 0.0
    context: int = 0  # tokens in the cache while timing
    device: str = "cpu"
    round_s_by_tree: dict[TreeSpec, float] = field(default_factory=dict)  # rounds timed end to end
    round_scale: float = 1.0

    def verify_s(self, n: int) -> float:
        """One verification forward over n tokens (the root + n - 1 draft nodes)."""
        return interpolate(self.verify_s_by_tokens, n)

    def draft_step_s(self, k: int) -> float:
        """One more draft depth with top-k k (a drafter forward over k tokens + top-k of k rows)."""
        return interpolate(self.draft_step_s_by_topk, k, monotone=False)

    def draft_s(self, depth: int, top_k: int) -> float:
        """Drafting a tree: draft_base(K) + (depth - 1) * draft_step(K)."""
        return interpolate(self.draft_base_s, top_k, monotone=False) + (depth - 1) * self.draft_step_s(top_k)

    def extend_s(self, n: float) -> float:
        return interpolate(self.extend_s_by_tokens, n, monotone=False)

    def bookkeeping_s(self, n: int) -> float:
        return interpolate(self.bookkeeping_s_by_tokens, n, monotone=False)

    def parts_s(self, spec: TreeSpec, tau: float) -> float:
        """draft_s(D, K) + verify_s(N + 1) + extend_s(tau) + bookkeeping_s(N + 1), with
        N = spec.total_tokens draft nodes (the root is verified too) and tau tokens re-read by the
        drafter."""
        n = int(spec.total_tokens) + 1
        return self.draft_s(spec.depth, spec.top_k) + self.verify_s(n) + self.extend_s(tau) + self.bookkeeping_s(n)

    def model_round_s(self, spec: TreeSpec, tau: float) -> float:
        """The model's round, before any scaling: parts_s + round_overhead_s."""
        return self.parts_s(spec, tau) + self.round_overhead_s

    def round_s(self, spec: TreeSpec, tau: float) -> float:
        """The round of ``spec`` as timed end to end (``eyas.tune.rounds.time_rounds``) when it was,
        else the model's round times ``round_scale``."""
        if spec in self.round_s_by_tree:
            return self.round_s_by_tree[spec]
        return self.model_round_s(spec, tau) * self.round_scale

    def fit_round_scale(self, taus: dict[TreeSpec, float]) -> float:
        """round_scale = the median over the timed trees of timed round / model_round_s(spec, taus[spec])
        (the model's parts are timed apart, each with a sync; on a GPU a real round overlaps its
        launches with its host work, so the sum can be far from it); unchanged without a timed
        tree. Returns the scale."""
        ratios = [t / self.model_round_s(s, taus[s]) for s, t in self.round_s_by_tree.items()
                  if s in taus and self.model_round_s(s, taus[s]) > 0]
        if ratios:
            self.round_scale = statistics.median(ratios)
        return self.round_scale

    def to_dict(self) -> dict[str, Any]:
        ms = lambda t: {int(k): round(v * 1e3, 4) for k, v in sorted(t.items())}  # noqa: E731
        return {"verify_ms_by_tokens": ms(self.verify_s_by_tokens), "plain_ms": round(self.plain_s * 1e3, 4),
                "draft_base_ms_by_topk": ms(self.draft_base_s), "draft_step_ms_by_topk": ms(self.draft_step_s_by_topk),
                "extend_ms_by_tokens": ms(self.extend_s_by_tokens),
                "bookkeeping_ms_by_tokens": ms(self.bookkeeping_s_by_tokens),
                "round_overhead_ms": round(self.round_overhead_s * 1e3, 4), "round_scale": round(self.round_scale, 4),
                "context": self.context,
                "device": self.device,
                "round_ms_by_tree": [{"depth": s.depth, "top_k": s.top_k, "total_tokens": s.total_tokens,
                                      "round_ms": round(t * 1e3, 4)} for s, t in self.round_s_by_tree.items()]}


# ---------------------------------------------------------------------------------------------
# The stopwatch
# ---------------------------------------------------------------------------------------------


def _timed(fn: Callable[[], Any], device: torch.device, after: Callable[[], Any] | None = None) -> float:
    """Wall time of one call of fn, the device synchronised before and after; ``after`` runs
    after the clock stops."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    dt = time.perf_counter() - t0
    if after is not None:
        after()
    return dt


def _median_time(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int,
                 after: Callable[[], Any] | None = None) -> float:
    """Median wall time of fn over ``repeats`` calls after ``warmup`` untimed ones; ``after`` runs
    after each call, untimed (e.g. a cache rollback)."""
    for _ in range(warmup):
        fn()
        if after is not None:
            after()
    return statistics.median(_timed(fn, device, after) for _ in range(max(1, repeats)))


# ---------------------------------------------------------------------------------------------
# The timers
# ---------------------------------------------------------------------------------------------


@dataclass
class TimingContext:
    """What every timer shares: the target with a random context prefilled, and how to repeat.

    ids [1, C] is the context (C = ``context`` tokens), ``features`` [1, C, S*H] the target's
    captured features over it, ``next_token`` the target's greedy token after it (the target's cache
    holds the C context entries). ``generator`` draws every random token, in the
    order the timers run, so a measurement is reproducible from its seed."""

    target: Target
    ids: Tensor
    features: Tensor
    next_token: int
    repeats: int
    warmup: int
    generator: torch.Generator

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def context(self) -> int:
        return int(self.ids.shape[1])

    @property
    def calls(self) -> int:
        """Calls per timed measurement (warm-up + timed): each may commit cache entries."""
        return self.warmup + self.repeats

    def random_tokens(self, n: int) -> Tensor:
        """long [1, n] uniform over the target's vocabulary, on its device."""
        return torch.randint(0, self.target.vocab_size, (1, n), generator=self.generator).to(self.device)


def _binary_tree(n: int, tokens: Tensor) -> DraftTree:
    """A binary tree of n nodes (parent of i = (i-1)//2) over ``tokens`` [n]. The shape does not
    change the cost of a dense-masked forward; it only has to be a valid tree."""
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, n)], device=tokens.device)
    return DraftTree.from_parents(tokens, parents, depth=max(n - 1, 0).bit_length(), top_k=2)


def context_length(target: Target, sizes: Sequence[int], calls: int, context: int) -> int:
    """Tokens of random context to time over: ``context``, fewer when the target's context must
    also hold the largest verification and the paths that the bookkeeping timer commits (up to 3
    entries per call per size) and the end-to-end runs."""
    room = max(max(sizes), max(BOOKKEEPING_SIZES), END_TO_END_TOKENS + 2) + 3 * calls * len(BOOKKEEPING_SIZES) + 8
    ctx = min(int(context), target.max_length - room)
    if ctx < 2:
        raise CostMeasurementError(f"measure_cost: the target's context ({target.max_length} positions) is too "
                                   f"short to time {max(sizes)}-token verifications; expected at least {room + 2}")
    return ctx


def time_verification(tc: TimingContext, sizes: Sequence[int]) -> dict[int, float]:
    """T -> verify_s: a T-node tree (mask built on the device from the tree, as the engine does)
    over random tokens, one target forward with capture at positions cache_len + depth, rolled back
    after each call. One untimed pass over every size first, so the first size timed does not pay
    the warm-up of them all."""
    target, verify = tc.target, {}
    for timed in (False, True):
        for T in sizes:
            tree = _binary_tree(T, tc.random_tokens(T)[0])
            pos = (tc.ids.shape[1] + tree.depths)[None]
            t = _median_time(lambda: target.forward(tree.tokens[None], pos, tree.mask), tc.device,
                             tc.repeats if timed else 1, tc.warmup if timed else 0, after=lambda: target.keep([]))
            if timed:
                verify[T] = t
    return verify


def time_bookkeeping(tc: TimingContext, sizes: Sequence[int] = BOOKKEEPING_SIZES) -> dict[int, float]:
    """T -> bookkeeping_s: after a T-token verification (untimed), the acceptance walk over its
    rows plus keeping a path, [0, 1, 3] when the tree has room (non-contiguous: entries move).
    Each kept path commits; the median drops the warm-up calls."""
    target, bookkeeping = tc.target, {}
    for T in sizes:
        path = [0, 1, 3] if T >= 4 else list(range(T))
        times = []
        for _ in range(tc.calls):
            tree = _binary_tree(T, tc.random_tokens(T)[0])
            out, _ = target.forward(tree.tokens[None], (target.cache_len + tree.depths)[None], tree.mask)

            def walk_and_keep() -> None:
                accept_greedy(tree, out[0]).path.tolist()  # read back, as a round does
                target.keep(path)

            times.append(_timed(walk_and_keep, tc.device))
        bookkeeping[T] = statistics.median(times[tc.warmup:] or times)
    return bookkeeping


@dataclass
class DraftTimes:
    """The drafter's side of a round: K -> draft_base_s, K -> draft_step_s, n -> extend_s."""

    base_s_by_topk: dict[int, float]
    step_s_by_topk: dict[int, float]
    extend_s_by_tokens: dict[int, float]


def time_drafting(tc: TimingContext, drafter: Eagle3Drafter, topks: Sequence[int], max_depth: int) -> DraftTimes:
    """A DraftState over the context (the target's features), then per top-k K the draft of depth 1
    (base) and of ``max_depth``: step = (t(max_depth) - t(1)) / (max_depth - 1), never negative;
    then the re-run over n accepted random tokens for n in EXTEND_SIZES (each call commits n)."""
    kmax, vocab = max(topks), tc.target.vocab_size
    state = DraftState(drafter, tc.context + 1 + kmax * max_depth
                       + tc.calls * max(EXTEND_SIZES) * len(EXTEND_SIZES) + 8)
    state.extend(tc.ids[0, 1:].tolist() + [tc.next_token], tc.features[0])
    state.draft(TreeSpec(max_depth, kmax, None), max_depth, GREEDY, None, vocab)  # warm-up
    base: dict[int, float] = {}
    step: dict[int, float] = {}
    for k in topks:
        times = {}
        for d in (1, max_depth):
            spec = TreeSpec(d, k, None)
            times[d] = _median_time(lambda: state.draft(spec, d, GREEDY, None, vocab), tc.device, tc.repeats,
                                    tc.warmup)
        base[k] = times[1]
        step[k] = max(0.0, (times[max_depth] - times[1]) / (max_depth - 1))
    extend: dict[int, float] = {}
    for n in EXTEND_SIZES:
        feats, toks = tc.features[0, :n], tc.random_tokens(n)[0].tolist()
        extend[n] = _median_time(lambda: state.extend(toks, feats), tc.device, tc.repeats, tc.warmup)
    return DraftTimes(base, step, extend)


def time_plain_token(tc: TimingContext) -> float:
    """plain_s: per decoded token of plain_generate over the context (prefill excluded, the first
    token too: it comes from the prefill), the faster of two runs after a warm-up."""
    prompt = tc.ids[0].tolist()
    plain_generate(tc.target, prompt, max_new_tokens=4)  # warm-up
    plain = []
    for _ in range(2):
        st = plain_generate(tc.target, prompt, max_new_tokens=END_TO_END_TOKENS + 1).stats
        plain.append((st.time_total - st.time_prefill) / max(1, st.new_tokens - 1))
    return min(plain)


def time_round_overhead(tc: TimingContext, drafter: Eagle3Drafter, parts: CostModel) -> float:
    """round_overhead_s: the rounds of a chain-of-1 request over the context (``step`` after
    ``start``: the prefill and the drafter's read of the prompt are not timed), per round, minus
    ``parts``.parts_s of that chain at its measured tau; the smaller of two runs after a warm-up,
    never negative (0 when no round ran). Timed around the rounds, not by subtracting a separate
    measurement of the request's start: the engine reads a prompt in fixed-shape chunks on a
    fixed-shape target and in one exact step elsewhere, and only the engine knows which."""
    prompt, chain = tc.ids[0].tolist(), TreeSpec.chain(1)
    speculative_generate(tc.target, drafter, prompt, tree=chain, max_new_tokens=4)  # warm-up
    over = []
    for _ in range(2):
        s = start(tc.target, prompt, drafter, tree=chain, max_new_tokens=END_TO_END_TOKENS + 1)
        synchronize(tc.target.device)
        t0 = time.perf_counter()
        while not s.done:
            step(s)
        synchronize(tc.target.device)
        st = s.result().stats
        if st.accept_lengths:
            per_round = (time.perf_counter() - t0) / len(st.accept_lengths)
            over.append(per_round - parts.parts_s(chain, st.tau))
    return max(0.0, min(over)) if over else 0.0


@torch.no_grad()
def measure_cost(
    target: Target,
    drafter: Eagle3Drafter,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    topks: Sequence[int] = DEFAULT_TOPKS,
    max_depth: int = max(DEFAULT_DEPTHS),
    repeats: int = 5,
    warmup: int = 2,
    context: int = 256,
    seed: int = 0,
) -> CostModel:
    """Time each part of a round on ``target`` and ``drafter`` over a random context of ``context``
    tokens (fewer when the target's context is short). The target's cache is rolled back after every
    timed verification and reset at the end: the target is as clean as after construction."""
    sizes = sorted({max(1, int(s)) for s in sizes} | {1})
    topks = sorted({max(1, int(k)) for k in topks})
    max_depth = max(2, int(max_depth))
    ctx = context_length(target, sizes, warmup + repeats, context)
    g = torch.Generator().manual_seed(seed)
    try:
        ids = torch.randint(0, target.vocab_size, (1, ctx), generator=g).to(target.device)
        logits, features = target.prefill(ids)
        tc = TimingContext(target, ids, features, int(logits[0, -1].argmax()), repeats, warmup, g)
        verify = time_verification(tc, sizes)
        bookkeeping = time_bookkeeping(tc)
        draft = time_drafting(tc, drafter, topks, max_depth)
        cost = CostModel(verify, 0.0, draft.base_s_by_topk, draft.step_s_by_topk, draft.extend_s_by_tokens,
                         bookkeeping, context=ctx, device=str(target.device))
        # The end-to-end anchors: the engine's own loops over the same context.
        cost.plain_s = time_plain_token(tc)
        cost.round_overhead_s = time_round_overhead(tc, drafter, cost)
    finally:
        target.reset()
    return cost
