"""`eyas doctor` on a third-party SGLang directory whose nested ids the conventions read differently:
its static stage says the trained boundaries are assumed (and what settles it) unless the user
named the convention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from eyas.doctor import run_doctor
from eyas.drafter import DrafterConfig, Eagle3Drafter
from eyas.interop.common import llama_fields
from tests.support.toy import make_toy_target


def _third_party(target: Path, d: Path) -> Path:
    from transformers import AutoConfig

    cfg = DrafterConfig.for_target(AutoConfig.from_pretrained(target), draft_vocab_size=64)
    d.mkdir()
    state = {k: v for k, v in Eagle3Drafter(cfg).state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], **llama_fields(cfg), "draft_vocab_size": 64,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 5, 8]}}))  # specforge [3, 6, 9], sglang [2, 5, 8]
    return d


@pytest.mark.integration
def test_doctor_warns_that_assumed_boundaries_are_assumed_unless_the_convention_is_named(tmp_path, one_thread):
    target = make_toy_target(tmp_path / "t", num_blocks=12)
    draft = _third_party(target, tmp_path / "sf")
    kw = dict(samples=2, max_length=32)
    report = run_doctor(str(target), draft, **kw)
    found = {f.code: f for f in report.stages["static"].findings}
    assert "boundaries_assumed" in found and found["boundaries_assumed"].level == "warn"
    msg = found["boundaries_assumed"].message
    assert "[3, 6, 9] are assumed" in msg and "sglang (PR #25454): [2, 5, 8]" in msg
    assert "training shards" in msg and "eyas.json" in msg
    # an untrained drafter on the target's answers: its live accuracy cannot settle them, and says why
    assert "cannot decide between the candidate boundary sets" in msg
    assert "the assumed trained ones" in found["boundaries"].message  # eyas serves them; nothing verified them
    named = run_doctor(str(target), draft, ids_convention="sglang", **kw)
    assert "boundaries_assumed" not in {f.code for f in named.stages["static"].findings}
    assert named.draft.trained_boundaries == [2, 5, 8]


@pytest.mark.integration
def test_assumed_boundaries_that_nothing_settles_give_an_unverified_verdict(tmp_path, one_thread):
    """Unknown is not healthy: every check passes against assumed boundaries, so the verdict is
    'unverified' (exit code 3), not healthy; naming the convention settles it."""
    target = make_toy_target(tmp_path / "t", num_blocks=12)
    draft = _third_party(target, tmp_path / "sf")
    kw = dict(samples=2, max_length=32)
    report = run_doctor(str(target), draft, **kw)
    assert not report.problems  # nothing failed...
    assert report.status == "unverified" and report.exit_code == 3 and not report.healthy  # ...nothing verified
    assert "[3, 6, 9] are assumed" in report.unverified and "training shards" in report.unverified
    assert report.to_dict()["status"] == "unverified"
    named = run_doctor(str(target), draft, ids_convention="specforge", **kw)
    assert named.status != "unverified" and named.unverified is None


@pytest.mark.integration
def test_a_converted_directory_without_ids_is_never_called_healthy(tmp_path, one_thread):
    """Defect 3: a converter that drops the layer ids (and eyas.json) leaves a speculators directory
    that vLLM serves with the EAGLE-3 default; the drafter was trained on [3, 6, 9]. Without evidence
    the doctor says the boundaries are assumed (unverified), never healthy, and import says so too."""
    from typer.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from eyas.cli.main import app
    from eyas.drafter.build import new_drafter
    from eyas.interop import export_drafter, save_drafter
    from eyas.interop.servers.vllm import TOP_IDS

    target = make_toy_target(tmp_path / "t", num_blocks=12)
    drafter, contract = new_drafter(AutoModelForCausalLM.from_pretrained(target), boundaries=[3, 6, 9],
                                    draft_vocab_size=64)
    spec = tmp_path / "spec"
    export_drafter(save_drafter(drafter, contract, tmp_path / "eyas"), "vllm", spec, verifier=str(target))
    config = json.loads((spec / "config.json").read_text())
    for key in [k for k in config if k == TOP_IDS or k.startswith("eyas_")]:
        del config[key]
    (spec / "config.json").write_text(json.dumps(config))
    (spec / "eyas.json").unlink(missing_ok=True)

    report = run_doctor(str(target), spec, engine="vllm", samples=2, max_length=32)
    assert not report.healthy and report.exit_code != 0
    found = {f.code: f for f in report.stages["static"].findings}
    assert "boundaries_assumed" in found and "records no eagle_aux_hidden_state_layer_ids" in found["boundaries_assumed"].message
    r = CliRunner().invoke(app, ["import", str(spec), "--out", str(tmp_path / "imported"), "--target", str(target)])
    assert r.exit_code == 0, r.output
    assert "ASSUMED" in r.output
