"""eyas.engine.row_speculation through RowBatch.speculate: batched speculative rounds are lossless.

- greedy, float32: every row gets exactly its answer alone (HF ``generate``), whatever depth each
  round drafts, with plain steps in between (rows whose drafter went stale), requests joining and
  resumed mid-answer, eos and limits cutting a round's tokens; and the drafts are accepted
  (the rounds do speculate);
- sampled: the first three tokens of many rows (each its own seed) follow the target's exact
  distribution (Pearson's chi-square, as for the single-stream engine), at temperature 1 and with
  top-p, for chains and trees (eyas.engine.row_trees), and the same test catches an acceptance
  rule that skips the residual.
"""

from __future__ import annotations

import pytest
import torch

from eyas.engine import row_speculation
from eyas.engine.batched import BatchedLlama
from eyas.engine.continuous import RowBatch, RowRequest
from eyas.engine.graphs import CompiledOrEager
from eyas.engine.sampling import SamplingParams
from eyas.engine.tree import TreeSpec
from tests.support.lossless import SPEC3, Z_999, chi_square, exact_first_three, make_small_vocab, wilson_hilferty_critical
from tests.support.tiny import SPEC4, random_prompts
from tests.test_batched import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


def drive(batch: RowBatch, arrivals: dict[int, list[RowRequest]], plan) -> tuple[dict[int, list[int]], list[int]]:
    """Run ``batch`` round after round: at round s the requests ``arrivals[s]`` wait for a free row,
    then ``plan(s)`` says the round: a depth (a speculative round) or 0 (a plain step). Returns each
    request's tokens by arrival order, and the accepted drafts of every speculative round and row."""
    owner: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    accepted: list[int] = []
    waiting: list[RowRequest] = []
    n = 0
    for s in range(400):
        waiting += arrivals.get(s, [])
        while waiting and batch.free:
            row = batch.free[0]  # a request takes the lowest free row
            owner[row], tokens[n] = n, []
            for got in batch.admit([waiting.pop(0)]):  # none for a resumed request
                tokens[n] += got.tokens
                if got.finished:
                    batch.release(row)
                    del owner[row]
            n += 1
        depth = plan(s)
        for t in (batch.speculate(depth) if depth else batch.step()):
            tokens[owner[t.row]] += t.tokens
            if depth:
                accepted.append(t.accepted)
                assert t.drafted == getattr(depth, "depth", depth) and t.accepted <= len(t.tokens) - (not t.finished)
            if t.finished:
                batch.release(t.row)
                del owner[t.row]
        if not batch.busy and not waiting and s > max(arrivals):
            break
    return tokens, accepted


@pytest.mark.unit
@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_greedy_rounds_give_each_row_its_answer_alone(llama, trained_drafter, backend):
    # "compiled": the steps and the rounds' verification and drafter steps traced by torch.compile
    # (dynamic sizes for the rounds) as on a GPU, with a backend that runs on the CPU
    rounds_give_each_row_its_answer_alone(llama, trained_drafter, backend)


@pytest.mark.slow
def test_greedy_rounds_compiled_by_inductor_give_each_row_its_answer_alone(llama, trained_drafter):
    # the GPU's compiler (C++ kernels here): every step of a round compiles, none falls back to eager
    rounds_give_each_row_its_answer_alone(llama, trained_drafter, "inductor")


def rounds_give_each_row_its_answer_alone(llama, trained_drafter, backend,
                                          plan=(3, 1, 4, 0, 2, 5, 0, 0, 3), steps=("_layer", "_draft_step", "_reread")):
    """Six requests (one resumed mid-answer) through rounds drafting ``plan`` in turn (depths, trees,
    0: a plain step) each get their HF answer; with a backend, the RowSpeculation functions
    ``steps`` ran compiled."""
    prompts = random_prompts(6, 128, seed=5, lengths=(1, 20))
    limits = [17, 9, 23, 1, 14, 20]
    want = [hf_greedy(llama, p, m, None)[0] for p, m in zip(prompts, limits)]
    # a resumed request: its prompt and 5 tokens but the last prefilled, the 5th fed next
    resumed = RowRequest(prompts[5] + want[5][:4], limits[5], next_token=want[5][4], generated=5)
    engine = BatchedLlama(llama, rows=4, compile=backend is not None, backend=backend)
    batch = RowBatch(engine, capacity=64, drafter=trained_drafter, boundaries=SPEC4.boundaries)
    assert batch.spec is not None and isinstance(batch.spec._layer, CompiledOrEager) == (backend is not None)
    arrivals = {0: [RowRequest(p, m) for p, m in zip(prompts[:3], limits[:3])],
                3: [RowRequest(prompts[3], limits[3]), RowRequest(prompts[4], limits[4])], 6: [resumed]}
    got, accepted = drive(batch, arrivals, plan=lambda s: plan[s % len(plan)])
    assert [got[i] for i in range(5)] == want[:5]
    assert want[5][:5] + got[5] == want[5]
    # the drafter's drafts are accepted: the rounds speculate (the tiny drafter: 0.4-0.6 a round here)
    assert sum(accepted) > len(accepted) // 3
    assert batch.busy == [] and not batch.engine.state.active.any()
    if backend is not None:  # the rounds did run compiled (a failed compilation falls back to eager)
        for step in (getattr(batch.spec, name) for name in steps):
            assert step.error is None and step.compiled is not None and step.seconds > 0, step.name


@pytest.mark.unit
@pytest.mark.parametrize("draft", [4, TreeSpec(4, 4, 16)], ids=["chain", "tree"])
def test_an_eos_inside_a_round_ends_the_row_there(llama, trained_drafter, draft):
    prompt = random_prompts(1, 128, seed=8, lengths=(6, 6))[0]
    alone = hf_greedy(llama, prompt, 30, None)[0]
    eos = alone[7]  # the 8th token is the eos: a round that accepts past it is cut after it
    want = alone[:alone.index(eos) + 1]
    batch = RowBatch(BatchedLlama(llama, rows=2), capacity=64, eos_ids=[eos], drafter=trained_drafter,
                     boundaries=SPEC4.boundaries)
    got, _ = drive(batch, {0: [RowRequest(prompt, 30)]}, plan=lambda s: draft)
    assert got[0] == want


@pytest.mark.unit
def test_a_prepared_round_shape_runs_without_compiling_and_changes_nothing(llama, trained_drafter):
    # prepare() compiles a round's shape ahead (a server's idle time) on the rows' real state, then
    # puts the state back: the rounds that follow give the same tokens and compile nothing more
    prompts = random_prompts(2, 128, seed=11, lengths=(4, 9))
    got = {}
    for ahead in (False, True):
        engine = BatchedLlama(llama, rows=4, compile=True, backend="aot_eager")
        batch = RowBatch(engine, capacity=64, drafter=trained_drafter, boundaries=SPEC4.boundaries)
        tokens = {t.row: list(t.tokens) for t in batch.admit([RowRequest(p, 12) for p in prompts])}
        shapes = batch.round_shapes(context=64, depths=[3], max_rows=2, modes=["greedy"])
        assert shapes == [(n, TreeSpec.chain(3), "greedy", K) for K in engine.buckets() for n in (1, 2)]  # row buckets 1, 2, 4
        if ahead:
            assert all(batch.spec.prepare(*shape) for shape in shapes)
            assert not batch.spec.prepare(*shapes[0]) and batch.spec.prepared(*shapes[0])
        compiled = batch.compile_s
        for _ in range(3):
            for t in batch.speculate(3):
                tokens[t.row] += t.tokens
        assert (batch.compile_s == compiled) == ahead
        got[ahead] = tokens
    assert got[True] == got[False] and min(map(len, got[True].values())) > 4


@pytest.mark.unit
def test_a_round_shape_not_compiled_waits_until_the_plain_steps_in_its_place_cost_its_compilation(llama,
                                                                                                trained_drafter):
    # rent or buy (RowBatch.round_ready): a round whose shape would compile now waits while the plain
    # steps run in its place (charged to it) cost less than compiling a shape has cost on average
    engine = BatchedLlama(llama, rows=4, compile=True, backend="aot_eager")
    batch = RowBatch(engine, capacity=64, drafter=trained_drafter, boundaries=SPEC4.boundaries)
    batch.admit([RowRequest(p, 20) for p in random_prompts(2, 128, seed=12, lengths=(4, 9))])
    shape = batch.round_shape(3)
    assert shape == (2, TreeSpec.chain(3), "greedy", engine.buckets()[0])
    assert batch.round_ready(shape)  # no compilation yet, no price known: it compiles now
    batch.step()  # a plain step compiles: the price of a shape
    price = engine.compile_per_shape_s
    assert price > 0 and not batch.round_ready(shape)
    batch.charge(shape, price * 0.6)
    assert not batch.round_ready(shape)
    batch.charge(shape, price * 0.6)
    assert batch.round_ready(shape)
    batch.speculate(3)  # compiles the round: rounds now have their own price
    assert batch.spec.compile_per_shape_s == batch.spec.compile_s > 0 and batch.compile_s > engine.compile_s
    other = batch.round_shape(2)
    assert not batch.round_ready(other) and batch.spec.prepare(*other) and batch.round_ready(other)


@pytest.fixture(scope="module")
def small_vocab():
    return make_small_vocab()


def sample_first_three(model, drafter, prompt: list[int], params: SamplingParams, n: int,
                       depth: int) -> tuple[torch.Tensor, float]:
    """Counts [16, 16, 16] of the first three tokens of n rows, each with its own seed: a prefill
    then speculative rounds of ``depth``; and the mean accepted drafts of a row's first round."""
    counts = torch.zeros(16, 16, 16)
    first_round: list[int] = []
    rows = 100
    batch = RowBatch(BatchedLlama(model, rows=rows), capacity=32, drafter=drafter, boundaries=SPEC3.boundaries)
    for start in range(0, n, rows):
        firsts = batch.admit([RowRequest(prompt, 3, params, seed=start + j) for j in range(rows)])
        tokens = {t.row: list(t.tokens) for t in firsts}
        rounds = 0
        while batch.busy:
            rounds += 1
            for t in batch.speculate(depth):
                if rounds == 1:
                    first_round.append(t.accepted)
                tokens[t.row] += t.tokens
                if t.finished:
                    batch.release(t.row)
        for row in tokens.values():
            a, b, c = row
            counts[a, b, c] += 1
    return counts, sum(first_round) / len(first_round)


def first_three_statistic(small_vocab, params: SamplingParams, draft) -> tuple[float, int, float, float]:
    """Pearson's statistic of the first three tokens of 800 rows decoded by rounds of ``draft`` (a
    depth or a TreeSpec) against the target's exact distribution: (statistic, degrees of freedom,
    the 0.1% critical value, the mean accepted drafts of a row's first round)."""
    model, drafter = small_vocab
    prompt = [3, 1, 4, 1, 5]
    exact = exact_first_three(model, prompt, params)
    counts, accepted = sample_first_three(model, drafter, prompt, params, 800, draft)
    stat, df = chi_square(counts, exact)
    return stat, df, wilson_hilferty_critical(df, Z_999), accepted


@pytest.mark.integration
@pytest.mark.parametrize("params,draft", [(SamplingParams(temperature=1.0), 2),
                                          (SamplingParams(temperature=0.7, top_p=0.9), 3),
                                          (SamplingParams(temperature=1.0), TreeSpec(3, 3, 8)),  # row_trees
                                          (SamplingParams(temperature=0.7, top_p=0.9), TreeSpec(2, 4, 6))],
                         ids=["chain-t1", "chain-top-p", "tree-t1", "tree-top-p"])
def test_sampled_rounds_follow_the_target_distribution(small_vocab, params, draft):
    stat, df, crit, accepted = first_three_statistic(small_vocab, params, draft)
    print(f"{params} {draft}: chi2 {stat:.1f} on {df} df (critical {crit:.1f}); accepted {accepted:.2f}")
    assert 0.3 < accepted < 1.7  # drafts accepted and rejected: every branch of the rule runs
    assert df >= 15 and stat < crit


@pytest.mark.integration
def test_a_rule_that_accepts_every_draft_fails_the_same_test(small_vocab, monkeypatch):
    """The test has the power to see a wrong rule: accepting every sampled draft (q = 0 makes
    u * q < p always true) gives the drafter's distribution, not the target's."""
    real = row_speculation.accept_chain
    monkeypatch.setattr(row_speculation, "accept_chain",
                        lambda st, n, drafts, q, logits, mode: real(st, n, drafts, torch.zeros_like(q), logits, mode))
    stat, _, crit, _ = first_three_statistic(small_vocab, SamplingParams(temperature=1.0), 2)
    assert stat > crit
