"""eyas.engine.llama: our own Llama-family forward (static KV cache written by index, tree attention,
capture inside the forward) computes what the Hugging Face model computes, through every cache
operation the decoding loop uses, and serves greedy speculative decoding token-identically.

The reference is :class:`~eyas.engine.target.HFTarget`, whose features come from
:class:`~eyas.capture.hooks.BoundaryCapture`, the capture that made the training data. float32, CPU:
the step's functions run eagerly here, and the same functions traced by torch.compile (the GPU
compiles them with inductor) give the same results with one compilation per bucket for all blocks.
The last test runs the compiled, CUDA-graphed target on a GPU (skipped without one).
"""

from __future__ import annotations

import pytest
import torch

from eyas.engine import HFTarget, TreeSpec, plain_generate, speculative_generate
from eyas.engine.llama import LlamaTarget, UnsupportedTarget, supports
from tests.support.tiny import SPEC4, random_prompts, tiny_model
from tests.support.walk import KEYS, L, SPEC, same, tree_of_five, walk

pytestmark = pytest.mark.usefixtures("one_thread")

def _pair(kind: str, fixed_shapes: bool = False, attention: str = "eager"):
    model = tiny_model(kind, L)
    return (LlamaTarget(model, SPEC, max_length=64, fixed_shapes=fixed_shapes, key_buckets=KEYS, attention=attention),
            HFTarget(model, SPEC, max_length=64))


@pytest.mark.unit
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["exact", "fixed_shapes"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_logits_and_boundaries_equal_the_hf_model_through_prefill_tree_keep_and_decode(kind, fixed_shapes, attention):
    """fixed_shapes: each step padded to a token bucket (9 -> 16, 5 -> 8, 2 -> 8, 1 -> 1) and attending
    the smallest key bucket that holds cache_len + that (16, 32, 32, 16) under a mask, as the CUDA
    graphs run it. attention="sdpa": one scaled_dot_product_attention call per block, the same
    results (the tree mask and the padded rows included)."""
    fast, hf = _pair(kind, fixed_shapes, attention)
    assert fast.implementation.endswith("+attention-sdpa") == (attention == "sdpa")
    walk(fast, hf, torch.Generator().manual_seed(0))
    logits, features = fast.forward(torch.tensor([[7]]), torch.tensor([[15]]), capture=False)
    assert features is None and logits.shape == (1, 1, 128)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])  # q/k/v bias; per-head q/k norm
def test_the_step_traced_by_torch_compile_computes_the_same_with_one_compilation_per_bucket(kind):
    """The GPU compiles the fixed-shape step's functions with inductor; here dynamo and AOT autograd
    trace the same functions (fullgraph: no graph break; the cache writes as in-place mutations of
    the inputs) without generating code. Every block reuses its (token bucket, key bucket)
    compilation: the walk's steps (16, 16), (8, 32), (8, 32), (1, 16) make 3 pairs x _layer + 3
    token buckets x (_prologue, _down, _head) = 12 graphs, whatever the number of blocks; a decode
    step that crosses into key bucket 32 adds _layer alone (the prologue's mask covers the cache;
    the step takes a view of its first K columns), which keeps a warm start's tracing short."""
    from torch._dynamo.utils import counters

    fast, hf = _pair(kind, fixed_shapes=True)
    torch._dynamo.reset()
    counters.clear()
    fast._fixed = fast._functions("aot_eager")
    walk(fast, hf, torch.Generator().manual_seed(0))
    assert fast._ready == {(16, 16), (8, 32), (1, 16)}
    assert counters["stats"]["unique_graphs"] == 12
    ids = torch.tensor([[5]])
    for pos in (15, 16):  # cache_len 15 + 1 <= 16; then 16 + 1: key bucket 32
        same(fast.forward(ids, torch.tensor([[pos]])), hf.forward(ids, torch.tensor([[pos]])))
    assert (1, 32) in fast._ready and counters["stats"]["unique_graphs"] == 13


@pytest.mark.unit
def test_unwarmed_lists_the_pairs_a_partial_warmup_left_smallest_keys_first():
    """A warm server start compiles the key buckets of a short request and leaves the others to the
    worker's idle time (eyas.serve.startup): unwarmed() is that list, and warming each empties it."""
    fast, _ = _pair("llama", fixed_shapes=True)
    assert fast.unwarmed() == [(B, K) for K in fast.key_buckets for B in fast.buckets if B <= K]
    fast.warmup(context=KEYS[0])
    left = fast.unwarmed()
    assert left and left == [(B, K) for K in fast.key_buckets[1:] for B in fast.buckets if B <= K]
    for B, K in left:
        fast.warmup(buckets=[B], keys=[K])
    assert fast.unwarmed() == [] and _pair("llama")[0].unwarmed() == []  # exact shapes: nothing to warm


@pytest.mark.unit
def test_a_step_pads_to_a_larger_ready_bucket_rather_than_compile_its_own():
    """prefer_ready (a server after a warm start that left buckets to the background): a step of T
    tokens whose own bucket is not compiled runs in the smallest larger one that is, and gives the
    same tokens and features; once its own bucket is warmed, it runs there again."""
    fast, hf = _pair("llama", fixed_shapes=True)
    top = max(b for b in fast.buckets if b <= KEYS[0])  # 16
    fast.warmup(buckets=[top], keys=[KEYS[0]])
    assert fast.step_shape(5) == (8, KEYS[0])  # not asked: the smallest bucket, compiled at first use
    fast.prefer_ready = True
    assert fast.step_shape(5) == (top, KEYS[0])
    prompt = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    same(fast.prefill(prompt), hf.prefill(prompt))
    assert (8, KEYS[0]) not in fast._ready  # nothing compiled for it
    ids = prompt[0].tolist()
    assert plain_generate(fast, ids, max_new_tokens=10).tokens == plain_generate(hf, ids, max_new_tokens=10).tokens
    fast.warmup(buckets=[8], keys=[KEYS[0]])
    assert fast.step_shape(5) == (8, KEYS[0])


@pytest.mark.unit
def test_a_failing_compiler_leaves_the_eager_step_with_a_warning(monkeypatch):
    """E.g. a GPU machine without the C compiler Triton needs: the step still runs, and says so."""
    def no_compiler(gm, example_inputs):
        raise RuntimeError("Failed to find C compiler")

    fast, hf = _pair("llama", fixed_shapes=True)
    torch._dynamo.reset()
    fast._fixed, fast.compile, fast.implementation = fast._functions(no_compiler), True, "fast+compile"
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # (the compiled path is a GPU's)
    prompt = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="(?s)torch.compile failed .*Failed to find C compiler.*runs eagerly"):
        same(fast.prefill(prompt), hf.prefill(prompt))
    assert fast.implementation == "fast" and not fast.compile and "C compiler" in fast.compile_error


@pytest.mark.unit
@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["exact", "fixed_shapes"])
def test_forward_and_keep_never_read_a_tensor_on_the_host(monkeypatch, fixed_shapes):
    """On a GPU each read would wait for the device; the speculative loop counts on none here."""
    fast, _ = _pair("llama", fixed_shapes)
    fast.warmup()

    def read(*_args, **_kwargs):
        raise AssertionError("a tensor was read on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, read)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (1, 9), generator=g)
    fast.prefill(prompt)
    mask, depth = tree_of_five()
    fast.forward(torch.randint(0, 128, (1, 5), generator=g), (9 + depth)[None], mask)
    fast.keep([0, 2, 4])
    fast.forward(torch.randint(0, 128, (1, 1), generator=g), torch.tensor([[12]]))
    monkeypatch.undo()
    assert fast.cache_len == 13


@pytest.mark.unit
def test_the_cache_refuses_positions_past_its_capacity():
    fast, _ = _pair("llama")
    fast.prefill(torch.zeros(1, 60, dtype=torch.long))
    with pytest.raises(ValueError, match="past the context"):
        fast.forward(torch.zeros(1, 5, dtype=torch.long), torch.arange(60, 65)[None])


@pytest.mark.unit
def test_other_architectures_are_refused_with_the_reason():
    model = tiny_model("deepseek_v3", L)
    assert "deepseek_v3" in supports(model)
    with pytest.raises(UnsupportedTarget, match=r"model_type 'deepseek_v3' is not one of .*HFTarget"):
        LlamaTarget(model, SPEC)


@pytest.mark.integration
@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["exact", "fixed_shapes"])
def test_greedy_speculative_on_the_llama_target_is_token_identical_to_plain(llama, trained_drafter, fixed_shapes):
    fast, hf = LlamaTarget(llama, SPEC4, fixed_shapes=fixed_shapes), HFTarget(llama, SPEC4)
    eos = llama.generation_config.eos_token_id
    accepted = 0
    for prompt in random_prompts(6, 128, seed=11):
        plain = plain_generate(hf, prompt, max_new_tokens=20, eos_token_ids=[eos])
        assert plain_generate(fast, prompt, max_new_tokens=20, eos_token_ids=[eos]).tokens == plain.tokens
        for tree in (TreeSpec.chain(4), TreeSpec(4, 4, 16)):
            out = speculative_generate(fast, trained_drafter, prompt, tree=tree, max_new_tokens=20,
                                       eos_token_ids=[eos])
            assert out.tokens == plain.tokens, (prompt, tree)
            accepted += sum(out.stats.accept_lengths)
    assert accepted > 10  # the drafter is right often enough that keep() moves real tree paths


@pytest.mark.unit
def test_build_target_picks_the_implementation_and_says_which():
    from eyas.engine import build_target

    model = tiny_model("llama", L)
    assert build_target(model, SPEC, "auto").implementation == "fast"  # eager on a CPU, and faster there than HF
    assert build_target(model, SPEC, "fast").implementation == "fast"
    assert LlamaTarget(model, SPEC, cuda_graphs=True, compile=True).implementation == "fast"  # GPU only
    assert build_target(model, SPEC, "HF").implementation == "hf"
    with pytest.raises(UnsupportedTarget, match=r"--target-impl: expected one of \['auto', 'fast', 'hf'\], found 'x'"):
        build_target(model, SPEC, "x")
    with pytest.raises(UnsupportedTarget, match="deepseek_v3"):
        build_target(tiny_model("deepseek_v3", L), SPEC, "fast")
    with pytest.raises(UnsupportedTarget, match=r"--matvec triton: options of the fast Llama-family target, and this "
                                                r"model runs on the Hugging Face target \(model_type 'deepseek_v3'"):
        build_target(tiny_model("deepseek_v3", L), SPEC, "auto", matvec="triton")


@pytest.mark.integration
def test_generate_on_the_fast_target_prints_it_and_equals_the_hf_target(toy_drafter):
    import json

    from typer.testing import CliRunner

    from eyas.cli.main import app

    target, draft = toy_drafter
    outputs = {}
    for impl in ("fast", "hf"):
        r = CliRunner().invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hi",
                                     "--max-new-tokens", "12", "--tree", "3,2,6", "--device", "cpu",
                                     "--target-impl", impl, "--json"])
        assert r.exit_code == 0, r.output
        outputs[impl] = json.loads(r.stdout)
        assert outputs[impl]["target_impl"] == impl
    assert outputs["fast"]["tokens"] == outputs["hf"]["tokens"]
    r = CliRunner().invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hi",
                                 "--device", "cpu", "--target-impl", "turbo"])
    assert r.exit_code == 2 and "--target-impl: expected one of" in r.stderr
    # the fast target's kernels: passed through, checked, refused where the Hugging Face target runs
    for extra, message in ((["--matvec", "gemv"], "LlamaTarget: matvec must be one of ['auto', 'gemm', 'reduce', "
                                                  "'reduce-tuned', 'triton', 'triton-verify'], found 'gemv'"),
                           (["--attention", "flash"], "LlamaTarget: attention must be one of ['auto', 'eager', "
                                                      "'sdpa', 'split-kv'], found 'flash'"),
                           (["--target-impl", "hf", "--matvec", "triton", "--attention", "split-kv"],
                            "--matvec triton --attention split-kv: options of the fast Llama-family target, and this "
                            "model runs on the Hugging Face target (--target-impl hf); leave them out")):
        r = CliRunner().invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hi",
                                     "--device", "cpu", *extra])
        assert r.exit_code == 2 and message in " ".join(r.stderr.split()), r.stderr


@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("matvec,attention", [("gemm", "eager"), ("reduce", "eager"), ("gemm", "sdpa"),
                                              ("gemm", "split-kv"), ("reduce", "split-kv"), ("triton", "eager"),
                                              ("triton", "split-kv"), ("triton-verify", "split-kv")])
def test_the_compiled_cuda_graphed_target_equals_the_hf_model_on_a_gpu(matvec, attention):
    """float32 on the GPU, buckets compiled and captured up front (warmup), then the same walk; and
    a bucket first used later is compiled and captured then. With both ways of multiplying a
    one-token step (cuBLAS; inductor's reduction kernel; our Triton kernels, eyas.engine.matvec), and
    attention as one fused SDPA kernel or as the split-KV Triton kernels."""
    model = tiny_model("llama", L).cuda()
    fast = LlamaTarget(model, SPEC, max_length=64, cuda_graphs=True, buckets=(1, 8, 16, 32), key_buckets=KEYS,
                       matvec=matvec, attention=attention)
    hf = HFTarget(model, SPEC, max_length=64)
    assert fast.implementation == ("fast+compile+cuda-graphs" + (f"+matvec-{matvec}" if matvec != "gemm" else "")
                                   + (f"+attention-{attention}" if attention != "eager" else ""))
    seconds = fast.warmup(buckets=(1, 8, 16))  # with every key bucket (16, 32, 64: all within 2048)
    warmed = [(B, K) for B in (1, 8, 16) for K in (16, 32, 64)]
    assert 0 < fast.compile_seconds <= seconds and sorted(fast._graphs) == warmed
    assert fast.compile_error is None, fast.compile_error  # compiled, not the eager fallback
    walk(fast, hf, torch.Generator().manual_seed(0), device="cuda")
    ids = torch.randint(0, 128, (1, 20), device="cuda")
    same(fast.forward(ids, torch.arange(15, 35, device="cuda")[None]),
          hf.forward(ids, torch.arange(15, 35, device="cuda")[None]))
    assert sorted(fast._graphs) == sorted(warmed + [(32, 64)])
    fast.keep(list(range(2)))  # cache_len 17: decode steps replay the graphs of key buckets 32, then 64
    hf.keep(list(range(2)))
    for pos in range(17, 40):
        one = torch.randint(0, 128, (1, 1), device="cuda")
        same(fast.forward(one, torch.tensor([[pos]], device="cuda")), hf.forward(one, torch.tensor([[pos]], device="cuda")))


# -- fused projections ------------------------------------------------------------------------------


def _storages(model) -> dict[int, int]:
    """data pointer -> bytes of every distinct storage behind the model's parameters."""
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fuse_projections_makes_the_models_parameters_views_of_one_tensor_without_a_second_copy(kind):
    from eyas.engine.llama_kernels import fuse_projections

    model = tiny_model(kind, L)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits
    assert fuse_projections(model) is None
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    for b in model.model.layers:
        a, m = b.self_attn, b.mlp
        groups = [(a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj)]
        for group in groups:
            for name in ("weight", "bias") if group[0].bias is not None else ("weight",):  # Qwen2: q/k/v bias
                parts = [getattr(x, name) for x in group]
                storage = parts[0].untyped_storage()
                assert all(p.untyped_storage().data_ptr() == storage.data_ptr() for p in parts)
                assert storage.nbytes() == sum(p.numel() * p.element_size() for p in parts)  # exactly the rows
                assert [p.storage_offset() for p in parts] == [sum(q.numel() for q in parts[:i]) for i in range(len(parts))]
    # No weight held twice: the distinct storages add up to the parameters' bytes.
    assert sum(_storages(model).values()) == sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.equal(model(ids).logits, logits)  # the Hugging Face model computes as before
    ptrs = _storages(model)
    assert fuse_projections(model) is None and _storages(model) == ptrs  # idempotent: nothing moved
    fast = LlamaTarget(model, SPEC)  # fuses nothing again, multiplies by the model's own storage
    assert fast.unfused_reason is None and _storages(model) == ptrs
    w = fast.weights[0]
    assert len(w.qkv) == 1 and w.qkv[0].shape == (4 * 16 + 2 * 2 * 16, 64) and w.gate_up[0].shape == (256, 64)
    assert w.qkv[0].data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert (w.qkv_bias is not None) == (kind == "qwen2")


@pytest.mark.unit
def test_the_fused_model_still_trains_loads_and_saves_and_the_fast_target_follows_its_weights(tmp_path):
    """Writes into the model's parameters (an optimizer step, load_state_dict) are writes into the
    fused tensors the fast target multiplies by; save_pretrained writes the same tensors."""
    from transformers import AutoModelForCausalLM

    model, other = tiny_model("qwen2", L), tiny_model("qwen2", L, seed=1)
    fast = LlamaTarget(model, SPEC, max_length=64)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    model.train()
    model(ids).logits.square().mean().backward()
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.grad is not None and q.weight.grad.shape == q.weight.shape
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    model.eval().zero_grad()
    same(fast.prefill(ids), HFTarget(model, SPEC).prefill(ids))
    model.load_state_dict(other.state_dict())
    same(fast.prefill(ids), HFTarget(other, SPEC).prefill(ids))
    model.save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in other.state_dict().items())


@pytest.mark.unit
def test_projections_that_cannot_be_stacked_are_left_alone_with_the_reason_and_the_step_still_equals_the_model():
    from transformers import AutoModelForCausalLM

    from eyas.engine.llama_kernels import fuse_projections
    from tests.support.tiny import tiny_config

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("llama", L))
    assert "meta device" in fuse_projections(meta)

    class Quantized(torch.nn.Parameter):  # stands for a quantized weight (a tensor subclass)
        pass

    model = tiny_model("qwen2", L)
    v = model.model.layers[L - 1].self_attn.v_proj
    v.weight = Quantized(v.weight.detach().clone())
    ptrs = _storages(model)
    assert fuse_projections(model) == f"block {L - 1} q/k/v: its weight is a Quantized, not a plain nn.Parameter (quantized?)"
    assert _storages(model) == ptrs  # all or nothing: block 0 was not fused either
    with pytest.warns(UserWarning, match="not fused .*Quantized"):
        fast = LlamaTarget(model, SPEC, max_length=64)
    assert fast.unfused_reason.startswith(f"block {L - 1}") and len(fast.weights[0].qkv) == 3
    walk(fast, HFTarget(model, SPEC, max_length=64), torch.Generator().manual_seed(0))  # separate GEMMs


# -- key buckets --------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fixed_shape_steps_equal_the_hf_model_as_they_cross_key_buckets_mid_generation(kind):
    """The walk (key buckets 16, 32, 32, 16), then one token at a time from cache_len 15 to 59: the
    step attends 16, then 32 (from cache_len 16), then 64 keys (from 32), equal at every step; a
    step whose padded bucket would not fit the cache (3 tokens at 60: bucket 8) runs exact shapes."""
    fast, hf = _pair(kind, fixed_shapes=True)
    assert fast.key_buckets == (16, 32, 64)
    g = torch.Generator().manual_seed(0)
    walk(fast, hf, g)
    for pos in range(15, 60):
        ids = torch.randint(0, 128, (1, 1), generator=g)
        same(fast.forward(ids, torch.tensor([[pos]])), hf.forward(ids, torch.tensor([[pos]])))
    assert {(1, 16), (1, 32), (1, 64)} <= fast._ready
    assert fast.cache_len == 60 and fast.step_shape(1) == (1, 64) and fast.step_shape(3) is None
    ids = torch.randint(0, 128, (1, 3), generator=g)
    same(fast.forward(ids, torch.arange(60, 63)[None]), hf.forward(ids, torch.arange(60, 63)[None]))
    assert not any(B == 8 and K == 64 for B, K in fast._ready)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases through the reduction
def test_one_token_steps_multiplied_as_reductions_equal_the_hf_model_and_call_no_gemm(kind, monkeypatch):
    """matvec="reduce": a fixed-shape step of one token computes every product as a float32
    reduction (what inductor compiles into a weight-streaming kernel on a GPU; eager here), with the
    same results as the model; steps of more tokens keep F.linear."""
    import eyas.engine.llama_kernels as kernels

    model = tiny_model(kind, L)
    fast = LlamaTarget(model, SPEC, max_length=64, fixed_shapes=True, key_buckets=KEYS, matvec="reduce")
    hf = HFTarget(model, SPEC, max_length=64)
    assert fast.implementation == "fast+matvec-reduce"
    g = torch.Generator().manual_seed(0)
    walk(fast, hf, g)
    rows: list[int] = []  # the rows of every F.linear the fast target calls (the HF model's are not counted)
    real = kernels.F.linear

    def fast_forward(ids, positions):
        with monkeypatch.context() as m:
            m.setattr(kernels.F, "linear", lambda a, *w: rows.append(a.shape[0]) or real(a, *w))
            return fast.forward(ids, positions)

    for pos in range(15, 20):
        ids = torch.randint(0, 128, (1, 1), generator=g)
        same(fast_forward(ids, torch.tensor([[pos]])), hf.forward(ids, torch.tensor([[pos]])))
    assert rows == []  # not one GEMM in the one-token steps: the fast target's products were reductions
    ids = torch.randint(0, 128, (1, 3), generator=g)
    same(fast_forward(ids, torch.arange(20, 23)[None]), hf.forward(ids, torch.arange(20, 23)[None]))
    assert rows and set(rows) == {8}  # 3 tokens: token bucket 8, F.linear
    assert LlamaTarget(model, SPEC, max_length=64, fixed_shapes=True).matvec == "gemm"  # auto


@pytest.mark.unit
def test_auto_picks_the_triton_kernels_on_the_compiled_gpu_path_only(monkeypatch):
    """matvec and attention "auto": eyas' Triton kernels where the steps are compiled on a GPU and
    triton is installed (split-kv where the head dimension is a power of two of at least 16; with
    it, verification through them too up to FEW_ROW_KERNELS_UP_TO_HIDDEN), cuBLAS and the eager
    order elsewhere (the CPU's eager steps here)."""
    import importlib.util

    from eyas.engine.llama_kernels import FEW_ROW_KERNELS_UP_TO_HIDDEN as SMALL, auto_kernels

    fast = LlamaTarget(tiny_model("llama", L), SPEC, max_length=64, fixed_shapes=True)
    assert (fast.matvec, fast.attention, fast.implementation) == ("gemm", "eager", "fast")
    assert auto_kernels(False, 64, 576) == ("gemm", "eager")
    if importlib.util.find_spec("triton") is not None:
        assert auto_kernels(True, 64, 4096) == ("triton", "split-kv")  # an 8B: verification on cuBLAS
        assert auto_kernels(True, 64, SMALL) == auto_kernels(True, 64, 576) == ("triton-verify", "split-kv")
        assert auto_kernels(True, 64, SMALL + 1) == ("triton", "split-kv")
        assert auto_kernels(True, 80, 576) == ("triton", "eager")  # no split-kv: plain steps only
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else object())
    assert auto_kernels(True, 64, 576) == ("gemm", "eager")  # no triton: cuBLAS


@pytest.mark.unit
def test_linear_on_the_cpu_transposed_for_few_rows_equals_f_linear():
    """Up to CPU_TRANSPOSED_ROWS rows the CPU computes y^T = w a^T (one row as two), more rows with
    F.linear: the same products, contiguous [B, out], bias included."""
    from eyas.engine.llama_kernels import CPU_TRANSPOSED_ROWS, linear

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    for B in range(1, CPU_TRANSPOSED_ROWS + 3):
        a = torch.randn(B, 48, generator=g)
        for bias in (None, b):
            y = linear(a, w, bias)
            assert y.shape == (B, 40) and y.is_contiguous()
            torch.testing.assert_close(y, torch.nn.functional.linear(a, w, bias), rtol=1e-5, atol=1e-5)
    a3 = torch.randn(2, 3, 48, generator=g)  # more dimensions (the batched engine's prefill): F.linear
    torch.testing.assert_close(linear(a3, w, b), torch.nn.functional.linear(a3, w, b))


@pytest.mark.unit
def test_linear_as_a_reduction_equals_f_linear_and_a_wrong_matvec_is_refused():
    g = torch.Generator().manual_seed(0)
    a, w, b = torch.randn(1, 48, generator=g), torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    from eyas.engine.llama_kernels import linear

    torch.testing.assert_close(linear(a, w, b, matvec=True), torch.nn.functional.linear(a, w, b))
    torch.testing.assert_close(linear(a, w, matvec=True), a @ w.T)
    a16, w16 = a.bfloat16(), w.bfloat16()  # bf16 in, float32 sums, one rounding at the end
    torch.testing.assert_close(linear(a16, w16, matvec=True).float(), (a16.float() @ w16.float().T).bfloat16().float())
    with pytest.raises(ValueError, match=r"matvec must be one of .*'gemm'.*found 'gemv'"):
        LlamaTarget(tiny_model("llama", L), SPEC, max_length=64, matvec="gemv")
    with pytest.raises(ValueError, match=r"attention must be one of \['auto', 'eager', 'sdpa', 'split-kv'\], found 'flash'"):
        LlamaTarget(tiny_model("llama", L), SPEC, max_length=64, attention="flash")


@pytest.mark.unit
def test_the_key_ladder_and_what_warmup_compiles():
    from eyas.engine.llama import key_ladder

    assert key_ladder(4096) == (512, 1024, 2048, 4096) and key_ladder(3000) == (512, 1024, 2048, 3000)
    assert key_ladder(64) == (64,) and key_ladder(512) == (512,)
    model = tiny_model("llama", L)
    # The default: every token bucket with the key buckets of a 2048-token sequence (not 4096).
    fast = LlamaTarget(model, SPEC, max_length=4096, fixed_shapes=True)
    assert fast.key_buckets == (512, 1024, 2048, 4096)
    fast.warmup()
    assert fast._ready == {(B, K) for B in (1, 8, 16, 32, 64, 128) for K in (512, 1024, 2048)}
    fast = LlamaTarget(model, SPEC, max_length=4096, fixed_shapes=True, key_buckets=(100, 512, 9999))
    assert fast.key_buckets == (100, 512, 4096)  # the capacity added, rungs past it dropped
    fast.warmup(buckets=(1, 128), context=300)  # cache_len + B <= K: no step of 128 tokens attends 100 keys
    assert fast._ready == {(1, 100), (1, 512), (128, 512)}
    fast.warmup(buckets=(8,), keys=(4096,))
    assert (8, 4096) in fast._ready
    with pytest.raises(ValueError, match=r"key bucket 256 is not one of \[100, 512, 4096\]"):
        fast.warmup(keys=(256,))
    fast, _ = _pair("llama", fixed_shapes=True)  # a 64-entry cache: the default warms every key bucket
    fast.warmup()
    assert fast._ready == {(B, K) for B in (1, 8, 16, 32, 64) for K in (16, 32, 64) if B <= K}


@pytest.mark.integration
def test_greedy_output_with_fixed_shapes_and_key_buckets_equals_exact_shapes_token_for_token(llama, trained_drafter):
    """Plain and speculative greedy generation with fixed shapes, key buckets 16, 32, 64, 128 (prompts
    of 5 to 30 tokens, 60 new ones: every sequence crosses key buckets mid-generation, and tree
    verification's keep() moves the cache back and forth across them) give the tokens of the
    exact-shape target."""
    exact = LlamaTarget(llama, SPEC4, max_length=128)
    fixed = LlamaTarget(llama, SPEC4, max_length=128, fixed_shapes=True, key_buckets=(16, 32, 64))
    for prompt in random_prompts(4, 128, seed=5, lengths=(5, 30)):
        plain = plain_generate(exact, prompt, max_new_tokens=60).tokens
        assert len(prompt) + len(plain) > 64
        assert plain_generate(fixed, prompt, max_new_tokens=60).tokens == plain, prompt
        out = speculative_generate(fixed, trained_drafter, prompt, tree=TreeSpec(4, 4, 16), max_new_tokens=60)
        assert out.tokens == plain, prompt
    assert {K for _, K in fixed._ready} == {16, 32, 64, 128}


@pytest.mark.unit
@pytest.mark.parametrize("T,padded", [(3, 4), (2, 2), (6, 6), (7, 7)])
def test_steps_on_the_cpu_run_padded_where_more_rows_cost_less_with_the_same_result(T, padded):
    """On the CPU a step of 3 tokens runs as 4 rows (3 cost more, see CPU_PADDED_ROWS), others as
    they are; the pads change nothing: the logits and features equal the HF model's, only T entries
    are committed, and the next step sees the same cache as without padding."""
    model = tiny_model("llama", L)
    fast, hf = LlamaTarget(model, SPEC), HFTarget(model, SPEC)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    for target in (fast, hf):
        target.prefill(prompt)
    rows = []
    step = fast._step
    fast._step = lambda inputs, *a: rows.append(len(inputs.ids)) or step(inputs, *a)
    tokens = torch.tensor([[2, 6, 5, 3, 5, 8, 9][:T]])
    parents = [-1, 0, 0, 1, 2, 3, 4][:T]  # node 2 skips node 1; two branches below them
    tree = torch.eye(T, dtype=torch.bool)
    depths = [0] * T
    for i in range(1, T):
        tree[i] |= tree[parents[i]]
        depths[i] = depths[parents[i]] + 1
    positions = (6 + torch.tensor(depths))[None]
    got, want = fast.forward(tokens, positions, tree), hf.forward(tokens, positions, tree)
    assert rows == [padded]
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    assert fast.cache_len == hf.cache_len == 6 + T
    nxt = torch.tensor([[7]]), torch.tensor([[6 + T]])
    torch.testing.assert_close(fast.forward(*nxt)[0], hf.forward(*nxt)[0], rtol=1e-4, atol=1e-4)
