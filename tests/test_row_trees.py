"""eyas.engine.row_trees through RowBatch.speculate: batched tree rounds are lossless and accept more.

- greedy, float32: every row gets exactly its answer alone (HF ``generate``) when tree rounds of
  several shapes, chain rounds and plain steps follow each other, requests join and one resumes
  mid-answer, limits cut a round (eagerly and traced by torch.compile);
- the drafted trees are well formed (topological, depths and ancestor masks consistent, the N best
  candidates kept, distinct siblings), and an accepted path's cache entries move where a row's
  sequence continues;
- a tree accepts more drafts a round than a chain of its depth (the reason for trees in a batch);
- sampled rows' tree rounds follow the target's exact distribution (chi-square: in
  test_row_speculation.py with the chains), and the test catches a rule that keeps a rejected
  child's mass;
- a tree a round cannot draft is refused with a message saying why.
"""

from __future__ import annotations

import pytest
import torch

from eyas.engine.batched import BatchedLlama
from eyas.engine.continuous import RowBatch, RowRequest
from eyas.engine import row_trees
from eyas.engine.row_trees import draft_tree, move_path_entries
from eyas.engine.sampling import SamplingParams
from eyas.engine.tree import TreeSpec
from tests.support.lossless import make_small_vocab
from tests.support.tiny import SPEC4, random_prompts
from tests.test_row_speculation import drive, first_three_statistic, rounds_give_each_row_its_answer_alone

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.unit
@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_greedy_tree_rounds_give_each_row_its_answer_alone(llama, trained_drafter, backend):
    # trees of several shapes, a chain and plain steps in turn (an eos inside a tree round:
    # test_row_speculation.py's eos test, with a tree)
    plan = (TreeSpec(3, 2, 6), 2, TreeSpec(4, 3, 12), 0, TreeSpec(2, 4, 8), TreeSpec(3, 4, 12))
    rounds_give_each_row_its_answer_alone(llama, trained_drafter, backend, plan,
                                          steps=("_tree_prologue", "_tree_step", "_layer"))


@pytest.mark.unit
def test_a_tree_accepts_more_a_round_than_a_chain_of_its_depth(llama, trained_drafter):
    prompts = random_prompts(4, 128, seed=5, lengths=(5, 20))
    per_round = {}
    for draft in (3, TreeSpec(3, 4, 12)):
        batch = RowBatch(BatchedLlama(llama, rows=4), capacity=96, drafter=trained_drafter,
                         boundaries=SPEC4.boundaries)
        _, accepted = drive(batch, {0: [RowRequest(p, 40) for p in prompts]}, plan=lambda s: draft)
        per_round[draft] = sum(accepted) / len(accepted)
    # measured: 0.49 for the chain, 1.01 for the tree
    assert per_round[TreeSpec(3, 4, 12)] > 1.5 * per_round[3] > 0.3


@pytest.mark.unit
def test_drafted_trees_are_well_formed(llama, trained_drafter):
    batch = RowBatch(BatchedLlama(llama, rows=4), capacity=64, drafter=trained_drafter, boundaries=SPEC4.boundaries)
    batch.admit([RowRequest(p, 20) for p in random_prompts(3, 128, seed=3, lengths=(2, 12))])
    spec, st = batch.spec, batch.engine.state
    tree = draft_tree(spec, st, 3, TreeSpec(4, 3, 10))
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (3, 11)
    assert torch.equal(tree.tokens[:, 0], st.ids[:3])
    for r in range(3):
        parents, depths, mask = tree.parents[r].tolist(), tree.depths[r].tolist(), tree.mask[r]
        assert parents[0] == -1 and depths[0] == 0
        for t in range(1, 11):
            assert 0 <= parents[t] < t and depths[t] == depths[parents[t]] + 1 <= 4
            ancestors = {t}
            u = t
            while u > 0:
                u = parents[u]
                ancestors.add(u)
            assert set(mask[t].nonzero().flatten().tolist()) == ancestors
        siblings = {}
        for t in range(1, 11):
            siblings.setdefault(parents[t], []).append(tree.tokens[r, t].item())
        assert all(len(set(ts)) == len(ts) for ts in siblings.values())  # a parent's children differ
    # the root's children are its most likely tokens, the most likely first
    top = spec.draft_ids[spec.root_logits[:3].topk(3).indices]
    first_children = [[tree.tokens[r, t].item() for t in range(1, 11) if tree.parents[r, t] == 0] for r in range(3)]
    assert all(kids == top[r, :len(kids)].tolist() and kids for r, kids in enumerate(first_children))


@pytest.mark.unit
def test_an_accepted_paths_entries_move_where_the_row_continues():
    L, R, H, C, D = 2, 3, 1, 12, 2
    keys = torch.arange(L * R * H * C * D, dtype=torch.float32).view(L, R, H, C, D)
    values = -keys
    before_k, before_v = keys.clone(), values.clone()
    pos = torch.tensor([1, 4, 0])
    path = torch.tensor([[0, 2, 5], [0, 1, 2], [0, 3, 3]])  # row 1: already in place; row 2: node 3, then past a
    move_path_entries(keys, values, pos, path)
    for cache, before in ((keys, before_k), (values, before_v)):
        for r in range(R):
            for t in range(1, 3):
                assert torch.equal(cache[:, r, :, pos[r] + t], before[:, r, :, pos[r] + path[r, t]])
            untouched = [c for c in range(C) if not pos[r] < c <= pos[r] + 2]
            assert torch.equal(cache[:, r, :, untouched], before[:, r, :, untouched])


@pytest.mark.unit
def test_a_round_checks_its_tree_and_a_one_wide_tree_is_the_chain(llama, trained_drafter):
    batch = RowBatch(BatchedLlama(llama, rows=2), capacity=64, drafter=trained_drafter, boundaries=SPEC4.boundaries)
    batch.admit([RowRequest([5, 6, 7], 10, SamplingParams(temperature=1.0))])
    with pytest.raises(ValueError, match=r"tree 8,4,20: a sampled round draws a uniform per child examined, "
                                         r"depth x top_k <= 31; found 32"):
        batch.speculate(TreeSpec(8, 4, 20))
    assert batch.round_shape(TreeSpec(3, 1, 3)) == batch.round_shape(3)
    shapes = batch.round_shapes(context=64, depths=[2, TreeSpec(3, 2, 6)], max_rows=1, modes=["sample"])
    assert [d for _, d, _, _ in shapes] == [TreeSpec.chain(2), TreeSpec(3, 2, 6)] * (len(shapes) // 2)
    with pytest.raises(ValueError, match=r"tree 4,8,40: a round writes 41 entries past a row's position, "
                                         r"expected at most 32"):
        batch.spec.check(TreeSpec(4, 8, 40), "greedy")


@pytest.fixture(scope="module")
def small_vocab():
    return make_small_vocab()


@pytest.mark.integration
def test_a_tree_rule_that_keeps_rejected_mass_fails_the_same_test(small_vocab, monkeypatch):
    """The test sees a wrong rule: a residual that keeps a rejected child's mass (no r(c) = 0)
    over-represents the drafter's choices."""
    monkeypatch.setattr(row_trees, "_without", lambda residual, tok, rejected: residual)
    stat, _, crit, _ = first_three_statistic(small_vocab, SamplingParams(temperature=1.0), TreeSpec(3, 3, 8))
    assert stat > crit
