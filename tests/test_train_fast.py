"""Training at GPU speed and to convergence (issue 11): no host reads in a training step,
length-bucketed batches under a token budget, labels without float32 full-vocabulary logits,
sharded train state, held-out metrics outside repetition loops, the best checkpoint and patience.

Host reads are counted as tests/test_engine_rounds.py counts them for the engine: every Tensor
method that copies a value to Python is wrapped with a counter (on a GPU each is a device sync).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from eyas.drafter.ttt import Tally, TargetLabels, ttt_forward
from eyas.training.config import TrainConfig
from eyas.training.order import PAD_MULTIPLE, BucketOrder, FixedOrder
from eyas.training.state import load_sharded, load_train_state, save_sharded, save_train_state
from tests.support.toy import make_toy_conversations, make_toy_target, toy_train_config

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


class HostReads:
    """Counts READS (and indexing with a 0-dim integer tensor) while active, except calls made by
    torch.optim: on CPU AdamW keeps its step counters as CPU tensors and reads them (no device
    involved); on CUDA the loop uses the fused AdamW, whose counters live on the device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self.active, self.where = 0, False, []
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(t, *args, _original=original, _name=name, **kwargs):
                if self.active and not sys._getframe(1).f_globals.get("__name__", "").startswith("torch.optim"):
                    self.count += 1
                    f = sys._getframe(1)
                    self.where.append(f"{_name} at {f.f_code.co_filename}:{f.f_lineno}")
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        getitem = torch.Tensor.__getitem__

        def counted_getitem(t, index):
            parts = index if isinstance(index, tuple) else (index,)
            if self.active and any(isinstance(i, torch.Tensor) and i.dim() == 0 and not i.is_floating_point()
                                   and i.dtype != torch.bool for i in parts):
                self.count += 1
                self.where.append("0-dim tensor index")
            return getitem(t, index)

        monkeypatch.setattr(torch.Tensor, "__getitem__", counted_getitem)


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_from_logits_keeps_the_dtype_until_the_draft_columns():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 300, generator=g)
    ids = torch.tensor([3, 17, 299, 42])
    lab = TargetLabels.from_logits(logits, ids)
    assert torch.equal(lab.argmax, logits.float().argmax(-1))  # float32: identical to the old path
    assert torch.equal(lab.draft_logits, logits.float()[..., ids])
    half = logits.bfloat16()
    lab16 = TargetLabels.from_logits(half, ids)
    assert lab16.draft_logits.dtype == torch.float32
    assert torch.equal(lab16.argmax, half.float().argmax(-1))
    assert torch.equal(lab16.draft_logits, half.float()[..., ids])


@pytest.mark.unit
def test_ttt_counts_are_device_tensors_and_the_count_mask_selects_positions(trained_drafter):
    """Counts are [steps] tensors; count_mask = loss_mask gives the same counts, an empty one zeros,
    and Tally sums without host reads until summary."""
    drafter = trained_drafter
    B, T = 2, 24
    g = torch.Generator().manual_seed(1)
    vd = drafter.config.draft_vocab_size
    draft_ids = drafter.draft_to_target(torch.arange(vd))
    ids = draft_ids[torch.randint(0, vd, (B, T), generator=g)]
    feats = torch.randn(B, T, drafter.fc.weight.shape[1], generator=g)
    logits = torch.randn(B, T, int(drafter.t2d.numel()), generator=g)
    labels = TargetLabels.from_logits(logits, draft_ids)
    mask = torch.ones(B, T, dtype=torch.long)
    with torch.no_grad():
        r = ttt_forward(drafter, ids, feats, labels, mask, steps=3, count_mask=mask.bool())
        none = ttt_forward(drafter, ids, feats, labels, mask, steps=3, count_mask=torch.zeros(B, T, dtype=torch.bool))
    for name in ("correct", "total", "cond_correct", "cond_total", "step_loss"):
        v = getattr(r, name)
        assert isinstance(v, torch.Tensor) and v.shape == (3,), name
        assert torch.equal(v, getattr(r.subset, name)), name
    assert int(r.total[0]) == B * (T - 2) and int(none.subset.total.sum()) == 0
    assert torch.all(r.cond_total <= r.total) and torch.all(r.correct <= r.total)
    t = Tally(3)
    t.add(r)
    t.add(r)
    m = t.summary()
    assert m.tokens_counted == 2 * B * (T - 2)
    assert m.accuracy_per_position[0] == pytest.approx(float(r.correct[0]) / float(r.total[0]), abs=1e-5)


@pytest.mark.unit
def test_bucketed_order_covers_each_epoch_once_within_the_budget():
    g = torch.Generator().manual_seed(0)
    train_idx = list(range(100, 400))
    lengths = torch.randint(10, 300, (len(train_idx),), generator=g).tolist()
    length_of = dict(zip(train_idx, lengths))
    o = BucketOrder(train_idx, lengths, tokens_per_batch=1024, seed=3)
    for e in range(2):
        plan = o.plan(e)
        assert sorted(i for b in plan for i in b) == train_idx  # every sample once per epoch
        for b in plan:
            width = -(-max(length_of[i] for i in b) // PAD_MULTIPLE) * PAD_MULTIPLE
            assert len(b) * width <= 1024 or len(b) == 1
    assert o.plan(0) != o.plan(1)  # epochs differ
    widths = {-(-max(length_of[i] for i in b) // PAD_MULTIPLE) for b in o.plan(0)}
    assert len(widths) <= 300 // PAD_MULTIPLE + 1  # few shapes
    # a function of the step alone: a fresh order (a resumed run) reads the same, ranks partition
    fresh = BucketOrder(train_idx, lengths, tokens_per_batch=1024, seed=3)
    assert [fresh.step(s) for s in range(60, 0, -7)] == [o.step(s) for s in range(60, 0, -7)]
    assert [o.step(s, r, 2) for s in range(5) for r in range(2)] == [o.step(s) for s in range(10)]
    n0 = len(o.plan(0))
    assert o.steps_for(1.0, 1) == n0 and o.steps_for(1.0, 2) == -(-n0 // 2)
    # padding in a bucketed epoch is far below the fixed order's
    padded = sum(len(b) * max(length_of[i] for i in b) for b in o.plan(0))
    fixed = FixedOrder(train_idx, 4, 3)
    fixed_padded = sum(4 * max(length_of[i] for i in fixed.step(s)) for s in range(75))
    assert padded < 0.8 * fixed_padded


@pytest.mark.unit
def test_config_names_the_field_expected_and_found():
    with pytest.raises(ValueError, match="tokens_per_batch: expected None or at least 64, found 10"):
        TrainConfig(data="x", steps=1, tokens_per_batch=10)
    with pytest.raises(ValueError, match="patience: expected None or at least 1, found 0"):
        TrainConfig(data="x", steps=1, patience=0)


@pytest.mark.unit
def test_sharded_state_round_trips_exactly_with_files_under_the_cap(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(1000, 37, generator=g), "small": torch.arange(5), "scalar": torch.tensor(3.5),
               "bf": torch.randn(300, generator=g).bfloat16(), "empty": torch.zeros(0, 4)}
    index = save_sharded(tensors, tmp_path, "s", max_bytes=4096)
    assert all((tmp_path / f).stat().st_size <= 4096 + 2048 for f in index["files"])  # + safetensors header
    assert len(index["files"]) > 5 and len(index["tensors"]["big"]["parts"]) > 1
    back = load_sharded(tmp_path, index)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


@pytest.mark.unit
def test_train_state_files_are_at_most_16_mib(tmp_path):
    p = torch.nn.Parameter(torch.randn(6_000_000))  # 24 MB per AdamW moment
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_train_state(tmp_path, 1, opt, sched, {})
    files = list((tmp_path / "resume").iterdir())
    assert all(f.stat().st_size <= 16 * 2**20 for f in files)
    assert sum(f.suffix == ".safetensors" for f in files) >= 4
    p2 = torch.nn.Parameter(p.detach().clone())
    opt2 = torch.optim.AdamW([p2], lr=1e-3)
    load_train_state(tmp_path, opt2, torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0))
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt2.state[p2][k], opt.state[p][k])


@pytest.mark.unit
def test_positions_inside_loop_bodies_are_left_out():
    from eyas.training.evaluation import keep_outside_loops

    ids = torch.tensor(list(range(100, 110)) + [7, 8, 9] * 12 + list(range(200, 210)))
    mask = torch.ones_like(ids)
    mask[:3] = 0
    keep = keep_outside_loops({"input_ids": ids, "loss_mask": mask})
    assert not keep[:3].any() and keep[3:13].all()  # prompt out; text and the loop's first copy in
    assert not keep[13:46].any() and keep[46:].all()  # the repeats out; the text after in


# ---------------------------------------------------------------------------------------------
# End to end on a toy target
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    target = make_toy_target(root / "target")
    data = make_toy_conversations(target, root / "conversations.jsonl", n=48, answer_tokens=24)
    return target, data


def _cfg(toy, out, **kw) -> TrainConfig:
    return toy_train_config(toy, out, **(dict(batch_size=4, warmup_steps=5, max_val_samples=8, log_every=1000) | kw))


@pytest.mark.integration
@pytest.mark.parametrize("tokens_per_batch", [None, 512])
def test_a_training_step_reads_nothing_back_from_the_device(toy, tmp_path, monkeypatch, tokens_per_batch):
    """Counted between consecutive steps of the progress bar: batch, TTT forward, backward, clip,
    optimizer, scheduler, tally, timer. Only the log step (here the last) reads."""
    import eyas.training.loop as loop

    reads = HostReads(monkeypatch)
    per_step: list[int] = []
    where: list[list[str]] = []
    real_tqdm = loop.tqdm

    def counting_tqdm(iterable, **kw):
        bar = real_tqdm(iterable, **kw)

        class Bar:
            def __iter__(self):
                for step in bar:
                    reads.count, reads.where, reads.active = 0, [], True
                    yield step
                    reads.active = False
                    per_step.append(reads.count)
                    where.append(reads.where)
                reads.active = False

            def __getattr__(self, name):
                return getattr(bar, name)

        return Bar()

    monkeypatch.setattr(loop, "tqdm", counting_tqdm)
    cfg = _cfg(toy, tmp_path / "run", steps=5, log_every=5, tokens_per_batch=tokens_per_batch)
    loop.train(cfg)
    assert len(per_step) == 5
    assert per_step[:4] == [0, 0, 0, 0], where[:4]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_row = next(r for r in rows if r["kind"] == "train")
    for k in ("tokens_per_s", "target_share", "drafter_share", "padding_share"):
        assert k in train_row
    assert train_row["tokens_per_s"] > 0 and 0 < train_row["target_share"] + train_row["drafter_share"] <= 1.01


@pytest.mark.integration
def test_patience_stops_early_and_the_best_drafter_is_written(toy, tmp_path):
    """validate returns a tau that peaks at the second evaluation: the best is chosen by tau, the
    run stops after ``patience`` evaluations without improvement, and out holds the best drafter."""
    from safetensors.torch import load_file

    from eyas.interop import read_contract
    from eyas.training.loop import train

    taus = iter([1.5, 2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4])
    seen: list[int] = []

    def validate(drafter, model):
        assert model is not None and not any(p.requires_grad for p in model.parameters())  # training's target
        seen.append(1)
        return {"tau": next(taus), "prompts": 3}

    cfg = _cfg(toy, tmp_path / "run", steps=40, eval_every=2, patience=2, tokens_per_batch=512)
    r = train(cfg, validate=validate)
    assert r.stopped_early and r.best_step == 4 and r.steps_done == 8 and len(seen) == 4
    c = read_contract(tmp_path / "run")
    assert c.metrics.step == 4 and c.metrics.model_dump()["tau"] == 2.0
    assert c.metrics.model_dump()["last_step"] == 8 and c.metrics.model_dump()["selected_by"] == "tau"
    a = load_file(str(tmp_path / "run" / "model.safetensors"))
    b = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["kind"] == "val"]
    assert [v["step"] for v in val] == [2, 4, 6, 8]
    for v in val:
        assert v["prompts"] == 3 and "simulated_accept_length_no_loops" in v
        assert "accuracy_per_position_no_loops" in v
    assert (tmp_path / "run" / "training.png").stat().st_size > 1000


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_resume_with_buckets_and_patience_gives_identical_weights_and_best(toy, tmp_path):
    from eyas.training.loop import train

    kw = dict(steps=12, save_every=4, eval_every=2, tokens_per_batch=512, patience=50)
    train(_cfg(toy, tmp_path / "straight", **kw))
    crashed = _cfg(toy, tmp_path / "crashed", **kw)
    partial = train(crashed, stop_after=6)  # past the step-4 checkpoint: out/best may be from step 6
    assert partial.steps_done == 6
    train(crashed)
    for name in ("", "best"):
        a, b = _weights(tmp_path / "straight" / name), _weights(tmp_path / "crashed" / name)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    from eyas.interop import read_contract

    assert read_contract(tmp_path / "straight").metrics == read_contract(tmp_path / "crashed").metrics
    steps = [json.loads(x)["step"] for x in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "val"]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # the crashed run's later rows were dropped


@pytest.mark.integration
def test_cli_train_takes_the_new_options_and_keeps_json(toy, tmp_path):
    """--tokens-per-batch, --patience, --log-every and --validate-prompts (the engine's tau on a
    few prompts, which then picks the best); --json prints the path and the contract's metrics."""
    from typer.testing import CliRunner

    from eyas.cli.main import app

    target, data = toy
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(data.read_text().splitlines(keepends=True)[:1]))
    r = CliRunner().invoke(app, [
        "train", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "o"), "--steps", "4",
        "--eval-every", "2", "--log-every", "2", "--tokens-per-batch", "512", "--patience", "3",
        "--validate-prompts", str(prompts), "--validate-limit", "1", "--validate-tokens", "8",
        "--draft-vocab", "1024", "--ttt-steps", "2", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout[r.stdout.index("{"):])
    m = report["metrics"]
    assert m["selected_by"] == "tau" and m["tau"] >= 1.0 and m["step"] in (2, 4) and m["last_step"] == 4
    rows = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if x["kind"] == "train"] == [2, 4]
    assert all("tau" in x for x in rows if x["kind"] == "val")
