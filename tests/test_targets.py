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
