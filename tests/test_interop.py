"""eyas.interop: checkpoint formats, layer-id conversion at the edge, and the checks on load."""

from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.contract import CaptureContract, Contract, ContractError, TargetIdentity, tokenisation_of
from eyas.drafter import DrafterConfig, Eagle3Drafter
from eyas.drafter.build import drafter_flags, new_drafter
from eyas.interop import (
    CheckpointError,
    export_drafter,
    import_drafter,
    load_drafter,
    read_contract,
    save_drafter,
    view_engines,
)
from tests.support.tiny import COMMON, tiny_model

pytestmark = pytest.mark.unit

FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def randomise(drafter: Eagle3Drafter, seed: int = 0) -> Eagle3Drafter:
    """Non-trivial weights everywhere (norms included) and a non-identity vocabulary map."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    cfg = drafter.config
    ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    drafter.set_vocab_map(ids)
    assert drafter.d2t.any()  # the map is not the identity prefix
    return drafter


def synthetic(boundaries=(2, 16, 29), num_blocks=32, seed=0, **flags) -> tuple[Eagle3Drafter, Contract]:
    """A drafter built from a DrafterConfig directly, with a contract for a made-up target."""
    cfg = DrafterConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=128, draft_vocab_size=40, target_hidden_size=48, num_slots=len(boundaries), **flags,
    )
    drafter = randomise(Eagle3Drafter(cfg), seed)
    contract = Contract(
        target=TargetIdentity(architecture="LlamaForCausalLM", model_type="llama", num_blocks=num_blocks,
                              hidden_size=48, vocab_size=128, fingerprint="0123456789abcdef"),
        capture=CaptureContract(boundaries=list(boundaries)),
        drafter=drafter_flags(cfg, "trained"),
    )
    return drafter, contract


def assert_same_state(a: Eagle3Drafter, b: Eagle3Drafter, skip=()) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if k in skip:
            continue
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def strip_eyas_metadata(d: pathlib.Path) -> None:
    """Leave only what a third-party tool would have written."""
    (d / "eyas.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    for k in [k for k in cfg if k.startswith("eyas_")]:
        del cfg[k]
    (d / "config.json").write_text(json.dumps(cfg))


def edit_json(path: pathlib.Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


# ---------------------------------------------------------------------------------------------
# the eyas directory
# ---------------------------------------------------------------------------------------------


def test_save_writes_sglang_loadable_dir_with_every_flag_and_both_id_conventions(tmp_path):
    drafter, contract = synthetic((3, 10, 29), norm_before_residual=True, norm_output=True)
    out = save_drafter(drafter, contract, tmp_path / "d")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "eyas.json", "model.safetensors"]

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (40, 48, 128)
    assert {f: cfg[f] for f in FLAGS} == {
        "norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [3, 10, 29]  # boundaries, for vLLM
    # PR #25454 rule, first boundary is not 2: ids are used as written
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [3, 10, 29], "use_aux_hidden_state": True}

    meta = json.loads((out / "eyas.json").read_text())
    assert meta["format"] == "eyas" and meta["embeddings"] == "from_target"
    assert DrafterConfig.model_validate(meta["drafter_config"]) == drafter.config
    assert Contract.model_validate(meta["contract"]) == contract == read_contract(out)

    names = set(load_file(str(out / "model.safetensors")))
    assert names == set(drafter.state_dict()) - {"embed_tokens.weight"}
    assert "midlayer.self_attn.q_proj.weight" in names and "d2t" in names and "t2d" in names


def test_save_with_embeddings_and_load_is_bit_identical(tmp_path):
    drafter, contract = synthetic(norm_before_fc=True, norm_before_residual=True)
    out = save_drafter(drafter, contract, tmp_path / "d", include_embeddings=True)
    assert "embed_tokens.weight" in load_file(str(out / "model.safetensors"))
    assert json.loads((out / "eyas.json").read_text())["embeddings"] == "saved"
    loaded, c = load_drafter(out)
    assert c == contract
    assert loaded.config == drafter.config
    assert_same_state(drafter, loaded)


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    drafter, contract = synthetic()
    out = save_drafter(drafter, contract, tmp_path / "d")
    before = (out / "model.safetensors").read_bytes()

    import eyas.interop.common as common

    def broken(tensors, path, metadata=None):
        pathlib.Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(common, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(randomise(drafter, seed=5), contract, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "eyas.json", "model.safetensors"]


def test_save_refuses_a_contract_that_does_not_describe_the_drafter(tmp_path):
    drafter, contract = synthetic()
    wrong = contract.model_copy(update={"capture": CaptureContract(boundaries=[2, 16])})
    with pytest.raises(CheckpointError, match=r"drafter.num_slots: expected 2 .*found 3"):
        save_drafter(drafter, wrong, tmp_path / "d")
    assert not (tmp_path / "d" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# round trips through the engine formats
# ---------------------------------------------------------------------------------------------

ROUND_TRIP_FLAGS = [
    {},
    {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
    {"fc_norm": True},
]


@pytest.mark.parametrize("flags", ROUND_TRIP_FLAGS + [dict(dict.fromkeys(FLAGS, True), fc_norm=False)])
@pytest.mark.parametrize("rule", ["pr25454", "legacy"])
def test_round_trip_through_sglang_keeps_every_tensor_and_the_boundaries(tmp_path, flags, rule):
    drafter, contract = synthetic((3, 10, 29), **flags)
    src = save_drafter(drafter, contract, tmp_path / "eyas", include_embeddings=True)
    report = export_drafter(src, "sglang", tmp_path / "sglang", sglang_rule=rule)
    exported = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert {f: exported[f] for f in FLAGS} == {f: getattr(drafter.config, f) for f in FLAGS}
    assert set(load_file(str(tmp_path / "sglang" / "model.safetensors"))) == set(drafter.state_dict())

    back = import_drafter(report.path, tmp_path / "back")
    loaded, c = load_drafter(back)
    assert_same_state(drafter, loaded)
    assert loaded.config == drafter.config
    assert c == contract
    assert view_engines(back).boundaries == [3, 10, 29]


@pytest.mark.parametrize("flags", ROUND_TRIP_FLAGS)
def test_round_trip_through_speculators_keeps_every_tensor_and_the_boundaries(tmp_path, flags):
    drafter, contract = synthetic((3, 10, 29), **flags)
    src = save_drafter(drafter, contract, tmp_path / "eyas")
    export_drafter(src, "vllm", tmp_path / "spec")
    back = import_drafter(tmp_path / "spec", tmp_path / "back")
    loaded, c = load_drafter(back)
    assert_same_state(drafter, loaded, skip={"embed_tokens.weight"})  # not saved: comes from the target
    assert loaded.config == drafter.config and c == contract
    assert view_engines(back).boundaries == [3, 10, 29]


@pytest.mark.parametrize("flags", ROUND_TRIP_FLAGS)
def test_speculators_dir_alone_carries_boundaries_and_flags(tmp_path, flags):
    """Without any eyas metadata the speculators config itself must be enough."""
    drafter, contract = synthetic((3, 10, 29), **flags)
    export_drafter(save_drafter(drafter, contract, tmp_path / "eyas"), "vllm", tmp_path / "spec")
    strip_eyas_metadata(tmp_path / "spec")
    back = import_drafter(tmp_path / "spec", tmp_path / "back", num_target_blocks=32)
    loaded, c = load_drafter(back)
    assert c is None  # imported without a target: nothing to vouch for
    assert_same_state(drafter, loaded, skip={"embed_tokens.weight"})
    assert loaded.config == drafter.config
    assert view_engines(back).boundaries == [3, 10, 29]


def test_sglang_dir_alone_carries_boundaries_and_flags_when_the_rules_agree(tmp_path):
    drafter, contract = synthetic((2, 16, 29), **dict(dict.fromkeys(FLAGS, True), fc_norm=False))
    export_drafter(save_drafter(drafter, contract, tmp_path / "eyas"), "sglang", tmp_path / "sg")
    strip_eyas_metadata(tmp_path / "sg")
    assert json.loads((tmp_path / "sg" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]
    back = import_drafter(tmp_path / "sg", tmp_path / "back", num_target_blocks=32)
    loaded, _ = load_drafter(back)
    assert_same_state(drafter, loaded, skip={"embed_tokens.weight"})
    assert loaded.config == drafter.config
    assert view_engines(back).boundaries == [2, 16, 29]


def test_speculators_layout_names_flags_and_verifier(tmp_path):
    drafter, contract = synthetic((3, 10, 29), fc_norm=True)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    contract.target.source = str(tmp_path / "target")
    export_drafter(save_drafter(drafter, contract, tmp_path / "eyas"), "vllm", tmp_path / "spec")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    # every flag explicit: vLLM reads an absent norm_before_residual as true
    assert {f: cfg[f] for f in FLAGS} == {
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": True, "norm_output": False}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [3, 10, 29]
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (40, 48)
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] >= 1
    assert sc["verifier"] == {"name_or_path": str(tmp_path / "target"), "architectures": ["LlamaForCausalLM"]}
    tl = cfg["transformer_layer_config"]
    assert (tl["model_type"], tl["hidden_size"], tl["num_hidden_layers"], tl["vocab_size"]) == ("llama", 64, 1, 128)

    names = set(load_file(str(tmp_path / "spec" / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and "layers.0.hidden_norm.weight" in names
    assert not any(n.startswith("midlayer.") for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "fc_norm.0.weight"} <= names


def _verifier(out: pathlib.Path) -> dict:
    return json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]


SMOLLM2_LABEL = "smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf)"  # how the embedded target names itself


def test_speculators_verifier_is_never_a_display_label(tmp_path):
    # speculators and vLLM resolve verifier.name_or_path as a model: a label is null, with a warning
    # that says what to pass (issue 12, defect 1: the label used to be written).
    drafter, contract = synthetic((3, 10, 29))
    contract.target.source = SMOLLM2_LABEL
    src = save_drafter(drafter, contract, tmp_path / "eyas")
    with pytest.warns(UserWarning, match=r"name_or_path written as null.*--verifier"):
        report = export_drafter(src, "vllm", tmp_path / "spec")
    assert _verifier(tmp_path / "spec") == {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}
    assert any("--verifier" in n for n in report.notes)
    # a GGUF file is no model speculators can resolve either
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    contract.target.source = str(gguf)
    with pytest.warns(UserWarning, match="--verifier"):
        export_drafter(save_drafter(drafter, contract, tmp_path / "eyas2"), "vllm", tmp_path / "spec2")
    assert _verifier(tmp_path / "spec2")["name_or_path"] is None
    # --verifier names it
    export_drafter(src, "vllm", tmp_path / "spec3", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert _verifier(tmp_path / "spec3")["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_speculators_verifier_from_a_recorded_hub_id_or_local_directory(tmp_path, recwarn):
    drafter, contract = synthetic((3, 10, 29))
    contract.target.source = "HuggingFaceTB/SmolLM2-135M-Instruct"
    export_drafter(save_drafter(drafter, contract, tmp_path / "eyas"), "vllm", tmp_path / "spec")
    assert _verifier(tmp_path / "spec")["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert not [w for w in recwarn if "verifier" in str(w.message)]
    # without a contract: a local --verifier directory names its architectures too
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    strip_eyas_metadata(tmp_path / "spec")
    d = import_drafter(tmp_path / "spec", tmp_path / "nocontract", num_target_blocks=32)
    assert load_drafter(d)[1] is None
    export_drafter(d, "vllm", tmp_path / "spec2", verifier=str(target))
    assert _verifier(tmp_path / "spec2") == {"name_or_path": str(target.resolve()), "architectures": ["Qwen3ForCausalLM"]}


def test_export_refuses_a_verifier_that_no_engine_can_resolve(tmp_path):
    drafter, contract = synthetic((3, 10, 29))
    src = save_drafter(drafter, contract, tmp_path / "eyas")
    with pytest.raises(CheckpointError, match=r"verifier: expected a Hugging Face hub id .*found 'smollm2 \(x\)'"):
        export_drafter(src, "vllm", tmp_path / "spec", verifier="smollm2 (x)")
    with pytest.raises(CheckpointError, match=r"verifier: expected only for the speculators format"):
        export_drafter(src, "sglang", tmp_path / "sg", verifier="org/name")
    assert not (tmp_path / "spec").exists() and not (tmp_path / "sg").exists()


def test_norm_before_fc_with_fc_norm_is_refused_as_ambiguous():
    # speculators rejects the pair and engines disagree on their order: eyas never builds it.
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm: expected at most one"):
        synthetic(norm_before_fc=True, fc_norm=True)


def test_speculators_config_without_norm_before_residual_reads_it_as_vllm_does(tmp_path):
    drafter, contract = synthetic((3, 10, 29))
    export_drafter(save_drafter(drafter, contract, tmp_path / "eyas"), "vllm", tmp_path / "spec")
    strip_eyas_metadata(tmp_path / "spec")
    edit_json(tmp_path / "spec" / "config.json", lambda c: c.pop("norm_before_residual"))
    with pytest.warns(UserWarning, match="norm_before_residual is absent; reading it as true"):
        back = import_drafter(tmp_path / "spec", tmp_path / "back", num_target_blocks=32)
    loaded, _ = load_drafter(back)
    assert loaded.config.norm_before_residual is True


def test_export_rejects_an_unknown_engine(tmp_path):
    drafter, contract = synthetic()
    src = save_drafter(drafter, contract, tmp_path / "eyas")
    with pytest.raises(CheckpointError, match=r"to: expected one of .*found 'trt'"):
        export_drafter(src, "trt", tmp_path / "x")


# ---------------------------------------------------------------------------------------------
# third-party SGLang / SpecForge directories
# ---------------------------------------------------------------------------------------------


def specforge_dir(d: pathlib.Path, eagle_config: dict | None, seed: int = 0) -> Eagle3Drafter:
    """A directory as SpecForge writes it: Llama config + nested eagle_config, no norm flags."""
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=128, draft_vocab_size=40, target_hidden_size=48, num_slots=3)
    drafter = randomise(Eagle3Drafter(cfg), seed)
    d.mkdir(parents=True)
    state = {k: v for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, str(d / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "vocab_size": 128, "draft_vocab_size": 40, "target_hidden_size": 48,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    if eagle_config is not None:
        config["eagle_config"] = eagle_config
    (d / "config.json").write_text(json.dumps(config))
    return drafter


def test_specforge_ids_are_output_of_block_and_import_as_boundaries(tmp_path):
    drafter = specforge_dir(tmp_path / "sf", {"eagle_aux_hidden_state_layer_ids": [1, 29, 57],
                                               "use_aux_hidden_state": True})
    out = import_drafter(tmp_path / "sf", tmp_path / "eyas", num_target_blocks=61)
    view = view_engines(out)
    assert view.boundaries == [2, 30, 58] and view.num_target_blocks == 61
    assert view.engines == {"eyas": [2, 30, 58], "sglang": [2, 30, 58], "sglang_legacy": [2, 30, 58],
                               "vllm": [2, 30, 58]}
    loaded, contract = load_drafter(out)
    assert contract is None
    assert_same_state(drafter, loaded, skip={"embed_tokens.weight"})
    assert not any(getattr(loaded.config, f) for f in FLAGS)  # absent flags are false for SGLang


def test_specforge_dir_without_ids_needs_the_block_count(tmp_path):
    specforge_dir(tmp_path / "sf", None)
    with pytest.raises(CheckpointError, match="--target T or --num-target-blocks N") as e:
        import_drafter(tmp_path / "sf", tmp_path / "eyas")
    assert "config.json" in str(e.value) and "[2, L//2, L-3]" in str(e.value)
    out = import_drafter(tmp_path / "sf", tmp_path / "eyas", num_target_blocks=32)
    assert view_engines(out).boundaries == [2, 16, 29]


def test_specforge_dir_whose_ids_do_not_match_fc_fails_naming_num_slots(tmp_path):
    specforge_dir(tmp_path / "sf", {"eagle_aux_hidden_state_layer_ids": [1, 29]})
    with pytest.raises(CheckpointError, match=r"drafter.num_slots: expected 2 .*found 3"):
        import_drafter(tmp_path / "sf", tmp_path / "eyas", num_target_blocks=61)


def test_import_with_target_records_its_contract(tmp_path):
    model = tiny_model(num_blocks=10)
    cfg = DrafterConfig.for_target(model.config, draft_vocab_size=32)
    drafter = randomise(Eagle3Drafter(cfg))
    d = tmp_path / "sf"
    d.mkdir()
    save_file({k: v for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}, str(d / "model.safetensors"))
    from eyas.interop.common import llama_fields
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], **llama_fields(cfg), "draft_vocab_size": 32}))
    out = import_drafter(d, tmp_path / "eyas", target=model)
    contract = read_contract(out)
    assert contract.target.num_blocks == 10 and contract.capture.boundaries == [2, 5, 7]
    assert contract.drafter.vocab_map == "trained"
    loaded, _ = load_drafter(out, target=model)
    assert torch.equal(loaded.embed_tokens.weight, model.get_input_embeddings().weight)


# ---------------------------------------------------------------------------------------------
# view_engines: every engine's reading
# ---------------------------------------------------------------------------------------------


def test_engine_view_shows_what_each_sglang_rule_captures(tmp_path):
    drafter, contract = synthetic((3, 10, 29), num_blocks=32)
    src = save_drafter(drafter, contract, tmp_path / "eyas")

    new = export_drafter(src, "sglang", tmp_path / "new", sglang_rule="pr25454")
    assert new.ids_written["eagle_config.eagle_aux_hidden_state_layer_ids"] == [3, 10, 29]
    assert new.sglang_rules_agree is False and "[4, 11, 30]" in " ".join(new.notes)
    assert new.view.engines == {"eyas": [3, 10, 29], "sglang": [3, 10, 29],
                                      "sglang_legacy": [4, 11, 30], "vllm": [3, 10, 29]}
    assert new.view.differs == ["sglang_legacy"]

    old = export_drafter(src, "sglang", tmp_path / "old", sglang_rule="legacy")
    assert old.ids_written["eagle_config.eagle_aux_hidden_state_layer_ids"] == [2, 9, 28]
    assert old.view.engines == {"eyas": [3, 10, 29], "sglang": [2, 9, 28],
                                      "sglang_legacy": [3, 10, 29], "vllm": [3, 10, 29]}
    assert old.view.differs == ["sglang"]
    assert view_engines(tmp_path / "old").to_dict() == old.view.to_dict()

    # A speculators directory has no nested ids: SGLang would fall back to its default.
    spec = export_drafter(src, "vllm", tmp_path / "spec")
    assert spec.view.engines["vllm"] == [3, 10, 29]
    assert spec.view.engines["sglang"] == [2, 16, 29]
    assert spec.view.differs == ["sglang", "sglang_legacy"]


def test_engine_view_reads_config_json_as_it_stands(tmp_path):
    """A hand-edited config.json changes what the engines capture, not what the drafter was trained on."""
    drafter, contract = synthetic((2, 16, 29), num_blocks=32)
    out = save_drafter(drafter, contract, tmp_path / "eyas")
    edit_json(out / "config.json", lambda c: (c.pop("eagle_config"), c.pop("eagle_aux_hidden_state_layer_ids")))
    edit_json(out / "eyas.json", lambda e: e.__setitem__("boundaries", [3, 16, 29]))
    edit_json(out / "eyas.json", lambda e: e["contract"]["capture"].__setitem__("boundaries", [3, 16, 29]))
    view = view_engines(out)
    assert view.boundaries == [3, 16, 29]
    assert view.engines["sglang"] == view.engines["vllm"] == [2, 16, 29]  # the default


def test_engine_view_rejects_a_block_count_that_contradicts_the_directory(tmp_path):
    drafter, contract = synthetic(num_blocks=32)
    out = save_drafter(drafter, contract, tmp_path / "eyas")
    with pytest.raises(CheckpointError, match=r"num_target_blocks: expected 32 .*found 30"):
        view_engines(out, num_target_blocks=30)


# ---------------------------------------------------------------------------------------------
# loading against a target
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_model(num_blocks=10, seed=0)
    tok = SimpleNamespace(chat_template="{{ messages }}", bos_token="<s>", eos_token="</s>")
    drafter, contract = new_drafter(model, tok, draft_vocab_size=32)
    randomise(drafter)
    path = save_drafter(drafter, contract, tmp_path_factory.mktemp("saved") / "d")
    return model, tok, drafter, contract, path


def test_load_against_its_target_copies_the_embedding(saved):
    model, tok, drafter, contract, path = saved
    loaded, c = load_drafter(path, target=model, tokenizer=tok)
    assert c == contract
    assert torch.equal(loaded.embed_tokens.weight, model.get_input_embeddings().weight)
    assert_same_state(drafter, loaded, skip={"embed_tokens.weight"})


def test_load_without_target_leaves_an_unsaved_embedding_nan_not_random(saved):
    """A drafter never given its target's embedding must not produce plausible output."""
    _, _, drafter, _, path = saved
    loaded, _ = load_drafter(path)
    assert torch.isnan(loaded.embed_tokens.weight).all()
    assert_same_state(drafter, loaded, skip={"embed_tokens.weight"})


def _fields(err: ContractError) -> set[str]:
    return {m.field for m in err.mismatches}


def test_load_against_other_hidden_size_fails_naming_each_field(saved):
    from transformers import AutoModelForCausalLM, LlamaConfig

    _, _, _, _, path = saved
    torch.manual_seed(0)
    other = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=10, **{**COMMON, "hidden_size": 32}))
    with pytest.raises(ContractError) as e:
        load_drafter(path, target=other)
    assert {"target.hidden_size", "drafter.target_hidden_size"} <= _fields(e.value)
    msg = str(e.value)
    assert "target.hidden_size: expected 64, found 32" in msg
    assert "drafter.target_hidden_size: expected 64, found 32" in msg
    assert str(path) in msg

    # --force loads anyway, says what it skipped, and cannot copy an embedding of the wrong shape
    with pytest.warns(UserWarning) as record:
        loaded, _ = load_drafter(path, target=other, force=True)
    messages = " ".join(str(w.message) for w in record)
    assert "target.hidden_size" in messages and "embed_tokens" in messages
    assert loaded.config.target_hidden_size == 64


def test_load_against_same_shape_other_weights_fails_on_the_fingerprint(saved):
    model, _, _, contract, path = saved
    other = tiny_model(num_blocks=10, seed=1)
    with pytest.raises(ContractError) as e:
        load_drafter(path, target=other)
    assert _fields(e.value) == {"target.fingerprint"}
    m = e.value.mismatches[0]
    assert m.expected == contract.target.fingerprint and m.found != m.expected
    assert m.found in str(e.value) and m.expected in str(e.value)

    with pytest.warns(UserWarning, match="target.fingerprint"):
        loaded, _ = load_drafter(path, target=other, force=True)
    assert torch.equal(loaded.embed_tokens.weight, other.get_input_embeddings().weight)


def test_load_against_other_block_count_fails(saved):
    _, _, _, _, path = saved
    with pytest.raises(ContractError) as e:
        load_drafter(path, target=tiny_model(num_blocks=6))
    assert "target.num_blocks" in _fields(e.value)
    assert "target.num_blocks: expected 10, found 6" in str(e.value)


def test_load_with_another_tokenizer_fails_on_the_template(saved):
    model, _, _, _, path = saved
    other_tok = SimpleNamespace(chat_template="{{ other }}", bos_token="<s>", eos_token="</s>")
    with pytest.raises(ContractError) as e:
        load_drafter(path, target=model, tokenizer=other_tok)
    assert _fields(e.value) == {"tokenisation.chat_template_sha256"}
    assert tokenisation_of(other_tok).chat_template_sha256 in str(e.value)


def test_boundary_count_other_than_the_fc_slots_fails_naming_the_field(saved, tmp_path):
    import shutil

    model, _, _, _, path = saved
    d = tmp_path / "d"
    shutil.copytree(path, d)

    def two_boundaries(e):
        e["boundaries"] = [2, 5]
        e["contract"]["capture"]["boundaries"] = [2, 5]

    edit_json(d / "eyas.json", two_boundaries)
    with pytest.raises(CheckpointError) as e:
        load_drafter(d, target=model)
    msg = str(e.value)
    assert "drafter.num_slots: expected 2" in msg and "found 3" in msg and str(d) in msg


def test_contract_and_drafter_config_must_agree(saved, tmp_path):
    import shutil

    _, _, _, _, path = saved
    d = tmp_path / "d"
    shutil.copytree(path, d)
    edit_json(d / "eyas.json", lambda e: e["contract"]["drafter"].__setitem__("norm_before_residual", True))
    with pytest.raises(CheckpointError, match=r"contract.drafter.norm_before_residual: expected False .*found True"):
        load_drafter(d)


def test_config_json_flag_that_disagrees_with_eyas_json_fails(saved, tmp_path):
    """config.json is what the engines read; a flag there that differs from training is an error."""
    import shutil

    _, _, _, _, path = saved
    d = tmp_path / "d"
    shutil.copytree(path, d)
    edit_json(d / "config.json", lambda c: c.__setitem__("norm_output", True))
    with pytest.raises(CheckpointError, match=r"config.json norm_output: expected False .*found True"):
        load_drafter(d)


# ---------------------------------------------------------------------------------------------
# broken files
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def eyas_dir(tmp_path):
    drafter, contract = synthetic()
    return save_drafter(drafter, contract, tmp_path / "d")


def test_truncated_safetensors_fails_naming_the_file(eyas_dir):
    f = eyas_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_drafter(eyas_dir)
    assert str(f) in str(e.value) and "truncated" in str(e.value)


def test_garbage_safetensors_fails_naming_the_file(eyas_dir):
    f = eyas_dir / "model.safetensors"
    f.write_bytes(b"this is not a safetensors file at all" * 4)
    assert view_engines(eyas_dir).boundaries == [2, 16, 29]  # metadata only: still readable
    with pytest.raises(CheckpointError) as e:
        load_drafter(eyas_dir)
    assert str(f) in str(e.value)


@pytest.mark.parametrize("with_config", [True, False])
def test_pickle_only_dir_is_never_unpickled(tmp_path, monkeypatch, with_config):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    if with_config:
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64}))

    def no_unpickling(*a, **k):
        raise AssertionError("torch.load must not be called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(CheckpointError) as e:
        load_drafter(d)
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and "safetensors only" in msg and "Convert it" in msg and str(d) in msg


def test_missing_and_extra_tensors_are_named(eyas_dir):
    f = eyas_dir / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["lm_head.weight"]
    tensors["midlayer.bogus.weight"] = torch.zeros(2)
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1].contiguous()
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError) as e:
        load_drafter(eyas_dir)
    msg = str(e.value)
    assert str(f) in msg
    assert "missing tensors ['lm_head.weight']" in msg
    assert "unexpected tensors ['midlayer.bogus.weight']" in msg
    assert "fc.weight: expected shape (64, 144), found (64, 143)" in msg


def test_speculators_tensor_errors_use_the_files_names(tmp_path):
    drafter, contract = synthetic((3, 10, 29))
    export_drafter(save_drafter(drafter, contract, tmp_path / "eyas"), "vllm", tmp_path / "spec")
    f = tmp_path / "spec" / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError, match=r"missing tensors \['layers.0.mlp.up_proj.weight'\]"):
        load_drafter(tmp_path / "spec")


def test_inconsistent_vocab_map_is_rejected(eyas_dir):
    f = eyas_dir / "model.safetensors"
    tensors = load_file(str(f))
    tensors["t2d"] = torch.zeros_like(tensors["t2d"])
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError, match=r"t2d: expected exactly the 40 target ids .*found 0 set"):
        load_drafter(eyas_dir)


def test_unknown_architecture_and_corrupt_json_are_named(eyas_dir):
    edit_json(eyas_dir / "config.json", lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"]))
    with pytest.raises(CheckpointError, match=r"config.json: architectures: expected .*found \['LlamaForCausalLM'\]"):
        load_drafter(eyas_dir)
    (eyas_dir / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: file is not valid JSON .*; expected a JSON object"):
        view_engines(eyas_dir)


def test_writing_over_stale_weight_files_is_refused(tmp_path):
    drafter, contract = synthetic()
    d = tmp_path / "d"
    d.mkdir()
    (d / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002.safetensors"):
        save_drafter(drafter, contract, d)


def test_first_boundary_1_is_saved_for_the_legacy_rule_and_flagged(tmp_path):
    """PR #25454 SGLang cannot capture boundary 1 first; saving must not fail, and must not hide it."""
    drafter, contract = synthetic((1, 16, 29), num_blocks=32)
    with pytest.warns(UserWarning, match="legacy rule instead"):
        out = save_drafter(drafter, contract, tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 15, 28]
    assert cfg["eyas_sglang_rule"] == "legacy"
    view = view_engines(out)
    assert view.engines["sglang_legacy"] == [1, 16, 29] and view.engines["sglang"] == [0, 15, 28]
    assert view.differs == ["sglang"]


def test_export_warns_that_engines_cannot_capture_the_last_boundary(tmp_path):
    drafter, contract = synthetic((2, 16, 32))
    report = export_drafter(save_drafter(drafter, contract, tmp_path / "eyas"), "vllm", tmp_path / "spec")
    assert any("boundary 32 (the last block's output) is a slot" in n for n in report.notes)


def test_another_eos_token_only_warns_another_bos_token_refuses(saved):
    """The eos token decides where generation stops, not what the drafter sees; tokenizer readers
    disagree on it across versions, so it is reported, never a refusal. A bos token can change the
    rendered sequence, so it stays binding."""
    model, tokenizer, drafter, _, path = saved
    other_eos = SimpleNamespace(chat_template=tokenizer.chat_template, bos_token="<s>", eos_token="<other>")
    with pytest.warns(UserWarning, match="tokenisation.eos_token: expected '</s>', found '<other>'"):
        loaded, _ = load_drafter(path, target=model, tokenizer=other_eos)
    assert_same_state(drafter, loaded, skip={"embed_tokens.weight"})

    other_bos = SimpleNamespace(chat_template=tokenizer.chat_template, bos_token="<b>", eos_token="</s>")
    with pytest.raises(ContractError) as e:
        load_drafter(path, target=model, tokenizer=other_bos)
    assert _fields(e.value) == {"tokenisation.bos_token"}


# ---------------------------------------------------------------------------------------------
# third-party nested SGLang ids: ambiguous, so named or marked assumed (issue 12, Defect 5)
# ---------------------------------------------------------------------------------------------

AMBIGUOUS = {"eagle_aux_hidden_state_layer_ids": [2, 15, 27], "use_aux_hidden_state": True}
READINGS = {"specforge": [3, 16, 28], "sglang": [2, 15, 27], "sglang-legacy": [3, 16, 28]}


def test_third_party_nested_ids_that_the_conventions_read_differently_are_assumed_not_silently_legacy(tmp_path):
    specforge_dir(tmp_path / "sf", AMBIGUOUS)
    view = view_engines(tmp_path / "sf", 32)
    assert view.boundaries == [3, 16, 28]  # SpecForge's reading, but only assumed
    assert view.boundaries_assumed and "ASSUMED" not in view.boundaries_assumed
    assert "specforge: [3, 16, 28]; sglang (PR #25454): [2, 15, 27]; sglang-legacy: [3, 16, 28]" in \
        view.boundaries_assumed
    assert "--ids-convention" in view.boundaries_assumed and "eyas.json" in view.boundaries_assumed
    assert view.id_readings == READINGS and view.ids_convention == "specforge"
    eyas = view.readings["eyas"]
    assert eyas.boundaries_assumed and eyas.assumed_why == view.boundaries_assumed and "ASSUMED" in eyas.boundaries_note
    d = view.to_dict()
    assert d["boundaries_assumed"] is True and d["id_readings"] == READINGS
    assert not view.readings["sglang"].boundaries_assumed  # what an engine captures is no assumption


@pytest.mark.parametrize("convention", sorted(READINGS))
def test_a_named_ids_convention_picks_its_reading_and_nothing_is_assumed(tmp_path, convention):
    specforge_dir(tmp_path / "sf", AMBIGUOUS)
    view = view_engines(tmp_path / "sf", 32, ids_convention=convention)
    assert view.boundaries == READINGS[convention] and view.boundaries_assumed is None
    assert view.ids_convention == convention and view.id_readings == READINGS
    assert not view.readings["eyas"].boundaries_assumed
    assert view.to_dict()["boundaries_assumed"] is False
    out = import_drafter(tmp_path / "sf", tmp_path / "eyas", num_target_blocks=32, ids_convention=convention)
    assert view_engines(out).boundaries == READINGS[convention]
    assert view_engines(out).boundaries_assumed is None
    assert "boundaries_assumed" not in json.loads((out / "eyas.json").read_text())


def test_ids_every_convention_reads_alike_are_not_assumed(tmp_path):
    specforge_dir(tmp_path / "sf", {"eagle_aux_hidden_state_layer_ids": [1, 15, 27]})
    view = view_engines(tmp_path / "sf", 32)
    assert view.boundaries == [2, 16, 28] and view.boundaries_assumed is None and view.id_readings == {}


def test_an_import_that_assumed_the_boundaries_records_it_and_its_exports_keep_it(tmp_path):
    specforge_dir(tmp_path / "sf", AMBIGUOUS)
    out = import_drafter(tmp_path / "sf", tmp_path / "eyas", num_target_blocks=32)
    recorded = json.loads((out / "eyas.json").read_text())["boundaries_assumed"]
    assert "sglang (PR #25454): [2, 15, 27]" in recorded
    view = view_engines(out)
    assert view.boundaries == [3, 16, 28] and view.boundaries_assumed == recorded
    assert view.readings["eyas"].boundaries_assumed
    report = export_drafter(out, "sglang", tmp_path / "sg")
    assert any("assumed" in n for n in report.notes) and report.view.boundaries_assumed == recorded


def test_an_eyas_written_directory_is_read_as_before_whatever_the_ids_convention(tmp_path):
    drafter, contract = synthetic(boundaries=(3, 10, 29))
    src = save_drafter(drafter, contract, tmp_path / "eyas")
    sg = export_drafter(src, "sglang", tmp_path / "sg").path  # nested ids [3, 10, 29]: readings would differ
    for d in (src, sg):
        for convention in (None, "specforge", "sglang", "sglang-legacy"):
            view = view_engines(d, ids_convention=convention)
            assert view.boundaries == [3, 10, 29] and view.boundaries_assumed is None
            assert view.id_readings == {} and view.ids_convention is None


def test_an_unknown_ids_convention_is_refused(tmp_path):
    specforge_dir(tmp_path / "sf", AMBIGUOUS)
    with pytest.raises(CheckpointError, match=r"ids_convention: expected one of \['specforge', 'sglang', "
                                              r"'sglang-legacy'\], found 'eagle'"):
        view_engines(tmp_path / "sf", 32, ids_convention="eagle")


def test_a_drafter_larger_than_the_file_limit_is_written_in_shards_and_read_back(tmp_path) -> None:
    """save_drafter(max_file_bytes=...): shards of at most that size with an index, identical tensors
    on reading; saving again small removes the shards (no stale weight file for an engine to load)."""
    import json

    from eyas.drafter.build import new_drafter
    from eyas.interop import load_drafter, save_drafter
    from tests.support.tiny import tiny_model

    model = tiny_model("llama", 8)
    drafter, contract = new_drafter(model, None, None, 64)
    out = tmp_path / "d"
    total = sum(v.numel() * v.element_size() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight")
    limit = total // 2 + 65536 + 1024
    save_drafter(drafter, contract, out, max_file_bytes=limit)
    shards = sorted(p for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and not (out / "model.safetensors").exists()
    assert all(p.stat().st_size <= limit for p in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    back, _ = load_drafter(out, target=model)
    for k, v in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # a tensor larger than a file is cut by rows (a float32 lm_head over a large draft vocabulary)
    head = drafter.state_dict()["lm_head.weight"]
    one_file = head.numel() * head.element_size() // 3 + 65536
    save_drafter(drafter, contract, out, max_file_bytes=one_file)
    assert all(p.stat().st_size <= one_file for p in out.glob("model-*-of-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(index["metadata"]["eyas_split_by_rows"]["lm_head.weight"]) >= 3
    back, _ = load_drafter(out, target=model)
    for k, v in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    save_drafter(drafter, contract, out)  # small again: one file, the shards and index gone
    assert (out / "model.safetensors").exists() and not list(out.glob("model-*")) \
        and not (out / "model.safetensors.index.json").exists()
