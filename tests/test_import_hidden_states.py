"""`eyas import-hidden-states`: a SpecForge offline dump (scripts/prepare_hidden_states.py's
rows_*/data_<idx>.ckpt files) becomes eyas shards whose contract, tokens and boundary values equal
eyas' own capture of the same tokens by the same target.

The dump is written here, in SpecForge's layout, from a tiny random Llama: ``aux_hidden_state`` the
outputs of the blocks named by the layer ids (SpecForge's "output of block k" = boundary k+1),
concatenated in layer order, ``hidden_state`` the final norm's output."""

from __future__ import annotations


import pytest
import torch
from typer.testing import CliRunner

from eyas.cli.main import app
from eyas.data.dumps import DumpError, import_specforge
from eyas.data.shards import ShardDataset
from eyas.training.batches import OfflineBatches
from tests.support.toy import reference_capture

pytestmark = pytest.mark.unit

LAYER_IDS = [0, 1, 2]  # SpecForge ids: outputs of blocks 0, 1, 2 = eyas boundaries 1, 2, 3 (L = 4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("import")
    target, loaded, ds = reference_capture(root, [1, 2, 3], num_blocks=4, hidden=32)
    dump = root / "dump"
    (dump / "rows_0-5000").mkdir(parents=True)
    with torch.no_grad():
        for i in range(len(ds)):  # what prepare_hidden_states.py writes, per sample
            item = ds[i]
            out = loaded.model(input_ids=item["input_ids"][None], output_hidden_states=True)
            hs = out.hidden_states  # HF: [i] = input of block i; [-1] = after the final norm
            torch.save({"input_ids": item["input_ids"], "loss_mask": item["loss_mask"],
                        "hidden_state": hs[-1].clone(),
                        "aux_hidden_state": torch.cat([hs[k + 1] for k in LAYER_IDS], dim=-1).clone()},
                       dump / "rows_0-5000" / f"data_{i}.ckpt")
    return root, target, loaded, ds, dump


def test_converted_shards_equal_eyas_own_capture(setup):
    root, target, loaded, ref, dump = setup
    out = root / "imported"
    result = CliRunner().invoke(app, ["import-hidden-states", "--dump", str(dump), "--out", str(out),
                                      "--target", str(target), "--layer-ids", "0,1,2", "--ids-convention",
                                      "specforge", "--dtype", "float32", "--shard-size", "2", "--json"])
    assert result.exit_code == 0, result.output
    got = ShardDataset(out, verify="full")
    assert got.contract.capture.boundaries == [1, 2, 3] == ref.contract.capture.boundaries
    assert got.contract.target == ref.contract.target  # identity of the same target: weights included
    assert got.last_hidden_normed and not ref.last_hidden_normed and len(got.shards) == 2
    got.check_target(loaded)  # the contract check training runs passes
    norm = loaded.model.model.norm
    for i in range(len(ref)):
        a, b = ref[i], got[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.equal(a["slots"], b["slots"])
        with torch.no_grad():
            assert torch.allclose(norm(a["last_hidden"]), b["last_hidden"], atol=1e-6)
    # Training's labels from the imported (post-norm) shards equal those from eyas' own.
    draft_ids = torch.arange(64)
    la = OfflineBatches(loaded.model, draft_ids, torch.device("cpu")).make([ref[i] for i in range(len(ref))]).labels
    lb = OfflineBatches(loaded.model, draft_ids, torch.device("cpu"), normed=True).make(
        [got[i] for i in range(len(got))]).labels
    assert torch.equal(la.argmax, lb.argmax) and torch.allclose(la.draft_logits, lb.draft_logits, atol=1e-5)
    fa, fb = ref.contract.fingerprint, got.contract.fingerprint
    assert [f.boundary for f in fa] == [f.boundary for f in fb]
    # The doctor's replay labels too (lm_head only on the imported post-norm states).
    from eyas.doctor.capture import stored_labels
    from eyas.doctor.samples import Sample

    def samples(ds):
        return [Sample(str(x["id"]), x["input_ids"].long(), x["loss_mask"].long(), x["slots"].flatten(1).float(),
                       x["last_hidden"]) for x in (ds[i] for i in range(len(ds)))]

    assert all(torch.equal(a, b) for a, b in zip(stored_labels(loaded.model, samples(ref)),
                                                 stored_labels(loaded.model, samples(got), normed=True)))


def test_ambiguous_or_missing_layers_are_refused(setup):
    root, target, _, _, dump = setup
    base = ["import-hidden-states", "--dump", str(dump), "--target", str(target)]
    r = CliRunner().invoke(app, [*base, "--out", str(root / "x1"), "--layer-ids", "0,1,2"])
    assert r.exit_code == 2 and "read them differently" in r.output and "--ids-convention" in r.output, r.output
    r = CliRunner().invoke(app, [*base, "--out", str(root / "x2")])
    assert r.exit_code == 2 and "--boundaries" in r.output and "found neither" in r.output, r.output
    r = CliRunner().invoke(app, [*base, "--out", str(root / "x3"), "--boundaries", "1,2"])  # 2 slots, dump has 3
    assert r.exit_code == 2 and "aux_hidden_state [1, " in r.output, r.output
    assert not any((root / x).exists() for x in ("x1", "x2", "x3"))


def test_a_dump_without_aux_hidden_states_names_the_missing_flag(setup, tmp_path):
    _, _, loaded, _, _ = setup
    (tmp_path / "d").mkdir()
    torch.save({"input_ids": torch.arange(4), "loss_mask": torch.ones(4), "hidden_state": torch.zeros(1, 4, 32)},
               tmp_path / "d" / "data_0.ckpt")
    with pytest.raises(DumpError, match="missing \\['aux_hidden_state'\\].*--enable-aux-hidden-states"):
        import_specforge(tmp_path / "d", tmp_path / "o", loaded.model, [1, 2, 3])
    assert not (tmp_path / "o").exists()  # nothing written
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match="expected data_<idx>.ckpt files"):
        import_specforge(tmp_path / "empty", tmp_path / "o2", loaded.model, [1, 2, 3])
    with pytest.raises(DumpError, match="ascending"):
        import_specforge(tmp_path / "d", tmp_path / "o3", loaded.model, [3, 1, 2])
