"""The prediction model of ``--tree auto``: for a candidate tree, its accept length tau and its speedup.

From the acceptance profile (:mod:`eyas.tune.acceptance`, q_d(i) = P(the target's token is the
drafter's i-th choice at depth d)) and the cost model (:mod:`eyas.tune.cost`):

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

from dataclasses import dataclass
from typing import Any

from eyas.engine.tree import TreeSpec
from eyas.tune.acceptance import AcceptanceProfile
from eyas.tune.cost import CostModel


def tree_nodes(acceptance: AcceptanceProfile, spec: TreeSpec) -> list[tuple[float, tuple[int, ...]]]:
    """The model of the EAGLE-2 tree ``spec``: its kept nodes as (value, child ranks along the
    path from the root), most valuable first.

        value(root) = 1
        depth d:  children of each expanded node v, child rank i < K:  value = value(v) * q_d(i)
                  expanded at depth d: the K most valuable nodes of depth d
        kept:     the N = spec.total_tokens most valuable drafted nodes (a parent is worth >= its child)

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
    return nodes[: spec.total_tokens]


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
    """One tree under the model: its predicted tau, round time (and the draft and verify parts of
    it) and speedup over plain decoding."""

    spec: TreeSpec
    tau: float
    round_s: float
    draft_s: float
    verify_s: float
    speedup: float

    def to_dict(self) -> dict[str, Any]:
        return {"depth": self.spec.depth, "top_k": self.spec.top_k, "total_tokens": self.spec.total_tokens,
                "predicted_tau": round(self.tau, 4), "predicted_speedup": round(self.speedup, 4),
                "round_ms": round(self.round_s * 1e3, 4), "draft_ms": round(self.draft_s * 1e3, 4),
                "verify_ms": round(self.verify_s * 1e3, 4)}


def predict_candidate(spec: TreeSpec, cost: CostModel, acceptance: AcceptanceProfile) -> Candidate:
    """``spec`` under the model: tau = :func:`predict_tau`, round_s = cost.round_s(spec, tau),
    speedup = tau * plain_s / round_s (0 for a round that costs nothing: an empty cost model)."""
    tau = predict_tau(acceptance, spec)
    round_s = cost.round_s(spec, tau)
    return Candidate(spec, tau, round_s, cost.draft_s(spec.depth, spec.top_k),
                     cost.verify_s(int(spec.total_tokens) + 1), tau * cost.plain_s / round_s if round_s > 0 else 0.0)
