"""Repetition loops in generated text: spans where the same block of tokens repeats back to back.

Small targets answering greedily often fall into a loop (one SmolLM2 answer repeats one Hebrew word
until the token limit). Such a span is trivially predictable several tokens ahead, so it inflates a
drafter's held-out accuracy without predicting what a user will see on real prompts, and it teaches
nothing. Regeneration cuts answers at their first loop (or drops them); training reports held-out
metrics with and without the tokens inside loops.

Definition. For a period ``p`` the tokens x_s .. x_{e-1} form a loop when x_i == x_{i+p} for every
i in [s, e - p), the span holds at least ``min_repeats`` copies of its block (e - s >= min_repeats * p)
and at least ``min_span`` tokens. The first copy, x_s .. x_{s+p-1}, is ordinary text; the
*repeated* tokens x_{s+p} .. x_{e-1} are the loop's body, the part that only repeats. Among the
periods that cover a position, the smallest wins (a block "a b a b" of period 4 is also period 2).

The search is vectorised per period (one comparison of the sequence with itself shifted by p),
so it costs O(T * max_period) elementwise work and max_period tensor operations per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

MAX_PERIOD = 64  # tokens; a repeated block longer than this is a quoted passage more than a loop
MIN_REPEATS = 3  # copies of the block: two copies happen in normal text (a repeated line)
MIN_SPAN = 24  # tokens: "| --- | --- |" table rules and short repeated lines stay ordinary text


@dataclass(frozen=True)
class Loop:
    start: int  # first token of the first copy
    period: int  # tokens in the repeated block
    end: int  # one past the last token of the span

    @property
    def body_start(self) -> int:
        """First token that only repeats (after the first copy)."""
        return self.start + self.period


def _runs(flags: Tensor) -> list[tuple[int, int]]:
    """(start, length) of every run of True in a 1-D bool tensor."""
    if flags.numel() == 0 or not bool(flags.any()):
        return []
    x = torch.cat([flags.new_zeros(1), flags, flags.new_zeros(1)]).to(torch.int8)
    d = x[1:] - x[:-1]
    starts = torch.nonzero(d == 1).flatten().tolist()
    ends = torch.nonzero(d == -1).flatten().tolist()
    return [(s, e - s) for s, e in zip(starts, ends)]


def find_loops(ids: Sequence[int] | Tensor, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
               min_span: int = MIN_SPAN) -> list[Loop]:
    """Every loop of ``ids`` (see the module docstring), in order of start, non-overlapping: where
    spans of several periods overlap, the one found with the smallest period is kept."""
    x = torch.as_tensor(list(ids) if not isinstance(ids, Tensor) else ids, dtype=torch.long).flatten()
    T = x.numel()
    found: list[Loop] = []
    taken = torch.zeros(T, dtype=torch.bool)
    for p in range(1, min(max_period, T // max(min_repeats, 1)) + 1):
        eq = x[:-p] == x[p:]  # eq[i]: x_i == x_{i+p}
        for s, n in _runs(eq):
            span = n + p  # x_s .. x_{s+n+p-1}
            if span < min_repeats * p or span < min_span:
                continue
            if bool(taken[s : s + span].any()):
                continue
            found.append(Loop(s, p, s + span))
            taken[s : s + span] = True
    return sorted(found, key=lambda lp: lp.start)


def loop_body_mask(ids: Sequence[int] | Tensor, **kw: int) -> Tensor:
    """Bool [T]: True on the tokens that only repeat (every loop's body, not its first copy)."""
    x = torch.as_tensor(list(ids) if not isinstance(ids, Tensor) else ids, dtype=torch.long).flatten()
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    for lp in find_loops(x, **kw):
        mask[lp.body_start : lp.end] = True
    return mask


def cut_at_first_loop(ids: Sequence[int], **kw: int) -> tuple[list[int], Loop | None]:
    """``ids`` up to the end of its first loop's first copy (the block once, the repeats dropped),
    and that loop; ``ids`` unchanged and None when it has no loop."""
    loops = find_loops(ids, **kw)
    if not loops:
        return list(ids), None
    return list(ids)[: loops[0].body_start], loops[0]


def rows_with_loops(rows: Sequence[Sequence[int]], max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
                    min_span: int = MIN_SPAN) -> list[bool]:
    """Per row, whether :func:`find_loops` finds at least one loop in it, for a whole batch at once.

    Invariant: ``rows_with_loops(rows)[i] == bool(find_loops(rows[i]))`` for the same thresholds.
    A loop of period p exists iff some run of x_i == x_{i+p} is at least
    ``max(min_repeats * p, min_span) - p`` long (the first run found at a period is never taken by
    a smaller one unless that one is a loop itself), and a run that long exists iff a window of that
    many consecutive comparisons is all True: one cumulative sum per period over the padded
    [B, T] batch instead of one search per row. The padding holds distinct negative values, so it
    never equals a token or itself shifted. Used as a cheap filter: only the rows it flags need
    :func:`cut_at_first_loop`.
    """
    n_rows = len(rows)
    width = max((len(r) for r in rows), default=0)
    if n_rows == 0 or width == 0:
        return [False] * n_rows
    pad = list(range(-1, -width - 1, -1))
    x = torch.tensor([list(r) + pad[len(r):] for r in rows], dtype=torch.long)
    found = torch.zeros(n_rows, dtype=torch.bool)
    for p in range(1, min(max_period, width // max(min_repeats, 1)) + 1):
        need = max(max(min_repeats * p, min_span) - p, 1)  # comparisons in a row
        if need > width - p:
            continue
        eq = (x[:, :-p] == x[:, p:]).to(torch.int32)
        c = torch.nn.functional.pad(eq.cumsum(dim=1), (1, 0))
        found |= ((c[:, need:] - c[:, :-need]) == need).any(dim=1)
    return found.tolist()
