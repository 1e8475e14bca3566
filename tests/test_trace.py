"""`eyas trace`: the engine's three junctions (each captured boundary, the concatenation, the fc
input) recorded per round through the engine's observer calls (the same records whatever target
computes the features), free when off, and held against the training fingerprint.

Engine-level tests run a tiny random Llama (vocab 128, no tokenizer) with a drafter trained for a
few seconds (so that rounds accept several tokens and the drafter re-reads multi-token paths).
The CLI tests use test_doctor.py's toy target (SmolLM2 tokenizer, 12 blocks whose MLP outputs are
scaled up so that the boundaries differ from each other as in trained models) and an untrained
drafter whose contract carries a training fingerprint computed the way online training computes
it: a trace holds statistics against the fingerprint, accuracy plays no part.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eyas.convention import CaptureSpec

from eyas.capture import BoundaryCapture
from eyas.doctor.trace import JUNCTIONS, Tracer, tensor_stats
from eyas.engine import HFTarget, LlamaTarget, RoundObserver, TreeSpec, plain_generate, speculative_generate
from eyas.engine.speculative import start, step
from tests.support.tiny import self_trained_drafter, sharpened, tiny_model
from tests.support.toy import make_toy_target

SPEC = CaptureSpec((2, 4, 5), 8)
H = 64
PROMPT = [5, 17, 99, 3, 42, 42, 7, 120, 64, 11, 30, 2]


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.integration]


@pytest.fixture(scope="module")
def tiny():
    model = sharpened(tiny_model("llama", SPEC.num_blocks), 8.0)
    return model, self_trained_drafter(model, SPEC, prompts=16, new_tokens=30, steps=40)


def hook_count(*modules) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for root in modules for m in root.modules())


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# The records
# ---------------------------------------------------------------------------------------------


def test_records_cover_every_round_and_junction_with_the_right_shapes(tiny, tmp_path):
    model, drafter = tiny
    target = HFTarget(model, SPEC)
    tree = TreeSpec(3, 2, 6)
    with Tracer(target, drafter, tmp_path / "t.jsonl") as tr:
        r = speculative_generate(target, drafter, PROMPT, tree=tree, max_new_tokens=30, observer=tr)
    lines = read_jsonl(tmp_path / "t.jsonl")
    assert lines[0]["header"]["boundaries"] == [2, 4, 5] and lines[0]["header"]["fc_in_features"] == 3 * H
    assert lines[0]["header"]["target_impl"] == "hf"
    assert lines[1:] == json.loads(json.dumps(tr.records))  # the file holds every record, in order
    rounds = r.stats.rounds  # the prefill counts as a round, as in the engine's statistics
    assert tr.round + 1 == rounds and {rec["round"] for rec in tr.records} == set(range(rounds))
    S = SPEC.num_slots
    rows_read = []
    for k in range(rounds):
        recs = [rec for rec in tr.records if rec["round"] == k]
        assert {rec["phase"] for rec in recs} == {"prefill" if k == 0 else "verify"}
        bounds = [rec for rec in recs if rec["junction"] == "boundary"]
        assert [(b["slot"], b["boundary"]) for b in bounds] == list(enumerate(SPEC.boundaries))
        T = bounds[0]["shape"][1]
        assert all(b["shape"] == [1, T, H] and b["dtype"] == "float32" for b in bounds)
        assert T == len(PROMPT) if k == 0 else 1 <= T <= tree.total_tokens + 1  # the prompt, or the tree with its root
        concat = [rec for rec in recs if rec["junction"] == "concat"]
        fc = [rec for rec in recs if rec["junction"] == "fc_input"]
        if k == rounds - 1 and not concat:
            assert not fc  # the drafter never reads the round generation stops in
            continue
        assert len(concat) == len(fc) == 1 and {rec["junction"] for rec in recs} == set(JUNCTIONS)
        (c,), (f,) = concat, fc
        n = c["shape"][1]
        assert c["shape"] == f["shape"] == [1, n, S * H] and f["expected_width"] == S * H
        assert c["slot_order"] == [2, 4, 5]  # recovered from the values: the trained boundaries in slot order
        rows_read.append(n)
    # the drafter reads the whole prompt, then each round's accepted path plus the bonus token
    assert rows_read[0] == len(PROMPT)
    assert rows_read[1:] == r.stats.accept_lengths[: len(rows_read) - 1]
    assert max(rows_read[1:]) > 1  # multi-token paths were exercised


def test_prefill_boundary_statistics_equal_a_direct_capture(tiny):
    model, drafter = tiny
    target = HFTarget(model, SPEC)
    with Tracer(target, drafter) as tr:
        speculative_generate(target, drafter, PROMPT, max_new_tokens=4, observer=tr)
    with torch.no_grad(), BoundaryCapture(model, SPEC) as cap:
        model(torch.tensor([PROMPT]))
        slots = cap.slots()
    prefill = [rec for rec in tr.records if rec["round"] == 0]
    bounds = [rec for rec in prefill if rec["junction"] == "boundary"]
    for rec, x in zip(bounds, slots):
        direct = tensor_stats(x[0, 1:])  # every token but the first, the fingerprint rule
        assert direct["tokens"] == rec["tokens"] == len(PROMPT) - 1
        for key in ("rms", "rms_std", "mean", "std", "absmax"):
            assert rec[key] == pytest.approx(direct[key], rel=1e-5, abs=1e-8), key
        assert rec["first_token_rms"] == pytest.approx(x[0, 0].pow(2).mean().sqrt().item(), rel=1e-5)
    # the concatenation of the prefill holds those same boundaries, slot by slot
    (concat,) = [rec for rec in prefill if rec["junction"] == "concat"]
    assert concat["slot_rms"] == pytest.approx([b["rms"] for b in bounds], rel=1e-5)


@pytest.mark.parametrize("tree", [TreeSpec.chain(4), TreeSpec(3, 2, 6)], ids=["chain", "tree"])
def test_tracing_changes_no_token_and_leaves_no_hook(tiny, tree):
    model, drafter = tiny
    target = HFTarget(model, SPEC)
    assert hook_count(model, drafter) == 0
    off = speculative_generate(target, drafter, PROMPT, tree=tree, max_new_tokens=24)
    # free when off: the engine registered nothing and left nothing behind
    assert hook_count(model, drafter) == 0
    with Tracer(target, drafter) as tr:
        on = speculative_generate(target, drafter, PROMPT, tree=tree, max_new_tokens=24, observer=tr)
        assert hook_count(model, drafter) == 0  # the engine calls the tracer: no hook on any module
    assert on.tokens == off.tokens and on.stats.accept_lengths == off.stats.accept_lengths
    assert hook_count(model, drafter) == 0 and not tr.active
    again = speculative_generate(target, drafter, PROMPT, tree=tree, max_new_tokens=24)
    assert again.tokens == off.tokens


def records_close(a: list[dict], b: list[dict], rel: float = 1e-4) -> None:
    """The same records (keys, every exact field) with their statistics equal to ``rel``."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (x, y)
        for k in x:
            if isinstance(x[k], float) or (isinstance(x[k], list) and x[k] and isinstance(x[k][0], float)):
                assert y[k] == pytest.approx(x[k], rel=rel, abs=1e-6), (k, x, y)
            else:
                assert x[k] == y[k], (k, x, y)


@pytest.mark.parametrize("tree", [TreeSpec.chain(4), TreeSpec(3, 2, 6)], ids=["chain", "tree"])
def test_hf_and_fast_targets_give_the_same_records(tiny, tree):
    """The records come from what the engine hands over, not from hooks: the fast target (features
    computed inside its forward, fixed shapes, padded steps) traces the same request to the same
    boundary, concat and fc_input records as the Hugging Face target."""
    model, drafter = tiny
    traces = {}
    for name, target in (("hf", HFTarget(model, SPEC)), ("fast", LlamaTarget(model, SPEC, fixed_shapes=True))):
        with Tracer(target, drafter) as tr:
            r = speculative_generate(target, drafter, PROMPT, tree=tree, max_new_tokens=24, observer=tr)
        traces[name] = (tr, r)
    (hf, r_hf), (fast, r_fast) = traces["hf"], traces["fast"]
    assert r_fast.tokens == r_hf.tokens and r_fast.stats.accept_lengths == r_hf.stats.accept_lengths
    assert max(r_hf.stats.accept_lengths) > 1  # multi-token re-reads were exercised
    assert {rec["junction"] for rec in fast.records} == set(JUNCTIONS)
    records_close(hf.records, fast.records)
    assert fast.slot_orders == hf.slot_orders and fast.slot_orders[0] == tuple(SPEC.boundaries)
    for o, h in zip(fast.observed(), hf.observed()):
        assert o.num_tokens == h.num_tokens and o.rms_mean == pytest.approx(h.rms_mean, rel=1e-4)


class Counting(RoundObserver):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def target_forward(self, round, phase, positions, features):
        self.calls.append(("target", round, phase, positions.tolist(), tuple(features.shape)))

    def drafter_reads(self, round, phase, positions, tokens, features):
        self.calls.append(("drafter", round, phase, positions.tolist(), tuple(features.shape), tokens.tolist()))


def test_the_engine_calls_an_observer_once_per_forward_and_read_and_only_when_given(tiny):
    model, drafter = tiny
    target = HFTarget(model, SPEC)
    tree = TreeSpec(3, 2, 6)
    # off (the default): the session has no observer and decodes as ever
    off = speculative_generate(target, drafter, PROMPT, tree=tree, max_new_tokens=20)
    s = start(target, PROMPT, drafter, tree=tree, max_new_tokens=20)
    while not s.done:
        step(s)
    assert s.observer is None and s.result().tokens == off.tokens

    obs = Counting()
    on = speculative_generate(target, drafter, PROMPT, tree=tree, max_new_tokens=20, observer=obs)
    assert on.tokens == off.tokens and on.stats.accept_lengths == off.stats.accept_lengths
    rounds = on.stats.rounds
    fwd = [c for c in obs.calls if c[0] == "target"]
    reads = [c for c in obs.calls if c[0] == "drafter"]
    # one target forward per round (the prefill is round 0), in order
    assert [(c[1], c[2]) for c in fwd] == [(0, "prefill")] + [(r, "verify") for r in range(1, rounds)]
    # one read per round but the last: the drafter never reads the round generation stops in
    assert [(c[1], c[2]) for c in reads] == [(0, "prefill")] + [(r, "verify") for r in range(1, rounds - 1)]
    # each read follows its round's forward
    assert [c[1] for c in obs.calls] == sorted(c[1] for c in obs.calls)
    # the prefill: the prompt's positions, features of every prompt token; the drafter reads them
    # with the next tokens
    n = len(PROMPT)
    assert fwd[0][3] == list(range(n)) and fwd[0][4] == (1, n, 3 * H)
    assert reads[0][3] == list(range(n)) and reads[0][4] == (n, 3 * H)
    assert reads[0][5] == PROMPT[1:] + on.tokens[:1]
    # each re-read: the accepted path plus the bonus, at the positions after the committed ones
    m = n
    for c, k in zip(reads[1:], on.stats.accept_lengths):
        assert c[3] == list(range(m, m + k)) and c[4] == (k, 3 * H)
        m += k
    # plain decoding captures nothing: no call
    obs = Counting()
    s = start(target, PROMPT, None, max_new_tokens=5, observer=obs)
    while not s.done:
        step(s)
    assert obs.calls == []
    assert plain_generate(target, PROMPT, max_new_tokens=5).tokens == s.result().tokens


def test_summary_matches_itself_and_catches_a_shifted_capture(tiny):
    """Without a training fingerprint, the live target's trained boundaries on the same request
    stand in for one: a healthy capture matches it, and a capture shifted by one block does not
    (the recovered slot order and the boundary check say so whatever the statistics)."""
    model, drafter = tiny
    for spec, healthy in ((SPEC, True), (CaptureSpec((3, 5, 6), SPEC.num_blocks), False)):
        target = HFTarget(model, spec)
        with Tracer(target, drafter) as tr:
            r = speculative_generate(target, drafter, PROMPT, max_new_tokens=12, observer=tr)
        s = tr.summary(trained=list(SPEC.boundaries), sequence=PROMPT + r.tokens)
        assert s.healthy is healthy and s.exit_code == (0 if healthy else 1), s.problems
        assert s.reference.startswith("no training fingerprint")
        assert s.slot_order == list(spec.boundaries) and s.fc_input.width == 3 * H
        if healthy:
            assert all(row.verdict == "ok" and row.looks_like == b for row, b in zip(s.slots, SPEC.boundaries))
            assert all(abs(row.rms_z) < 1 for row in s.slots)
        else:
            assert all(row.off and row.boundary_mismatch for row in s.slots)
            assert "slot 0 is fed boundary 3 (output of block 2) but was trained on boundary 2" in " ".join(s.problems)
        json.dumps(s.to_dict())


def test_a_channel_shift_alone_is_a_warning_when_the_slot_is_what_it_should_be(tiny):
    """One request is not the training data: its channel means move with its text. A slot whose RMS
    matches and that matches its trained boundary of the live target on the same tokens is only
    warned about; without the live target to tell, or with the RMS off, it is a problem."""
    model, drafter = tiny
    target = HFTarget(model, SPEC)
    with Tracer(target, drafter) as tr:
        r = speculative_generate(target, drafter, PROMPT, max_new_tokens=12, observer=tr)
    seq = PROMPT + r.tokens
    live = tr.live_boundary_stats(seq)

    def moved(fp, rms=1.0, shift=0.0):
        return fp.model_copy(update={"rms_mean": fp.rms_mean * rms,
                                     "channel_means": [m + shift * fp.rms_mean for m in fp.channel_means]})

    shifted = [moved(live[b], shift=1.0) for b in SPEC.boundaries]
    s = tr.summary(shifted, sequence=seq)
    assert s.healthy and s.exit_code == 0 and len(s.warnings) == 3, s.problems
    assert all(row.channel_off and row.fingerprint_off and not row.off for row in s.slots)
    assert not tr.summary(shifted).healthy  # no live target to tell what the slot is
    s = tr.summary([moved(live[b], rms=2.0) for b in SPEC.boundaries], sequence=seq)
    assert s.exit_code == 1 and all(row.rms_off and row.off for row in s.slots)
    assert s.problems[0].startswith("slot 0 is off: per-token RMS") and "ratio 0.50" in s.problems[0]


# ---------------------------------------------------------------------------------------------
# The command, on a toy target with a training fingerprint
# ---------------------------------------------------------------------------------------------

L = 12
TRAINED = [2, 6, 9]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from eyas.capture.stats import FingerprintAccumulator
    from eyas.data.render import render_prompt
    from eyas.drafter.build import new_drafter
    from eyas.interop import save_drafter
    from eyas.targets import load_target

    root = tmp_path_factory.mktemp("trace")
    path = make_toy_target(root / "target", num_blocks=L)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # as test_doctor.py: every block writes its own features into the residual stream
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(3.0)
    model.save_pretrained(path)
    loaded = load_target(str(path))
    model, tok = loaded.model, loaded.tokenizer
    # The training fingerprint, as online training records it: the captured slots of training
    # conversations (prompt and the target's own answer), every token but the first.
    spec = CaptureSpec(tuple(TRAINED), L)
    acc = FingerprintAccumulator(TRAINED, model.config.hidden_size)
    with torch.no_grad():
        for i in range(6):
            question = f"Question {i}: what is {i} times {i % 7 + 2}?"
            ids = render_prompt([{"role": "user", "content": question}], tok)[None]
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            with BoundaryCapture(model, spec) as cap:
                model(seq)
                acc.update_sequence(torch.stack(cap.slots(), dim=2)[0])
    drafter, contract = new_drafter(model, tok, TRAINED, draft_vocab_size=512)
    contract.fingerprint = acc.result()
    save_drafter(drafter, contract, root / "base")
    return {"root": root, "target": path, "base": root / "base"}


def served_copy(world, name: str, edit) -> Path:
    dst = world["root"] / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(world["base"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def trace_cli(world, draft, out, *extra):
    import typer
    from typer.testing import CliRunner

    from eyas.cli.doctor_command import register

    cli = typer.Typer()
    register(cli)

    @cli.callback()
    def _root() -> None:  # a group, so that `trace` is a subcommand as in `eyas trace`
        pass

    args = ["trace", "--target", str(world["target"]), "--draft", str(draft), "--prompt", "What is 7 times 8?",
            "--out", str(out), "--max-new-tokens", "16", "--device", "cpu", *extra]
    return CliRunner().invoke(cli, args)


def test_cli_healthy_drafter_matches_its_fingerprint(world, tmp_path):
    res = trace_cli(world, world["base"], tmp_path / "ok.jsonl", "--json", "--tree", "3,2,6")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    s = report["summary"]
    assert report["healthy"] and s["healthy"] and s["problems"] == []
    assert s["reference"] == "contract.fingerprint (from the training data)"
    assert s["slot_order"] == TRAINED and s["served_boundaries"] == TRAINED and s["trained_boundaries"] == TRAINED
    for row, b in zip(s["slots"], TRAINED):
        assert row["verdict"] == "ok" and row["looks_like"] == b and row["trained_matches"] == b
    assert s["fc_input"]["width"] == s["fc_input"]["expected_width"] == 3 * 64
    lines = read_jsonl(tmp_path / "ok.jsonl")
    assert lines[0]["header"]["engine"]["name"] == "eyas" and lines[-1]["summary"] == s
    assert {rec["junction"] for rec in lines[1:-1]} == set(JUNCTIONS)
    assert len({rec["round"] for rec in lines[1:-1]}) == s["rounds"] == report["generation"]["rounds"]
    # vLLM reads the top-level ids eyas wrote: the same boundaries, the same verdict, as a table
    res = trace_cli(world, world["base"], tmp_path / "ok-vllm.jsonl", "--engine", "vllm")
    assert res.exit_code == 0, res.output
    assert "MATCHES" in res.stdout and "vLLM" in res.stdout


def test_cli_traces_the_fast_target_to_the_same_records(world, tmp_path):
    """--target-impl picks the engine's target (auto: the fast one wherever it applies, the CPU
    included); the fast target is traced to the same records and verdict as the Hugging Face one,
    and the header and report say which ran."""
    runs = {}
    for impl in ("hf", "auto"):
        res = trace_cli(world, world["base"], tmp_path / f"{impl}.jsonl", "--json", "--tree", "3,2,6",
                        "--target-impl", impl)
        assert res.exit_code == 0, res.output
        runs[impl] = (json.loads(res.stdout), read_jsonl(tmp_path / f"{impl}.jsonl"))
    (hf, hf_lines), (fast, fast_lines) = runs["hf"], runs["auto"]
    assert hf["target_impl"] == hf_lines[0]["header"]["target_impl"] == "hf"
    assert fast["target_impl"] == fast_lines[0]["header"]["target_impl"] == "fast"
    assert fast["healthy"] and fast["generation"]["text"] == hf["generation"]["text"]
    records_close(hf_lines[1:-1], fast_lines[1:-1])
    assert [r["verdict"] for r in fast["summary"]["slots"]] == [r["verdict"] for r in hf["summary"]["slots"]]
    res = trace_cli(world, world["base"], tmp_path / "x.jsonl", "--target-impl", "turbo")
    assert res.exit_code == 2 and "--target-impl" in res.output


def test_cli_embedding_served_as_first_slot_is_flagged(world, tmp_path):
    # vLLM reads top-level ids as boundaries: [0, 2, 6] = the embedding first, the trained slots shifted right
    d = served_copy(world, "emb-in-vllm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 6]))
    res = trace_cli(world, d, tmp_path / "bad.jsonl", "--engine", "vllm", "--json")
    assert res.exit_code == 1, res.output
    s = json.loads(res.stdout)["summary"]
    assert not s["healthy"] and s["slot_order"] == [0, 2, 6] and s["trained_boundaries"] == TRAINED
    slot0 = s["slots"][0]
    assert slot0["off"] and slot0["fingerprint_off"] and slot0["served_boundary"] == 0
    assert slot0["looks_like"] == 0 and slot0["trained_matches"] == 2 and slot0["rms_z"] < -3
    assert any(p.startswith("slot 0 is off") and "looks like boundary 0 (the embedding output)" in p
               for p in s["problems"])
    assert read_jsonl(tmp_path / "bad.jsonl")[1]["boundary"] == 0  # slot 0's record: the embedding
    # as a table
    res = trace_cli(world, d, tmp_path / "bad2.jsonl", "--engine", "vllm")
    assert res.exit_code == 1 and "OFF" in res.stdout and "looks like boundary 0" in res.stdout


def test_cli_unusable_input_exits_2(world, tmp_path):
    res = trace_cli(world, world["base"], tmp_path / "x.jsonl", "--engine", "sglang", "--sglang-rule", "v9")
    assert res.exit_code == 2 and "sglang-rule" in res.output
    res = trace_cli(world, world["root"] / "nowhere", tmp_path / "x.jsonl")
    assert res.exit_code == 2
    # one new token: the drafter never reads anything, there is nothing to hold against the fingerprint
    res = trace_cli(world, world["base"], tmp_path / "x.jsonl", "--max-new-tokens", "1")
    assert res.exit_code == 2 and "nothing to hold against the fingerprint" in res.output
    # a directory the engine cannot serve: boundary L never arrives in vLLM
    d = served_copy(world, "ids-with-L", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 6, L]))
    res = trace_cli(world, d, tmp_path / "x.jsonl", "--engine", "vllm")
    assert res.exit_code == 2 and "never arrives" in res.output
