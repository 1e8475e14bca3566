"""``--tree auto``: choose the draft tree (depth, top-k, total tokens) that should serve fastest on
this hardware with this drafter.

Three parts, each usable alone:

1. :func:`measure_cost` times, on the real target and drafter over a prefilled context, one target
   forward over T tokens with a tree mask (what verification costs) for a few T, the drafter's tree
   expansion per depth for each top-k, the drafter's re-run over the accepted tokens, and the
   acceptance walk + cache compaction; then short runs of the engine's own loops give the cost of a
   plain decoding token and what a real round costs beyond its parts -> :class:`CostModel`. The
   target's cache is rolled back after every timed forward and reset at the end.

2. :func:`measure_acceptance` runs a short greedy calibration: the target's own greedy continuation
   of a few prompts, then ONE teacher-forced pass of the drafter over it per draft depth (the
   training-time-test pattern of ``eyas.drafter.ttt``, which is exactly what the tree expansion
   computes when the drafted path equals the target's tokens). At every position and depth d it
   records the rank r_d of the target's token among the drafter's candidates, given the true prefix
   -> conditional hit rates

       c[d][k] = P(r_d < k  |  r_j < k for every j < d)          (d = 1..D, k = 1..K)

   i.e. "the target's token is in the drafter's top-k at depth d, given the path so far was too".
   Without calibration prompts, :func:`acceptance_from_metrics` reads the top-1 conditional
   accuracies that training wrote into the drafter's contract (``eyas.json`` ``metrics``) and
   extrapolates top-k.

3. :func:`choose_tree` predicts, for every candidate tree, the accept length tau and the time of a
   round, and keeps the best ratio.

The prediction model, in one place:

    q_d(i)      = c[d][i+1] - c[d][i]          P(the target's token is the drafter's i-th choice at depth d)
    value(node) = prod_{j<=d} q_j(i_j)         P(the node at child ranks (i_1..i_d) is the target's path)
    tree        EAGLE-2 expansion on these values: depth 1 = the K best children of the root; at each
                depth the K most valuable nodes are expanded into their K best children; then the
                N most valuable nodes are kept (a parent is always worth at least its child)
    tau         replay (calibration): serve each calibration sequence greedily with that tree; a round
                at position m accepts the deepest kept node that is the target's path there (its rank
                vector r_1..r_d), the next round starts after it; tau = tokens / rounds
                expectation (training metrics only): tau = 1 + sum over kept nodes of value(node)
    round_s     = draft_s(D, K) + verify_s(N + 1) + extend_s(tau) + bookkeeping_s(N + 1) + overhead
    speedup     = tau * plain_s / round_s                      (plain_s: one plain decoding step)

(the parts are timed alone; ``overhead`` and plain_s come from short runs of the engine's own loops,
so syncs and host copies between the phases are counted for both sides of the ratio).

The tree's shape assumes the drafter's confidence is calibrated (EAGLE-2's premise: it ranks nodes
by the drafter's cumulative probability, this by the measured hit rates). For a chain (top-k 1) the
replay is exactly the engine's greedy rounds on the calibration text, and the expectation reduces to
training's simulated accept length ``1 + sum_d prod_{j<=d} c[j][1]``. The replay matters: rounds
start where the previous one stopped, so hard positions weigh more in serving than in an average
over all positions (on the tests' tiny models, the expectation over-predicted a depth-6 chain's tau
by 0.9; the replay came within 0.1 of what the engine then measured on the same prompts, trees
included).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from eyas.contract.contract import ValidationMetrics
from eyas.drafter.model import Eagle3Drafter
from eyas.engine.sampling import GREEDY, accept_greedy
from eyas.engine.speculative import plain_generate, speculative_generate
from eyas.engine.target import Target
from eyas.engine.tree import DraftState, DraftTree, TreeSpec

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)  # tokens per verification forward that are timed
BOOKKEEPING_SIZES = (2, 16, 64)  # verified tokens at which the acceptance walk + keep are timed
END_TO_END_TOKENS = 16  # tokens of the plain and chain-of-1 runs that anchor the component timings
DEFAULT_DEPTHS = tuple(range(1, 9))
DEFAULT_TOPKS = (1, 2, 3, 4, 6, 8, 10)
DEFAULT_TOTALS = (4, 8, 12, 16, 24, 32, 48, 63)  # verified tokens = total + 1 <= 64
CALIBRATION_PROMPTS = 3  # prompts the CLI calibrates on
CALIBRATION_TOKENS = 96  # greedy tokens generated per calibration prompt
TOPK_SPREAD = 0.8  # acceptance_from_metrics: each extra candidate catches 20% of the remaining misses


# ---------------------------------------------------------------------------------------------
# 1. Cost
# ---------------------------------------------------------------------------------------------


def _interp(table: dict[int, float], x: float, monotone: bool = True) -> float:
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
                        copies, Python between the phases): a chain-of-1 speculative_generate run, per
                        round, minus the model's round of that chain; never negative
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

    def verify_s(self, n: int) -> float:
        """One verification forward over n tokens (the root + n - 1 draft nodes)."""
        return _interp(self.verify_s_by_tokens, n)

    def draft_step_s(self, k: int) -> float:
        """One more draft depth with top-k k (a drafter forward over k tokens + top-k of k rows)."""
        return _interp(self.draft_step_s_by_topk, k, monotone=False)

    def draft_s(self, depth: int, top_k: int) -> float:
        """Drafting a tree: draft_base(K) + (depth - 1) * draft_step(K)."""
        return _interp(self.draft_base_s, top_k, monotone=False) + (depth - 1) * self.draft_step_s(top_k)

    def extend_s(self, n: float) -> float:
        return _interp(self.extend_s_by_tokens, n, monotone=False)

    def bookkeeping_s(self, n: int) -> float:
        return _interp(self.bookkeeping_s_by_tokens, n, monotone=False)

    def parts_s(self, spec: TreeSpec, tau: float) -> float:
        """draft_s(D, K) + verify_s(N + 1) + extend_s(tau) + bookkeeping_s(N + 1), with N = spec.budget
        draft nodes (the root is verified too) and tau tokens re-read by the drafter."""
        n = spec.budget + 1
        return self.draft_s(spec.depth, spec.top_k) + self.verify_s(n) + self.extend_s(tau) + self.bookkeeping_s(n)

    def round_s(self, spec: TreeSpec, tau: float) -> float:
        """round_s = parts_s + round_overhead_s."""
        return self.parts_s(spec, tau) + self.round_overhead_s

    def to_dict(self) -> dict[str, Any]:
        ms = lambda t: {int(k): round(v * 1e3, 4) for k, v in sorted(t.items())}  # noqa: E731
        return {"verify_ms_by_tokens": ms(self.verify_s_by_tokens), "plain_ms": round(self.plain_s * 1e3, 4),
                "draft_base_ms_by_topk": ms(self.draft_base_s), "draft_step_ms_by_topk": ms(self.draft_step_s_by_topk),
                "extend_ms_by_tokens": ms(self.extend_s_by_tokens),
                "bookkeeping_ms_by_tokens": ms(self.bookkeeping_s_by_tokens),
                "round_overhead_ms": round(self.round_overhead_s * 1e3, 4), "context": self.context,
                "device": self.device}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, after: Callable[[], Any] | None = None) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
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


def _draft_tree(n: int, tokens: Tensor) -> DraftTree:
    """A binary tree of n nodes (parent of i = (i-1)//2) over ``tokens`` [n]. The shape does not
    change the cost of a dense-masked forward; it only has to be a valid tree."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
    depths = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        children[parents[i]].append(i)
    return DraftTree(tokens=tokens, parents=parents, depths=torch.tensor(depths, device=tokens.device),
                     children=children)


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
    dev = target.device
    sizes = sorted({max(1, int(s)) for s in sizes} | {1})
    topks = sorted({max(1, int(k)) for k in topks})
    max_depth = max(2, int(max_depth))
    # Room for the context, the largest verification, and the committed paths of the keep timing.
    n_keep = warmup + repeats
    room = max(max(sizes), max(BOOKKEEPING_SIZES), END_TO_END_TOKENS + 2) + 3 * n_keep * len(BOOKKEEPING_SIZES) + 8
    ctx = min(int(context), target.max_length - room)
    if ctx < 2:
        raise ValueError(f"measure_cost: the target's context ({target.max_length} positions) is too short "
                         f"to time {max(sizes)}-token verifications")
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, target.vocab_size, (1, n), generator=g).to(dev)  # noqa: E731
    try:
        ids = rand(ctx)
        logits, f = target.prefill(ids)
        x_next = int(logits[0, -1].argmax())
        m = target.cache_len

        # verification: T tokens, tree mask, capture; rolled back after each forward. One untimed
        # pass over every size first, so the first size timed does not pay the warm-up of them all.
        # As the engine does it: the mask is built on the device from the tree (DraftTree).
        verify: dict[int, float] = {}
        for timed in (False, True):
            for T in sizes:
                tree = _draft_tree(T, rand(T)[0])
                pos = (m + tree.depths)[None]
                t = _median_time(lambda: target.forward(tree.tokens[None], pos, tree.ancestor_mask()), dev,
                                 repeats if timed else 1, warmup if timed else 0, after=lambda: target.keep([]))
                if timed:
                    verify[T] = t

        # bookkeeping: the acceptance walk (an argmax over every verified row) and keeping a path
        # (non-contiguous when the tree has room for one: entries move); each kept path commits
        bookkeeping: dict[int, float] = {}
        for T in BOOKKEEPING_SIZES:
            path = [0, 1, 3] if T >= 4 else list(range(T))
            book = []
            for _ in range(n_keep):
                tree = _draft_tree(T, rand(T)[0])
                out, _ = target.forward(tree.tokens[None], (target.cache_len + tree.depths)[None], tree.ancestor_mask())

                def walk_and_keep() -> None:
                    accept_greedy(tree.tokens.tolist(), tree.children, out[0])
                    target.keep(path)

                book.append(_timed(walk_and_keep, dev))
            bookkeeping[T] = statistics.median(book[warmup:] or book)

        # drafting: DraftState over the same prefix (target features of the context)
        kmax = max(topks)
        state = DraftState(drafter, ctx + 1 + kmax * max_depth + n_keep * 8 * 3 + 8)
        state.extend(ids[0, 1:].tolist() + [x_next], f[0])
        state.draft(TreeSpec(max_depth, kmax, None), max_depth, GREEDY, None, target.vocab_size)  # warm-up
        base: dict[int, float] = {}
        step: dict[int, float] = {}
        for k in topks:
            times = {}
            for d in (1, max_depth):
                spec = TreeSpec(d, k, None)
                times[d] = _median_time(lambda: state.draft(spec, d, GREEDY, None, target.vocab_size),
                                        dev, repeats, warmup)
            base[k] = times[1]
            step[k] = max(0.0, (times[max_depth] - times[1]) / (max_depth - 1))
        extend: dict[int, float] = {}
        for n in (1, 4, 8):
            feats, toks = f[0, :n], rand(n)[0].tolist()
            extend[n] = _median_time(lambda: state.extend(toks, feats), dev, repeats, warmup)
        # what speculative_generate does once before its first round: the drafter over the prompt
        prompt = ids[0].tolist()
        first = prompt[1:] + [x_next]
        init = _median_time(lambda: DraftState(drafter, ctx + END_TO_END_TOKENS + 2).extend(first, f[0]), dev, 1, 1)
        cost = CostModel(verify, 0.0, base, step, extend, bookkeeping, context=ctx, device=str(dev))

        # End to end: the engine's own loops over the same context. plain_s is a token of plain
        # decoding; the round overhead is a chain-of-1 round beyond the sum of its parts.
        n_new = END_TO_END_TOKENS + 1
        plain_generate(target, prompt, max_new_tokens=4)  # warm-up
        plain = []
        for _ in range(2):
            st = plain_generate(target, prompt, max_new_tokens=n_new).stats
            plain.append((st.time_total - st.time_prefill) / max(1, st.new_tokens - 1))
        cost.plain_s = min(plain)
        chain = TreeSpec.chain(1)
        speculative_generate(target, drafter, prompt, tree=chain, max_new_tokens=4)  # warm-up
        over = []
        for _ in range(2):
            st = speculative_generate(target, drafter, prompt, tree=chain, max_new_tokens=n_new).stats
            if st.accept_lengths:
                per_round = (st.time_total - st.time_prefill - init) / len(st.accept_lengths)
                over.append(per_round - cost.parts_s(chain, st.tau))
        cost.round_overhead_s = max(0.0, min(over)) if over else 0.0
    finally:
        target.reset()
    return cost


# ---------------------------------------------------------------------------------------------
# 2. Acceptance
# ---------------------------------------------------------------------------------------------


@dataclass
class AcceptanceProfile:
    """hit[d-1][k-1] = c[d][k] = P(target token in the drafter's top-k at depth d | the path so far
    was in the top-k too); ``counts[d-1]`` = positions that reached depth d with the top-1 path
    (the denominator of c[d][1]); ``source`` says where the numbers come from.

    ``sequences`` (calibration only): per calibration sequence, the per-position ranks [T][D] and
    valid flags [T][D] of :func:`teacher_forced_ranks`, which :func:`simulate_rounds` replays."""

    hit: list[list[float]]
    source: str = ""
    counts: list[int] = field(default_factory=list)
    sequences: list[tuple[list[list[int]], list[list[bool]]]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.hit or not self.hit[0]:
            raise ValueError("acceptance profile: expected hit rates for at least one depth and top-k")

    @property
    def max_depth(self) -> int:
        return len(self.hit)

    @property
    def max_topk(self) -> int:
        return len(self.hit[0])

    def rank_probs(self, depth: int) -> list[float]:
        """q_d(i) = c[d][i+1] - c[d][i], i = 0..max_topk-1 (c[d][0] = 0), after making c
        non-decreasing in k; depths past the profile reuse its last depth."""
        row = self.hit[min(depth, self.max_depth) - 1]
        q, best = [], 0.0
        for c in row:
            c = min(1.0, max(best, c))
            q.append(c - best)
            best = c
        return q

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "top1_by_depth": [round(r[0], 4) for r in self.hit],
                f"top{self.max_topk}_by_depth": [round(r[-1], 4) for r in self.hit],
                "hit": [[round(c, 4) for c in r] for r in self.hit], "counts": self.counts,
                "tau_from": "replay" if self.sequences else "expectation"}


@torch.no_grad()
def teacher_forced_ranks(target: Target, drafter: Eagle3Drafter, seq: Sequence[int], start: int,
                         max_depth: int) -> tuple[Tensor, Tensor, Tensor]:
    """Ranks of the target's tokens under the drafter along ``seq``, teacher-forced.

    Round at position t+1 (the drafter has committed entries 0..t, the root is x_{t+1}): the depth-d
    node is the candidate for x_{t+1+d}; when the nodes above it are the target's own tokens, its
    drafter output is TTT step d-1 at position t (tokens teacher-forced, the drafter's hidden fed
    back, position t+d-1, attending the committed prefix and the same position of earlier steps).

    Returns ranks [T, D] (rank of the target's argmax token among the drafter's draft-vocabulary
    logits: 0 = the drafter's top choice; a huge number when the token is not in the draft
    vocabulary), the drafter's top-1 target ids [T, D], and valid [T, D]: the position is a round the
    engine runs (t + 1 >= start: the root is a generated token, ``start`` = the prompt's length) and
    the depth's token lies inside ``seq``.
    """
    from eyas.drafter.ttt import TargetLabels, shift_left, ttt_forward

    dev = target.device
    ids = torch.tensor([list(seq)], device=dev)
    T = ids.shape[1]
    logits, f = target.prefill(ids)
    target.reset()
    vd = drafter.config.draft_vocab_size
    draft_ids = drafter.draft_to_target(torch.arange(vd, device=dev))
    to_draft = torch.full((target.vocab_size,), -1, dtype=torch.long, device=dev)
    to_draft[draft_ids] = torch.arange(vd, device=dev)
    labels = TargetLabels.from_logits(logits, draft_ids)  # argmax [1, T]: the target's token after seq[..t]
    ttt = ttt_forward(drafter, ids, f.to(drafter.fc.weight.dtype), labels, torch.ones_like(ids), steps=max_depth,
                      keep_logits=True)
    t = torch.arange(T, device=dev)
    ranks, top1, valid = [], [], []
    never = torch.iinfo(torch.long).max // 2
    for k, step_logits in enumerate(ttt.logits):
        lg = step_logits[0].float()  # [T, Vd]: step k at t, the candidates for x_{t+2+k}
        did = to_draft[shift_left(labels.argmax, 1 + k)[0]]  # the target's token there, as a draft id (-1: none)
        score = lg.gather(-1, did.clamp(min=0)[:, None])
        rank = (lg > score).sum(-1)
        ranks.append(torch.where(did >= 0, rank, torch.full_like(rank, never)))
        top1.append(draft_ids[lg.argmax(-1)])
        valid.append((t + 1 >= start) & (t + 2 + k <= T - 1))
    return torch.stack(ranks, 1).cpu(), torch.stack(top1, 1).cpu(), torch.stack(valid, 1).cpu()


def hit_rates(ranks: Tensor, valid: Tensor, max_topk: int) -> tuple[list[list[float]], list[int]]:
    """c[d][k] = #(r_1..r_d < k) / #(r_1..r_{d-1} < k) over valid positions; a depth nobody
    reached repeats the depth above (0 at depth 1)."""
    D = ranks.shape[1]
    hit = [[0.0] * max_topk for _ in range(D)]
    counts = [0] * D
    for k in range(1, max_topk + 1):
        inside = ranks < k
        alive = torch.ones(ranks.shape[0], dtype=torch.bool)
        for d in range(D):
            den = alive & valid[:, d]
            num = den & inside[:, d]
            nd = int(den.sum())
            hit[d][k - 1] = int(num.sum()) / nd if nd else (hit[d - 1][k - 1] if d else 0.0)
            if k == 1:
                counts[d] = nd
            alive = alive & inside[:, d]
    return hit, counts


@torch.no_grad()
def measure_acceptance(
    target: Target,
    drafter: Eagle3Drafter,
    prompts: Sequence[Sequence[int] | Tensor],
    *,
    max_depth: int = max(DEFAULT_DEPTHS),
    max_topk: int = max(DEFAULT_TOPKS),
    new_tokens: int = CALIBRATION_TOKENS,
    eos_token_ids: Sequence[int] = (),
) -> AcceptanceProfile | None:
    """Greedy calibration: generate the target's continuation of each prompt (plain decoding, up
    to ``new_tokens``), then measure the drafter's conditional top-k hit rates along it at every
    position (see :func:`teacher_forced_ranks`). None when no position could be measured. The target
    is reset at the end."""
    all_ranks, all_valid = [], []
    try:
        for p in prompts:
            prompt = p.flatten().tolist() if isinstance(p, Tensor) else [int(x) for x in p]
            room = target.max_length - len(prompt)
            if not prompt or room < 2:
                continue
            cont = plain_generate(target, prompt, max_new_tokens=min(new_tokens, room),
                                  eos_token_ids=eos_token_ids).tokens
            if len(cont) < 2:
                continue
            r, _, v = teacher_forced_ranks(target, drafter, prompt + cont, len(prompt), max_depth)
            all_ranks.append(r), all_valid.append(v)
    finally:
        target.reset()
    if not all_ranks or not bool(torch.cat(all_valid)[:, 0].any()):
        return None
    ranks, valid = torch.cat(all_ranks), torch.cat(all_valid)
    hit, counts = hit_rates(ranks, valid, max_topk)
    n = int(valid[:, 0].sum())
    sequences = [(r.tolist(), v.tolist()) for r, v in zip(all_ranks, all_valid)]
    return AcceptanceProfile(hit, f"greedy calibration on {len(all_ranks)} prompt(s), {n} positions", counts,
                             sequences)


def acceptance_from_metrics(metrics: ValidationMetrics | None, max_topk: int = max(DEFAULT_TOPKS),
                            spread: float = TOPK_SPREAD) -> AcceptanceProfile | None:
    """From the contract's training metrics: c[d][1] = ``conditional_accuracy_per_position``
    (held-out TTT, top-1), and top-k extrapolated as c[d][k] = 1 - (1 - c[d][1]) * spread^(k-1)
    (an assumption: training records top-1 only). None without those metrics."""
    cond = metrics.conditional_accuracy_per_position if metrics is not None else None
    if not cond:
        return None
    hit = [[1 - (1 - float(c)) * spread ** (k - 1) for k in range(1, max_topk + 1)] for c in cond]
    step = metrics.step
    return AcceptanceProfile(hit, f"the drafter's training metrics (step {step}; top-1 measured, top-k "
                                  f"extrapolated with spread {spread})")


# ---------------------------------------------------------------------------------------------
# 3. Choice
# ---------------------------------------------------------------------------------------------


def tree_nodes(acceptance: AcceptanceProfile, spec: TreeSpec) -> list[tuple[float, tuple[int, ...]]]:
    """The model of the EAGLE-2 tree ``spec``: its kept nodes as (value, child ranks along the
    path from the root), most valuable first.

        value(root) = 1
        depth d:  children of each expanded node v, child rank i < K:  value = value(v) * q_d(i)
                  expanded at depth d: the K most valuable nodes of depth d
        kept:     the N = spec.budget most valuable drafted nodes (a parent is worth >= its child)

    value(node) = P(the node is the target's path), with q_d(i) = P(the target's token is the
    drafter's i-th choice at depth d | the path so far is right) from the profile. EAGLE-2 ranks
    nodes by the drafter's own confidence; this ranks them by the measured hit rates, i.e. assumes
    the drafter's confidence is calibrated. Ranks past the profile's top-k have q = 0.
    """
    K = spec.top_k
    nodes: list[tuple[float, tuple[int, ...]]] = []
    frontier: list[tuple[float, tuple[int, ...]]] = [(1.0, ())]
    for d in range(1, spec.depth + 1):
        q = acceptance.rank_probs(d)
        new = [(v * (q[i] if i < len(q) else 0.0), path + (i,)) for v, path in frontier for i in range(K)]
        new.sort(key=lambda n: (-n[0], n[1]))
        nodes += new
        frontier = new[:K]
    nodes.sort(key=lambda n: (-n[0], len(n[1]), n[1]))  # ties: the parent (shorter path) first
    return nodes[: spec.budget]


def expected_tau(acceptance: AcceptanceProfile, spec: TreeSpec) -> float:
    """tau = 1 + sum over the kept nodes of value(node): the expected accepted drafts (at most one
    node per depth is accepted, and a node is accepted iff it is the target's path) + the bonus.
    For a chain: 1 + sum_d prod_{j<=d} c[j][1], training's simulated accept length."""
    return 1.0 + sum(v for v, _ in tree_nodes(acceptance, spec))


def simulate_rounds(acceptance: AcceptanceProfile, spec: TreeSpec) -> list[list[int]]:
    """Replay greedy serving over each calibration sequence: a round at position m (root x_m)
    accepts the deepest d whose target path (r_1 .. r_d at that position) is a kept node of
    :func:`tree_nodes`, emits d + 1 tokens, and the next round starts at m + d + 1. Returns the
    tokens emitted per round, per sequence; rounds whose full depth runs past the sequence are
    not played.

    Replaying matters: a round starts where the previous one stopped, so positions after a
    rejection weigh more than an average over all positions gives them (easy stretches are
    crossed in a few rounds). For a chain, the replay is exactly the engine's greedy rounds.
    """
    kept = {path for _, path in tree_nodes(acceptance, spec)}
    D = spec.depth
    out = []
    for ranks, valid in acceptance.sequences:
        rounds: list[int] = []
        t = next((i for i, v in enumerate(valid) if v and v[0]), len(valid))  # round at m = t + 1
        while t < len(valid) and len(valid[t]) >= D and valid[t][D - 1]:
            a = 0
            while a < D and tuple(ranks[t][: a + 1]) in kept:
                a += 1
            rounds.append(a + 1)
            t += a + 1
        out.append(rounds)
    return out


def predict_tau(acceptance: AcceptanceProfile, spec: TreeSpec) -> float:
    """Predicted tokens per round of ``spec``: the replay of :func:`simulate_rounds` over the
    calibration sequences when there are any (and a round fits), else :func:`expected_tau`."""
    if acceptance.sequences:
        rounds = [r for seq in simulate_rounds(acceptance, spec) for r in seq]
        if rounds:
            return sum(rounds) / len(rounds)
    return expected_tau(acceptance, spec)


@dataclass
class Candidate:
    spec: TreeSpec
    tau: float
    round_s: float
    draft_s: float
    verify_s: float
    speedup: float

    def to_dict(self) -> dict[str, Any]:
        return {"depth": self.spec.depth, "top_k": self.spec.top_k, "total_tokens": self.spec.budget,
                "predicted_tau": round(self.tau, 4), "predicted_speedup": round(self.speedup, 4),
                "round_ms": round(self.round_s * 1e3, 4), "draft_ms": round(self.draft_s * 1e3, 4),
                "verify_ms": round(self.verify_s * 1e3, 4)}


@dataclass
class TreeChoice:
    spec: TreeSpec
    predicted_tau: float
    predicted_speedup: float
    round_s: float
    candidates: list[Candidate]  # every candidate considered, best first
    reason: str
    cost: CostModel
    acceptance: AcceptanceProfile

    def to_dict(self, top: int = 5) -> dict[str, Any]:
        """The JSON ``tree_auto`` entry."""
        return {
            "depth": self.spec.depth, "top_k": self.spec.top_k, "total_tokens": self.spec.budget,
            "predicted_tau": round(self.predicted_tau, 4), "predicted_speedup": round(self.predicted_speedup, 4),
            "round_ms": round(self.round_s * 1e3, 4), "plain_ms": round(self.cost.plain_s * 1e3, 4),
            "verify_ms_by_tokens": self.cost.to_dict()["verify_ms_by_tokens"],
            "reason": self.reason,
            "cost": self.cost.to_dict(),
            "acceptance": self.acceptance.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates[:top]],
            "candidates_considered": len(self.candidates),
        }


def candidate_trees(depths: Sequence[int] = DEFAULT_DEPTHS, topks: Sequence[int] = DEFAULT_TOPKS,
                    totals: Sequence[int] = DEFAULT_TOTALS) -> list[TreeSpec]:
    """Chains TreeSpec.chain(D) for every depth, and every (D, K>1, N) with D <= N; N past what
    the expansion can produce (K + (D-1) K^2) is cut to that, once."""
    out: list[TreeSpec] = []
    for d in sorted(set(depths)):
        for k in sorted(set(topks)):
            if k == 1:
                out.append(TreeSpec.chain(d))
                continue
            seen = set()
            for n in sorted(set(totals)):
                spec = TreeSpec(d, k, n)
                if n < d or spec.budget in seen:
                    continue
                seen.add(spec.budget)
                out.append(TreeSpec(d, k, spec.budget))
    return out


def choose_tree(cost: CostModel, acceptance: AcceptanceProfile, depths: Sequence[int] | None = None,
                topks: Sequence[int] = DEFAULT_TOPKS, totals: Sequence[int] = DEFAULT_TOTALS) -> TreeChoice:
    """The candidate with the highest predicted speedup tau * plain_s / round_s (ties: the cheaper
    round, then the smaller tree). depths default to 1 .. the acceptance profile's depth."""
    depths = depths or range(1, acceptance.max_depth + 1)
    cands = []
    for spec in candidate_trees(depths, topks, totals):
        tau = predict_tau(acceptance, spec)
        round_s = cost.round_s(spec, tau)
        cands.append(Candidate(spec, tau, round_s, cost.draft_s(spec.depth, spec.top_k),
                               cost.verify_s(spec.budget + 1), tau * cost.plain_s / round_s if round_s > 0 else 0.0))
    cands.sort(key=lambda c: (-round(c.speedup, 9), c.round_s, c.spec.budget, c.spec.depth, c.spec.top_k))
    best = cands[0]
    reason = _reason(best, cands, cost, acceptance)
    return TreeChoice(best.spec, best.tau, best.speedup, best.round_s, cands, reason, cost, acceptance)


def _fmt(spec: TreeSpec) -> str:
    return f"{spec.depth},{spec.top_k},{spec.budget}"


def _reason(best: Candidate, cands: list[Candidate], cost: CostModel, acceptance: AcceptanceProfile) -> str:
    s = best.spec
    ms = lambda x: f"{x * 1e3:.2f} ms"  # noqa: E731
    big = max(cost.verify_s_by_tokens)
    growth = cost.verify_s(big) / cost.verify_s(1) if cost.verify_s(1) > 0 else math.inf
    text = (f"chose {_fmt(s)} because it has the best predicted speedup, {best.speedup:.2f}x: "
            f"{best.tau:.2f} tokens per round (predicted accept length) for a {ms(best.round_s)} round "
            f"(draft {ms(best.draft_s)}, verify {s.budget + 1} tokens {ms(best.verify_s)}) vs "
            f"{ms(cost.plain_s)} per plain token; verifying {big} tokens costs {growth:.1f}x one token here")
    chains = [c for c in cands if c.spec.top_k == 1]
    trees = [c for c in cands if c.spec.top_k > 1]
    other = trees[0] if s.top_k == 1 and trees else chains[0] if s.top_k > 1 and chains else None
    if other is not None:
        kind = "tree" if other.spec.top_k > 1 else "chain"
        text += (f"; the best {kind}, {_fmt(other.spec)}, would give tau {other.tau:.2f} at "
                 f"{ms(other.round_s)} per round ({other.speedup:.2f}x)")
    if best.speedup < 1:
        text += "; no candidate is predicted to beat plain decoding on this hardware with this drafter"
    return text + f"; acceptance from {acceptance.source}" if acceptance.source else text
