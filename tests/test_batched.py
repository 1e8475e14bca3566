"""eyas.engine.batched: batched generation with continuous batching on eyas' own Llama-family forward
answers every prompt as Hugging Face ``generate`` does, whatever the rows, refills and syncs, and
serves ``eyas regenerate --engine fast``.

float32 on the CPU, where the decode step's functions run eagerly (the GPU compiles the same
functions; one test traces them with torch.compile's aot_eager backend). The reference for greedy
answers is ``generate`` on each prompt alone (no padding).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from eyas.data.generation import BatchGenerator, BatchParams
from eyas.engine.batch_engines import choose_engine
from eyas.engine.batched import BatchedLlama
from eyas.engine.batched_steps import key_ladder
from eyas.engine.sampling import counter_uniform
from eyas.engine.llama import UnsupportedTarget
from tests.support.tiny import random_prompts, sharpened, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None) -> tuple[list[int], str]:
    """``generate``'s greedy answer to one prompt, as regenerate reads it: (ids before the first eos,
    "eos"), or (all ids, "length")."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=[] if eos is None else [eos], pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    stop = next((j for j, t in enumerate(new) if t == eos), None)
    return (new, "length") if stop is None else (new[:stop], "eos")


def eos_inside(model, prompts: list[list[int]], max_new_tokens: int) -> int:
    """A token that ``generate``'s greedy answers emit after their first token in some answers but
    not all: as eos, some answers end inside the batch and others run to max_new_tokens."""
    free = [hf_greedy(model, p, max_new_tokens, None)[0] for p in prompts]
    counts = Counter(t for a in free for t in set(a[1:max_new_tokens - 1]))
    ok = [t for t, c in counts.most_common() if 2 <= c <= len(prompts) - 2]
    assert ok, counts
    return ok[0]


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_answers_equal_generate_per_prompt_through_refills_eos_and_max_new_tokens(kind):
    """9 prompts of 1..24 tokens on 3 rows: refills (in small prefill groups) happen while other rows
    decode; some answers end at eos inside the batch, the others at max_new_tokens."""
    model = tiny_model(kind, 3)
    prompts = random_prompts(9, 128, seed=5, lengths=(1, 24))
    eos = eos_inside(model, prompts, 10)
    expected = [hf_greedy(model, p, 10, eos) for p in prompts]
    engine = BatchedLlama(model, rows=3, sync_every=3, refill_rows=2, prefill_tokens=40)
    res = engine.run(prompts, max_new_tokens=10, eos_ids=[eos])
    assert res.answers == expected
    assert {f for _, f in expected} == {"eos", "length"}
    assert res.prefills >= 4 and res.syncs >= 3  # several refills, groups cut by the token budget
    assert res.new_tokens == sum(len(a) + (f == "eos") for a, f in expected)
    assert res.prompt_tokens == sum(map(len, prompts)) and 0 < res.occupancy <= 1


@pytest.mark.unit
def test_answers_do_not_depend_on_rows_syncs_refills_or_prefill_groups():
    """Greedy and sampled: each answer is a function of its prompt (and, sampled, the seed and its
    index), however the prompts are scheduled."""
    model = sharpened(tiny_model("llama", 2), 3.0)
    prompts = random_prompts(9, 128, seed=2, lengths=(1, 30))
    setups = [dict(rows=1), dict(rows=4, sync_every=1, refill_rows=1, key_buckets=[4, 9]),
              dict(rows=16, sync_every=7, prefill_tokens=12)]
    for sampling in (dict(), dict(temperature=0.9, seed=7), dict(temperature=1.3, top_p=0.8, seed=7)):
        runs = [BatchedLlama(model, **kw).run(prompts, 12, [3], **sampling).answers for kw in setups]
        assert all(r == runs[0] for r in runs[1:]), sampling
    a = BatchedLlama(model, rows=4).run(prompts, 12, [3], temperature=1.3, top_p=0.8, seed=8).answers
    assert a != runs[0]  # another seed, other answers


@pytest.mark.unit
def test_sampling_draws_from_the_targets_distribution_with_top_p():
    """The first token of one prompt asked 3000 times (each its own key): frequencies within 0.03 of
    the probabilities of eyas.engine.sampling.probabilities (Hugging Face's order: temperature, then
    top-p), and nothing outside the nucleus."""
    from eyas.engine.sampling import SamplingParams, probabilities

    model = sharpened(tiny_model("qwen2", 2), 2.0)
    prompt = [5, 17, 33, 2]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    n = 3000
    engine = BatchedLlama(model, rows=512)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.6)):
        p = probabilities(logits, SamplingParams(temperature, top_p))
        res = engine.run([prompt] * n, 1, [], temperature=temperature, top_p=top_p, seed=0)
        freq = torch.bincount(torch.tensor([a[0] for a, _ in res.answers]), minlength=p.numel()).float() / n
        assert (freq - p).abs().max() < 0.03, (temperature, top_p)
        assert freq[p == 0].sum() == 0
    assert (p > 0).sum() < 128  # the nucleus did drop tokens


@pytest.mark.unit
def test_counter_uniforms_are_uniform_and_differ_per_key_and_count():
    key = torch.randint(0, 1 << 32, (200,), generator=torch.Generator().manual_seed(0))
    count = torch.arange(500)
    u = counter_uniform(key[:, None], count[None, :])  # [200, 500]
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    deciles = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (deciles - 0.1).abs().max() < 0.005
    assert u.unique().numel() > 0.99 * u.numel()
    # neighbouring counts and keys are not correlated
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]) < 0.02
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]) < 0.02


@pytest.mark.unit
def test_first_token_eos_max_new_tokens_1_and_a_cache_that_grows():
    model = tiny_model("llama", 2)
    prompts = random_prompts(5, 128, seed=9, lengths=(2, 8))
    engine = BatchedLlama(model, rows=2, capacity=16)
    first = [hf_greedy(model, p, 1, None)[0][0] for p in prompts]
    res = engine.run(prompts, 1, [first[0]])
    assert res.answers == [([], "eos") if t == first[0] else ([t], "length") for t in first]
    assert res.decode_steps == 0  # every answer came from its prefill
    long = random_prompts(3, 128, seed=4, lengths=(40, 60))
    assert engine.capacity == 64
    res = engine.run(long, 12, [])
    assert engine.capacity >= 72 and res.answers == [hf_greedy(model, p, 12, None) for p in long]


@pytest.mark.unit
def test_the_decode_step_and_the_prefill_never_read_a_tensor_on_the_host(monkeypatch):
    """Only the sync between rounds reads the device (``.cpu()``): on a GPU a read inside a step
    would wait for the device, and inside a CUDA graph capture it would fail."""
    model = tiny_model("qwen3", 2)
    engine = BatchedLlama(model, rows=3, sync_every=4, refill_rows=1)
    prompts = random_prompts(6, 128, seed=1, lengths=(1, 12))
    expected = engine.run(prompts, 8, [7], temperature=0.8, top_p=0.9, seed=1).answers

    def read(*_args, **_kwargs):
        raise AssertionError("a tensor was read on the host")

    def guarded(fn):
        def call(*args, **kwargs):
            with pytest.MonkeyPatch.context() as mp:
                for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
                    mp.setattr(torch.Tensor, name, read)
                return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(engine, "decode_step", guarded(engine.decode_step))
    monkeypatch.setattr(engine, "prefill_rows", guarded(engine.prefill_rows))
    assert engine.run(prompts, 8, [7], temperature=0.8, top_p=0.9, seed=1).answers == expected


@pytest.mark.slow  # ~6 s of tracing
def test_the_step_traced_by_torch_compile_is_the_eager_step_with_one_compilation_per_bucket():
    """The GPU compiles the decode step's functions with inductor; aot_eager traces the same
    functions (fullgraph: no graph break; the cache writes and the state's update as in-place
    mutations) without generating code. Every block reuses its bucket's compilation: the prologue
    once (its mask covers the whole cache; the step hands the blocks a bucket's columns), the block
    once per key bucket used (2: the second is the capacity, 64, as an answer grows past 8 entries)
    and the epilogue once per mode = 1 + 2 + 2 graphs, whatever the number of blocks."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3", 3)
    prompts = random_prompts(3, 128, seed=3, lengths=(3, 5))
    kw = dict(rows=2, sync_every=4, key_buckets=[8])
    eager = BatchedLlama(model, **kw)
    torch._dynamo.reset()
    counters.clear()
    traced = BatchedLlama(model, compile=True, backend="aot_eager", **kw)
    assert traced.implementation == "fast+compile"
    for sampling in (dict(), dict(temperature=0.8, top_p=0.9, seed=3)):
        assert traced.run(prompts, 8, [], **sampling).answers == eager.run(prompts, 8, [], **sampling).answers
    assert traced.capacity == 64 and counters["stats"]["unique_graphs"] == 1 + 2 + 2
    assert traced._layer.error is None and traced.compile_s > 0


@pytest.mark.unit
def test_the_engine_is_chosen_and_refused_with_the_reason():
    model = tiny_model("llama", 2)
    assert choose_engine(model, "auto") == "hf"  # on a CPU
    assert choose_engine(model, "fast") == "fast" and choose_engine(model, "HF") == "hf"
    with pytest.raises(UnsupportedTarget, match=r"--engine: expected one of \['auto', 'fast', 'hf'\], found 'x'"):
        choose_engine(model, "x")
    other = tiny_model("deepseek_v3", 2)
    assert choose_engine(other, "auto") == "hf"
    with pytest.raises(UnsupportedTarget, match=r"--engine fast: model_type 'deepseek_v3' is not one of .*--engine hf"):
        choose_engine(other, "fast")
    with pytest.raises(UnsupportedTarget, match="deepseek_v3"):
        BatchedLlama(other)
    engine = BatchedLlama(model, rows=2)
    assert isinstance(engine, BatchGenerator) and engine.name == "fast" and engine.implementation == "fast"
    prompts = random_prompts(3, 128, seed=0)
    assert engine.generate(prompts, BatchParams(5, (2,))) == engine.run(prompts, 5, [2]).answers
    assert engine.last_decode_steps == engine.last.decode_steps > 0


@pytest.mark.unit
def test_key_ladder():
    assert key_ladder(1000) == [128, 192, 256, 384, 512, 768, 1000]
    assert key_ladder(64) == [64] and key_ladder(256) == [128, 192, 256]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_compiled_and_graphed_step_gives_the_cpu_answers():
    """float32 on the GPU: inductor-compiled functions inside CUDA graphs, one per (bucket, mode)."""
    model = tiny_model("qwen3", 3)
    prompts = random_prompts(10, 128, seed=6, lengths=(1, 40))
    cpu = BatchedLlama(model, rows=4, sync_every=3).run(prompts, 20, [9]).answers
    gpu = BatchedLlama(model.cuda(), rows=4, sync_every=3)
    assert gpu.implementation == "fast+compile+cuda-graphs"
    res = gpu.run(prompts, 20, [9])
    assert res.answers == cpu and gpu._graphs and res.compile_s > 0
    model.cpu()


# -- eyas regenerate --engine fast --------------------------------------------------------------------


def _conversations():
    """Prompts of several lengths, two with a second turn (MT-bench style)."""
    from eyas.data.conversations import Conversation

    out = [Conversation([{"role": "user", "content": "why " * (1 + 3 * i) + f"{i}?"}], id=f"c{i}") for i in range(7)]
    for i in (1, 4):
        out[i] = Conversation(out[i].messages + [{"role": "user", "content": "and then, " * 3}], id=f"c{i}")
    return out


@pytest.mark.integration
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_regenerate_with_the_fast_engine(tmp_path, temperature):
    """Greedy: the same file as the hf engine, byte for byte (float32). Either way, a run stopped
    after its first unit resumes to the uninterrupted file (units of 3 conversations on 2 rows:
    refills inside a unit; the second turn of two conversations is a second call)."""
    from eyas.data.regenerate import RegenerateOptions, regenerate
    from tests.support.chat import chat_target, chat_tokenizer

    tok = chat_tokenizer()
    model = chat_target(tok, seed=4)
    kw = dict(max_new_tokens=12, batch_size=3, progress=False, temperature=temperature, seed=5, loops="keep")
    ref = tmp_path / "ref.jsonl"
    s = regenerate(model, tok, _conversations(), RegenerateOptions(out_path=ref, **kw),
                   generator=BatchedLlama(model, rows=2))
    assert (s.engine, s.cache, s.written) == ("fast", "fast", 7)
    assert s.generate_calls == 3 + 2 and s.decode_steps > 0  # 3 units; 2 of them hold a second turn
    if temperature == 0:
        hf = tmp_path / "hf.jsonl"
        s_hf = regenerate(model, tok, _conversations(), RegenerateOptions(out_path=hf, **kw))
        assert s_hf.engine == "hf" and hf.read_bytes() == ref.read_bytes()
        assert (s_hf.new_tokens, s_hf.prompt_tokens) == (s.new_tokens, s.prompt_tokens)
        answers = [json.loads(x)["messages"][-1]["content"] for x in ref.read_text().splitlines()]
        assert len(set(answers)) >= 5  # not one degenerate answer

    class Stop(RuntimeError):
        pass

    def stop_after_first(chunk, records):
        raise Stop

    out = tmp_path / "out.jsonl"
    with pytest.raises(Stop):
        regenerate(model, tok, _conversations(), RegenerateOptions(out_path=out, **kw),
                   generator=BatchedLlama(model, rows=2), on_chunk_written=stop_after_first)
    assert 0 < len(out.read_text().splitlines()) < 7
    regenerate(model, tok, _conversations(), RegenerateOptions(out_path=out, **kw),
               generator=BatchedLlama(model, rows=3, sync_every=2))  # other rows: same answers
    assert out.read_bytes() == ref.read_bytes()


@pytest.mark.integration
def test_cli_engine_fast_runs_reports_and_refuses_an_unsupported_target_with_the_reason(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    from typer.testing import CliRunner

    from eyas.cli.main import app
    from tests.support.chat import chat_target, chat_tokenizer

    tok = chat_tokenizer()
    llama, gpt2 = tmp_path / "llama", tmp_path / "gpt2"
    chat_target(tok, seed=4).save_pretrained(llama)
    tok.save_pretrained(llama)
    torch.manual_seed(0)
    gpt2_config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=256)
    GPT2LMHeadModel(gpt2_config).save_pretrained(gpt2)
    tok.save_pretrained(gpt2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [f"question {i}?"]}) + "\n" for i in range(5)))
    runner = CliRunner()

    def regen(target, out, *extra):
        return runner.invoke(app, ["regenerate", "--target", str(target), "--prompts", str(prompts), "--out",
                                   str(tmp_path / out), "--max-new-tokens", "10", "--batch-size", "4",
                                   "--device", "cpu", "--json", *extra])

    fast, hf = regen(llama, "fast.jsonl", "--engine", "fast", "--rows", "2"), regen(llama, "hf.jsonl")
    assert fast.exit_code == 0 and hf.exit_code == 0, (fast.output, hf.output)
    rep_fast, rep_hf = json.loads(fast.stdout), json.loads(hf.stdout)
    assert (rep_fast["engine"], rep_fast["rows"], rep_hf["engine"], rep_hf["rows"]) == ("fast", 2, "hf", None)
    assert (tmp_path / "fast.jsonl").read_bytes() == (tmp_path / "hf.jsonl").read_bytes()
    table = runner.invoke(app, ["regenerate", "--target", str(llama), "--prompts", str(prompts), "--out",
                                str(tmp_path / "fast.jsonl"), "--max-new-tokens", "10", "--batch-size", "4",
                                "--device", "cpu", "--engine", "fast"])
    assert table.exit_code == 0 and "fast (fast, 4 rows)" in " ".join(table.stdout.split())

    refused = regen(gpt2, "gpt2.jsonl", "--engine", "fast")
    message = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "--engine fast: model_type 'gpt2' is not one of" in message
    assert "use --engine hf" in message
    bad = regen(llama, "x.jsonl", "--engine", "vllm")
    assert bad.exit_code == 2 and "--engine: expected one of ['auto', 'fast', 'hf'], found 'vllm'" in " ".join(
        bad.output.split())
