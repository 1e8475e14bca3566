"""`eyas import-hidden-states --format speculators`: speculators' offline data (vLLM's
extract_hidden_states connector writes ``hs_<row>.safetensors``; the loss masks live in the
preprocessed dataset of ``speculators prepare-data``) becomes eyas shards whose contract, tokens and
boundary values equal eyas' own capture of the same tokens by the same target.

The dump is written here as speculators and vLLM write it, from a tiny random Llama (L = 4):
``PRE/`` a ``datasets.save_to_disk`` directory with ``input_ids``, ``loss_mask``, ``seq_len`` (torch
format), ``PRE/hidden_states/hs_<row>.safetensors`` holding ``token_ids`` int64 [T] and
``hidden_states`` [T, S+1, H]: the inputs of blocks 1 and 2 (vLLM's ids 1, 2 = eyas boundaries 1,
2) and id L = the last block's output before the final norm (launch_vllm.py appends it), read here
with HF's ``output_hidden_states`` and a hook on the last block, not with eyas' capture."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from eyas.cli.main import app
from eyas.data.dumps import DumpError, import_speculators
from eyas.data.shards import ShardDataset
from eyas.training.batches import OfflineBatches
from tests.support.toy import reference_capture

pytestmark = pytest.mark.integration

datasets = pytest.importorskip("datasets")  # installed by scripts/setup.sh with speculators

L, H = 4, 32
LAUNCH_IDS = [1, 2, L]  # launch_vllm.py --target-layer-ids 1 2 (+ the L it appends)


def save_preprocessed(path, rows):
    """What ``speculators prepare-data`` saves: input_ids, loss_mask, seq_len, torch format."""
    ds = datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows],
                                     "seq_len": [len(r[0]) for r in rows]})
    ds.set_format(type="torch")
    ds.save_to_disk(str(path))


@torch.no_grad()
def vllm_hidden_states(model, input_ids, layer_ids):
    """[T, len(layer_ids), H] as vLLM stores it: id k < L = the input of block k, id L = the last
    block's output (pre-norm), in layer order."""
    box = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: box.__setitem__("last", (o[0] if isinstance(o, tuple) else o)[0].clone()))
    try:
        hs = model(input_ids=input_ids[None], output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return torch.stack([box["last"] if k == L else hs[k][0] for k in layer_ids], dim=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculators")
    target, loaded, ds = reference_capture(root, [1, 2], num_blocks=L, hidden=H)
    pre = root / "pre"
    rows = [(ds[i]["input_ids"].tolist(), ds[i]["loss_mask"].tolist()) for i in range(len(ds))]
    rows.append(([1, 2, 3], [0, 1, 1]))  # a row whose request failed: no file (speculators skips it)
    save_preprocessed(pre, rows)
    (pre / "hidden_states").mkdir()
    for i in range(len(ds)):
        ids = ds[i]["input_ids"].long()
        save_file({"hidden_states": vllm_hidden_states(loaded.model, ids, LAUNCH_IDS).contiguous(),
                   "token_ids": ids.clone()}, str(pre / "hidden_states" / f"hs_{i}.safetensors"))
    return root, target, loaded, ds, pre


def test_converted_shards_equal_eyas_own_capture(setup):
    root, target, loaded, ref, pre = setup
    out = root / "imported"
    r = CliRunner().invoke(app, ["import-hidden-states", "--format", "speculators", "--dump",
                                 str(pre / "hidden_states"), "--out", str(out), "--target", str(target),
                                 "--layer-ids", "1,2,4", "--dtype", "float32", "--shard-size", "2", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["format"] == "speculators" and report["boundaries"] == [1, 2]
    assert (report["samples"], report["shards"], report["missing"], report["shards_resumed"]) == (3, 2, 1, 0)
    got = ShardDataset(out, verify="full")
    assert got.contract.capture.boundaries == [1, 2] == ref.contract.capture.boundaries
    assert got.contract.capture.dtype == "float32" and got.contract.capture.values == "pre_norm_residual"
    assert got.contract.target == ref.contract.target  # identity of the same target: weights included
    assert not got.last_hidden_normed and not ref.last_hidden_normed  # vLLM's id L is boundary L, pre-norm
    assert got.manifest["imported"]["format"] == "speculators"
    assert got.manifest["imported"]["preprocessed_data"] == str(pre)  # found above the dump
    assert got.manifest["imported"]["rows_without_file"] == 1
    assert got.ids == ["speculators:hs_0", "speculators:hs_1", "speculators:hs_2"]
    got.check_target(loaded)  # the contract check training runs passes
    for i in range(len(ref)):
        a, b = ref[i], got[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.equal(a["slots"], b["slots"])
        assert torch.equal(a["last_hidden"], b["last_hidden"])
    fa, fb = ref.contract.fingerprint, got.contract.fingerprint
    assert [f.boundary for f in fa] == [f.boundary for f in fb]
    assert all(abs(x.rms_mean - y.rms_mean) < 1e-5 for x, y in zip(fa, fb))
    draft_ids = torch.arange(64)
    la = OfflineBatches(loaded.model, draft_ids, torch.device("cpu")).make([ref[i] for i in range(len(ref))]).labels
    lb = OfflineBatches(loaded.model, draft_ids, torch.device("cpu")).make([got[i] for i in range(len(got))]).labels
    assert torch.equal(la.argmax, lb.argmax) and torch.allclose(la.draft_logits, lb.draft_logits, atol=1e-6)

    # The same slots named without the appended last layer, or as eyas boundaries: the same shards.
    for opt in (["--layer-ids", "1,2"], ["--boundaries", "1,2"]):
        out2 = root / f"imported{len(opt[0])}"
        r = CliRunner().invoke(app, ["import-hidden-states", "--format", "speculators", "--dump",
                                     str(pre / "hidden_states"), "--out", str(out2), "--target", str(target),
                                     *opt, "--dtype", "float32", "--shard-size", "2", "--json"])
        assert r.exit_code == 0, r.output
        assert [e["sha256"] for e in ShardDataset(out2).shards] == [e["sha256"] for e in got.shards]


def test_an_interrupted_import_resumes_and_another_is_refused(setup, tmp_path):
    _, _, loaded, _, pre = setup
    out = tmp_path / "o"

    def crash_after_first(msg):
        if msg.startswith("shard 0"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_speculators(pre / "hidden_states", out, loaded.model, LAUNCH_IDS, dtype="float32", shard_size=1,
                           log=crash_after_first)
    assert not (out / "manifest.json").exists() and (out / "shard-r00-00000.safetensors").exists()
    with pytest.raises(DumpError, match="cannot resume.*dtype: the earlier run had 'float32', now 'bfloat16'"):
        import_speculators(pre / "hidden_states", out, loaded.model, LAUNCH_IDS, shard_size=1)
    other = tmp_path / "other"  # the same rows, another preprocessed dataset: the loss masks may differ
    shutil.copytree(pre, other, ignore=shutil.ignore_patterns("hidden_states"))
    with pytest.raises(DumpError, match="cannot resume.*preprocessed_data: the earlier run had"):
        import_speculators(pre / "hidden_states", out, loaded.model, LAUNCH_IDS, dtype="float32", shard_size=1,
                           preprocessed_data=other)
    s = import_speculators(pre / "hidden_states", out, loaded.model, LAUNCH_IDS, dtype="float32", shard_size=1)
    assert (s.shards, s.shards_resumed, s.samples) == (3, 1, 3)
    whole = import_speculators(pre / "hidden_states", tmp_path / "w", loaded.model, LAUNCH_IDS, dtype="float32",
                               shard_size=1)
    assert [e["sha256"] for e in ShardDataset(out, verify="full").shards] == \
        [e["sha256"] for e in ShardDataset(whole.out_dir).shards]
    with pytest.raises(DumpError, match="already holds a finished capture"):
        import_speculators(pre / "hidden_states", out, loaded.model, LAUNCH_IDS, dtype="float32", shard_size=1)


def test_fp8_files_are_dequantized(setup, tmp_path):
    _, _, loaded, _, pre = setup
    shutil.copytree(pre, tmp_path / "pre", ignore=shutil.ignore_patterns("hidden_states"))
    (tmp_path / "pre" / "hidden_states").mkdir()
    ref = {}
    for i in range(3):  # what hs_connectors' FP8HiddenStatesConnector writes: per-token scale
        d = _load(pre / "hidden_states" / f"hs_{i}.safetensors")
        hs = d["hidden_states"]
        scale = (hs.abs().amax(dim=(1, 2), keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
        fp8 = (hs / scale).to(torch.float8_e4m3fn)
        ref[i] = fp8.float() * scale
        save_file({"hidden_states": fp8, "hidden_states_scales": scale.float(), "token_ids": d["token_ids"]},
                  str(tmp_path / "pre" / "hidden_states" / f"hs_{i}.safetensors"))
    s = import_speculators(tmp_path / "pre" / "hidden_states", tmp_path / "o", loaded.model, LAUNCH_IDS,
                           dtype="float32")
    got = ShardDataset(s.out_dir)
    for i in range(3):
        assert torch.equal(got[i]["slots"], ref[i][:, :2]) and torch.equal(got[i]["last_hidden"], ref[i][:, 2])


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


# ---------------------------------------------------------------------------------------------
# Bad input: each error names the file, the field, what was expected and what was found
# ---------------------------------------------------------------------------------------------


def _bad_dump(tmp_path, setup, tensors=None, rows=None, name="hs_0.safetensors", raw=None):
    """A one-file dump beside a preprocessed dataset; the file holds ``tensors`` (default: sample
    0 as vLLM writes it) or the bytes ``raw``."""
    _, _, loaded, ref, pre = setup
    ids = ref[0]["input_ids"].long()
    d = tmp_path / "pre"
    save_preprocessed(d, rows if rows is not None else [(ids.tolist(), ref[0]["loss_mask"].tolist())])
    (d / "hidden_states").mkdir()
    f = d / "hidden_states" / name
    if raw is not None:
        f.write_bytes(raw)
    else:
        base = _load(pre / "hidden_states" / "hs_0.safetensors")
        save_file(base if tensors is None else tensors(base), str(f))
    return d / "hidden_states", loaded.model, f


def _refused(dump, model, match, tmp_path, ids=LAUNCH_IDS, **kw):
    with pytest.raises(DumpError, match=match):
        import_speculators(dump, tmp_path / "out", model, ids, **kw)
    assert not (tmp_path / "out").exists()  # nothing written


def test_missing_key(setup, tmp_path):
    dump, model, f = _bad_dump(tmp_path, setup, lambda b: {"token_ids": b["token_ids"]})
    _refused(dump, model, f"{f}: expected keys token_ids, hidden_states; missing \\['hidden_states'\\]", tmp_path)


def test_layer_count_without_the_last_layer(setup, tmp_path):
    dump, model, f = _bad_dump(tmp_path, setup, lambda b: {**b, "hidden_states": b["hidden_states"][:, :2].clone()})
    _refused(dump, model, f"{f}: hidden_states: expected .* = \\[\\d+, 3, 32\\].*found \\[\\d+, 2, 32\\].*"
                          "--no-include-last-layer", tmp_path)


def test_layer_count_not_matching_the_ids_given(setup, tmp_path):
    dump, model, f = _bad_dump(tmp_path, setup)
    _refused(dump, model, f"{f}: hidden_states: expected .*S = 1 boundaries.*found \\[\\d+, 3, 32\\].*"
                          "2 captured layers in the file", tmp_path, ids=[2, L])


def test_hidden_size_of_another_model(setup, tmp_path):
    dump, model, f = _bad_dump(tmp_path, setup, lambda b: {**b, "hidden_states": b["hidden_states"][..., :16].clone()})
    _refused(dump, model, f"{f}: hidden_states: expected .*H = 32 the target's hidden size.*found \\[\\d+, 3, 16\\]",
             tmp_path)


def test_token_ids_of_another_dataset(setup, tmp_path):
    def shifted(b):
        ids = b["token_ids"].clone()
        ids[3] += 1
        return {**b, "token_ids": ids}

    dump, model, f = _bad_dump(tmp_path, setup, shifted)
    _refused(dump, model, f"{f}: token_ids: expected row 0's input_ids of .*pre.*differ from position 3", tmp_path)


def test_row_beyond_the_preprocessed_dataset(setup, tmp_path):
    dump, model, f = _bad_dump(tmp_path, setup, name="hs_7.safetensors")
    _refused(dump, model, f"{f}: expected a row of .*\\(rows 0..0\\), found row 7", tmp_path)


def test_loss_mask_of_another_length(setup, tmp_path):
    _, _, _, ref, _ = setup
    ids = ref[0]["input_ids"].tolist()
    dump, model, _ = _bad_dump(tmp_path, setup, rows=[(ids, [1] * (len(ids) - 1))])
    _refused(dump, model, f"row 0: loss_mask: expected {len(ids)} values \\(its input_ids\\), found {len(ids) - 1}",
             tmp_path)


def test_unreadable_file(setup, tmp_path):
    dump, model, f = _bad_dump(tmp_path, setup, raw=b"\x10\x00\x00\x00\x00\x00\x00\x00{truncated")
    _refused(dump, model, f"{f}: expected a safetensors file.*found an unreadable file", tmp_path)


def test_fp8_without_scales(setup, tmp_path):
    dump, model, f = _bad_dump(tmp_path, setup,
                               lambda b: {**b, "hidden_states": b["hidden_states"].to(torch.float8_e4m3fn)})
    _refused(dump, model, f"{f}: hidden_states: expected bfloat16, float16 or float32.*found torch.float8_e4m3fn "
                          "without hidden_states_scales", tmp_path)


def test_non_finite_values(setup, tmp_path):
    def nan(b):
        hs = b["hidden_states"].clone()
        hs[2, 1, 5] = float("nan")
        return {**b, "hidden_states": hs}

    dump, model, f = _bad_dump(tmp_path, setup, nan)
    _refused(dump, model, f"{f}: expected finite hidden states, found NaN or Inf", tmp_path)


def test_no_files_or_no_preprocessed_dataset(setup, tmp_path):
    _, _, loaded, _, pre = setup
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", loaded.model, "expected hs_<row>.safetensors files .*found none", tmp_path)
    _refused(pre, loaded.model, "found none.*subdirectory .*hidden_states is where generate-offline-data writes",
             tmp_path)
    lone = tmp_path / "lone"
    shutil.copytree(pre / "hidden_states", lone)
    _refused(lone, loaded.model, "loss masks are not in the hs_<row>.safetensors files.*pass --preprocessed-data",
             tmp_path)
    _refused(lone, loaded.model, f"{tmp_path / 'nowhere'}: expected speculators' preprocessed dataset", tmp_path,
             preprocessed_data=tmp_path / "nowhere")
    s = import_speculators(lone, tmp_path / "o", loaded.model, LAUNCH_IDS, preprocessed_data=pre)
    assert s.samples == 3 and s.missing == 1


def test_cli_options_that_do_not_apply(setup, tmp_path):
    _, target, _, _, pre = setup
    base = ["import-hidden-states", "--format", "speculators", "--dump", str(pre / "hidden_states"),
            "--target", str(target), "--out", str(tmp_path / "x")]
    r = CliRunner().invoke(app, [*base, "--layer-ids", "1,2", "--ids-convention", "specforge"])
    assert r.exit_code == 2 and "applies to --format specforge only" in r.output, r.output
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 2 and "launch_vllm.py --target-layer-ids" in r.output and "found neither" in r.output
    r = CliRunner().invoke(app, [*base[:2], "specforge", *base[3:], "--boundaries", "1,2", "--preprocessed-data",
                                 str(pre)])
    assert r.exit_code == 2 and "--preprocessed-data: applies to --format speculators only" in r.output, r.output
    assert not (tmp_path / "x").exists()
