"""A target split across devices (``--target-devices``, eyas.targets.split): the boundaries it
captures equal the single-device ones bit for bit in float32, and every wrong option fails naming
``--target-devices``, what was expected and what was found.

Only CPUs here: the split puts the blocks on ``cpu`` and ``cpu``, which runs the same moves and
hooks as two GPUs but on one kind of device. The same equality on two real GPUs is pending a
machine with several GPUs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from eyas.capture import BoundaryCapture
from eyas.convention import CaptureSpec
from eyas.targets import (
    PlacementError,
    load_target,
    parse_target_devices,
    place_model,
    split_device_map,
)
from eyas.targets.split import devices_of
from tests.support.tiny import tiny_model

pytestmark = pytest.mark.unit

CPU2 = [torch.device("cpu"), torch.device("cpu")]
SPEC = CaptureSpec((0, 1, 3), 4)


def _capture(model, ids):
    with torch.no_grad(), BoundaryCapture(model, SPEC, include_last=True) as cap:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        return [cap.boundary(b) for b in (*SPEC.boundaries, 4)], logits


@pytest.fixture(scope="module")
def pair():
    one = tiny_model("llama", num_blocks=4, seed=3)
    return one, place_model(copy.deepcopy(one), split_device_map(one, CPU2))


def test_the_split_puts_blocks_in_contiguous_runs_embedding_first_head_last(pair):
    one, _ = pair
    dmap = split_device_map(one, [torch.device("cpu"), torch.device("meta")])  # a stand-in second device
    assert dmap[""] == torch.device("cpu")
    assert [dmap[f"model.layers.{i}"].type for i in range(4)] == ["cpu", "cpu", "meta", "meta"]
    assert dmap["model.norm"].type == "meta" and dmap["lm_head"].type == "meta"
    # Placing moves each weight straight to its device (never the whole model to the first one).
    placed = place_model(tiny_model("llama", num_blocks=4), dmap)
    where = {n: p.device.type for n, p in placed.named_parameters()}
    assert where["model.embed_tokens.weight"] == "cpu" and where["model.layers.1.mlp.up_proj.weight"] == "cpu"
    assert where["model.layers.2.mlp.up_proj.weight"] == "meta" and where["lm_head.weight"] == "meta"
    assert placed.model.rotary_emb.inv_freq.device.type == "cpu"


def test_split_capture_equals_single_device_capture_bit_for_bit_in_float32(pair):
    one, split = pair
    assert split.hf_device_map["model.layers.3"] == "cpu"
    assert split.model.layers[2]._forward_pre_hooks and split.lm_head._forward_hooks  # the split path runs
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    ref, ref_logits = _capture(one, ids)
    got, logits = _capture(split, ids)
    assert all(r.dtype == torch.float32 and torch.equal(r, g) for r, g in zip(ref, got))
    assert torch.equal(ref_logits, logits)
    # Generation (the KV cache across blocks on their devices) gives the same tokens.
    a = one.generate(ids[:1, :5], max_new_tokens=6, do_sample=False)
    b = split.generate(ids[:1, :5], max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_an_explicit_device_map_file_is_checked_and_applied(tmp_path):
    model = tiny_model("llama", num_blocks=4, seed=3)
    good = tmp_path / "map.json"
    good.write_text(json.dumps({"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                                "model.layers.1": "cpu", "model.layers.2": "cpu", "model.layers.3": "cpu",
                                "model.norm": "cpu", "lm_head": "cpu"}))
    td = parse_target_devices(str(good))
    place_model(model, td.plan(model))
    assert devices_of(model) == [torch.device("cpu")]
    bad = tmp_path / "holes.json"
    bad.write_text(json.dumps({"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.norm": "cpu",
                               "lm_head": "cpu"}))
    with pytest.raises(PlacementError, match=r"--target-devices: the device map leaves decoder block 1 "
                                             r"\(model.layers.1\) unplaced"):
        parse_target_devices(str(bad)).plan(tiny_model("llama", num_blocks=4))
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"": "cpu", "model.layer.0": "cpu"}))
    with pytest.raises(PlacementError, match="model.layer.0.*not modules of LlamaForCausalLM"):
        parse_target_devices(str(typo)).plan(tiny_model("llama", num_blocks=4))


@pytest.mark.parametrize("text, needle", [
    ("cuda:7", "'cuda:7' is not available: this machine has"),
    ("cpu,tpu9", "expected cpu or cuda:N, found 'tpu9'"),
    ("cuda", "expected an indexed GPU such as cuda:0, found 'cuda'"),
    ("cpu,", "expected auto, devices such as cuda:0,cuda:1 or a .json device map, found 'cpu,'"),
    ("missing.json", "missing.json: no such file"),
])
def test_bad_target_devices_name_the_option_expected_and_found(text, needle):
    if text == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    with pytest.raises(PlacementError) as e:
        parse_target_devices(text)
    assert str(e.value).startswith("--target-devices") and needle in str(e.value)


def test_more_devices_than_blocks_fails():
    with pytest.raises(PlacementError, match="--target-devices: 5 devices for a target of 4 decoder blocks"):
        split_device_map(tiny_model("llama", num_blocks=4), [torch.device("cpu")] * 5)


def test_load_target_and_the_cli_take_target_devices(tmp_path):
    from eyas.cli.main import app
    from tests.support.toy import make_toy_target

    target = make_toy_target(tmp_path / "t", num_blocks=4, hidden=32)
    one = load_target(str(target))
    split = load_target(str(target), target_devices="cpu,cpu")
    assert split.model.hf_device_map["model.layers.2"] == "cpu" and split.device == torch.device("cpu")
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(_capture(one.model, ids)[0], _capture(split.model, ids)[0]))
    auto = load_target(str(target), target_devices="auto")  # accelerate's placement: the CPU here
    assert all(torch.equal(a, b) for a, b in zip(_capture(one.model, ids)[0], _capture(auto.model, ids)[0]))

    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    for command in (["capture", "--data", str(data), "--out", str(tmp_path / "o")],
                    ["regenerate", "--prompts", str(data), "--out", str(tmp_path / "a.jsonl")]):
        result = CliRunner().invoke(app, [*command, "--target", str(target), "--target-devices", "cuda:9"])
        assert result.exit_code == 2, result.output
        assert "--target-devices" in result.output and "'cuda:9' is not available" in result.output


def test_a_tied_lm_head_stays_with_the_embedding():
    from transformers import AutoModelForCausalLM

    from tests.support.tiny import tiny_config

    cfg = tiny_config("llama", num_blocks=4)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    dmap = split_device_map(model, [torch.device("cpu"), torch.device("meta")])
    assert dmap["lm_head"].type == "cpu" and dmap["model.norm"].type == "meta"
    split = place_model(copy.deepcopy(model), split_device_map(model, CPU2))
    assert split.lm_head.weight is split.model.embed_tokens.weight
    ids = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(2))
    ref, got = _capture(model, ids), _capture(split, ids)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0])) and torch.equal(ref[1], got[1])
