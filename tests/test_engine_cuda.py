"""The engine on a GPU (skipped without CUDA): the same greedy identity and sampling losslessness as
test_engine.py, with the target and drafter on CUDA and the random generator on the CPU; a bf16
target with a float32 drafter runs end to end."""

from __future__ import annotations

import copy

import pytest
import torch

from eyas.engine import HFTarget, SamplingParams, TreeSpec, plain_generate, speculative_generate
from eyas.engine.llama import LlamaTarget
from tests.support.lossless import (
    SPEC3, Z_999, chi_square, exact_first_three, make_small_vocab, wilson_hilferty_critical,
)
from tests.support.tiny import SPEC4, random_prompts

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.integration]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def llama_and_drafter(llama, trained_drafter):
    return llama.to(CUDA), trained_drafter.to(CUDA)  # this module's own instances (module scope)


def test_greedy_identity_on_cuda(llama_and_drafter):
    model, drafter = llama_and_drafter
    target = HFTarget(model, SPEC4)
    taus = []
    for prompt in random_prompts(8, 128, seed=7):
        ids = torch.tensor([prompt], device=CUDA)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert plain_generate(target, prompt, max_new_tokens=20).tokens == ref
        for tree in (TreeSpec.chain(4), TreeSpec(4, 4, 16), TreeSpec(5, 3, None)):
            r = speculative_generate(target, drafter, prompt, tree=tree, max_new_tokens=20)
            assert r.tokens == ref, (prompt, tree)
            taus.append(r.stats.tau)
    assert sum(taus) / len(taus) > 1.3


def test_bf16_target_with_float32_drafter_runs(llama_and_drafter):
    model, drafter = llama_and_drafter
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    target = HFTarget(bf16, SPEC4)
    g = torch.Generator().manual_seed(0)  # a CPU generator with a CUDA model
    for sampling in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=20)):
        r = speculative_generate(target, drafter, [5, 6, 7, 8], tree=TreeSpec(4, 4, 16), sampling=sampling,
                                 max_new_tokens=32, generator=g)
        assert len(r.tokens) == 32 and r.stats.stop_reason == "max_new_tokens"
        assert r.stats.time_verify > 0 and r.stats.time_draft > 0


@pytest.mark.parametrize("kind,drafts,params", [
    ("hf", "gumbel", SamplingParams(temperature=1.0)), ("hf", "top-k", SamplingParams(temperature=1.0)),
    ("fast", "top-k", SamplingParams(temperature=1.0)), ("fast", "top-k", SamplingParams(temperature=0.7, top_p=0.9)),
    ("fast", "gumbel", SamplingParams(temperature=1.0))])
def test_sampling_is_lossless_on_cuda(kind, drafts, params):
    """Also on the fast target, whose rounds run pipelined through captured (and compiled) drafts and
    acceptance, the temperature an input of the graph."""
    model, drafter = make_small_vocab()
    prompt = [3, 1, 4, 1, 5]
    exact = exact_first_three(model, prompt, params)  # on the CPU copy
    model, drafter = model.to(CUDA), drafter.to(CUDA)
    target = HFTarget(model, SPEC3) if kind == "hf" else LlamaTarget(model, SPEC3, cuda_graphs=True)
    g = torch.Generator(device=CUDA).manual_seed(0)  # and a CUDA generator
    counts = torch.zeros(16, 16, 16)
    for _ in range(1200):
        a, b, c = speculative_generate(target, drafter, prompt, tree=TreeSpec(2, 3, 6), sampling=params,
                                       max_new_tokens=4, generator=g, sampled_drafts=drafts).tokens[:3]
        counts[a, b, c] += 1
    stat, df = chi_square(counts, exact)
    assert df >= 15 and stat < wilson_hilferty_critical(df, Z_999)


# ---------------------------------------------------------------------------------------------
# The fast path on the GPU: LlamaTarget with fixed shapes and CUDA graphs, the drafter's graphs
# ---------------------------------------------------------------------------------------------


def test_fast_target_matches_the_hf_model_in_bf16_on_cuda(llama_and_drafter):
    model, _ = llama_and_drafter
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    fast, hf = LlamaTarget(bf16, SPEC4, max_length=128, cuda_graphs=True), HFTarget(bf16, SPEC4, max_length=128)
    prompt = torch.tensor([[5, 17, 99, 3, 42, 8, 1, 2, 3, 4]], device=CUDA)
    tokens = torch.tensor([[60, 11, 12, 13, 14]], device=CUDA)
    parents = [-1, 0, 0, 1, 2]
    mask = torch.eye(5, dtype=torch.bool, device=CUDA)
    for i in range(1, 5):
        mask[i] |= mask[parents[i]]
    pos = 10 + torch.tensor([[0, 1, 1, 2, 2]], device=CUDA)
    # one pair at a time: a forward's outputs are valid until the next forward (Target.forward)
    for pair in (lambda: (fast.prefill(prompt), hf.prefill(prompt)),
                 lambda: (fast.forward(tokens, pos, mask), hf.forward(tokens, pos, mask))):
        a, b = pair()
        for x, y in zip(a, b):
            rms = y.float().pow(2).mean().sqrt()
            assert (x.float() - y.float()).abs().max() <= 0.05 * rms  # bf16: a few ulps of the RMS


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("matvec,attention", [("gemm", "eager"), ("reduce", "eager"), ("gemm", "split-kv"),
                                              ("triton", "split-kv"), ("triton-verify", "split-kv")])
def test_greedy_fast_path_with_graphs_is_token_identical_to_plain_in_float32(llama_and_drafter, matvec, attention):
    """Also when plain decoding's one-token steps multiply by reductions (matvec="reduce") while
    verification's steps multiply by GEMMs: float32 sums in another order, the same tokens; and
    with the one-token steps attending through the split-KV kernels (with cuBLAS, or with our
    Triton products: matvec="triton"; and verification and the drafter through them too:
    "triton-verify")."""
    model, drafter = llama_and_drafter
    fast = LlamaTarget(model, SPEC4, cuda_graphs=True, matvec=matvec, attention=attention)
    assert "cuda-graphs" in fast.implementation
    accepted = 0
    for prompt in random_prompts(6, 128, seed=3):
        plain = plain_generate(fast, prompt, max_new_tokens=24).tokens
        hf = plain_generate(HFTarget(model, SPEC4), prompt, max_new_tokens=24).tokens
        assert plain == hf, f"fast plain parts from HF plain at token {_first_difference(plain, hf)}"
        for tree in (TreeSpec.chain(4), TreeSpec(4, 4, 16), TreeSpec(5, 8, 32)):
            r = speculative_generate(fast, drafter, prompt, tree=tree, max_new_tokens=24)
            assert r.tokens == plain, f"{tree}: speculative parts from plain at token {_first_difference(r.tokens, plain)}"
            accepted += sum(r.stats.accept_lengths) - len(r.stats.accept_lengths)
    assert accepted > 10


@pytest.mark.parametrize("sampling,drafts", [(SamplingParams(), "top-k"), (SamplingParams(temperature=1.0), "top-k"),
                                             (SamplingParams(temperature=1.0), "gumbel")],
                         ids=["greedy", "sampling-top-k", "sampling-gumbel"])
def test_a_fast_round_synchronises_the_device_once(llama_and_drafter, sampling, drafts, monkeypatch):
    """CUDA's sync debug mode flags every synchronising call (a read of a value, a blocking copy), and
    the host's waits on an event are counted: one per round, the wait for the verdict's transfer
    (a copy into pinned memory behind an event, which the debug mode does not flag), and nothing
    else (issue 10's bars: 2 greedy, 3 sampling)."""
    import warnings

    from eyas.engine.speculative import start, step

    model, drafter = llama_and_drafter
    fast = LlamaTarget(model, SPEC4, cuda_graphs=True)
    prompt, tree = [7, 8, 9, 10], TreeSpec(4, 4, 16)
    # warm-up: the same request once, so every shape it meets (the verification buckets, the drafts
    # of each depth near the end) is captured; a capture synchronises, once per shape
    speculative_generate(fast, drafter, prompt, tree=tree, sampling=sampling, max_new_tokens=40,
                         generator=torch.Generator(device=CUDA).manual_seed(0), sampled_drafts=drafts)
    session = start(fast, prompt, drafter, tree=tree, sampling=sampling, max_new_tokens=40,
                    generator=torch.Generator(device=CUDA).manual_seed(0), timing="off", sampled_drafts=drafts)
    waits: list[str] = []
    event_wait = torch.cuda.Event.synchronize

    def counted_wait(event):
        waits.append("Event.synchronize")
        return event_wait(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted_wait)
    counts = []
    # Switched on once, outside the rounds: the switch itself is reported as a synchronising call
    # (from set_sync_debug_mode, the first time), which is not the engine's.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")
    try:
        while not session.done:
            waits.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step(session)
            syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)] + waits
            counts.append(len(syncs))
            assert len(syncs) <= 1, (counts, syncs)
        with warnings.catch_warnings(record=True) as caught:  # the mode was on: a read of a value is flagged
            warnings.simplefilter("always")
            torch.ones(1, device=CUDA).item()
        assert any("synchroniz" in str(w.message) for w in caught)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts and max(counts) == 1  # the verdict's transfer is waited for


def test_a_draft_state_warmed_when_built_captures_nothing_in_a_request(llama_and_drafter):
    """DraftState.warm on a GPU: the state built for a target with CUDA graphs has captured the extend,
    the draft of every depth and the re-read before any request, so a request makes no new draft
    function (compiling one took seconds, in the request's last rounds). The first request adds only
    the graphs that read the round's buffers in place (the re-read on the acceptance's outputs, the
    draft on the re-read's: graphs.StepGraphs); a second request captures nothing. Both serve plain
    decoding's tokens."""
    from eyas.engine.speculative import _draft_state

    model, drafter = llama_and_drafter
    fast = LlamaTarget(model, SPEC4, cuda_graphs=True)
    tree = TreeSpec(4, 4, 16)
    state = _draft_state(fast, drafter, tree, 64)
    graphs = [*state._drafts.values(), state._extend_step, state._reread]

    def captured() -> int:
        return sum(len(g.graphs) for g in graphs)

    before = captured()
    assert before >= tree.depth + 2  # a draft per depth, the extend, the re-read
    prompt = random_prompts(1, 128, seed=11)[0]
    r = speculative_generate(fast, drafter, prompt, tree=tree, max_new_tokens=40)
    first = captured()
    assert first > before and len(state._drafts) == tree.depth  # graphs reading in place; no new function
    again = speculative_generate(fast, drafter, prompt, tree=tree, max_new_tokens=40)
    assert captured() == first
    assert r.tokens == again.tokens == plain_generate(fast, prompt, max_new_tokens=40).tokens
