"""`eyas doctor` on toy targets of 12 blocks with briefly trained drafters: each test breaks the
served setup the way users break it (an edited config.json, another engine, another target, another
chat template) and asserts the verdict, the cause and the fix.

The toy target is tests/support/toy.py's tiny Llama with its MLP outputs scaled up, so that every block
writes its own features into the residual stream and the boundaries differ from each other as
they do in trained models (with the plain toy, every boundary is nearly the embedding, and a
drafter fed the wrong ones barely notices). Its greedy answers to 24 short prompts, each
conversation twice, are data a drafter learns in 60 steps (held-out samples have a twin in the
training split), so live accuracy visibly falls when the capture is wrong.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eyas.doctor import run_doctor
from tests.support.toy import make_toy_target

L = 12
TRAINED = [2, 6, 9]  # the EAGLE-3 default [2, L//2, L-3]
EMB_TRAINED = [0, 6, 9]  # a drafter trained with the embedding output as its first slot


def _toy_target(root: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    path = make_toy_target(root, num_blocks=L, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(3.0)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def _conversations(model, tok, out: Path, n: int = 24, answer_tokens: int = 24) -> Path:
    tok.padding_side = "left"
    batch = [[{"role": "user", "content": f"Question {i}: what is {i} times {i % 7 + 2}?"}] for i in range(n)]
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    gen = model.generate(**enc, max_new_tokens=answer_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    rows = [{"messages": m + [{"role": "assistant", "content": tok.decode(g, skip_special_tokens=True)}]}
            for m, g in zip(batch, gen[:, enc.input_ids.shape[1]:])]
    tok.padding_side = "right"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows + rows))
    return out


def _train_cfg(target: Path, data: Path, out: Path, **kw):
    from eyas.training.config import TrainConfig

    base = dict(target=str(target), data=str(data), out=str(out), steps=60, batch_size=8, draft_vocab_size=512,
                lr=3e-3, warmup_steps=10, ttt_steps=3, val_fraction=0.25, max_val_samples=16, log_every=20,
                eval_every=1000, save_every=1000, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):
    """Targets, data and two trained drafters, built once for the module."""
    import eyas.training.loop as loop
    from eyas.data.conversation_files import read_conversations
    from eyas.data.shards import CaptureOptions, capture_shards
    from eyas.targets import load_target

    root = tmp_path_factory.mktemp("doctor")
    target = _toy_target(root / "target")
    loaded = load_target(str(target))
    model, tok = loaded.model, loaded.tokenizer
    convs = _conversations(model, tok, root / "conversations.jsonl")
    capture_shards(model, tok, read_conversations(convs).conversations,
                   CaptureOptions(out_dir=root / "shards", boundaries=list(TRAINED), dtype="bfloat16", progress=False))
    # 1. offline, from shards, on the default boundaries [2, 6, 9]
    loop.train(_train_cfg(target, root / "shards", root / "base"), log=lambda m: None)
    # 2. online, with the embedding output as slot 0, and norm_before_fc
    loop.train(_train_cfg(target, convs, root / "emb", boundaries=EMB_TRAINED, norm_before_fc=True), log=lambda m: None)
    return {"root": root, "target": target, "model": model, "tok": tok, "shards": root / "shards", "convs": convs,
           "base": root / "base", "emb": root / "emb"}


def doctor(world, draft, engine="eyas", version=None, data="shards", target=None, **kw):
    model, tok, name = world["model"], world["tok"], world["target"]
    if target is not None:
        from eyas.targets import load_target

        loaded = load_target(str(target))
        model, tok = loaded.model, loaded.tokenizer
        name = target
    data_path = world[data] if data in ("shards", "convs") else data
    return run_doctor(str(name), str(draft), data=str(data_path) if data_path else None, engine=engine,
                      sglang_rule=version, samples=16, model=model, tokenizer=tok, **kw)


def served_copy(world, src: str, name: str, edit=None) -> Path:
    """A copy of a trained drafter directory (what gets served), with config.json edited by ``edit``."""
    dst = world["root"] / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(world[src], dst, ignore=shutil.ignore_patterns("checkpoints", "*.png", "metrics.jsonl"))
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def codes(report, stage: str) -> set[str]:
    return {f.code for f in report.stages[stage].findings if f.level == "fail"}


# ---------------------------------------------------------------------------------------------
# Healthy
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("engine,version", [("eyas", None), ("sglang", "pr25454"), ("sglang", "legacy"), ("vllm", None)])
def test_healthy_drafter_passes_with_no_warning_on_every_engine_setting(world, engine, version):
    r = doctor(world, world["base"], engine, version)
    assert r.healthy, (r.cause, r.problems)
    assert r.warnings == [] and r.cause is None and r.fix is None and r.exit_code == 0
    assert r.stages["static"].status == "pass" and r.stages["replay"].status == "pass"
    assert r.stages["live"].status == "pass" and r.stages["fingerprint"].status == "pass"
    assert r.stages["search"].status == "skipped"
    # the held-out split of the training run is reproduced: replay gives exactly the recorded accuracy
    trained = r.stages.replay.result.training.accuracy_per_position
    assert r.stages.replay.result.accuracy.accuracy_per_position == pytest.approx(trained, abs=1e-4)
    assert r.stages.live.result.accuracy.accuracy_per_position == pytest.approx(trained, abs=0.02)
    assert trained[0] > 0.15  # the drafter learned something: the checks below are not about a dead drafter
    for slot in r.stages.fingerprint.result.slots:
        assert slot.looks_like == slot.trained_boundary and abs(slot.rms_z) < 1
        assert slot.trained_matches == slot.trained_boundary and not slot.shifted and not slot.indistinct


@pytest.mark.integration
def test_healthy_speculators_export_read_by_vllm(world, tmp_path):
    from eyas.interop import export_drafter

    export_drafter(world["base"], "vllm", tmp_path / "spec")
    r = doctor(world, tmp_path / "spec", "vllm")
    assert r.healthy and r.warnings == [], (r.cause, r.warnings)
    # without --data and without train_config.json (an export has none), the target answers built-in prompts
    r = doctor(world, tmp_path / "spec", "vllm", data=None)
    assert r.healthy and r.warnings == [] and r.data.source == "generated", (r.cause, r.warnings)
    # SGLang cannot load that format at all: said, with the export that fixes it
    s = doctor(world, tmp_path / "spec", "sglang")
    assert not s.healthy and "engine_cannot_load" in codes(s, "static")
    assert "eyas export" in s.fix and "--to sglang" in s.fix


@pytest.mark.integration
def test_cli_json_png_and_exit_codes(world, tmp_path):
    import typer
    from typer.testing import CliRunner

    from eyas.cli.doctor_command import register

    cli = typer.Typer()
    register(cli)

    @cli.callback()
    def _root() -> None:  # a group, so that `doctor` is a subcommand as in `eyas doctor`
        pass

    runner = CliRunner()
    args = ["doctor", "--target", str(world["target"]), "--data", str(world["shards"]), "--samples", "8"]
    ok = runner.invoke(cli, args + ["--draft", str(world["base"]), "--json", "--png", str(tmp_path / "ok.png")])
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.stdout)
    assert report["healthy"] is True and report["cause"] is None and report["fix"] is None
    assert {"static", "replay", "live", "fingerprint", "search"} <= report.keys()
    assert (tmp_path / "ok.png").stat().st_size > 1000

    broken = served_copy(world, "base", "cli-broken", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 5, 8]))
    bad = runner.invoke(cli, args + ["--draft", str(broken), "--engine", "vllm"])
    assert bad.exit_code == 1 and "NOT HEALTHY" in bad.stdout and "verdict" in bad.stdout
    usage = runner.invoke(cli, args + ["--draft", str(broken), "--engine", "sglang", "--sglang-rule", "v9"])
    assert usage.exit_code == 2


# ---------------------------------------------------------------------------------------------
# Embedding in or out
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_embedding_served_as_first_slot_and_last_slot_dropped(world, tmp_path):
    # vLLM reads top-level ids as boundaries: [0, 2, 6] = embedding first, trained slots shifted right
    d = served_copy(world, "base", "emb-in-vllm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 6]))
    r = doctor(world, d, "vllm", png=tmp_path / "doctor.png")
    assert not r.healthy and r.exit_code == 1
    assert "boundaries" in codes(r, "static") and "live_short" in codes(r, "live")
    assert "slot 0 is the embedding output (boundary 0)" in r.cause and "boundary 9" in r.cause
    assert "slot 0 looks like boundary 0 (the embedding output)" in r.cause  # named by the fingerprint
    assert "top-level eagle_aux_hidden_state_layer_ids: [2, 6, 9]" in r.fix
    assert [e.to_dict() for e in r.fix_edits] == [
        {"file": "config.json", "key": "eagle_aux_hidden_state_layer_ids", "value": [2, 6, 9],
         "text": "top-level eagle_aux_hidden_state_layer_ids: [2, 6, 9]"}]
    slot0 = r.stages.fingerprint.result.slots[0]
    assert slot0.off and slot0.looks_like == 0 and slot0.trained_matches == 2
    live = r.stages.live.result.accuracy.accuracy_per_position
    replay = r.stages.replay.result.accuracy.accuracy_per_position
    assert live[0] < replay[0] / 2
    search = r.stages.search.result
    assert search.winner.boundaries == "[2, 6, 9]"
    assert search.winner_accuracy.accuracy_per_position[0] == pytest.approx(replay[0], abs=0.02)

    assert (tmp_path / "doctor.png").stat().st_size > 1000
    json.dumps(r.to_dict())  # the whole report is JSON

    # the same for SGLang (PR #25454 reads ids not starting with 1 as written): the fix is in its convention
    d = served_copy(world, "base", "emb-in-sglang", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, 6]))
    r = doctor(world, d, "sglang", "pr25454")
    assert not r.healthy and "slot 0 is the embedding output" in r.cause
    assert "eagle_config.eagle_aux_hidden_state_layer_ids: [1, 5, 8]" in r.fix


@pytest.mark.integration
def test_trained_with_embedding_first_served_without_it(world):
    # vLLM: the top-level ids were dropped, so vLLM falls back to its default [2, 6, 9]
    d = served_copy(world, "emb", "emb-out-vllm", lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    r = doctor(world, d, "vllm", data="convs")
    assert not r.healthy
    assert "slot 0 was trained on the embedding output (boundary 0)" in r.cause
    assert "absent" in r.cause  # the engine's default is named as the reason
    assert "top-level eagle_aux_hidden_state_layer_ids: [0, 6, 9]" in r.fix
    assert r.stages.fingerprint.result.slots[0].trained_matches == 0
    # an SGLang before PR #25454 reads the ids eyas wrote for the current rule ([0, 6, 9]) as [1, 7, 10]
    r = doctor(world, world["emb"], "sglang", "legacy", data="convs")
    assert not r.healthy and r.stages.static.result.engine.boundaries == [1, 7, 10]
    assert "eagle_config.eagle_aux_hidden_state_layer_ids: [-1, 5, 8]" in r.fix
    # ...while the current rule reads them right (a warning says the legacy rule would not)
    r = doctor(world, world["emb"], "sglang", "pr25454", data="convs")
    assert r.healthy and any("legacy rule would capture [1, 7, 10]" in w for w in r.warnings)


# ---------------------------------------------------------------------------------------------
# Layer-id conventions
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_sglang_convention_read_by_vllm_is_off_by_one(world):
    # SpecForge/SGLang ids (output of block k) copied to the top-level key that vLLM reads as boundaries
    d = served_copy(world, "base", "sg-ids-vllm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 5, 8]))
    r = doctor(world, d, "vllm")
    assert not r.healthy
    assert "[1, 5, 8]" in r.cause and "one block before" in r.cause
    assert "top-level eagle_aux_hidden_state_layer_ids: [2, 6, 9]" in r.fix
    assert r.stages.search.result.winner.boundaries == "[2, 6, 9]"
    # the fingerprint names each one-block shift: fed [1, 5, 8], its training statistics match [2, 6, 9]
    slots = r.stages.fingerprint.result.slots
    assert r.stages.fingerprint.status == "fail" and all(s.off and s.shifted for s in slots)
    assert [(s.looks_like, s.trained_matches) for s in slots] == [(1, 2), (5, 6), (8, 9)]


@pytest.mark.integration
def test_vllm_convention_read_by_sglang_is_off_by_one(world):
    # vLLM ids (boundaries) written into SGLang's nested key
    d = served_copy(world, "base", "vl-ids-sglang", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 6, 9]))
    r = doctor(world, d, "sglang", "legacy")
    assert not r.healthy
    assert "[3, 7, 10]" in r.cause and "one block after" in r.cause
    assert "eagle_config.eagle_aux_hidden_state_layer_ids: [1, 5, 8]" in r.fix
    # PR #25454 happens to read [2, 6, 9] as written: healthy, with a warning for the other rule
    r = doctor(world, d, "sglang", "pr25454")
    assert r.healthy and len(r.warnings) == 1 and "[1, 5, 8]" in r.warnings[0]


@pytest.mark.integration
def test_the_last_blocks_output_reaches_eyas_but_not_sglang_or_vllm(world, tmp_path):
    from eyas.drafter.build import new_drafter
    from eyas.interop import save_drafter

    # config.json edited to ask vLLM for boundary L: vLLM captures layer inputs only, it never arrives
    d = served_copy(world, "base", "ids-with-L", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 6, L]))
    r = doctor(world, d, "vllm")
    assert not r.healthy and "never arrives" in r.cause
    assert "top-level eagle_aux_hidden_state_layer_ids: [2, 6, 9]" in r.fix
    assert r.stages["live"].status == "skipped"
    # a drafter made for [2, 6, L]: fine in eyas, impossible in SGLang and vLLM whatever the ids
    drafter, contract = new_drafter(world["model"], world["tok"], [2, 6, L], draft_vocab_size=512)
    save_drafter(drafter, contract, tmp_path / "withL")
    r = doctor(world, tmp_path / "withL", "sglang")
    assert not r.healthy and codes(r, "static") == {"uncapturable"} and "retrain" in r.fix
    r = doctor(world, tmp_path / "withL", "eyas")
    assert r.healthy, r.problems


@pytest.mark.integration
def test_a_third_party_directory_is_judged_by_its_training_shards(world, tmp_path):
    """No eyas.json: the directory's own convention is exactly what is in doubt. Given the shards it
    was trained on, the doctor takes their boundaries as the trained ones."""
    import os

    from eyas.interop import export_drafter

    d = tmp_path / "third-party"
    export_drafter(world["base"], "sglang", d)
    os.remove(d / "eyas.json")
    cfg = json.loads((d / "config.json").read_text())
    for key in [k for k in cfg if k.startswith("eyas_")] + ["eagle_aux_hidden_state_layer_ids"]:
        del cfg[key]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = TRAINED  # boundaries written where SGLang expects ids
    (d / "config.json").write_text(json.dumps(cfg))
    r = doctor(world, d, "sglang", "legacy")
    assert not r.healthy and "one block after" in r.cause
    assert "eagle_config.eagle_aux_hidden_state_layer_ids: [1, 5, 8]" in r.fix
    assert r.stages.replay.result.features.startswith("stored training features")
    r = doctor(world, d, "vllm")  # no top-level ids: vLLM's default [2, 6, 9] is right
    assert r.healthy and any("no eyas.json contract" in w for w in r.warnings)


# ---------------------------------------------------------------------------------------------
# No contract, no ids: the conversations decide
# ---------------------------------------------------------------------------------------------


def stripped(world, src, name: str) -> Path:
    """A copy of a drafter directory with nothing that records its boundaries: no eyas.json, no
    train_config.json, no eyas_* keys and no layer ids in config.json (a third-party SGLang checkpoint)."""
    dst = world["root"] / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("best", "checkpoints", "*.png", "metrics.jsonl",
                                                            "eyas.json", "train_config.json"))
    cfg = json.loads((dst / "config.json").read_text())
    for key in [k for k in cfg if k.startswith("eyas_") or k == "eagle_aux_hidden_state_layer_ids"]:
        del cfg[key]
    cfg.pop("eagle_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    assert not (dst / "eyas.json").exists()
    return dst


@pytest.mark.integration
def test_without_contract_or_ids_the_conversations_find_the_trained_boundaries(world):
    """The drafter trained on [0, 6, 9] (embedding first), stripped of everything that records it:
    the engines capture the default [2, 6, 9]. Given only the conversations, its live accuracy picks
    [0, 6, 9] by a clear margin; the verdict rests on that (SGLang's default is wrong for it)."""
    d = stripped(world, world["emb"], "emb-stripped")
    r = doctor(world, d, "sglang", "pr25454", data="convs")
    assert r.draft.trained_boundaries == EMB_TRAINED
    static = {f.code: f for f in r.stages["static"].findings}
    assert "boundaries_assumed" not in static and static["boundaries_inferred"].level == "info"
    assert "inferred from live accuracy" in static["boundaries_inferred"].message
    inference = r.stages.static.result.trained.inference
    assert inference.decided == EMB_TRAINED and inference.candidates[0].boundaries == EMB_TRAINED
    assert inference.lead > inference.lead_needed > 0
    assert f"{inference.candidates[0].log_likelihood:.3f}" in static["boundaries_inferred"].message  # the figures
    assert r.stages.static.result.trained.boundaries_source.startswith("live accuracy on conversations")
    # decided, the verdict is a verdict: SGLang feeds the default [2, 6, 9], the fix writes [0, 6, 9]
    assert r.status == "unhealthy" and r.unverified is None
    assert "trained on [0, 6, 9]" in r.cause and "eagle_aux_hidden_state_layer_ids: [0, 6, 9]" in r.fix
    assert r.stages.search.result.winner.boundaries == "[0, 6, 9]"
    assert r.to_dict()["static"]["trained"]["inference"]["decided"] == EMB_TRAINED

    # the drafter trained on the default, stripped: the default is found, and it is healthy
    d = stripped(world, world["base"], "base-stripped")
    r = doctor(world, d, "sglang", "pr25454", data="convs")
    assert r.status == "healthy" and r.exit_code == 0, (r.unverified, r.problems)
    assert r.stages.static.result.trained.inference.decided == TRAINED
    assert "boundaries_inferred" in {f.code for f in r.stages["static"].findings}


@pytest.mark.integration
def test_without_contract_or_ids_an_untrained_drafter_leaves_the_boundaries_undecided(world):
    """A drafter that reads no boundary set as trained (untrained, with the trained drafter's draft
    vocabulary so that enough tokens count): the doctor says it cannot decide and why, with the
    figures of the top two, and the verdict stays unverified."""
    from safetensors.torch import load_file

    from eyas.drafter.build import new_drafter
    from eyas.interop import save_drafter

    drafter, contract = new_drafter(world["model"], world["tok"], [3, 6, 9], draft_vocab_size=512)
    d2t = load_file(str(world["base"] / "model.safetensors"))["d2t"]
    drafter.set_vocab_map(torch.arange(d2t.shape[0]) + d2t.long())
    d = stripped(world, save_drafter(drafter, contract, world["root"] / "untrained"), "untrained-stripped")
    r = doctor(world, d, "sglang", "pr25454", data="convs")
    assert r.status == "unverified" and r.exit_code == 3
    inference = r.stages.static.result.trained.inference
    assert inference.decided is None and inference.candidates[0].tokens >= 100
    assumed = next(f for f in r.stages["static"].findings if f.code == "boundaries_assumed")
    assert "cannot decide" in assumed.message and "predicts the target's next token poorly" in assumed.message
    assert f"accuracy {inference.candidates[0].accuracy:.3f}" in assumed.message
    assert "cannot decide" in r.unverified


@pytest.mark.unit
def test_the_margin_rule_needs_a_lead_beyond_noise_enough_tokens_and_a_reading_drafter():
    from eyas.doctor.infer import INFER_MIN_TOKENS, ScoredSet, candidate_sets, decide

    def scored(bs, lp, right):
        lp, right = torch.tensor(lp, dtype=torch.float64), torch.tensor(right, dtype=torch.float64)
        return ScoredSet(bs, str(bs), float(lp.mean()), float(right.mean()), lp.numel(), lp)

    n = 400
    g = torch.Generator().manual_seed(0)
    base = (-3 + torch.randn(n, generator=g)).tolist()
    right = [1.0] * (n // 2) + [0.0] * (n - n // 2)
    clear = [scored([2, 6, 9], base, right), scored([2, 6, 10], [x - 0.1 for x in base], right)]
    best, lead, need, why = decide(clear)
    assert best is not None and best.boundaries == [2, 6, 9] and lead == pytest.approx(0.1) and need == 0.01
    noisy = [scored([2, 6, 9], base, right),
             scored([2, 6, 10], [x - 0.1 + float(e) for x, e in zip(base, torch.randn(n, generator=g) * 3)], right)]
    best, lead, need, why = decide(noisy)
    assert best is None and lead < need and why.startswith("no clear winner") and "[2, 6, 10]" in why
    few = [scored(s.boundaries, s.lp[: INFER_MIN_TOKENS - 1].tolist(), right[: INFER_MIN_TOKENS - 1]) for s in clear]
    assert decide(few)[0] is None and "tokens counted" in decide(few)[3]
    dead = [scored(s.boundaries, s.lp.tolist(), [0.0] * n) for s in clear]
    assert decide(dead)[0] is None and "poorly" in decide(dead)[3]
    assert decide(clear[:1])[0] is None and "nothing tells it apart" in decide(clear[:1])[3]  # no runner-up
    # candidates: the bases first, then their one-block shifts; never out of range, never repeated
    sets = [bs for bs, _ in candidate_sets([([2, 6, 9], "default"), ([0, 6, 9], "emb"), (None, "x")], 3, L)]
    assert sets[:2] == [[2, 6, 9], [0, 6, 9]] and [3, 7, 10] in sets and [2, 6, 10] in sets and [1, 6, 9] in sets
    assert len(sets) == len({tuple(s) for s in sets}) and all(0 <= b <= L for s in sets for b in s)


# ---------------------------------------------------------------------------------------------
# Norm flags
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_norm_before_fc_trained_on_but_missing_from_config(world, engine):
    d = served_copy(world, "emb", f"nbf-{engine}", lambda c: c.pop("norm_before_fc"))
    r = doctor(world, d, engine, data="convs")
    assert not r.healthy and codes(r, "static") == {"flag:norm_before_fc"}
    assert "norm_before_fc=false" in r.cause and "norm_before_fc=true" in r.cause and "input_norm.weight" in r.cause
    assert r.fix.endswith('set "norm_before_fc": true')
    assert r.stages.live.result.flags["norm_before_fc"] is False


@pytest.mark.integration
def test_norm_before_fc_missing_still_serves_right_in_eyas_with_a_warning(world):
    d = served_copy(world, "emb", "nbf-eyas", lambda c: c.pop("norm_before_fc"))
    r = doctor(world, d, "eyas", data="convs")
    assert r.healthy  # eyas reads eyas.json
    assert any("does not state norm_before_fc" in w for w in r.warnings)


def _as_converted(world, tmp_path, norm_before_residual: bool) -> Path:
    """The base drafter (trained with norm_before_residual false) as speculators' converter writes
    it: speculators format, its top-level ids kept, no eyas.json or eyas_* keys, speculators_version,
    and norm_before_residual from the converter's option."""
    from eyas.interop import export_drafter

    d = tmp_path / f"converted-{norm_before_residual}"
    export_drafter(world["base"], "vllm", d)
    (d / "eyas.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    for key in [k for k in cfg if k.startswith("eyas_")]:
        del cfg[key]
    cfg.update(speculators_version="0.9.0", norm_before_residual=norm_before_residual)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.integration
def test_a_norm_flag_the_converter_chose_is_settled_by_live_accuracy(world, tmp_path):
    """norm_before_residual in a converted directory is the converter's choice, not a record: the
    doctor measures the drafter with it as written and toggled. Written wrong (true for a drafter
    trained with false), the measured value is the trained one and vLLM's reading fails with the
    edit; written right, the measurement confirms it."""
    r = doctor(world, _as_converted(world, tmp_path, True), "vllm", data="convs")
    assert not r.healthy and "flag:norm_before_residual" in codes(r, "static")
    fi = r.stages.static.result.trained.flag_inferences["norm_before_residual"]
    assert fi.written is True and fi.decided is False
    assert r.stages.static.result.trained.flags["norm_before_residual"] is False
    assert "norm_before_residual=false inferred from live accuracy" in r.cause
    assert r.fix.endswith('set "norm_before_residual": false')
    r = doctor(world, _as_converted(world, tmp_path, False), "vllm", data="convs")
    assert r.healthy, (r.cause, r.problems)
    confirmed = [f for f in r.stages["static"].findings if f.code == "flag_confirmed:norm_before_residual"]
    assert len(confirmed) == 1 and "confirms it" in confirmed[0].message
    assert not [f for f in r.stages["static"].findings if f.code.startswith("flag_assumed")]


@pytest.mark.integration
def test_vllm_reads_an_absent_norm_before_residual_as_true(world, tmp_path):
    from eyas.interop import export_drafter

    export_drafter(world["base"], "vllm", tmp_path / "spec")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    del cfg["norm_before_residual"]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    r = doctor(world, tmp_path / "spec", "vllm")
    assert not r.healthy and codes(r, "static") == {"flag:norm_before_residual"}
    assert "norm_before_residual=true" in r.cause and "absent from config.json" in r.cause
    assert r.fix.endswith('set "norm_before_residual": false')


# ---------------------------------------------------------------------------------------------
# Target and chat template
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_another_checkpoint_of_the_same_shape(world):
    other = world["root"] / "target-seed1"
    if not other.exists():
        _toy_target(other, seed=1)
    r = doctor(world, world["base"], "vllm", target=other)
    assert not r.healthy and "target_mismatch" in codes(r, "static")
    fp = r.stages["static"].findings[[f.code for f in r.stages["static"].findings].index("target_mismatch")]
    assert fp.field == "target.fingerprint" and fp.expected != fp.found
    assert "the embedding, blocks 0 to 11" in fp.message  # the per-part sample names what differs
    assert "target.fingerprint" in r.cause and "same shape" in r.cause
    assert f"weights fingerprint {fp.expected}" in r.fix and str(world["target"]) in r.fix


@pytest.mark.integration
def test_a_shortfall_on_other_data_than_training_is_not_called_a_mismatch(world):
    """Replay below the recorded accuracy fails on the training data itself, but on conversations
    the run did not train on (train_config.json names other data) it is a note: other text is
    predicted less well, and the capture is judged by live against replay on the same tokens."""
    def inflate(d: Path) -> None:  # as if training had recorded a far higher accuracy
        meta = json.loads((d / "eyas.json").read_text())
        acc = meta["contract"]["metrics"]["accuracy_per_position"]
        meta["contract"]["metrics"]["accuracy_per_position"] = [0.99] + acc[1:]
        (d / "eyas.json").write_text(json.dumps(meta))

    d = served_copy(world, "base", "inflated")
    inflate(d)
    on_training_data = doctor(world, d, data="shards")
    assert not on_training_data.healthy and "replay_short" in codes(on_training_data, "replay")
    on_other_data = doctor(world, d, data="convs")  # base trained on the shards; train_config names them
    replay = on_other_data.stages["replay"].findings
    assert "replay_short" not in codes(on_other_data, "replay")
    assert any(f.code == "replay_other_data" and "not a failure" in f.message for f in replay)
    assert on_other_data.healthy, on_other_data.cause


@pytest.mark.integration
def test_a_changed_middle_block_is_named_as_a_warning_when_acceptance_holds(world):
    """Block 4's MLP output scaled by 1%: the embedding and final norm (the old fingerprint) are the
    same, the per-block sample names block 4, and the verdict rests on the measured acceptance."""
    from transformers import AutoModelForCausalLM

    changed = world["root"] / "target-block4"
    if not changed.exists():
        shutil.copytree(world["target"], changed)
        model = AutoModelForCausalLM.from_pretrained(changed, dtype=torch.float32)
        with torch.no_grad():
            model.model.layers[4].mlp.down_proj.weight.mul_(1.01)
        model.save_pretrained(changed)
    r = doctor(world, world["base"], "eyas", target=changed)
    static = r.stages["static"].findings
    warn = [f for f in static if f.code == "target_changed"]
    assert len(warn) == 1 and warn[0].level == "warn" and warn[0].field == "target.weights"
    assert "block 4 differs" in warn[0].message and warn[0].found == "block 4 differs"
    assert "target_mismatch" not in codes(r, "static") and "contract" not in {f.code for f in static}
    assert r.healthy, r.cause


@pytest.mark.integration
def test_a_changed_embedding_and_final_norm_are_named_as_a_warning_when_acceptance_holds(world):
    """The embedding and the final norm scaled by 1% (the weights fingerprint changes, every block is
    the same): a modified copy of the training target, named in a warning, and the verdict rests on the
    measured acceptance; another seed (every part differs) stays target_mismatch
    (test_another_checkpoint_of_the_same_shape)."""
    from transformers import AutoModelForCausalLM

    changed = world["root"] / "target-emb-norm"
    if not changed.exists():
        shutil.copytree(world["target"], changed)
        model = AutoModelForCausalLM.from_pretrained(changed, dtype=torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(1.01)
            model.model.norm.weight.mul_(1.01)
        model.save_pretrained(changed)
    r = doctor(world, world["base"], "vllm", target=changed)
    static = r.stages["static"].findings
    warn = [f for f in static if f.code == "target_changed"]
    assert len(warn) == 1 and warn[0].level == "warn" and warn[0].field == "target.weights"
    assert warn[0].found == "the embedding and the final norm differ"
    assert "2 of its 15 parts" in warn[0].message and "not another model" in warn[0].message
    assert "target_mismatch" not in codes(r, "static")
    assert r.healthy, (r.cause, r.problems)
    assert r.stages.live.result.accuracy.accuracy_per_position[0] == pytest.approx(
        r.stages.replay.result.training.accuracy_per_position[0], abs=0.05)


@pytest.mark.integration
def test_chat_template_without_the_training_system_prompt(world):
    tmpl = world["root"] / "target-no-system"
    if not tmpl.exists():
        shutil.copytree(world["target"], tmpl)
        path = tmpl / "chat_template.jinja"
        text = path.read_text()
        start = text.index("{% if loop.first")
        end = text.index("{% endif %}", start) + len("{% endif %}")
        path.write_text(text[:start] + text[end:])  # the template no longer inserts its default system prompt
    r = doctor(world, world["base"], "sglang", target=tmpl)
    assert not r.healthy and codes(r, "static") == {"template_mismatch"}
    assert "chat template differs from training" in r.cause
    assert "You are a helpful AI assistant named SmolLM, trained by Hugging Face" in r.cause
    assert "send the system prompt 'You are a helpful AI assistant named SmolLM, trained by Hugging Face'" in r.fix


@pytest.mark.integration
def test_another_eos_token_is_a_warning_not_a_failure(world):
    """Tokenizer readers disagree on the eos token across versions; it moves where generation stops,
    not what the drafter sees."""
    other = world["root"] / "target-other-eos"
    if not other.exists():
        shutil.copytree(world["target"], other)
        cfg = json.loads((other / "tokenizer_config.json").read_text())
        cfg["eos_token"] = "<|im_start|>"
        (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = doctor(world, world["base"], "vllm", target=other)
    assert r.healthy and r.exit_code == 0, (r.cause, r.problems)
    warn = [f for f in r.stages["static"].findings if f.code == "eos_mismatch"]
    assert len(warn) == 1 and warn[0].level == "warn" and warn[0].found == "<|im_start|>"


# ---------------------------------------------------------------------------------------------
# Input problems are findings, not crashes
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_unreadable_directory_and_bad_data_are_reported(world, tmp_path):
    (tmp_path / "empty").mkdir()
    r = doctor(world, tmp_path / "empty", "vllm")
    assert not r.healthy and codes(r, "static") == {"unreadable"}
    assert all(r.stages[s].status == "skipped" for s in ("replay", "live", "fingerprint", "search"))
    r = doctor(world, world["base"], "vllm", data=str(tmp_path / "nowhere.jsonl"))
    assert not r.healthy and "nowhere.jsonl" in r.cause
    with pytest.raises(ValueError, match="--engine"):
        doctor(world, world["base"], "tensorrt")


# ---------------------------------------------------------------------------------------------
# Units (no target)
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_search_candidates_cover_the_plausible_protocols():
    from eyas.doctor.search import candidates

    flags = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
    cands = candidates([0, 2, 6], flags, L, None, None, None)
    slots = {c.slots for c in cands if c.kind == "boundaries"}
    assert (2, 6, 9) in slots  # embedding out: slot 0 dropped, L-3 appended
    assert (1, 3, 7) in slots and (1, 2, 6) in slots  # every boundary +1; slot 0 +1
    assert (0, 6, 2) in slots and (6, 2, 0) in slots  # slot orders
    assert (0, 2, L + 1) in slots  # the last slot after the final norm
    assert all(-1 not in s for s in slots) and (0, 2, 6) not in slots  # valid, and never the served protocol
    toggled = [c for c in cands if c.kind == "flags"]
    assert [dict(c.flags) for c in toggled] == [dict(flags, **{f: True}) for f in flags]
    # the trained protocol comes first when it is known
    first = candidates([1, 5, 8], flags, L, TRAINED, dict(flags, norm_before_fc=True), None)[0]
    assert first.kind == "trained" and first.slots == (2, 6, 9) and dict(first.flags)["norm_before_fc"]


@pytest.mark.integration
def test_the_full_search_screens_hopeless_candidates_on_a_few_samples(world, monkeypatch):
    """Without the trained protocol to decide it at once, the search scores every candidate: those
    hopeless on 4 of the 16 samples are ruled out there, and the outcome (which candidates restore,
    the winner) is the one scoring every candidate on every sample gives."""
    import eyas.doctor.search as search

    every = search.candidates
    # the trained protocol as an ordinary candidate: screened and scored like the rest, never deciding
    # at once (the other candidates are deduplicated against it, so dropping it would leave none that
    # restores)
    monkeypatch.setattr(search, "candidates", lambda *a: [replace(p, kind="boundaries") if p.kind == "trained" else p
                                                         for p in every(*a)])
    d = served_copy(world, "base", "screened", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 6]))
    screened = doctor(world, d, "vllm").stages.search.result
    monkeypatch.setattr(search, "SCREEN_SAMPLES", 1000)  # no screening
    full = doctor(world, d, "vllm").stages.search.result
    out = [c for c in screened.candidates if c.screened_out_on is not None]
    assert out and all(c.screened_out_on == 4 and not c.restores for c in out)
    assert not any(c.screened_out_on for c in full.candidates)
    assert {c.protocol.key() for c in screened.candidates if c.restores} == \
        {c.protocol.key() for c in full.candidates if c.restores}
    assert screened.winner is not None and screened.winner.protocol.slots == tuple(TRAINED)
    assert screened.winner.protocol.key() == full.winner.protocol.key()
    assert screened.winner.screened_out_on is None and screened.winner.score == full.winner.score


@pytest.mark.unit
def test_search_screening_rules_out_only_what_noise_cannot_save():
    from eyas.doctor.search import hopeless

    # the replay scores 0.5: restoring needs 0.45 (short_by: 3 points or 10 %)
    assert hopeless(0.10, 200, 0.5)  # far below, even 3 standard errors up (0.10 + 0.064)
    assert not hopeless(0.40, 200, 0.5)  # 0.40 + 3 x 0.035 reaches 0.45: scored on every sample
    assert hopeless(0.40, 5000, 0.5)  # with many tokens the same shortfall is certain
    assert not hopeless(0.47, 200, 0.5)  # restoring already


@pytest.mark.unit
def test_describe_boundaries_names_the_slot_and_the_convention():
    from eyas.doctor.verdict import describe_boundaries

    assert describe_boundaries([2, 6, 9], [0, 2, 6], L).startswith("slot 0 is the embedding output (boundary 0)")
    assert describe_boundaries([0, 6, 9], [6, 9, 11], L).startswith("slot 0 was trained on the embedding output")
    assert "one block before" in describe_boundaries([2, 6, 9], [1, 5, 8], L)
    assert "one block after" in describe_boundaries([2, 6, 9], [3, 7, 10], L)
    assert describe_boundaries([2, 6, 9], [9, 6, 2], L) == "the slots are fed in another order"
    assert describe_boundaries([0, 6, 9], [2, 6, 9], L) == (
        "slot 0 was trained on the embedding output (boundary 0) but is fed boundary 2 (output of block 1)")


@pytest.mark.unit
def test_fingerprint_z_scores_and_resemblance():
    from eyas.contract import SlotFingerprint
    from eyas.doctor.fingerprint import compare_slot, nearest

    def fp(b, rms, std, means):
        return SlotFingerprint(boundary=b, rms_mean=rms, rms_std=std, channels=[0, 1], channel_means=means, num_tokens=100)

    live = {0: fp(0, 0.06, 0.01, [0.0, 0.01]), 2: fp(2, 0.4, 0.05, [0.1, -0.2]), 6: fp(6, 0.7, 0.1, [0.3, 0.1])}
    trained_slot0 = fp(2, 0.41, 0.05, [0.1, -0.19])
    ok = compare_slot(live[2], trained_slot0)
    assert not ok.off and abs(ok.rms_z) < 1
    off = compare_slot(live[0], trained_slot0)
    assert off.off and off.rms_z < -3 and off.rms_ratio < 0.2
    assert nearest(live[0], live)[0] == 0 and nearest(trained_slot0, live)[0] == 2
