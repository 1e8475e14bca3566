"""The drafter shipped inside eyas for the embedded SmolLM2 target: what --draft default means, the
files' limits, and that it fits its target and serves losslessly there."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.interop import CheckpointError, embedded_drafter, load_drafter, resolve_draft
from eyas.interop.embedded import EMBEDDED_DIR

SHIPPED = EMBEDDED_DIR / "smollm2-135m-instruct"


@pytest.mark.unit
def test_default_and_no_draft_resolve_to_the_shipped_drafter_for_smollm2_only(tmp_path) -> None:
    assert resolve_draft(None, "smollm2") == SHIPPED == resolve_draft("default", "smollm2")
    assert resolve_draft(str(tmp_path), "smollm2") == tmp_path  # a directory is taken as given
    with pytest.raises(CheckpointError, match=r"ships a drafter only for --target smollm2, found --target 'org/other'"):
        resolve_draft(None, "org/other")
    with pytest.raises(CheckpointError, match="pass --draft DIR"):
        embedded_drafter("/models/llama")


@pytest.mark.unit
def test_shipped_files_are_bf16_at_most_16_mib_each_40_in_all_without_the_target_embedding() -> None:
    from safetensors import safe_open

    files = sorted(p for p in SHIPPED.iterdir() if p.is_file())
    assert all(p.stat().st_size <= 16 * 2**20 for p in files), [(p.name, p.stat().st_size) for p in files]
    assert sum(p.stat().st_size for p in files) <= 40 * 2**20
    index = json.loads((SHIPPED / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert "embed_tokens.weight" not in names and {"fc.weight", "lm_head.weight", "d2t", "t2d"} <= names
    for shard in set(index["weight_map"].values()):
        with safe_open(str(SHIPPED / shard), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                assert not t.is_floating_point() or t.dtype == torch.bfloat16, (k, t.dtype)
    meta = json.loads((SHIPPED / "eyas.json").read_text())
    assert meta["embeddings"] == "from_target" and meta["boundaries"] == [2, 15, 27]
    metrics = meta["contract"]["metrics"]
    assert metrics["simulated_accept_length"] > 2.5 and metrics["tau"] > 2.5  # recorded at training
    assert (SHIPPED / "README.md").read_text().count("train_smollm2_drafter.py") >= 2  # how to reproduce it


@pytest.mark.slow
def test_the_shipped_drafter_fits_smollm2_and_serves_greedy_output_equal_to_plain() -> None:
    from eyas.convention import CaptureSpec
    from eyas.data.render import render_prompt
    from eyas.engine import TreeSpec, build_target, plain_generate, speculative_generate
    from eyas.targets import load_target

    loaded = load_target("smollm2", dtype=torch.float32, device="cpu")
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")  # no contract mismatch, not even a warning
        drafter, contract = load_drafter(resolve_draft(None, "smollm2"), target=loaded, tokenizer=loaded.tokenizer)
    drafter = drafter.float().eval()
    target = build_target(loaded.model, CaptureSpec(tuple(contract.capture.boundaries), loaded.num_blocks), "hf")
    ids = render_prompt([{"role": "user", "content": "Give me three tips for a good night's sleep."}],
                        loaded.tokenizer)[None]
    eos = list(loaded.eos_ids)
    spec = speculative_generate(target, drafter, ids, tree=TreeSpec.chain(4), max_new_tokens=48, eos_token_ids=eos)
    plain = plain_generate(target, ids, max_new_tokens=48, eos_token_ids=eos)
    assert spec.tokens == plain.tokens
    assert spec.stats.tau > 1.3  # drafts are accepted (1.5 on this prompt in float32; untrained: about 1.0)
