"""The trees ``--tree auto`` chooses from.

A candidate is a :class:`~eyas.engine.tree.TreeSpec` (depth D, top-k K, total_tokens N):

    chains      TreeSpec.chain(D) = (D, 1, D) for every depth D
    trees       (D, K, N) for every K > 1 and every N >= D, with N cut to what the EAGLE-2 expansion
                can produce, K + (D - 1) K^2; a cut that repeats an N already listed is dropped

The defaults cover what a GPU at batch size 1 can verify in one forward: N + 1 <= 64 tokens. Where
N + 1 fills one of the fast target's token buckets (8, 16, 32, 64) exactly, N is one less than the
round number (7, 15, 31, 63): 32 drafted tokens would be verified padded to 64, and on an H200
SmolLM2's rounds of tree 5,8,32 verified in 1.13 ms against 0.97 for 4,8,24 and 4,8,31, bucket 32
(``benchmarks/results/2026-12-02-round-compile-h200.md``).
"""

from __future__ import annotations

from typing import Sequence

from eyas.engine.tree import TreeSpec

DEFAULT_DEPTHS = tuple(range(1, 9))
DEFAULT_TOPKS = (1, 2, 3, 4, 6, 8, 10)
DEFAULT_TOTALS = (4, 7, 12, 15, 24, 31, 48, 63)  # verified tokens = total + 1 <= 64


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
                spec = TreeSpec(d, k, n)  # total_tokens cut to what the expansion can produce
                if n < d or spec.total_tokens in seen:
                    continue
                seen.add(spec.total_tokens)
                out.append(spec)
    return out
