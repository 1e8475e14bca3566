"""eyas.engine.draft_kernels: the drafter's step through the Triton kernels (matvec, decode_attention)
equals Eagle3Drafter's forward with a KVCache (logits, the hidden state fed back, the cache written),
from target features and from fed-back states, for one row and for several under a tree mask, for
every variant flag; the stacked projections change no output and hold no second copy; DraftState
with kernels="triton" drafts what kernels="torch" does, and refuses where the kernels cannot run;
speculative decoding on a target with matvec="triton-verify" runs them and emits the plain greedy tokens.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before triton's import); on a GPU they are compiled. float32 throughout (the
interpreter multiplies bfloat16 as raw bits in tl.dot)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.triton_kernels import DEVICE, require_triton

require_triton("the drafter's Triton step")

from eyas.drafter import DrafterConfig, Eagle3Drafter  # noqa: E402
from eyas.engine.draft_kernels import (  # noqa: E402
    UnsupportedDraftKernels, draft_weights, fuse_drafter_projections, kernel_step, why_not_kernels)
from eyas.engine.sampling import GREEDY, SamplingParams  # noqa: E402
from eyas.engine.draft_state import DraftState  # noqa: E402
from eyas.engine.tree import TreeSpec  # noqa: E402

H, H_T, SLOTS, VOCAB, DRAFT_VOCAB = 32, 24, 3, 100, 40
C = 96  # cache slots of the step tests

BASE = dict(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=H_T, num_slots=SLOTS)


def make_drafter(seed: int = 0, fuse: bool = True, **flags) -> Eagle3Drafter:
    """A tiny random float32 drafter on DEVICE (head_dim 16: the attention kernel's least), its norm
    weights (and biases, where configured) random so that every one matters; the projections stacked
    (``fuse``) as DraftState(kernels="triton") stacks them."""
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig(**{**BASE, **flags})).eval()
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or "fc_norm." in name or name.endswith(".bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    d = d.to(DEVICE)
    if fuse:
        assert fuse_drafter_projections(d) is None
    return d


def step_inputs(r: int, from_target: bool, committed: int = 20, scratch: int = 12, seed: int = 1):
    """A drafter step of r rows as DraftState's expansion makes it: tokens [1, r], hidden [1, r, W],
    positions [1, r] (one depth: all equal), slots [r] = start .. start+r-1 right after ``scratch``
    slots written by earlier levels (start = committed + scratch), and the tree mask [1, 1, r, C]:
    every committed entry, a random set of the scratch entries (the row's ancestors) and itself."""
    g = torch.Generator().manual_seed(seed)
    start = committed + scratch
    tokens = torch.randint(0, VOCAB, (1, r), generator=g)
    hidden = 3.0 * torch.randn(1, r, SLOTS * H_T if from_target else H, generator=g)  # RMS far from 1
    positions = torch.full((1, r), committed + 2)
    slots = start + torch.arange(r)
    mask = torch.zeros(r, C, dtype=torch.bool)
    mask[:, :committed] = True
    mask[:, committed:start] = torch.rand(r, scratch, generator=g) < 0.4
    mask[torch.arange(r), slots] = True
    return tuple(t.to(DEVICE) for t in (tokens, hidden, positions, slots, mask[None, None]))


def random_caches(d: Eagle3Drafter, seed: int = 2):
    """Two caches holding the same random entries (the committed ones, earlier levels' scratch, and
    stale values past them): one for the module, one for the kernels."""
    a, b = d.new_cache(1, C), d.new_cache(1, C)
    a.kv.copy_(torch.randn(a.kv.shape, generator=torch.Generator().manual_seed(seed)))
    b.kv.copy_(a.kv)
    return a, b


def assert_step_equals_forward(d: Eagle3Drafter, r: int, from_target: bool) -> None:
    tokens, hidden, positions, slots, mask = step_inputs(r, from_target)
    module_cache, kernel_cache = random_caches(d)
    with torch.no_grad():
        expected = d(tokens, hidden, positions, cache=module_cache, cache_slots=slots, mask=mask,
                     from_target=from_target)
        logits, fed_back = kernel_step(d, kernel_cache, from_target)(tokens, hidden, positions, slots, mask)
    assert logits.shape == (1, r, DRAFT_VOCAB) and fed_back.shape == (1, r, H)
    torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fed_back, expected.hidden, atol=1e-4, rtol=1e-4)
    # the step's entries written (rope(k), v), every other entry untouched
    torch.testing.assert_close(kernel_cache.kv, module_cache.kv, atol=1e-5, rtol=1e-5)
    untouched = torch.ones(C, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(kernel_cache.kv[..., untouched, :], random_caches(d)[0].kv[..., untouched, :])


@pytest.mark.unit
@pytest.mark.parametrize("norm_before_residual", [False, True], ids=["residual-pre-norm", "norm_before_residual"])
@pytest.mark.parametrize("r", [1, 5])
@pytest.mark.parametrize("from_target", [True, False], ids=["from-target", "fed-back"])
def test_the_kernel_step_equals_the_drafters_forward(from_target, r, norm_before_residual):
    assert_step_equals_forward(make_drafter(norm_before_residual=norm_before_residual), r, from_target)


@pytest.mark.unit
@pytest.mark.parametrize("flags", [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
                                   {"attention_bias": True, "mlp_bias": True}, {"unfused": True}],
                         ids=lambda f: "+".join(f))
def test_the_kernel_step_equals_the_forward_for_every_variant(flags):
    """norm_before_fc: input_norm as the fc product's prologue; fc_norm: the per-slot norms in torch;
    norm_output: the normed state fed back; biases in the products' kernels; "unfused": projections
    that are not stacked run as separate products (q, k, v; gate, up)."""
    unfused = flags.pop("unfused", False)
    d = make_drafter(fuse=not unfused, **flags)
    w = draft_weights(d)
    assert (len(w.qkv), len(w.gate_up)) == ((3, 2) if unfused else (1, 1))
    assert_step_equals_forward(d, 3, from_target=True)


@pytest.mark.unit
def test_a_bias_on_some_projections_runs_them_separately():
    """A q bias without k/v ones cannot be stacked: fusing changes nothing and says why; the step runs
    three products, the bias on the first only, and still equals the forward."""
    d = make_drafter(fuse=False, attention_bias=True)
    d.midlayer.self_attn.k_proj.bias = None
    d.midlayer.self_attn.v_proj.bias = None
    assert fuse_drafter_projections(d) == "q/k/v: only some of them have a bias"
    w = draft_weights(d)
    assert len(w.qkv) == 3 and w.qkv_bias[1] is None and w.qkv_bias[0] is not None
    assert_step_equals_forward(d, 2, from_target=False)
    with pytest.warns(UserWarning, match=r"DraftState: the drafter's q/k/v and gate/up not stacked \(q/k/v: only "
                                         r"some of them have a bias\); its steps run them as 5 products instead of 2"):
        assert DraftState(d, 64, kernels="triton").unfused_reason == "q/k/v: only some of them have a bias"


@pytest.mark.unit
def test_stacking_the_projections_keeps_the_outputs_and_holds_no_second_copy():
    d = make_drafter(fuse=False, attention_bias=True, mlp_bias=True)
    tokens, hidden, positions, slots, mask = step_inputs(3, from_target=True)
    before_state = {k: v.clone() for k, v in d.state_dict().items()}
    with torch.no_grad():
        before = d(tokens, hidden, positions, cache=d.new_cache(1, C), cache_slots=slots, mask=mask)
    attn, mlp = d.midlayer.self_attn, d.midlayer.mlp
    params = list(d.parameters())
    assert fuse_drafter_projections(d) is None
    assert list(d.parameters()) == params  # the same Parameter objects
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        for name in ("weight", "bias"):
            tensors = [getattr(m, name) for m in group]
            storage = tensors[0].untyped_storage()
            # one storage, rows one after another, nothing else in it: no second copy
            assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in tensors)
            sizes = [t.numel() for t in tensors]
            assert [t.storage_offset() for t in tensors] == [sum(sizes[:i]) for i in range(len(sizes))]
            assert storage.nbytes() == sum(t.numel() * t.element_size() for t in tensors)
    w = draft_weights(d)
    assert len(w.qkv) == len(w.qkv_bias) == len(w.gate_up) == len(w.gate_up_bias) == 1
    assert w.qkv[0].data_ptr() == attn.q_proj.weight.data_ptr() and w.qkv[0].shape == (8 * 16, 2 * H)
    after_state = d.state_dict()
    assert after_state.keys() == before_state.keys()
    assert all(torch.equal(after_state[k], v) for k, v in before_state.items())
    with torch.no_grad():
        after = d(tokens, hidden, positions, cache=d.new_cache(1, C), cache_slots=slots, mask=mask)
    assert torch.equal(after.logits, before.logits) and torch.equal(after.hidden, before.hidden)
    pointer = attn.q_proj.weight.data_ptr()
    assert fuse_drafter_projections(d) is None and attn.q_proj.weight.data_ptr() == pointer  # idempotent


@pytest.mark.unit
def test_triton_kernels_are_refused_where_they_cannot_run(monkeypatch):
    with pytest.raises(UnsupportedDraftKernels, match=r"expected one of \['torch', 'triton'\], found 'cuda'"):
        DraftState(make_drafter(), 64, kernels="cuda")
    with pytest.raises(UnsupportedDraftKernels, match=r"kernels='triton': its attention kernel needs a power-of-two "
                                                      r"head dimension of at least 16, found 8; use kernels='torch'"):
        DraftState(make_drafter(fuse=False, head_dim=8), 64, kernels="triton")
    cpu = make_drafter(fuse=False).cpu()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UnsupportedDraftKernels, match=r"kernels='triton': it runs Triton kernels, on a GPU \(the "
                                                      r"drafter is on cpu\) or under TRITON_INTERPRET=1; use "
                                                      r"kernels='torch'"):
        DraftState(cpu, 64, kernels="triton")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(UnsupportedDraftKernels, match=r"kernels='triton': it runs Triton kernels, and triton is not "
                                                      r"installed; use kernels='torch'"):
        DraftState(cpu, 64, kernels="triton")
    assert DraftState(cpu, 64).kernels == "torch"  # the default needs none of it


@pytest.mark.unit
def test_the_drafter_follows_the_targets_matvec_where_it_can():
    """speculative's DraftState runs the kernels on a target with matvec="triton-verify", the forward on
    others, and on such a target with a drafter the kernels cannot run (head_dim 8), the forward with
    a warning saying why."""
    from eyas.engine.speculative import _draft_state

    class Target:  # what _draft_state reads of a target
        def __init__(self, matvec: str) -> None:
            self.matvec, self.fixed_shapes, self.cuda_graphs, self.max_length = matvec, False, False, 64

    d = make_drafter()
    assert _draft_state(Target("triton-verify"), d, TreeSpec.chain(3), 32).kernels == "triton"
    assert _draft_state(Target("gemm"), d, TreeSpec.chain(3), 32).kernels == "torch"
    assert _draft_state(Target("triton"), d, TreeSpec.chain(3), 64).kernels == "torch"  # plain steps only
    with pytest.warns(UserWarning, match=r"the drafter's steps run its forward, not the Triton kernels of the "
                                         r"target's matvec='triton-verify': its attention kernel needs a power-of-two "
                                         r"head dimension of at least 16, found 8"):
        state = _draft_state(Target("triton-verify"), make_drafter(fuse=False, head_dim=8), TreeSpec.chain(3), 32)
    assert state.kernels == "torch"
    assert why_not_kernels(d) is None


@pytest.mark.integration
def test_a_draft_state_with_triton_kernels_drafts_what_the_torch_one_does():
    """Both DraftStates with fixed shapes (extend_bucket = depth + 1) on one drafter: a prompt's
    extend (exact shapes: the module either way), a greedy tree (each level's expansion, K rows
    under the tree mask: the kernel step), the re-read of 2 accepted tokens (the padded bucket, a
    causal mask with pads that see themselves), a fixed-shape extend, and a sampled tree (the eager
    expansion): the same trees, roots and cache entries."""
    d = make_drafter(seed=3)
    spec, bucket = TreeSpec(3, 3, 8), 4
    states = {k: DraftState(d, 64, fixed_shapes=True, extend_bucket=bucket, compile=False, kernels=k)
              for k in ("torch", "triton")}
    assert all("kernel_step" in f.__qualname__ for f in (states["triton"]._extend_step, *states["triton"]._eager.values()))
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, VOCAB, (9,), generator=g).to(DEVICE)
    features = torch.randn(9, SLOTS * H_T, generator=g).to(DEVICE)
    accepted = torch.randint(0, VOCAB, (bucket,), generator=g).to(DEVICE)
    accepted_features = torch.randn(bucket, SLOTS * H_T, generator=g).to(DEVICE)
    trees = {}
    for kernels, state in states.items():
        state.extend(prompt, features)
        first = state.draft(spec, 3, GREEDY, None, VOCAB)
        state.reread(accepted, accepted_features, torch.tensor(2, device=DEVICE), torch.tensor(9, device=DEVICE))
        state.advance(2)
        root = (state.root_token, state.root_logits, state.root_hidden)
        second = state.draft(spec, 3, GREEDY, None, VOCAB)
        state.extend(accepted[:3], accepted_features[:3])  # n = 3 <= bucket: the fixed-shape step
        sampled = state.draft(spec, 3, SamplingParams(temperature=1.0), torch.Generator(DEVICE).manual_seed(5), VOCAB)
        trees[kernels] = (first, second, sampled, root, state.cache.kv[..., :state.length, :].clone())
    torch_run, triton_run = trees["torch"], trees["triton"]
    for a, b in zip(torch_run[:3], triton_run[:3]):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.equal(a.valid, b.valid)
    torch.testing.assert_close(torch_run[2].proposals, triton_run[2].proposals, atol=1e-5, rtol=1e-4)
    assert torch.equal(torch_run[3][0], triton_run[3][0])
    torch.testing.assert_close(torch_run[3][1:], triton_run[3][1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch_run[4], triton_run[4], atol=1e-5, rtol=1e-5)  # committed entries 0 .. 13


@pytest.mark.slow
def test_greedy_speculative_with_the_drafters_triton_step_is_token_identical_to_plain(llama, trained_drafter):
    """On a target with matvec="triton-verify" (fixed shapes) the drafter's fixed-shape steps run through the
    kernels (its re-reads and expansions), and greedy speculative decoding emits the plain greedy
    tokens, as with the drafter's forward (float32). Slow on the CPU: Triton's interpreter."""
    from eyas.engine import LlamaTarget, plain_generate, speculative_generate
    from eyas.engine.speculative import draft_states
    from tests.support.tiny import SPEC4, random_prompts

    llama, drafter = llama.to(DEVICE), trained_drafter.to(DEVICE)
    fast = LlamaTarget(llama, SPEC4, max_length=96, fixed_shapes=True, key_buckets=(32, 96), matvec="triton-verify")
    accepted = 0
    for prompt in random_prompts(2, 128, seed=11):
        plain = plain_generate(LlamaTarget(llama, SPEC4, max_length=96), prompt, max_new_tokens=12)
        out = speculative_generate(fast, drafter, prompt, tree=TreeSpec(3, 3, 8), max_new_tokens=12)
        assert out.tokens == plain.tokens, prompt
        accepted += sum(out.stats.accept_lengths) - len(out.stats.accept_lengths)
    state, = draft_states(fast)
    assert state.kernels == "triton" and state.unfused_reason is None
    assert accepted > 3  # drafts were accepted: the kernels' cache entries were read by later rounds
