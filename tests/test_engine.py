"""The serving engine: greedy speculative decoding is token-identical to plain greedy decoding and to
HF ``generate``; speculative sampling has exactly the target's distribution (and a broken acceptance
rule is caught by the same test); edge cases (all drafts rejected, draft vocabulary missing the
target's token, the context limit, stop conditions).

Everything runs on CPU in float32 with tiny random targets. Drafters that are "partially right" are
trained here for a few seconds with the training code's own TTT step (eyas.drafter.ttt).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from eyas.capture import BoundaryCapture
from eyas.drafter.build import new_drafter
from eyas.engine import (
    HFTarget, SamplingParams, TreeSpec, plain_generate, rejection_rule, speculative_generate,
)
from eyas.engine.draft_state import DraftState
from tests.support.lossless import (
    SPEC3, Z_999, chi_square, exact_first_three, make_small_vocab, wilson_hilferty_critical,
)
from tests.support.tiny import SPEC4, random_prompts, sharpened, tiny_model, ttt_accepts

pytestmark = pytest.mark.usefixtures("one_thread")
TREES = [TreeSpec.chain(1), TreeSpec.chain(4), TreeSpec(3, 2, 6), TreeSpec(4, 4, 16), TreeSpec(5, 3, None)]


def hf_greedy(model, prompt: list[int], max_new_tokens: int | None, eos: int | None, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    if max_new_tokens is not None:
        kw["max_new_tokens"] = max_new_tokens
    # an explicit attention mask: without it generate masks every prompt token equal to pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=eos, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------------------------------------
# Fixtures: the tiny Llama (vocab 128) and trained drafter of conftest.py, and an untrained drafter
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def untrained_drafter(llama):
    return new_drafter(llama, boundaries=SPEC4.boundaries)[0].eval()


# ---------------------------------------------------------------------------------------------
# The target: tree masks are honoured, keep() compacts the cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_matches_causal_forward_of_each_path_and_keep_compacts(attn):
    model = tiny_model("llama", 4)
    model.set_attn_implementation(attn)
    target = HFTarget(model, SPEC4)
    prompt = [5, 17, 99, 3, 42, 8]
    #        node: 0   1   2   3   4   5   6      (0 = root, the last committed token)
    tokens = [60, 11, 12, 13, 14, 15, 16]
    parents = [-1, 0, 0, 1, 1, 2, 4]
    depth = [0, 1, 1, 2, 2, 2, 3]
    anc = torch.eye(7, dtype=torch.bool)
    for i in range(1, 7):
        anc[i] |= anc[parents[i]]
    target.prefill(torch.tensor([prompt]))
    n = len(prompt)
    logits, feats = target.forward(torch.tensor([tokens]), torch.tensor([[n + d for d in depth]]), anc)
    assert target.cache_len == n + 7

    def path_to(i):
        p = []
        while i >= 0:
            p.append(i)
            i = parents[i]
        return p[::-1]

    with torch.no_grad():
        for i in range(7):
            seq = prompt + [tokens[j] for j in path_to(i)]
            with BoundaryCapture(model, SPEC4) as cap:
                ref = model(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(logits[0, i], ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(feats[0, i], cap.features()[0, -1], atol=1e-4, rtol=1e-4)

        # keep a non-contiguous path (root, node 1, node 4, node 6), then continue from it
        target.keep([0, 1, 4, 6])
        assert target.cache_len == n + 4
        seq = prompt + [tokens[j] for j in (0, 1, 4, 6)]
        logits, _ = target.forward(torch.tensor([[77]]), torch.tensor([[len(seq)]]))
        ref = model(torch.tensor([seq + [77]])).logits[0, -1]
        torch.testing.assert_close(logits[0, 0], ref, atol=1e-4, rtol=1e-4)
        with pytest.raises(IndexError):
            target.keep([1])


# ---------------------------------------------------------------------------------------------
# Greedy: token-identical to plain greedy decoding and to HF generate
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_greedy_speculative_is_token_identical_to_plain_and_hf(llama, which, request):
    drafter = request.getfixturevalue(f"{which}_drafter")
    target = HFTarget(llama, SPEC4)
    eos = llama.generation_config.eos_token_id  # 2: some outputs stop early, exercising EOS
    taus, stop_reasons = [], set()
    # the untrained drafter is almost always rejected: fewer prompts exercise that path enough
    for prompt in random_prompts(10 if which == "trained" else 5, 128, seed=7):
        plain = plain_generate(target, prompt, max_new_tokens=20, eos_token_ids=[eos])
        assert plain.tokens == hf_greedy(llama, prompt, 20, eos)
        assert plain.stats.tau == 1.0
        for tree in TREES:
            spec = speculative_generate(target, drafter, prompt, tree=tree, max_new_tokens=20, eos_token_ids=[eos])
            assert spec.tokens == plain.tokens, (prompt, tree)
            s = spec.stats
            assert s.stop_reason == plain.stats.stop_reason
            assert s.new_tokens == len(spec.tokens) and s.rounds == 1 + len(s.accept_lengths)
            assert sum(s.accept_lengths) + 1 == s.new_tokens
            assert all(a <= d for a, d in zip(s.accepted_at_depth, s.drafted_at_depth))
            taus.append(s.tau)
            stop_reasons.add(s.stop_reason)
    mean_tau = sum(taus) / len(taus)
    print(f"{which} drafter: mean tau {mean_tau:.2f} over {len(taus)} generations, stops {stop_reasons}")
    if which == "trained":
        assert mean_tau > 1.3
        assert max(taus) > 2.0


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["qwen3"])
def test_greedy_identity_on_another_architecture(kind):
    model = tiny_model(kind, 4)
    drafter = new_drafter(model, boundaries=SPEC4.boundaries)[0].eval()
    target = HFTarget(model, SPEC4)
    for prompt in random_prompts(4, 128, seed=3):
        ref = hf_greedy(model, prompt, 16, None)
        for tree in (TreeSpec.chain(3), TreeSpec(3, 3, 8)):
            assert speculative_generate(target, drafter, prompt, tree=tree, max_new_tokens=16).tokens == ref


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(5,), (32,), (33,), (49152,), (3, 1000), (16, 49152), (2, 3, 1025)])
def test_the_chunked_scan_is_the_cumulative_sum(shape):
    """cumsum_last (scans of at most 32 elements, which inductor compiles without splitting them)
    equals torch.cumsum in float64 up to summation order, for lengths below, at and past a chunk,
    padded ones and the vocabulary's; and in float32 to a few units in the last place."""
    from eyas.engine.sampling import SCAN_CHUNK, cumsum_last

    assert SCAN_CHUNK == 32
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert cumsum_last(x).shape == x.shape
    assert torch.allclose(cumsum_last(x), x.cumsum(-1), rtol=1e-12, atol=1e-12)
    p = torch.softmax(x.float() * 8, dim=-1)  # a distribution: the cumulative mass ends at 1
    assert (cumsum_last(p).double() - p.double().cumsum(-1)).abs().max() < 1e-6


@pytest.mark.unit
def test_a_counter_stream_draws_the_same_again_and_fresh_numbers_per_position_tag_and_key():
    """A sampled round's draws are a hash of (key, committed length, tag, index): the same arguments
    give the same numbers (a round drafted ahead draws what it would in turn), any other position,
    tag or key gives uncorrelated uniform ones."""
    from eyas.engine.sampling import CounterStream, uniform

    cpu = torch.device("cpu")
    stream = CounterStream.from_generator(torch.Generator().manual_seed(0), cpu)
    assert torch.equal(stream.key, CounterStream.from_generator(torch.Generator().manual_seed(0), cpu).key)
    at = lambda s, m: s.at(torch.tensor(m))  # noqa: E731
    u = at(stream, 5).uniform((64, 100), tag=1)
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    assert torch.equal(u, at(stream, 5).uniform((64, 100), tag=1))
    assert torch.equal(u, uniform((64, 100), at(stream, 5), cpu, tag=1))  # what the draws call
    assert abs(u.mean().item() - 0.5) < 0.01
    assert ((torch.histc(u, bins=10, min=0, max=1) / u.numel()) - 0.1).abs().max() < 0.01
    other_key = CounterStream.from_generator(torch.Generator().manual_seed(1), cpu)
    for v in (at(stream, 6).uniform((64, 100), 1), at(stream, 5).uniform((64, 100), 2),
              at(other_key, 5).uniform((64, 100), 1)):
        assert abs(torch.corrcoef(torch.stack([u.flatten(), v.flatten()]))[0, 1]) < 0.04


@pytest.mark.integration
def test_drafts_that_are_always_rejected_still_give_one_correct_token_per_round(llama):
    """The draft vocabulary excludes every token the target will produce: nothing can match."""
    target = HFTarget(llama, SPEC4)
    prompt = [3, 14, 15, 92, 65]
    plain = plain_generate(target, prompt, max_new_tokens=20)
    excluded = set(plain.tokens)
    draft_ids = torch.tensor([t for t in range(128) if t not in excluded][:64])
    drafter = new_drafter(llama, boundaries=SPEC4.boundaries, draft_vocab_size=64)[0].eval()
    drafter.set_vocab_map(draft_ids)
    for tree in (TreeSpec.chain(3), TreeSpec(4, 4, 12)):
        spec = speculative_generate(target, drafter, prompt, tree=tree, max_new_tokens=20)
        assert spec.tokens == plain.tokens
        assert spec.stats.accept_lengths == [1] * 19 and spec.stats.rounds == 20 == spec.stats.new_tokens
        assert not any(spec.stats.accepted_at_depth) and len(spec.stats.accepted_at_depth) <= tree.depth


@pytest.mark.integration
def test_draft_vocab_missing_the_targets_token_is_handled(llama, trained_drafter):
    """The trained drafter cut down to the even token ids: an odd target token can only come from
    the target (the bonus token), even ones are still drafted and accepted."""
    target = HFTarget(llama, SPEC4)
    drafter = new_drafter(llama, boundaries=SPEC4.boundaries, draft_vocab_size=64)[0].eval()
    state = trained_drafter.state_dict()
    state["lm_head.weight"] = state["lm_head.weight"][0::2]
    drafter.load_state_dict({k: v for k, v in state.items() if k not in ("d2t", "t2d")}, strict=False)
    drafter.set_vocab_map(torch.arange(0, 128, 2))
    odd, accepted = 0, 0
    for prompt in random_prompts(6, 128, seed=11):
        plain = plain_generate(target, prompt, max_new_tokens=16)
        odd += sum(t % 2 for t in plain.tokens)
        for tree in (TreeSpec.chain(3), TreeSpec(3, 4, 10)):
            spec = speculative_generate(target, drafter, prompt, tree=tree, max_new_tokens=16)
            assert spec.tokens == plain.tokens
            accepted += sum(spec.stats.accepted_at_depth)
    assert odd > 5 and accepted > 5  # both paths really happen


@pytest.mark.integration
def test_prompts_near_the_context_limit_end_cleanly(trained_drafter):
    model = tiny_model("llama", 4)  # same weights as the `llama` fixture's model
    sharpened(model, 8.0)
    model.config.max_position_embeddings = 40
    target = HFTarget(model, SPEC4)
    assert target.max_length == 40
    for n in (30, 36, 38, 39, 40):
        prompt = random_prompts(1, 128, seed=n, lengths=(n, n))[0]
        plain = plain_generate(target, prompt, max_new_tokens=50)
        assert n + len(plain.tokens) == 40 and plain.stats.stop_reason == "max_length"
        if n < 40:
            assert plain.tokens == hf_greedy(model, prompt, None, None, max_length=40)
        for tree in (TreeSpec.chain(6), TreeSpec(6, 3, 12)):
            spec = speculative_generate(target, trained_drafter, prompt, tree=tree, max_new_tokens=50)
            assert spec.tokens == plain.tokens and spec.stats.stop_reason == "max_length"
    # max_new_tokens reached exactly at the context limit is reported as max_new_tokens
    prompt = random_prompts(1, 128, seed=5, lengths=(30, 30))[0]
    assert speculative_generate(target, trained_drafter, prompt, max_new_tokens=10).stats.stop_reason == "max_new_tokens"
    with pytest.raises(ValueError, match="longer than the target's context"):
        speculative_generate(target, trained_drafter, list(range(41)), max_new_tokens=5)


@pytest.mark.integration
def test_stop_conditions_cut_a_round_and_stream_every_token(llama, trained_drafter):
    target = HFTarget(llama, SPEC4)
    prompt = [7, 7, 21, 3]
    plain = plain_generate(target, prompt, max_new_tokens=30).tokens
    tree = TreeSpec(4, 3, 12)
    # EOS = a token that first appears late in the output (mid-round for an accepting drafter)
    k = next(i for i in range(8, 30) if plain[i] not in plain[:i])
    streamed: list[int] = []
    r = speculative_generate(target, trained_drafter, prompt, tree=tree, max_new_tokens=30,
                             eos_token_ids=[plain[k]], on_token=streamed.append)
    assert r.tokens == streamed == plain[: k + 1] and r.stats.stop_reason == "eos"
    # a stop string spanning two tokens, with a toy decode
    decode = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731
    j = next(i for i in range(6, 29) if decode(plain[i:i + 2]) not in decode(plain[: i + 1]))
    r = speculative_generate(target, trained_drafter, prompt, tree=tree, max_new_tokens=30,
                             stop_strings=[decode(plain[j:j + 2])], decode=decode)
    assert r.tokens == plain[: j + 2] and r.stats.stop_reason == "stop_string"
    assert plain_generate(target, prompt, max_new_tokens=30, stop_strings=[decode(plain[j:j + 2])],
                          decode=decode).tokens == r.tokens
    # max_new_tokens mid-round
    for m in (1, 2, 5, 13):
        r = speculative_generate(target, trained_drafter, prompt, tree=tree, max_new_tokens=m)
        assert r.tokens == plain[:m] and r.stats.stop_reason == "max_new_tokens"
    with pytest.raises(ValueError, match="decode"):
        speculative_generate(target, trained_drafter, prompt, stop_strings=["x"])


# ---------------------------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_tree_shapes(llama, trained_drafter):
    target = HFTarget(llama, SPEC4)
    prompt = [1, 2, 3, 4, 5]
    logits, f = target.prefill(torch.tensor([prompt]))
    x = prompt + [int(logits[0, -1].argmax())]
    for spec, sampling in itertools.product(
        [TreeSpec.chain(4), TreeSpec(3, 2, 5), TreeSpec(4, 4, 16), TreeSpec(5, 3, None), TreeSpec(2, 8, 100)],
        [SamplingParams(), SamplingParams(temperature=1.0)],
    ):
        state = DraftState(trained_drafter, 64)
        state.extend(x[1:], f[0])
        tree = state.draft(spec, spec.depth, sampling, torch.Generator().manual_seed(0), 128)
        N = tree.num_nodes - 1
        parents, depths, kids = tree.parents.tolist(), tree.depths.tolist(), tree.children.tolist()
        assert tree.tokens[0] == x[-1] and parents[0] == -1
        assert all(0 <= parents[i] < i for i in range(1, N + 1))
        assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, N + 1))
        assert N == spec.total_tokens  # the drafter's distributions have full support here
        assert bool(tree.valid.all())
        assert max(depths) <= tree.depth <= spec.depth
        for i, row in enumerate(kids):
            children = [c for c in row if c >= 0]
            assert row == children + [-1] * (len(row) - len(children))  # children first, then padding
            assert children == [c for c in range(1, N + 1) if parents[c] == i]  # in creation order
            assert len(children) <= spec.top_k
            assert len({int(tree.tokens[c]) for c in children}) == len(children)  # siblings are distinct tokens
        if spec.top_k == 1:
            assert parents == [-1] + list(range(N))  # a chain
        for i in range(N + 1):
            j, anc = i, set()
            while j >= 0:
                anc.add(j)
                j = parents[j]
            assert set(torch.nonzero(tree.mask[i]).flatten().tolist()) == anc
        if sampling.greedy:
            assert tree.proposals is None
        else:
            assert tree.proposals.shape == (N + 1, 128)
            has_children = tree.proposals.sum(-1) > 0
            for i, row in enumerate(kids):
                if row[0] >= 0:  # a node with children has its q, a distribution over the target vocabulary
                    assert has_children[i] and abs(float(tree.proposals[i].sum()) - 1) < 1e-5
    # depth 0: the root alone (the context leaves no room to draft)
    state = DraftState(trained_drafter, 64)
    state.extend(x[1:], f[0])
    assert state.draft(TreeSpec(4, 4, 16), 0, SamplingParams(), None, 128).num_nodes == 1
    root = state.draft(TreeSpec(4, 4, 16), 0, SamplingParams(temperature=1.0), None, 128)
    # sampling: the root's zero proposal row (a captured acceptance takes every tensor of the tree)
    assert root.num_nodes == 1 and torch.equal(root.proposals, torch.zeros(1, 128))
    assert TreeSpec.parse("6,10,60") == TreeSpec(6, 10, 60) and TreeSpec.parse("4") == TreeSpec.chain(4)
    with pytest.raises(ValueError):
        TreeSpec(0, 1, 1)


@pytest.mark.unit
def test_two_stage_top_k_equals_top_k_by_topk_and_by_sort():
    """The chunked top-k, by torch.topk or by stable sorts (a compiled draft's), equals torch.topk
    over the whole row; by_sort breaks ties by the lower index."""
    from eyas.engine.tree import by_sort, largest, top_k

    g = torch.Generator().manual_seed(0)
    for rows, V, k in ((1, 12288, 1), (10, 8192, 10), (4, 32000, 8), (3, 1500, 4), (2, 300, 5)):
        x = torch.randn(rows, V, generator=g)
        ref = x.topk(k, dim=-1)
        for select in (largest, by_sort):
            values, indices = top_k(x, k, select=select)
            assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)  # distinct values: same order
            assert torch.equal(x.gather(1, indices), values)
    values, indices = by_sort(torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0]]), 3)
    assert values.tolist() == [[3.0, 3.0, 2.0]] and indices.tolist() == [[1, 3, 4]]


# ---------------------------------------------------------------------------------------------
# Sampling is lossless
# ---------------------------------------------------------------------------------------------


def accept_if_likely_under_q(p, q, c):
    """BROKEN: accepts a draft the drafter is confident about, whatever the target thinks."""
    c = torch.as_tensor(c)
    accept = (q.gather(-1, c[..., None]).squeeze(-1) > 0.1).float()
    _, p_rejected, q_rejected = rejection_rule(p, q, c)
    return accept, p_rejected, q_rejected


def no_residual(p, q, c):
    """BROKEN: after a rejection keeps sampling from p instead of norm(max(p - q, 0))."""
    accept, _, q_rejected = rejection_rule(p, q, c)
    return accept, p, q_rejected


def exact_node_output(p, q, rule, k):
    """The exact distribution of the token leaving one node whose k children are drawn without
    replacement from q and verified in draw order with ``rule`` (enumerates every draw sequence)."""
    V = p.shape[0]
    out = torch.zeros(V, dtype=torch.float64)
    support = [t for t in range(V) if q[t] > 0]
    for seq in itertools.permutations(support, min(k, len(support))):
        # probability of drawing this ordered sequence without replacement
        w, left = 1.0, 1.0
        for t in seq:
            w *= float(q[t]) / left
            left -= float(q[t])
        pp, qq, reach = p.clone(), q.clone(), 1.0
        for t in seq:
            a, pp_r, qq_r = rule(pp, qq, t)
            out[t] += w * reach * float(a)
            reach *= 1 - float(a)
            pp, qq = pp_r, qq_r
        out += w * reach * pp.double()
    return out


@pytest.mark.unit
def test_rejection_rule_is_exactly_lossless_and_broken_rules_are_not():
    g = torch.Generator().manual_seed(0)
    for trial in range(6):
        V = 6
        p = torch.softmax(3 * torch.randn(V, generator=g), 0)
        q = torch.softmax(3 * torch.randn(V, generator=g), 0)
        if trial % 2:
            q[0] = 0  # a token outside the draft vocabulary
            p[0] += 0.2
            p, q = p / p.sum(), q / q.sum()
        for k in (1, 2, 3):  # a chain is k = 1
            out = exact_node_output(p, q, rejection_rule, k)
            torch.testing.assert_close(out, p.double(), atol=1e-6, rtol=0)
    p = torch.tensor([0.5, 0.3, 0.1, 0.1])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    for broken in (accept_if_likely_under_q, no_residual):
        assert (exact_node_output(p, q, broken, 2) - p.double()).abs().max() > 0.05


def top_k_node_counts(p_logits: torch.Tensor, children: list[int], params: SamplingParams, n: int,
                      rule=None) -> torch.Tensor:
    """Counts [V] of the token leaving one node (a root whose children are ``children``, in draft
    order) over n verifications by ``rule`` (default accept_top_k_drafts), each with fresh draws:
    the accepted child, else the bonus."""
    from eyas.engine.sampling import CounterStream, accept_top_k_drafts
    from eyas.engine.tree import DraftTree

    rule = rule or accept_top_k_drafts
    V, K = p_logits.shape[0], len(children)
    tokens = torch.tensor([0] + children)
    tree = DraftTree.from_parents(tokens, torch.tensor([-1] + [0] * K), 1, K)
    logits = torch.stack([p_logits] + [torch.zeros(V)] * K)  # [K+1, V]: only the root's row matters here
    stream = CounterStream(torch.tensor([12345]))
    counts = torch.zeros(V)
    args = (params.as_tensor(torch.device("cpu")), params.filters(V))
    for i in range(n):
        v = rule(tree, logits, *args, stream.at(torch.tensor(i)))
        counts[int(tokens[v.path[-1]]) if int(v.accepted) else int(v.bonus)] += 1
    return counts


def no_renormalising(tree, logits, params, filters, generator):
    """BROKEN: accepts child c_j with probability p(c_j), forgetting that its earlier siblings were
    rejected (its chance must be p(c_j) / (1 - the earlier siblings' mass))."""
    from eyas.engine import sampling

    p = sampling.filtered_probabilities(logits, params[0], params[1], params[2], *filters)
    kids = tree.children
    mass = p.gather(1, tree.tokens[kids.clamp(min=0)]) * (kids >= 0)
    u = sampling.uniform(tuple(kids.shape), generator, p.device, sampling.ACCEPT_TAG)
    take = (kids >= 0) & (u < mass)
    child = torch.where(take.any(-1), kids.gather(1, take.long().argmax(-1, keepdim=True)).squeeze(1), -1)
    path, a = sampling._follow(child, tree.depth)
    row = p[path[-1:]][0].clone()
    row[tree.tokens[kids[path[-1:]][0].clamp(min=0)]] = 0
    return sampling.Verdict(path, a, sampling.sample(row, generator, sampling.BONUS_TAG))


@pytest.mark.unit
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
                                    SamplingParams(temperature=1.0, top_k=4)])
def test_top_k_drafts_rule_leaves_each_node_with_the_target_distribution(params):
    """One node, three children in draft order (one outside top-p/top-k's support at times): the
    token that leaves it is distributed as p (chi-square), and the rule that forgets the earlier
    siblings' rejection is caught by the same test."""
    from eyas.engine.sampling import probabilities

    V = 8
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 1.2, -1.0])
    children = [1, 0, 6]
    p = probabilities(logits, params)
    counts = top_k_node_counts(logits, children, params, 3000)
    stat, df = chi_square(counts, p)
    crit = wilson_hilferty_critical(df, Z_999) if df >= 3 else 16.27  # chi2(3) at 0.999 below 3 df
    assert stat < crit, (stat, df, counts.tolist(), p.tolist())
    broken = top_k_node_counts(logits, children, params, 3000, rule=no_renormalising)
    assert chi_square(broken, p)[0] > crit


@pytest.fixture(scope="module")
def small_vocab():
    return make_small_vocab()


def sample_first_three(model, drafter, prompt, params, tree, rule, n, seed,
                       drafts: str = "gumbel") -> tuple[torch.Tensor, list[float]]:
    """Counts [16, 16, 16] of the first three new tokens over n speculative generations (sampled
    drafts as ``drafts``), and the mean number of accepted drafts per generation at depth 1 and 2."""
    target = HFTarget(model, SPEC3)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(16, 16, 16)
    accepted = [0, 0]
    for _ in range(n):
        # 4 new tokens: the first round may accept 2 drafts + a bonus, so x2 and x3 can both be drafts
        # (x1 always comes from the prefill)
        r = speculative_generate(target, drafter, prompt, tree=tree, sampling=params, max_new_tokens=4,
                                 generator=g, accept_rule=rule, sampled_drafts=drafts)
        a, b, c = r.tokens[:3]
        counts[a, b, c] += 1
        for d, k in enumerate(r.stats.accepted_at_depth[:2]):
            accepted[d] += k
    return counts, [a / n for a in accepted]


@pytest.mark.integration
@pytest.mark.parametrize("tree,params,n,drafts", [
    (TreeSpec(2, 3, 6), SamplingParams(temperature=1.0), 1200, "gumbel"),
    (TreeSpec.chain(2), SamplingParams(temperature=0.8, top_k=10, top_p=0.9), 800, "gumbel"),
    (TreeSpec(2, 3, 6), SamplingParams(temperature=1.0), 1200, "top-k"),
    (TreeSpec(2, 2, 4), SamplingParams(temperature=0.7), 1000, "top-k"),
    (TreeSpec.chain(2), SamplingParams(temperature=1.0, top_p=0.8), 800, "top-k"),
    (TreeSpec(2, 3, 6), SamplingParams(temperature=0.7, top_k=8, top_p=0.9), 800, "top-k"),
])
def test_speculative_sampling_matches_the_target_distribution(small_vocab, tree, params, n, drafts):
    model, drafter = small_vocab
    prompt = [3, 1, 4, 1, 5]
    exact = exact_first_three(model, prompt, params)
    counts, accepted = sample_first_three(model, drafter, prompt, params, tree, rejection_rule, n, seed=0,
                                          drafts=drafts)
    stat, df = chi_square(counts, exact)
    crit = wilson_hilferty_critical(df, Z_999)
    assert df >= 15  # enough populated cells for the test to have power
    print(f"{tree} {params} {drafts}: chi2 {stat:.1f} on {df} df (critical {crit:.1f}); accepted drafts per "
          f"generation at depth 1, 2: {accepted}")
    assert 0.3 < accepted[0] < 1.7 and accepted[1] > 0.1  # acceptance and rejection at both depths
    assert stat < crit


@pytest.mark.integration
@pytest.mark.parametrize("rule,n", [(no_residual, 600), (accept_if_likely_under_q, 300)])
def test_a_broken_acceptance_rule_fails_the_same_test(small_vocab, rule, n):
    model, drafter = small_vocab
    prompt = [3, 1, 4, 1, 5]
    params, tree = SamplingParams(temperature=1.0), TreeSpec(2, 3, 6)
    exact = exact_first_three(model, prompt, params)
    counts, _ = sample_first_three(model, drafter, prompt, params, tree, rule, n, seed=0)
    stat, df = chi_square(counts, exact)
    crit = wilson_hilferty_critical(df, Z_999)
    print(f"{rule.__name__}: chi2 {stat:.1f} on {df} df (critical {crit:.1f})")
    assert stat > crit


@pytest.mark.integration
def test_plain_sampling_matches_the_exact_distribution(small_vocab):
    """The reference itself: plain sampling through the same target code passes the same test."""
    model, _ = small_vocab
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(temperature=1.0)
    exact = exact_first_three(model, prompt, params)
    target = HFTarget(model, SPEC3)
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(16, 16, 16)
    for _ in range(600):
        a, b, c = plain_generate(target, prompt, sampling=params, max_new_tokens=3, generator=g).tokens
        counts[a, b, c] += 1
    stat, df = chi_square(counts, exact)
    assert df >= 15 and stat < wilson_hilferty_critical(df, Z_999)


# ---------------------------------------------------------------------------------------------
# Train/serve identity: serving computes what training-time test computed
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("depth", [1, 4])
def test_greedy_chain_accepts_exactly_what_ttt_predicts(llama, trained_drafter, depth):
    """Every greedy chain round accepts exactly the run of leading TTT steps that were right on the
    final sequence (tests/support/tiny.py ttt_accepts). A drafter that trains well but serves badly
    (positions, masks or fed-back hidden states differing) fails here."""
    rounds = []
    for prompt in random_prompts(8, 128, seed=11, lengths=(3, 12)):
        r = speculative_generate(HFTarget(llama, SPEC4), trained_drafter, prompt, tree=TreeSpec.chain(depth),
                                 max_new_tokens=40)
        rounds += ttt_accepts(llama, SPEC4, trained_drafter, prompt, r, depth, 40)
    assert all(a == e for a, e in rounds), [(i, a, e) for i, (a, e) in enumerate(rounds) if a != e][:5]
    # the check compared real acceptances (several drafts deep with a chain of 4), not only rejections
    accepted = [a for a, _ in rounds]
    assert len(rounds) > 50 and sum(accepted) > 20 and max(accepted) == depth, (len(rounds), sum(accepted))
