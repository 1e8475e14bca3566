"""eyas.engine.continuous: a running batch that requests join and leave at every step gives each
greedy request exactly its answer alone (HF ``generate`` in float32), whatever joins beside it and
whenever; a resumed request continues where it stood; a sampled row draws from its own seed only;
a released row stops at once; bad requests are refused with the field named."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.batched import BatchedLlama
from eyas.engine.continuous import RowBatch, RowRequest, step_mode
from eyas.engine.errors import RequestError
from eyas.engine.sampling import SamplingParams
from tests.support.tiny import random_prompts, tiny_model
from tests.test_batched import hf_greedy

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]

HOT = SamplingParams(temperature=1.0)


def drive(batch: RowBatch, arrivals: dict[int, list[RowRequest]], stop_after: int = 200) -> dict[int, list[int]]:
    """Run ``batch``: at step s the requests ``arrivals[s]`` arrive and wait for a free row; a row
    is released when the device finishes it. Returns each request's tokens by arrival order."""
    owner: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    waiting: list[RowRequest] = []
    n = 0
    for s in range(stop_after):
        waiting += arrivals.get(s, [])
        while waiting and batch.free:
            (got,) = batch.admit([waiting.pop(0)])
            owner[got.row], tokens[n] = n, list(got.tokens)
            n += 1
            if got.finished:
                batch.release(got.row)
        for t in batch.step():
            tokens[owner[t.row]] += t.tokens
            if t.finished:
                batch.release(t.row)
        if not batch.busy and not waiting and s > max(arrivals):
            break
    return tokens


def test_requests_joining_at_any_step_get_their_answer_alone():
    model = tiny_model("llama", 3)
    prompts = random_prompts(7, 128, seed=11, lengths=(1, 20))
    want = [hf_greedy(model, p, 9, None)[0] for p in prompts]
    batch = RowBatch(BatchedLlama(model, rows=3), capacity=64)
    arrivals = {0: [RowRequest(prompts[0], 9)], 2: [RowRequest(prompts[1], 9), RowRequest(prompts[2], 9)],
                5: [RowRequest(prompts[3], 9)], 11: [RowRequest(prompts[4], 9)], 12: [RowRequest(prompts[5], 9)],
                20: [RowRequest(prompts[6], 9)]}
    got = drive(batch, arrivals)
    assert [got[i] for i in range(7)] == want
    assert batch.busy == [] and not batch.engine.state.active.any()


def test_a_resumed_request_continues_exactly_where_it_stood():
    model = tiny_model("qwen2", 3)
    prompt = random_prompts(1, 128, seed=3, lengths=(6, 6))[0]
    want = hf_greedy(model, prompt, 12, None)[0]
    batch = RowBatch(BatchedLlama(model, rows=2), capacity=64)
    k = 5  # the request emitted want[:k] elsewhere (speculatively, alone); it joins the batch now
    other = random_prompts(1, 128, seed=4, lengths=(3, 3))[0]
    first = batch.admit([RowRequest(other, 12), RowRequest(prompt + want[:k - 1], 12, next_token=want[k - 1],
                                                           generated=k)])
    assert [t.row for t in first] == [0]  # the resumed row emits nothing at admission
    rest: list[int] = []
    for _ in range(12 - k):
        rest += [t.tokens[0] for t in batch.step() if t.row == 1]
    assert want[:k] + rest == want
    assert batch.engine.state.active[1].item() is False  # its limit (12 tokens in all) ended it


def test_a_sampled_row_draws_from_its_seed_alone_and_greedy_rows_beside_it_keep_their_answers():
    model = tiny_model("llama", 2)
    prompts = random_prompts(3, 128, seed=8, lengths=(4, 9))
    want = hf_greedy(model, prompts[0], 8, None)[0]

    def sampled(neighbours: list[RowRequest]) -> tuple[list[int], list[int]]:
        batch = RowBatch(BatchedLlama(model, rows=3), capacity=32)
        got = drive(batch, {0: [RowRequest(prompts[1], 8, HOT, seed=5), RowRequest(prompts[0], 8), *neighbours]})
        return got[0], got[1]

    alone, greedy_beside = sampled([])
    crowded, greedy_crowded = sampled([RowRequest(prompts[2], 8, SamplingParams(temperature=0.7, top_p=0.8), seed=9)])
    assert alone == crowded  # the draws depend on the row's seed and its logits only
    assert greedy_beside == greedy_crowded == want  # a greedy row in a sampled (top_p) step: the argmax
    batch = RowBatch(BatchedLlama(model, rows=3), capacity=32)
    other_seed = drive(batch, {0: [RowRequest(prompts[1], 8, HOT, seed=6)]})[0]
    assert other_seed != alone


def test_a_released_row_stops_at_once_and_its_row_is_reused():
    model = tiny_model("llama", 2)
    prompts = random_prompts(3, 128, seed=2, lengths=(3, 8))
    batch = RowBatch(BatchedLlama(model, rows=2), capacity=64)
    a, b = batch.admit([RowRequest(prompts[0], 40), RowRequest(prompts[1], 40)])
    batch.step()
    batch.release(a.row)
    assert batch.free == [a.row] and [t.row for t in batch.step()] == [b.row]
    (c,) = batch.admit([RowRequest(prompts[2], 6)])
    assert c.row == a.row
    tokens = list(c.tokens)
    while True:
        mine = [t for t in batch.step() if t.row == c.row]
        tokens += mine[0].tokens
        if mine[0].finished:
            break
    assert tokens == hf_greedy(model, prompts[2], 6, None)[0]


def test_bad_requests_are_refused_with_the_field_named_and_modes_follow_the_rows():
    batch = RowBatch(BatchedLlama(tiny_model("llama", 2), rows=1), capacity=16)
    with pytest.raises(RequestError, match="prompt: expected at least one token"):
        batch.admit([RowRequest([], 4)])
    with pytest.raises(RequestError, match=r"token ids must be in \[0, 128\), found \[1, 500\]"):
        batch.admit([RowRequest([1, 500], 4)])
    with pytest.raises(RequestError, match="max_new_tokens: 10 .* after 8 prompt tokens: a row holds 16 positions"):
        batch.admit([RowRequest([1] * 8, 10)])
    with pytest.raises(RequestError, match="top_k"):
        batch.admit([RowRequest([1], 4, SamplingParams(temperature=1.0, top_k=5))])
    batch.admit([RowRequest([1, 2], 4)])
    with pytest.raises(RequestError, match="admit: 1 requests, 0 free rows"):
        batch.admit([RowRequest([1], 4)])
    assert step_mode([SamplingParams()]) == "greedy" and step_mode([SamplingParams(), HOT]) == "sample"
    assert step_mode([HOT, SamplingParams(temperature=0.5, top_p=0.9)]) == "top_p"
    assert step_mode([SamplingParams(top_p=0.5)]) == "greedy"  # top_p without a temperature: greedy
    assert torch.equal(batch.engine.state.active, torch.tensor([True]))


def test_a_step_covers_the_rows_up_to_the_highest_busy_one_and_leaves_the_others_alone():
    model = tiny_model("llama", 2)
    prompts = random_prompts(3, 128, seed=21, lengths=(3, 7))
    engine = BatchedLlama(model, rows=8)
    batch = RowBatch(engine, capacity=64)
    assert batch.row_buckets == [1, 2, 4, 8]
    assert RowBatch(BatchedLlama(model, rows=8), capacity=64, row_buckets=[8]).row_buckets == [8]
    covered: list[int] = []
    step = engine.decode_step
    engine.decode_step = lambda K, mode, n=None: covered.append(n) or step(K, mode, n)
    a, b, c = batch.admit([RowRequest(p, 6) for p in prompts])
    tokens = {t.row: list(t.tokens) for t in (a, b, c)}
    batch.release(b.row)  # rows 0 and 2 busy: the step covers 4 rows
    ids_before = engine.state.ids[3:].clone()
    for t in batch.step():
        tokens[t.row] += t.tokens
    batch.release(c.row)  # row 0 alone: 1 row
    for _ in range(4):
        for t in batch.step():
            tokens[t.row] += t.tokens
    assert covered == [4, 1, 1, 1, 1]
    assert torch.equal(engine.state.ids[3:], ids_before)  # rows past the step's are untouched
    assert tokens[a.row] == hf_greedy(model, prompts[0], 6, None)[0]


def test_a_step_prepared_while_idle_changes_nothing_and_is_not_compiled_again():
    """A server prepares its batch's step shapes while idle (BatchedLlama.prepare over
    RowBatch.step_shapes): each is compiled once, the rows' state is left as it was, and the
    requests then served get their answers alone, their steps compiling nothing more."""
    model = tiny_model("llama", 2)
    prompts = random_prompts(3, 128, seed=5, lengths=(3, 12))
    want = [hf_greedy(model, p, 9, None)[0] for p in prompts]
    batch = RowBatch(BatchedLlama(model, rows=4, compile=True, backend="aot_eager", key_buckets=[16]), capacity=40,
                     row_buckets=[2, 4])
    eng, st = batch.engine, batch.engine.state
    shapes = batch.step_shapes(24, modes=("greedy",))
    assert shapes == [(16, "greedy", 2), (16, "greedy", 4), (eng.capacity, "greedy", 2), (eng.capacity, "greedy", 4)]
    before = [t.clone() for t in (st.ids, st.pos, st.active, st.n_gen, st.out)]
    assert [eng.prepare(*shape) for shape in shapes] == [True] * 4
    assert [eng.prepare(*shape) for shape in shapes] == [False] * 4  # once each
    assert all(torch.equal(a, b) for a, b in zip(before, (st.ids, st.pos, st.active, st.n_gen, st.out)))
    compiled = eng.compile_s
    got = drive(batch, {0: [RowRequest(p, 9) for p in prompts]})
    assert [got[i] for i in range(3)] == want
    assert eng.compile_s == compiled  # every step's shape was prepared
    assert not BatchedLlama(model, rows=2).prepare(16, "greedy")  # nothing compiled: nothing to prepare


def test_a_shape_not_compiled_yet_is_stood_in_for_until_its_rent_reaches_its_compilation():
    """Right after a start, a step whose shape is not compiled runs as a prepared step with more keys,
    rows and a wider mode (greedy rows take the argmax in a sampled step): the same answers, no
    compilation. Once the steps run in its place have cost what compiling it did on average, the
    shape itself is compiled and run (rent or buy)."""
    model = tiny_model("llama", 2)
    prompts = random_prompts(3, 128, seed=6, lengths=(3, 10))
    want = [hf_greedy(model, p, 9, None)[0] for p in prompts]
    eng = BatchedLlama(model, rows=4, compile=True, backend="aot_eager", key_buckets=[16])
    batch = RowBatch(eng, capacity=40, row_buckets=[2, 4])
    wide = (eng.capacity, "sample", 4)
    assert eng.cover(16, "greedy", 2) is None and eng.compile_per_shape_s is None
    assert eng.prepare(*wide) and eng.cover(16, "greedy", 2) == wide and eng.cover(16, "top_p", 2) is None
    compiled = eng.compile_s
    got = drive(batch, {0: [RowRequest(p, 9) for p in prompts]})
    assert [got[i] for i in range(3)] == want
    assert eng.compile_s == compiled and not eng.prepared(16, "greedy", 4)  # stood in for, not compiled
    assert batch.rent and all(s > 0 for s in batch.rent.values())
    shape = (16, "greedy", 4)
    batch.rent[shape] = eng.compile_per_shape_s  # its rent has reached its price: the next step compiles it
    got = drive(batch, {0: [RowRequest(p, 9) for p in prompts]})
    assert [got[i] for i in range(3)] == want and eng.prepared(*shape) and eng.compile_s > compiled
