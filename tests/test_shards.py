"""Hidden-state shards (eyas.data.shards) and the slot fingerprint (eyas.capture.stats).

Shards read back equal the live capture of the same sequence; a resumed capture (crash, deleted
shard, deleted progress) rewrites identical bytes; two ranks cover every sample exactly once; the
manifest fingerprint equals a direct computation; a manifest meets another target -> ContractError
naming target.fingerprint; a damaged shard -> ShardError naming the file. Plus the two CLI commands.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from eyas.capture import BoundaryCapture
from eyas.capture.stats import FingerprintAccumulator, default_channels
from eyas.contract import ContractError
from eyas.convention import CaptureSpec
from eyas.data.conversations import Conversation
from eyas.data.render import render
from eyas.data.shards import (
    PLAN_PARAMS,
    CaptureOptions,
    ShardDataset,
    ShardError,
    capture_shards,
    finalize_manifest,
    plan_shards,
    shard_name,
)
from tests.support.chat import chat_target, chat_tokenizer

SPEC = CaptureSpec((0, 3, 5), 6)  # boundary 0 (embeddings, pre-hook) and boundary 5; L = 6 is last_hidden
MAXLEN = 160


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def target(tok):
    return chat_target(tok)


def conversations(n: int = 11) -> list[Conversation]:
    """Varied lengths; c3 has two turns, c5 is a prompt without an answer (no loss tokens: left
    out), c9 is long enough to be truncated at MAXLEN."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"q{i} " + "ab" * (i % 5)},
                {"role": "assistant", "content": f"answer {i} " + "xyz" * (i % 4 + (40 if i == 9 else 0))}]
        if i == 3:
            msgs += [{"role": "user", "content": "again"}, {"role": "assistant", "content": "second answer"}]
        if i == 5:
            msgs = msgs[:1]
        out.append(Conversation(msgs, id=f"c{i}"))
    return out


KW = dict(max_length=MAXLEN, batch_size=3, dtype="float32", shard_size=3, progress=False)


def opts(out: pathlib.Path, **kw) -> CaptureOptions:
    """The tests' capture options: SPEC's boundaries, KW, then ``kw``."""
    return CaptureOptions(out_dir=out, boundaries=list(SPEC.boundaries), **(KW | kw))


def files(d: pathlib.Path) -> dict[str, bytes]:
    """Every shard and the manifest, by name (the outputs that must be identical)."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())
            if p.name.startswith("shard-") or p.name == "manifest.json"}


@torch.no_grad()
def live(model, ids: torch.Tensor):
    with BoundaryCapture(model, SPEC, include_last=True) as cap:
        model(ids[None])
    return torch.stack(cap.slots(), dim=2)[0], cap.last_hidden()[0]  # [1, T, S, H] -> [T, S, H]; [T, H]


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory, tok, target):
    """An uninterrupted single-rank capture, the reference for the resume tests."""
    d = tmp_path_factory.mktemp("ref")
    s = capture_shards(target, tok, conversations(), opts(d, source_data="convs.jsonl"), source="tiny")
    assert s.manifest == str(d / "manifest.json")
    return d


# -- writing and reading back -------------------------------------------------------------------


@pytest.mark.unit
def test_shards_read_back_equal_the_live_capture(tmp_path, tok, target):
    s = capture_shards(target, tok, conversations(), opts(tmp_path, batch_size=1))
    assert (s.conversations, s.samples, s.no_loss_tokens, s.truncated) == (11, 10, 1, 1)
    ds = ShardDataset(tmp_path)
    assert len(ds) == 10 and sorted(ds.ids) == sorted(f"c{i}" for i in range(11) if i != 5)
    for k in range(4):  # inside a shard, samples are stored longest first (the batch order)
        lens = [ds.lengths[i] for i in range(len(ds)) if ds._shard[i] == k]
        assert lens == sorted(lens, reverse=True)
    convs = {c.id: c for c in conversations()}
    for i in range(len(ds)):
        item = ds[i]
        r = render(convs[item["id"]], tok, max_length=MAXLEN)
        assert torch.equal(item["input_ids"], r.input_ids) and item["input_ids"].dtype == torch.long
        assert torch.equal(item["loss_mask"], r.loss_mask)
        slots, last = live(target, r.input_ids)
        assert item["slots"].shape == (r.num_tokens, 3, 64)
        assert torch.equal(item["slots"], slots), item["id"]  # exact: same sequence, unpadded
        assert torch.equal(item["last_hidden"], last)
    assert ds.lengths == [len(ds[i]["input_ids"]) for i in range(len(ds))]
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["counts"]["samples"] == 10 and m["counts"]["tokens"] == sum(ds.lengths)
    assert m["counts"]["loss_tokens"] == sum(int(ds[i]["loss_mask"].sum()) for i in range(len(ds)))
    assert [e["file"] for e in m["shards"]] == [shard_name(0, k) for k in range(4)]
    assert ds.contract.capture.boundaries == [0, 3, 5] and ds.contract.capture.dtype == "float32"


@pytest.mark.unit
def test_batched_capture_matches_within_float_rounding(ref_dir, tok, target):
    """Right padding + attention mask: the padded rows change nothing but GEMM rounding."""
    ds = ShardDataset(ref_dir, features=True)
    for i in range(len(ds)):
        item = ds[i]
        slots, last = live(target, item["input_ids"])
        assert "slots" not in item and item["features"].shape == (len(item["input_ids"]), 3 * 64)
        torch.testing.assert_close(item["features"], slots.reshape(slots.shape[0], -1), rtol=0, atol=1e-6)
        torch.testing.assert_close(item["last_hidden"], last, rtol=0, atol=1e-6)


@pytest.mark.unit
def test_bfloat16_storage(tmp_path, tok, target):
    capture_shards(target, tok, conversations(4), opts(tmp_path, dtype="bfloat16"))
    item = ShardDataset(tmp_path)[0]
    assert item["slots"].dtype == torch.bfloat16 and item["last_hidden"].dtype == torch.bfloat16
    slots, _ = live(target, item["input_ids"])
    torch.testing.assert_close(item["slots"].float(), slots, rtol=1e-2, atol=1e-2)


@pytest.mark.unit
def test_manifest_and_shard_metadata(ref_dir):
    from safetensors import safe_open

    m = json.loads((ref_dir / "manifest.json").read_text())
    assert m["format"] == "eyas-hidden-shards" and m["source_data"] == "convs.jsonl"
    assert m["contract"]["target"]["source"] == "tiny" and m["contract"]["target"]["num_blocks"] == 6
    assert m["contract"]["tokenisation"]["system_prompt"] == "template_default"
    assert sum(len(e["ids"]) for e in m["shards"]) == m["counts"]["samples"] == 10
    assert tuple(m["params"]) == PLAN_PARAMS and m["params"]["shard_tokens"] is not None  # resolved
    with safe_open(str(ref_dir / shard_name(0, 0)), "pt") as f:
        meta = json.loads(f.metadata()["eyas"])
        assert meta["ids"] == m["shards"][0]["ids"] and meta["boundaries"] == [0, 3, 5] and meta["index"] == 0
        assert f.get_tensor("input_ids").dtype == torch.int32 and f.get_tensor("loss_mask").dtype == torch.uint8
        assert f.get_tensor("offsets").dtype == torch.int64


@pytest.mark.integration
def test_capture_options_name_field_expected_and_found(tmp_path):
    # The plan parameters (a resume must share them) are the options marked PLAN, in field order.
    assert PLAN_PARAMS == ("boundaries", "dtype", "max_length", "shard_size", "shard_tokens", "system_prompt",
                           "world_size", "channels")
    with pytest.raises(ShardError, match=r"dtype: expected 'bfloat16', 'float16' or 'float32', found 'int8'"):
        CaptureOptions(out_dir=tmp_path, dtype="int8")
    with pytest.raises(ShardError, match=r"shard_size: expected greater than 0, found 0"):
        CaptureOptions(out_dir=tmp_path, shard_size=0)
    with pytest.raises(ShardError, match=r"batchsize: expected one of out_dir, .*, found 3"):
        CaptureOptions(out_dir=tmp_path, batchsize=3)
    # The CLI refuses a bad flag before it reads data or loads a target.
    import typer
    from typer.testing import CliRunner

    from eyas.cli.data_commands import register

    app = typer.Typer()
    register(app)
    r = CliRunner().invoke(app, ["capture", "--target", "nowhere", "--data", str(tmp_path / "none.jsonl"),
                                 "--out", str(tmp_path / "s"), "--dtype", "int8"])
    said = " ".join(r.output.split())  # rich wraps long lines
    assert r.exit_code == 2 and "dtype: expected 'bfloat16', 'float16' or 'float32', found 'int8'" in said


@pytest.mark.unit
def test_plan_shards_caps_samples_and_tokens():
    assert plan_shards([5, 5, 5, 5, 5], shard_size=2) == [[0, 1], [2, 3], [4]]
    assert plan_shards([5, 5, 20, 5], shard_size=10, shard_tokens=12) == [[0, 1], [2], [3]]


# -- resume ---------------------------------------------------------------------------------------


class Crash(RuntimeError):
    pass


@pytest.mark.unit
def test_resume_after_crash_gives_identical_files(tmp_path, ref_dir, tok, target):
    def crash(k, _entry):
        if k == 1:
            raise Crash

    with pytest.raises(Crash):
        capture_shards(target, tok, conversations(), opts(tmp_path, source_data="convs.jsonl"), source="tiny",
                       on_shard_written=crash)
    assert not (tmp_path / "manifest.json").exists()
    with pytest.raises(ShardError, match="missing manifest.*progress files"):
        ShardDataset(tmp_path)
    s = capture_shards(target, tok, conversations(), opts(tmp_path, source_data="convs.jsonl"), source="tiny")
    assert (s.shards_resumed, s.shards_written) == (2, 2)
    assert files(tmp_path) == files(ref_dir)


@pytest.mark.unit
def test_resume_after_deleting_the_last_shard_or_the_progress(tmp_path, ref_dir, tok, target):
    run = lambda: capture_shards(target, tok, conversations(), opts(tmp_path, source_data="convs.jsonl"),  # noqa: E731
                                 source="tiny")
    run()
    (tmp_path / shard_name(0, 3)).unlink()
    s = run()
    assert (s.shards_resumed, s.shards_written) == (3, 1)
    assert files(tmp_path) == files(ref_dir)
    (tmp_path / "progress-r00.json").unlink()
    s = run()
    assert (s.shards_resumed, s.shards_written) == (0, 4)
    assert files(tmp_path) == files(ref_dir)


@pytest.mark.unit
def test_resume_with_other_parameters_is_refused(tmp_path, tok, target):
    capture_shards(target, tok, conversations(4), opts(tmp_path))
    with pytest.raises(ShardError, match=r"progress-r00.json: cannot resume.*shard_size: progress has 3, now 2"):
        capture_shards(target, tok, conversations(4), opts(tmp_path, shard_size=2))
    with pytest.raises(ShardError, match="the rendered samples or their shard plan changed"):
        capture_shards(target, tok, conversations(5), opts(tmp_path))


# -- ranks ----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_two_ranks_cover_every_sample_exactly_once(tmp_path, ref_dir, tok, target):
    s0 = capture_shards(target, tok, conversations(), opts(tmp_path, rank=0, world_size=2))
    assert s0.manifest is None  # rank 1 has not finished
    s1 = capture_shards(target, tok, conversations(), opts(tmp_path, rank=1, world_size=2))
    assert s1.manifest == str(tmp_path / "manifest.json")
    assert (s0.conversations, s1.conversations) == (6, 5)
    ds, ref = ShardDataset(tmp_path), ShardDataset(ref_dir)
    assert sorted(ds.ids) == sorted(ref.ids) and len(set(ds.ids)) == len(ds.ids) == 10
    assert {p.name for p in tmp_path.glob("shard-r01-*")}  # rank 1 wrote its own shard set
    by_id = {ref.ids[i]: i for i in range(len(ref))}
    for i in range(len(ds)):
        a, b = ds[i], ref[by_id[ds.ids[i]]]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["slots"], b["slots"], rtol=0, atol=1e-6)
    m = json.loads((tmp_path / "manifest.json").read_text())
    mref = json.loads((ref_dir / "manifest.json").read_text())
    for k in ("samples", "tokens", "loss_tokens", "conversations"):
        assert m["counts"][k] == mref["counts"][k]
    # finalize_manifest is what the last rank ran: calling it again writes the same file.
    before = (tmp_path / "manifest.json").read_bytes()
    finalize_manifest(tmp_path)
    assert (tmp_path / "manifest.json").read_bytes() == before


@pytest.mark.unit
def test_rank_from_torchrun_environment(tmp_path, tok, target, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    s = capture_shards(target, tok, conversations(), opts(tmp_path))
    assert (s.rank, s.world_size, s.conversations, s.manifest) == (1, 3, 4, None)
    with pytest.raises(ShardError, match="progress-r00.json: no progress file"):
        finalize_manifest(tmp_path)


# -- fingerprint ----------------------------------------------------------------------------------


def direct_fingerprint(slots: torch.Tensor, channels: list[int]) -> list[dict]:
    """[N, S, H] -> per slot: mean/std of per-token RMS, channel means (float64 throughout)."""
    x = slots.double()
    rms = x.pow(2).mean(-1).sqrt()  # [N, S]
    return [{"rms_mean": rms[:, s].mean().item(), "rms_std": rms[:, s].std(unbiased=False).item(),
             "channel_means": x[:, s, channels].mean(0).tolist()} for s in range(x.shape[1])]


@pytest.mark.unit
def test_fingerprint_equals_a_direct_computation(ref_dir):
    ds = ShardDataset(ref_dir)
    # Every stored token but the first of each sequence (the attention sink): [N, S, H]
    allslots = torch.cat([ds[i]["slots"][1:] for i in range(len(ds))])
    fp = ds.contract.fingerprint
    assert [f.boundary for f in fp] == [0, 3, 5]
    want = direct_fingerprint(allslots, fp[0].channels)
    for f, w in zip(fp, want):
        assert f.num_tokens == allslots.shape[0] and f.channels == default_channels(64)
        assert math.isclose(f.rms_mean, w["rms_mean"], rel_tol=1e-6)
        assert math.isclose(f.rms_std, w["rms_std"], rel_tol=1e-4)
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-9) for a, b in zip(f.channel_means, w["channel_means"]))


@pytest.mark.unit
def test_fingerprint_accumulator_merge_mask_and_state():
    torch.manual_seed(0)
    x = torch.randn(50, 2, 16) * torch.tensor([1.0, 5.0])[None, :, None]  # slot 1 five times louder
    whole = FingerprintAccumulator([4, 9], 16)
    whole.update(x)
    a, b = FingerprintAccumulator([4, 9], 16), FingerprintAccumulator([4, 9], 16)
    a.update(x[:20])
    b.update(x[20:])
    merged = FingerprintAccumulator.from_state(json.loads(json.dumps(a.state()))).merge(b)
    for f, g in zip(whole.result(), merged.result()):
        assert f.num_tokens == g.num_tokens == 50
        assert math.isclose(f.rms_mean, g.rms_mean, rel_tol=1e-12) and math.isclose(f.rms_std, g.rms_std, rel_tol=1e-9)
    r = whole.result()
    assert 4 < r[1].rms_mean / r[0].rms_mean < 6
    # A padded batch [B, T, S, H] with a mask counts only the real tokens.
    masked = FingerprintAccumulator([4, 9], 16)
    padded = torch.zeros(2, 30, 2, 16)
    padded[0, :25], padded[1, :25] = x[:25], x[25:]
    mask = torch.zeros(2, 30, dtype=torch.long)
    mask[:, :25] = 1
    masked.update(padded, mask)
    assert masked.count == 50 and math.isclose(masked.result()[0].rms_mean, r[0].rms_mean, rel_tol=1e-12)
    # The first-token rule: a sequence's position 0 (the attention sink) is left out, also in a
    # left-padded batch, where the first real token sits after the padding.
    sink = x[:10].clone()
    sink[0] *= 1000
    seq = FingerprintAccumulator([4, 9], 16)
    seq.update_sequence(sink)
    ref = FingerprintAccumulator([4, 9], 16)
    ref.update(x[1:10])
    batch = torch.zeros(2, 12, 2, 16)
    batch[0, 2:] = sink  # left-padded row
    batch[1, :3] = x[20:23]
    attn = torch.zeros(2, 12, dtype=torch.long)
    attn[0, 2:], attn[1, :3] = 1, 1
    both = FingerprintAccumulator([4, 9], 16)
    both.update_batch(batch, attn)
    ref.update(x[21:23])
    assert seq.count == 9 and both.count == 11 == ref.count
    assert math.isclose(both.result()[1].rms_std, ref.result()[1].rms_std, rel_tol=1e-12)
    with pytest.raises(ValueError, match=r"expected slots \[N, 2, 16\]"):
        masked.update(torch.zeros(3, 3, 16))
    with pytest.raises(ValueError, match="cannot merge"):
        masked.merge(FingerprintAccumulator([4, 8], 16))


# -- contract and damaged input -------------------------------------------------------------------


@pytest.mark.unit
def test_manifest_contract_against_another_target(ref_dir, tok, target):
    ShardDataset(ref_dir, target=target, tokenizer=tok)  # the same target: fine
    other = chat_target(tok, seed=1)
    with pytest.raises(ContractError, match="target.fingerprint") as e:
        ShardDataset(ref_dir, target=other)
    assert "target.hidden_size" not in str(e.value)  # only what differs is named
    with pytest.warns(UserWarning, match="target.fingerprint"):
        ShardDataset(ref_dir, target=other, force=True)
    tok2 = chat_tokenizer()
    tok2.chat_template = tok2.chat_template.replace("Be brief.", "Be long.")
    with pytest.raises(ContractError, match="tokenisation.chat_template_sha256"):
        ShardDataset(ref_dir).check_target(target, tok2)


def copy_dir(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.unit
def test_damaged_shards_name_the_file(tmp_path, ref_dir):
    d = copy_dir(ref_dir, tmp_path / "d")
    bad = d / shard_name(0, 2)
    data = bad.read_bytes()

    bad.write_bytes(data[:-100])  # truncated
    with pytest.raises(ShardError, match=rf"{bad}: corrupt shard"):
        ShardDataset(d)

    bad.write_bytes(b"\xff" * 16 + data[16:])  # header overwritten, same size
    with pytest.raises(ShardError, match=rf"{bad}: corrupt shard: cannot read it as safetensors"):
        ShardDataset(d)

    flipped = bytearray(data)
    flipped[-5] ^= 0xFF  # a tensor byte: only the sha256 sees it
    bad.write_bytes(bytes(flipped))
    ShardDataset(d)
    with pytest.raises(ShardError, match=rf"{bad}: corrupt shard: sha256"):
        ShardDataset(d, verify="full")

    bad.unlink()
    with pytest.raises(ShardError, match=rf"{bad}: shard listed in .* is missing"):
        ShardDataset(d)

    (d / "manifest.json").write_text("{broken")
    with pytest.raises(ShardError, match=r"manifest.json: manifest is not valid JSON"):
        ShardDataset(d)
    (d / "manifest.json").unlink()
    with pytest.raises(ShardError, match=r"manifest.json: missing manifest"):
        ShardDataset(d)
    with pytest.raises(ShardError, match="no such shard directory"):
        ShardDataset(tmp_path / "nowhere")


# -- CLI ------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_cli_regenerate_then_capture(tmp_path, tok, target):
    import typer
    from typer.testing import CliRunner

    from eyas.cli.data_commands import register

    app = typer.Typer()
    register(app)
    tdir = tmp_path / "target"
    target.save_pretrained(tdir)
    tok.save_pretrained(tdir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [f"question {i}?"]}) + "\n" for i in range(5)))
    runner = CliRunner()
    answers = tmp_path / "answers.jsonl"
    r = runner.invoke(app, ["regenerate", "--target", str(tdir), "--prompts", str(prompts), "--out", str(answers),
                            "--max-new-tokens", "5", "--batch-size", "2", "--limit", "4", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["written"] == 4 and rep["out_path"] == str(answers) and "tokens_per_s" in rep
    shards = tmp_path / "shards"
    r = runner.invoke(app, ["capture", "--target", str(tdir), "--data", str(answers), "--out", str(shards),
                            "--boundaries", "1,3,4", "--max-length", "128", "--dtype", "float32", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["samples"] == 4 and rep["manifest"] == str(shards / "manifest.json")
    assert ShardDataset(shards).contract.capture.boundaries == [1, 3, 4]
    r = runner.invoke(app, ["capture", "--target", str(tdir), "--data", str(answers), "--out", str(shards),
                            "--boundaries", "1,3,9"])
    assert r.exit_code == 2 and "boundaries" in r.output
