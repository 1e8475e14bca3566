"""Training: TTT mechanics, draft vocabulary, exact resume, data parallel, and that a drafter
trained briefly on CPU beats the best unigram predictor of the target's next token."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eyas
from eyas.training.config import TrainConfig
from eyas.training.loop import FIT_AFTER_STEPS, fit_schedule, lr_lambda, train
from eyas.training.order import FixedOrder
from eyas.drafter.ttt import accept_length, ttt_mask
from eyas.training.vocab import build_draft_vocab, count_targets
from tests.support.toy import make_toy_conversations, make_toy_target, toy_train_config


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_ttt_mask_is_causal_prefix_plus_same_position_of_earlier_steps():
    m = ttt_mask(4, 2, torch.device("cpu"))[0, 0]
    assert m.shape == (4, 12)
    assert torch.equal(m[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(m[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(m[:, 8:], torch.eye(4, dtype=torch.bool))


@pytest.mark.unit
def test_accept_length_is_one_plus_sum_of_cumulative_products():
    assert accept_length([]) == 1.0
    assert accept_length([1.0, 1.0, 1.0]) == 4.0
    assert accept_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.unit
def test_validation_metrics_keep_the_json_of_the_old_metrics_dict():
    """contract.metrics is typed, and eyas.json reads and writes as when it was a plain dict: the
    fields in training's order, absent ones left out, keys another writer added kept."""
    from eyas.contract import ValidationMetrics

    old = {"step": 60, "loss_per_position": [2.5, 3.0], "accuracy_per_position": [0.3, 0.2],
           "conditional_accuracy_per_position": [0.3, 0.5], "simulated_accept_length": 1.45, "tokens_counted": 120,
           "by_another_writer": {"x": 1}}
    m = ValidationMetrics.model_validate(old)
    assert m.accuracy_per_position == [0.3, 0.2] and m.step == 60
    assert m.model_dump() == old and list(m.model_dump()) == list(old) and json.loads(m.model_dump_json()) == old
    assert ValidationMetrics(step=5).model_dump() == {"step": 5}  # a run without a validation split
    assert not ValidationMetrics.model_validate({}).recorded and m.recorded


@pytest.mark.unit
def test_draft_vocab_takes_most_frequent_loss_masked_targets():
    ids = torch.tensor([5, 5, 5, 7, 7, 1, 9, 9, 9, 9])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0])  # the 9s are prompt tokens: not counted
    counts = count_targets([(ids, mask)], vocab_size=12)
    assert counts[9] == 0 and counts[5] == 3 and counts[7] == 2
    v = build_draft_vocab(counts, 2)
    assert v.ids.tolist() == [5, 7]
    assert v.coverage == pytest.approx(5 / 6)
    # ties broken by id; unseen ids fill up to the requested size
    assert build_draft_vocab(counts, 4).ids.tolist() == [0, 1, 5, 7]
    with pytest.raises(ValueError, match="draft_vocab_size: expected 1..12, found 13"):
        build_draft_vocab(counts, 13)


@pytest.mark.unit
def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(data="x", steps=100, warmup_steps=10, min_lr_ratio=0.1)
    f = lr_lambda(cfg, 100)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))


@pytest.mark.unit
def test_the_schedule_is_fitted_to_the_time_left_at_the_pace_so_far():
    # 100 steps in 10 s: 0.1 s a step; 40 s left fit 400 more
    assert fit_schedule(planned=1000, start=0, done=100, elapsed_s=10.0, budget_s=50.0) == 500
    assert fit_schedule(planned=1000, start=0, done=100, elapsed_s=10.0, budget_s=500.0) == 1000  # never past the plan
    assert fit_schedule(planned=1000, start=0, done=100, elapsed_s=60.0, budget_s=50.0) == 101  # over: one more step
    # a resumed run: its own pace (100 steps since step 200 in 10 s), its own budget
    assert fit_schedule(planned=1000, start=200, done=300, elapsed_s=10.0, budget_s=20.0) == 400
    with pytest.raises(ValueError, match="time_budget_s: expected None or more than 0, found 0"):
        TrainConfig(data="x", steps=3, time_budget_s=0)


@pytest.mark.unit
def test_config_requires_exactly_one_of_steps_and_epochs():
    with pytest.raises(ValueError, match="exactly one of steps / epochs"):
        TrainConfig(data="x")
    with pytest.raises(ValueError, match="exactly one of steps / epochs"):
        TrainConfig(data="x", steps=3, epochs=1.0)


@pytest.mark.unit
def test_data_position_is_a_function_of_the_step_and_ranks_partition_the_batch():
    train_idx = list(range(10))
    one = [FixedOrder(train_idx, 3, seed=0).step(s) for s in range(4)]
    assert one == [FixedOrder(train_idx, 3, seed=0).step(s) for s in range(4)]  # a fresh order: the same
    seen = [i for s in one[:3] for i in s] + one[3][:1]  # 10 samples = one epoch
    assert sorted(seen) == train_idx
    r0, r1 = (FixedOrder(train_idx, 3, seed=0).step(0, rank, 2) for rank in (0, 1))  # within epoch 0
    assert len(r0) == len(r1) == 3 and not set(r0) & set(r1)


# ---------------------------------------------------------------------------------------------
# End to end on a toy target
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    target = make_toy_target(root / "target")
    data = make_toy_conversations(target, root / "conversations.jsonl", n=96, answer_tokens=32)
    return target, data


def _cfg(toy, out, **kw) -> TrainConfig:
    return toy_train_config(toy, out, **(dict(batch_size=8, warmup_steps=10, max_val_samples=16, log_every=5) | kw))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_trained_drafter_beats_the_best_unigram_predictor(toy, tmp_path):
    from eyas.data.conversation_files import read_conversations
    from eyas.data.render import render
    from eyas.interop import read_contract
    from eyas.targets import load_target
    from eyas.training.config import split_indices

    cfg = _cfg(toy, tmp_path / "run", steps=120)
    train(cfg)
    contract = read_contract(tmp_path / "run")
    metrics = contract.metrics
    acc0 = metrics.accuracy_per_position[0]
    # online training records the fingerprint of the live capture, one entry per slot
    assert [f.boundary for f in contract.fingerprint] == contract.capture.boundaries == [2, 5, 7]
    assert all(f.rms_mean > 0 and f.num_tokens > 100 for f in contract.fingerprint)

    # The best unigram predictor of the target's next token on the same held-out positions: the
    # single most frequent target argmax (an upper bound for any constant predictor).
    loaded = load_target(str(toy[0]))
    model, tok = loaded.model, loaded.tokenizer
    convs = read_conversations(toy[1]).conversations
    samples = [render(c, tok, max_length=cfg.max_length) for c in convs]
    _, val_idx = split_indices(len(samples), cfg)
    argmaxes = []
    with torch.no_grad():
        for i in val_idx:
            s = samples[i]
            top = model(s.input_ids[None]).logits[0].argmax(-1)  # top[t] predicts token t+1
            # step 0 at position t predicts x_{t+2} with label argmax at t+1, counted iff mask[t+2]
            keep = s.loss_mask[2:].bool()
            argmaxes += top[1:-1][keep].tolist()
    unigram = collections.Counter(argmaxes).most_common(1)[0][1] / len(argmaxes)
    print(f"held-out position-0 accuracy {acc0:.3f} vs best unigram {unigram:.3f}; "
          f"simulated accept length {metrics.simulated_accept_length:.2f}")
    assert metrics.tokens_counted > 100
    assert acc0 > unigram + 0.15
    assert (tmp_path / "run" / "training.png").stat().st_size > 1000
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"train", "val"} <= {r["kind"] for r in rows}


@pytest.mark.integration
def test_a_time_budget_ends_the_schedule_at_its_floor_and_writes_the_drafter(toy, tmp_path):
    """Far more steps planned than a few seconds allow: the run refits its cosine to the budget and
    ends on the floor learning rate (not cut off high), records the refit, and writes the drafter."""
    from eyas.interop import read_contract

    cfg = _cfg(toy, tmp_path / "run", steps=100_000, time_budget_s=6.0, eval_every=100_000, save_every=100_000)
    result = train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["kind"] == "train"]
    refits = [r for r in rows if r["kind"] == "schedule"]
    assert FIT_AFTER_STEPS < result.steps_done < 100_000
    assert refits and refits[0]["planned_steps"] == 100_000 and refits[0]["total_steps"] < 100_000
    assert trained[-1]["step"] == result.steps_done
    assert trained[-1]["lr"] == pytest.approx(cfg.lr * cfg.min_lr_ratio)  # the cosine's floor: it ended
    assert read_contract(tmp_path / "run").metrics.step == result.steps_done


@pytest.mark.slow
@pytest.mark.parametrize("tokens_per_batch", [None, 384])
def test_resume_after_a_crash_gives_identical_weights(toy, tmp_path, tokens_per_batch):
    """Weights, optimizer (sharded train state), scheduler and data position survive a crash; with
    length-bucketed batches the position is a function of the step as well."""
    straight = _cfg(toy, tmp_path / "straight", steps=6, save_every=3, batch_size=4, tokens_per_batch=tokens_per_batch)
    train(straight)
    crashed = _cfg(toy, tmp_path / "crashed", steps=6, save_every=3, batch_size=4, tokens_per_batch=tokens_per_batch)
    partial = train(crashed, stop_after=3)  # "crash" right after the step-3 checkpoint
    assert partial.steps_done == 3 and not (tmp_path / "crashed" / "model.safetensors").exists()
    assert (tmp_path / "crashed" / "checkpoints" / "step-0000003").is_dir()
    train(crashed)  # resumes at step 3
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "crashed")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_torchrun_two_ranks_train_identical_weights(toy, tmp_path):
    script = tmp_path / "run_ddp.py"
    script.write_text(
        "import hashlib, os, torch\n"
        "from eyas.training.config import TrainConfig\n"
        "from eyas.training.loop import train\n"
        f"cfg = TrainConfig(**{_cfg(toy, tmp_path / 'ddp', steps=4, batch_size=2).model_dump()!r})\n"
        "r = train(cfg)\n"
        "h = hashlib.sha256()\n"
        "for k, v in sorted(r.drafter.state_dict().items()):\n"
        "    h.update(k.encode()); h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())\n"
        f"open({str(tmp_path)!r} + f'/rank{{os.environ[\"RANK\"]}}.sha', 'w').write(h.hexdigest())\n"
    )
    # The ranks import the eyas this process imported (the checkout under test, not an installed
    # copy): through PYTHONPATH, not a sys.path edit in the script.
    src = str(Path(eyas.__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(filter(None, (src, os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29533", str(script)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    h0, h1 = (tmp_path / "rank0.sha").read_text(), (tmp_path / "rank1.sha").read_text()
    assert h0 == h1
    assert (tmp_path / "ddp" / "model.safetensors").exists()


@pytest.mark.integration
def test_offline_and_online_training_give_the_same_first_step_loss(toy, tmp_path):
    """Both paths go through the same capture code: float32 shards of the same conversations must
    give the same features and labels, hence the same first-step loss (one batch = all samples, so
    the shards' sample order does not matter)."""
    from eyas.data.conversation_files import read_conversations
    from eyas.data.shards import CaptureOptions, capture_shards
    from eyas.targets import load_target

    target, data = toy
    few = tmp_path / "few.jsonl"
    few.write_text("".join(data.read_text().splitlines(keepends=True)[:6]))
    loaded = load_target(str(target))
    model, tok = loaded.model, loaded.tokenizer
    capture_shards(model, tok, read_conversations(few).conversations,
                   CaptureOptions(out_dir=tmp_path / "shards", dtype="float32", progress=False))  # [2, L//2, L-3]

    def first_loss(data_path, out):
        cfg = _cfg(toy, out, data=str(data_path), steps=1, batch_size=6, val_fraction=0.0, log_every=1)
        train(cfg)
        row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        assert row["kind"] == "train" and row["step"] == 1
        return row["loss"], row["tokens_counted"]

    online = first_loss(few, tmp_path / "online")
    offline = first_loss(tmp_path / "shards", tmp_path / "offline")
    assert online[1] == offline[1] > 0
    assert offline[0] == pytest.approx(online[0], rel=1e-5)


@pytest.mark.integration
def test_init_from_takes_the_drafters_vocabulary_boundaries_and_flags_unless_they_are_set(toy, tmp_path):
    """issue 34: `eyas train --init-from default` exited 2 on the shipped drafter's draft vocabulary
    (12288 against the default 8192). A run takes the drafter's draft vocabulary size, boundaries and
    norm flags unless the user sets them; one the user sets is still checked and named."""
    import json as _json

    from typer.testing import CliRunner

    from eyas.cli.main import app
    from eyas.interop import read_contract

    target, data = toy
    train(_cfg(toy, tmp_path / "first", steps=2, draft_vocab_size=512, boundaries=[1, 4, 6], norm_output=True))
    r = CliRunner().invoke(app, ["train", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "again"),
                                 "--steps", "1", "--batch-size", "8", "--ttt-steps", "3", "--device", "cpu",
                                 "--init-from", str(tmp_path / "first"), "--json"])
    assert r.exit_code == 0, r.output
    assert "--init-from" in r.output and "draft_vocab_size=512" in r.output and "norm_output=True" in r.output
    again = read_contract(tmp_path / "again")
    assert list(again.capture.boundaries) == [1, 4, 6]
    cfg = _json.loads((tmp_path / "again" / "eyas.json").read_text())["drafter_config"]
    assert cfg["draft_vocab_size"] == 512 and cfg["norm_output"] is True
    r = CliRunner().invoke(app, ["train", "--target", str(target), "--data", str(data), "--out", str(tmp_path / "set"),
                                 "--steps", "1", "--device", "cpu", "--draft-vocab", "256",
                                 "--init-from", str(tmp_path / "first")])
    assert r.exit_code == 2
    assert ("drafter config draft_vocab_size: expected this run's 256, found 512 (pass --draft-vocab to match, or a "
            "larger one to widen it)") in " ".join(r.output.split())


@pytest.mark.unit
def test_widened_ids_keep_the_drafters_ids_and_add_the_most_frequent_targets_outside_them():
    from eyas.training.init_from import widened_ids

    counts = torch.tensor([0, 9, 5, 0, 7, 7, 1, 0])
    ids = widened_ids(torch.tensor([6, 2]), counts, 5)  # 6 is rare but kept; 1, then 4 before 5 (a tie: by id)
    assert ids.tolist() == [1, 2, 4, 5, 6]
    assert widened_ids(torch.tensor([6, 2]), counts, 8).tolist() == list(range(8))  # never-seen ids fill the rest
    with pytest.raises(ValueError, match="draft_vocab_size: expected at most the target's vocabulary 8, found 9"):
        widened_ids(torch.tensor([6, 2]), counts, 9)


@pytest.mark.unit
def test_fit_head_rows_keeps_the_drafters_rows_and_maps_the_targets_rows_for_new_ids():
    """Where the drafter's head is exactly a linear map of the target's, the least-squares fit finds
    it: a new id's row is its target row mapped; an id the drafter had keeps its own row."""
    from eyas.training.init_from import fit_head_rows

    g = torch.Generator().manual_seed(0)
    target_head = torch.randn(20, 6, generator=g)  # [V, H_t]
    a_true = torch.randn(6, 4, generator=g)  # [H_t, H]
    old_ids = torch.tensor([0, 1, 3, 7, 9, 12, 15, 18])
    old_head = target_head[old_ids] @ a_true
    old_head[2] += 1.0  # a row the map does not explain: kept as it is all the same
    ids = torch.tensor([0, 1, 2, 3, 5, 7, 9, 12, 15, 18])
    rows = fit_head_rows(old_head, old_ids, ids, target_head)
    assert rows.shape == (10, 4)
    kept = [ids.tolist().index(t) for t in old_ids.tolist()]
    assert torch.equal(rows[kept], old_head)
    fitted = torch.linalg.lstsq(target_head[old_ids], old_head).solution
    for t in (2, 5):
        assert torch.allclose(rows[ids.tolist().index(t)], target_head[t] @ fitted, atol=1e-5)
    exact = fit_head_rows(target_head[old_ids] @ a_true, old_ids, ids, target_head)
    assert torch.allclose(exact[ids.tolist().index(5)], target_head[5] @ a_true, atol=1e-4)


@pytest.mark.integration
def test_init_from_with_a_larger_draft_vocabulary_widens_it_keeping_the_drafters_ids_and_rows(toy, tmp_path):
    """--draft-vocab larger than the --init-from drafter's: its ids stay (more are added), their
    lm_head rows and every other weight are the drafter's (a learning rate of 0 keeps them)."""
    train(_cfg(toy, tmp_path / "first", steps=2, draft_vocab_size=256))
    lines: list[str] = []
    train(_cfg(toy, tmp_path / "wide", steps=1, lr=0.0, draft_vocab_size=512, init_from=str(tmp_path / "first")),
          log=lines.append)
    assert any(f"weights from {tmp_path / 'first'}, its draft vocabulary of 256 widened" in x for x in lines), lines
    a, b = _weights(tmp_path / "first"), _weights(tmp_path / "wide")
    old_ids = (torch.arange(256) + a["d2t"]).tolist()
    new_ids = (torch.arange(512) + b["d2t"]).tolist()
    assert set(old_ids) < set(new_ids) and new_ids == sorted(new_ids) and int(b["t2d"].sum()) == 512
    for k in a.keys() - {"lm_head.weight", "d2t", "t2d"}:
        assert torch.equal(a[k], b[k]), k
    rows = [new_ids.index(t) for t in old_ids]
    assert torch.equal(b["lm_head.weight"][rows], a["lm_head.weight"])
    added = sorted(set(range(512)) - set(rows))
    assert b["lm_head.weight"][added].abs().sum() > 0  # fitted, not left at zero


@pytest.mark.integration
def test_init_from_starts_at_the_given_drafter_and_refuses_one_of_another_shape(toy, tmp_path):
    """--init-from loads a drafter's weights and draft vocabulary: with a learning rate of 0 the run
    ends where it started, on the first run's weights, d2t and t2d. A drafter of another draft
    vocabulary size or other boundaries is refused with the field, this run's value and the one found."""
    first = _cfg(toy, tmp_path / "first", steps=4)
    train(first)
    again = _cfg(toy, tmp_path / "again", steps=3, lr=0.0, seed=1, init_from=str(tmp_path / "first"))
    lines: list[str] = []
    train(again, log=lines.append)
    assert any(x.endswith(f"; weights from {tmp_path / 'first'}, its draft vocabulary") for x in lines), lines
    a, b = _weights(tmp_path / "first"), _weights(tmp_path / "again")
    assert a.keys() == b.keys() and {"d2t", "t2d"} <= a.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    train(_cfg(toy, tmp_path / "fresh", steps=3, lr=0.0, seed=1))
    assert not torch.equal(_weights(tmp_path / "fresh")["fc.weight"], a["fc.weight"])

    with pytest.raises(ValueError, match=r"--init-from .*first: drafter config draft_vocab_size: "
                                         r"expected this run's 512, found 1024 \(pass --draft-vocab"):
        train(_cfg(toy, tmp_path / "vocab", steps=1, draft_vocab_size=512, init_from=str(tmp_path / "first")))
    with pytest.raises(ValueError, match=r"capture.boundaries: expected this run's \[1, 4, 6\], found \[2, 5, 7\]"):
        train(_cfg(toy, tmp_path / "bounds", steps=1, boundaries=[1, 4, 6], init_from=str(tmp_path / "first")))
