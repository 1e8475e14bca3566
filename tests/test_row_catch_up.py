"""The drafter of a batch catches up on the plain steps it did not follow
(:meth:`eyas.engine.row_speculation.RowSpeculation.catch_up`): after k <= FOLLOW plain steps, the
re-read from the engine's taps leaves each row's drafter cache and root as a drafter that had read
the longer prompt whole would hold them (float32, the tiny Llama and its trained drafter)."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.batched import BatchedLlama
from eyas.engine.continuous import RowBatch, RowRequest
from eyas.engine.row_speculation import FOLLOW
from tests.support.tiny import SPEC4, random_prompts

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]


def batch_of(llama, drafter, rows: int = 4) -> RowBatch:
    return RowBatch(BatchedLlama(llama, rows=rows), capacity=64, drafter=drafter, boundaries=SPEC4.boundaries)


def test_catching_up_after_plain_steps_equals_reading_the_longer_prompt(llama, trained_drafter):
    prompts = random_prompts(3, 128, seed=5, lengths=(4, 9))
    batch = batch_of(llama, trained_drafter)
    tokens = {t.row: list(t.tokens) for t in batch.admit([RowRequest(p, 20) for p in prompts[:2]])}
    for _ in range(FOLLOW - 1):
        for t in batch.step():
            tokens[t.row] += t.tokens
    late = batch.admit([RowRequest(prompts[2], 20)])[0]  # admitted after the plain steps: nothing missed
    assert batch.missed[:3] == [FOLLOW - 1, FOLLOW - 1, 0]
    spec = batch.spec
    late_root, late_kv = spec.root_logits[late.row].clone(), spec.kv[:, late.row].clone()
    stale_root = spec.root_logits[0].clone()
    spec.catch_up(3, torch.tensor(batch.missed[:3]))
    assert torch.equal(spec.root_logits[late.row], late_root)
    m_late = len(prompts[2])
    assert torch.equal(spec.kv[:, late.row, :, :m_late], late_kv[:, :, :m_late])
    assert not torch.allclose(spec.root_logits[0], stale_root)

    # the reference: a drafter that read prompt + the tokens decoded so far (but the last, fed next)
    fresh = batch_of(llama, trained_drafter)
    longer = [list(prompts[r]) + tokens[r][:-1] for r in (0, 1)]
    first = {t.row: t.tokens[0] for t in fresh.admit([RowRequest(p, 20) for p in longer])}
    assert [first[0], first[1]] == [tokens[0][-1], tokens[1][-1]]  # the same token fed next
    torch.testing.assert_close(spec.root_logits[:2], fresh.spec.root_logits[:2], atol=1e-4, rtol=1e-4)
    for r in (0, 1):
        m = len(longer[r])  # entries 0 .. m - 1: the prompt's, then the caught-up plain steps'
        torch.testing.assert_close(spec.kv[:, r, :, :m], fresh.spec.kv[:, r, :, :m], atol=1e-4, rtol=1e-4)


def test_a_round_after_plain_steps_catches_up_first(llama, trained_drafter, monkeypatch):
    batch = batch_of(llama, trained_drafter, rows=2)
    batch.admit([RowRequest(p, 30) for p in random_prompts(2, 128, seed=6, lengths=(4, 9))])
    seen = []
    catch_up = batch.spec.catch_up
    monkeypatch.setattr(batch.spec, "catch_up", lambda n, missed: (seen.append(missed.tolist()), catch_up(n, missed)))
    batch.speculate(2)
    assert seen == []  # fresh rows: nothing to catch up on
    batch.step()
    batch.step()
    assert batch.missed == [2, 2]
    batch.speculate(2)
    assert seen == [[2, 2]] and batch.missed == [0, 0]
