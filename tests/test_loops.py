"""Repetition-loop detection (eyas.data.loops)."""

from __future__ import annotations

import random

import pytest
import torch

from eyas.data.loops import Loop, cut_at_first_loop, find_loops, loop_body_mask

pytestmark = pytest.mark.unit


def test_a_tail_loop_is_found_with_its_smallest_period_and_cut_after_one_copy() -> None:
    text = list(range(100, 140))  # 40 distinct tokens
    block = [7, 8, 9]
    ids = text + block * 12  # 36 repeated tokens, period 3 (also period 6, 9, ...)
    loops = find_loops(ids)
    assert loops == [Loop(start=40, period=3, end=76)]
    kept, lp = cut_at_first_loop(ids)
    assert kept == text + block and lp == loops[0]
    mask = loop_body_mask(ids)
    assert mask.tolist() == [False] * 43 + [True] * 33


def test_ordinary_text_and_short_repeats_are_not_loops() -> None:
    rng = random.Random(0)
    ids = [rng.randrange(1000) for _ in range(500)]
    assert find_loops(ids) == []
    # a line repeated twice, and a short period-1 run (a markdown rule), stay text
    line = list(range(200, 215))
    ids2 = [1, 2] + line + line + [3] + [9] * 10 + [4, 5]
    assert find_loops(ids2) == []
    assert not loop_body_mask(ids2).any()
    assert cut_at_first_loop(ids2) == (ids2, None)


def test_a_loop_in_the_middle_and_the_thresholds() -> None:
    ids = [1, 2, 3] + [5] * 30 + [6, 7, 8]
    assert find_loops(ids) == [Loop(3, 1, 33)]
    assert find_loops(ids, min_span=31) == []
    # period 20 repeated 3 times = 60 tokens: found; with min_repeats 4: not
    block = list(range(300, 320))
    ids = [1] + block * 3 + [2]
    assert find_loops(ids) == [Loop(1, 20, 61)]
    assert find_loops(ids, min_repeats=4) == []
    assert find_loops(ids, max_period=19) == []


def test_accepts_a_tensor_and_empty_input() -> None:
    assert find_loops([]) == [] and loop_body_mask([]).numel() == 0
    t = torch.tensor([4] * 30)
    assert find_loops(t) == [Loop(0, 1, 30)]


def test_rows_with_loops_agrees_with_find_loops_row_by_row() -> None:
    from eyas.data.loops import rows_with_loops

    rng = random.Random(1)
    rows: list[list[int]] = [[], [5], [3] * 23, [3] * 24, [1, 2] * 12, [1, 2, 3] * 8, [1, 2] * 11 + [7, 7]]
    for _ in range(200):
        n = rng.randrange(0, 120)
        row = [rng.randrange(6) for _ in range(n)]  # a small alphabet: many near-loops
        if rng.random() < 0.5 and n > 10:
            s, p = rng.randrange(n), rng.randrange(1, 12)
            block = row[s : s + p] or [1]
            row = row[:s] + block * rng.randrange(1, 12) + row[s:]
        rows.append(row)
    expected = [bool(find_loops(r)) for r in rows]
    assert rows_with_loops(rows) == expected
    assert any(expected) and not all(expected)
    kw = dict(max_period=5, min_repeats=4, min_span=10)
    assert rows_with_loops(rows, **kw) == [bool(find_loops(r, **kw)) for r in rows]
    assert rows_with_loops([]) == []
