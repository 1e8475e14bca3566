"""The loaded target: its facts computed once (L, H, V, eos ids, device, dtype, identity), the check
that a drafter fits it, and the one rule for ``--device``/``--target-dtype`` "auto"."""

from __future__ import annotations

import pytest
import torch

import eyas.contract
import eyas.targets.placement as placement
from eyas.targets import (
    LoadedTarget,
    PlacementError,
    TargetIdentity,
    TargetSource,
    load_target,
    resolve_device,
    resolve_dtype,
    target_identity,
)
from eyas.targets.structure import find_decoder_blocks, find_embedding



@pytest.mark.unit
def test_from_model_reads_the_structure_once(llama):
    llama.train()  # from_model puts it back in eval mode
    t = LoadedTarget.from_model(llama, source=TargetSource("somewhere/tiny"))
    assert not t.model.training
    assert t.num_blocks == len(find_decoder_blocks(llama)) == 4
    assert t.hidden_size == llama.config.hidden_size == 64
    assert t.vocab_size == find_embedding(llama).weight.shape[0] == 128
    assert t.text_config is llama.config
    assert t.device == torch.device("cpu") and t.dtype == torch.float32
    assert t.eos_ids == tuple(sorted({llama.generation_config.eos_token_id} - {None}))
    assert t.name == "somewhere/tiny"
    assert t.identity == target_identity(llama, source="somewhere/tiny")
    assert LoadedTarget.from_model(llama).name == type(llama).__name__


@pytest.mark.unit
def test_the_contract_reexports_the_identity():
    """TargetIdentity moved down to eyas.targets; the contract (and its JSON schema) still has it."""
    assert eyas.contract.TargetIdentity is TargetIdentity
    assert eyas.contract.Contract.model_fields["target"].annotation is TargetIdentity


@pytest.mark.unit
def test_misfits_name_field_expected_and_found(llama):
    t = LoadedTarget.from_model(llama)
    assert t.misfits(64, 128, [1, 2, 4]) == []
    assert t.misfits(64, 128) == []
    problems = t.misfits(32, 256, [1, 2, 5])
    assert problems == [
        "boundaries: [1, 2, 5] exceed the target's 4 blocks (expected each in 0..4)",
        "target_hidden_size: the drafter reads 32-wide target states, the target's are 64",
        "vocab_size: the drafter's vocabulary has 256 ids, the target's 128",
    ]


@pytest.mark.unit
@pytest.mark.parametrize("cuda,local_rank,device,expected", [
    (False, None, "auto", "cpu"),
    (True, None, "auto", "cuda:0"),
    (True, "2", "auto", "cuda:2"),  # under torchrun each process takes its own GPU
    (True, "1", "cuda", "cuda:1"),
    (True, "1", "cuda:3", "cuda:3"),  # an explicit index is taken as given
    (True, "1", "cpu", "cpu"),
])
def test_resolve_device(monkeypatch, cuda, local_rank, device, expected):
    monkeypatch.setattr(placement.torch.cuda, "is_available", lambda: cuda)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert resolve_device(device) == torch.device(expected)
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.unit
def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16  # as engines serve it
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype(torch.float64, "cpu") == torch.float64
    with pytest.raises(PlacementError, match=r"target dtype: expected auto\|bfloat16\|float16\|float32, found 'fp8'"):
        resolve_dtype("fp8", "cpu")
    with pytest.raises(PlacementError, match=r"device: expected auto\|cpu\|cuda\|cuda:N, found 'gpu'"):
        resolve_device("gpu")


@pytest.mark.unit
def test_resolve_draft_dtype(monkeypatch):
    from eyas.targets.placement import resolve_draft_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert resolve_draft_dtype("auto", torch.float32, "cpu") == torch.bfloat16  # native bf16: half the reads
    assert resolve_draft_dtype("auto", torch.bfloat16, torch.device("cuda", 0)) == torch.bfloat16  # the target's
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert resolve_draft_dtype("auto", torch.float32, "cpu") == torch.float32  # emulated bf16 would be slower
    assert resolve_draft_dtype("float32", torch.bfloat16, "cpu") == torch.float32
    with pytest.raises(PlacementError, match=r"--draft-dtype: expected auto\|bfloat16\|float16\|float32, found 'int8'"):
        resolve_draft_dtype("int8", torch.float32, "cpu")


@pytest.mark.integration
def test_load_target_returns_a_loaded_target(toy_drafter):
    target_dir, _ = toy_drafter
    t = load_target(str(target_dir), dtype="auto", device="cpu")
    assert isinstance(t, LoadedTarget)
    assert (t.num_blocks, t.hidden_size, t.dtype, t.device) == (8, 32, torch.float32, torch.device("cpu"))
    assert t.source == TargetSource(str(target_dir), name=str(target_dir)) and t.name == str(target_dir)
    assert t.identity.source == str(target_dir) and t.identity.num_blocks == 8
    assert t.tokenizer.eos_token_id in t.eos_ids
    with pytest.raises(PlacementError):  # names are checked before anything is loaded
        load_target(str(target_dir), dtype="fp8")


@pytest.mark.unit
def test_train_config_defaults_the_drafter_variant_flags_as_the_drafter_does():
    """Every norm flag is a TrainConfig field with the drafter's own default (that training passes
    a set flag on to the drafter is held by tests/test_doctor.py's world, trained with norm_before_fc)."""
    from eyas.drafter.config import NORM_FLAGS, DrafterConfig
    from eyas.training.config import TrainConfig

    default = TrainConfig(steps=1)
    assert all(getattr(default, f) == DrafterConfig.model_fields[f].default for f in NORM_FLAGS)


# ---------------------------------------------------------------------------------------------
# The identity covers every weight: a per-part sample names what changed
# ---------------------------------------------------------------------------------------------


def _perturbed(blocks: list[int], num_blocks: int = 6):
    from tests.support.tiny import tiny_model

    model = tiny_model(num_blocks=num_blocks)
    with torch.no_grad():
        for i in blocks:
            model.model.layers[i].mlp.down_proj.weight.mul_(1.05)
    return model


@pytest.mark.unit
def test_a_changed_middle_block_is_named_behind_an_identical_embedding():
    from eyas.targets import changed_parts, describe_changes
    from tests.support.tiny import tiny_model

    base, changed = target_identity(tiny_model(num_blocks=6)), target_identity(_perturbed([2]))
    assert changed.fingerprint == base.fingerprint  # the embedding and final norm alone cannot tell
    assert changed_parts(base, changed) == ["block 2"]
    assert describe_changes(changed_parts(base, changed)) == "block 2 differs"
    several = target_identity(_perturbed([1, 2, 3, 5]))
    assert changed_parts(base, several) == ["blocks 1 to 3", "block 5"]
    assert describe_changes(changed_parts(base, several)) == "blocks 1 to 3 and block 5 differ"
    assert describe_changes(["the embedding", "blocks 3 and 4"]) == "the embedding and blocks 3 and 4 differ"
    mm = eyas.contract.compare(_contract(base), _contract(changed))
    assert [(m.field, m.found) for m in mm] == [("target.weights", "block 2 differs")]


@pytest.mark.unit
def test_a_changed_embedding_or_final_norm_is_a_modified_copy_not_another_model():
    """The embedding or the final norm retouched (the fingerprint changes): at most half of the parts
    differ, so the comparison names them under target.weights (advisory) instead of failing on the
    fingerprint; beyond half of the parts, or another seed, it is another model."""
    from eyas.targets import changed_count, modified_copy
    from tests.support.tiny import tiny_model

    base = target_identity(tiny_model(num_blocks=6))
    model = tiny_model(num_blocks=6)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.01)
        model.model.norm.weight.mul_(1.01)
    retouched = target_identity(model)
    assert retouched.fingerprint != base.fingerprint and modified_copy(base, retouched)
    assert changed_count(base, retouched) == (2, 9)  # embedding, 6 blocks, final norm, lm_head
    mm = eyas.contract.compare(_contract(base), _contract(retouched))
    assert [(m.field, m.found) for m in mm] == [("target.weights", "the embedding and the final norm differ")]
    assert "target.weights" in eyas.contract.contract.ADVISORY_FIELDS
    # the embedding and 4 of the 6 blocks: 5 of 9 parts, more than half: another model
    many = _perturbed([0, 1, 2, 3])
    with torch.no_grad():
        many.model.embed_tokens.weight.mul_(1.01)
    other = target_identity(many)
    assert changed_count(base, other) == (5, 9) and not modified_copy(base, other)
    assert [m.field for m in eyas.contract.compare(_contract(base), _contract(other))] == ["target.fingerprint"]
    # another shape is never a modified copy
    assert not modified_copy(base, base.model_copy(update={"hidden_size": base.hidden_size * 2}))


@pytest.mark.unit
def test_identical_targets_compare_equal_in_fp32_and_bf16():
    from eyas.targets import changed_parts, weights_sample
    from tests.support.tiny import tiny_model

    a, b = target_identity(tiny_model(num_blocks=6)), target_identity(tiny_model(num_blocks=6))
    assert a == b and changed_parts(a, b) == [] and a.weights is not None and len(a.weights.blocks) == 6
    assert eyas.contract.compare(_contract(a), _contract(b)) == []
    half = tiny_model(num_blocks=6).to(torch.bfloat16)  # the same checkpoint loaded in bf16
    assert weights_sample(half) == a.weights and target_identity(half).fingerprint == a.fingerprint


@pytest.mark.unit
def test_an_identity_without_the_per_block_record_still_loads_and_compares():
    """An eyas.json written before the per-part sample: it loads, compares as before, and names nothing."""
    from eyas.targets import changed_parts
    from tests.support.tiny import tiny_model

    new = target_identity(_perturbed([2]))
    old_json = new.model_dump(exclude={"weights"})
    old = TargetIdentity.model_validate(old_json)
    assert old.weights is None and "weights" not in old_json
    assert changed_parts(old, new) is None and changed_parts(new, old) is None
    assert eyas.contract.compare(_contract(old), _contract(target_identity(tiny_model(num_blocks=6)))) == []
    other_fp = old.model_copy(update={"fingerprint": "0" * 16})
    assert [m.field for m in eyas.contract.compare(_contract(other_fp), _contract(new))] == ["target.fingerprint"]
    # with both records but another embedding, the binding fingerprint mismatch is reported alone
    other_seed = target_identity(tiny_model(num_blocks=6, seed=1))
    assert [m.field for m in eyas.contract.compare(_contract(new), _contract(other_seed))] == ["target.fingerprint"]
    assert changed_parts(new, other_seed)[0] == "the embedding"
    roundtrip = eyas.contract.Contract.from_json(_contract(old).to_json())
    assert roundtrip.target == old


@pytest.mark.unit
def test_changed_blocks_warn_on_load_rather_than_refuse():
    from tests.support.tiny import tiny_model

    mm = eyas.contract.compare(_contract(target_identity(tiny_model(num_blocks=6))),
                               _contract(target_identity(_perturbed([4]))))
    with pytest.warns(UserWarning, match="target.weights.*block 4 differs.*eyas doctor"):
        assert eyas.contract.enforce(mm, "drafter vs target") == mm


def _contract(identity: TargetIdentity):
    return eyas.contract.Contract(target=identity, capture=eyas.contract.CaptureContract(boundaries=[1, 2, 3]))
