"""`eyas bench` and `eyas generate` end to end on a toy target: the report's structure and numbers
agree with each other, greedy speculative output equals plain decoding and HF generate, each
temperature is run and reported on its own with its own tree, the HF baseline says which it is, and
bad options fail naming the option, what it expects and what it found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.bench import load_prompts
from eyas.cli.main import app

runner = CliRunner()


@pytest.mark.unit
def test_named_sets_load_their_first_turns():
    mt = load_prompts("mt_bench")
    assert len(mt) == 80 and all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in mt)
    assert len(load_prompts("sum", limit=3)) == 3
    with pytest.raises(FileNotFoundError, match="expected one of mt_bench"):
        load_prompts("no_such_set")


@pytest.mark.integration
def test_bench_reports_tau_speeds_and_identity(toy_drafter, tmp_path):
    target, draft = toy_drafter
    r = runner.invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--prompts", "mt_bench",
                            "--prompts", "gsm8k", "--limit", "2", "--max-new-tokens", "12", "--tree", "3,2,5",
                            "--device", "cpu", "--out", str(tmp_path / "bench.json"), "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    report = json.loads(r.stdout)
    assert [s["set"] for s in report["sets"]] == ["mt_bench", "gsm8k"]
    for s in report["sets"]:
        assert s["prompts"] == 2
        assert s["identical_to_plain"] is True and s["identical_to_hf"] is True
        assert set(s["tokens_per_s"]) == {"speculative", "plain", "hf"}
        assert all(v > 0 for v in s["tokens_per_s"].values())
        assert s["speedup_vs_plain"] == pytest.approx(
            s["tokens_per_s"]["speculative"] / s["tokens_per_s"]["plain"], rel=1e-2)
        hist = {int(k): v for k, v in s["accept_length_histogram"].items()}
        assert s["tau"] == pytest.approx(sum(k * v for k, v in hist.items()) / sum(hist.values()), rel=1e-3)
        # every new token but the first of each prompt (from the prefill) came out of a round
        assert sum(k * v for k, v in hist.items()) == s["new_tokens"] - s["prompts"]
    assert json.loads((tmp_path / "bench.json").read_text()) == report
    assert Path(report["png"]).stat().st_size > 1000
    assert report["hf_baseline"] == "generate, eager"  # on the CPU; a GPU's: "generate, static cache, torch.compile"
    assert [t["temperature"] for t in report["temperatures"]] == [0.0] and report["temperature"] == 0.0
    assert report["temperatures"][0]["sets"] == report["sets"]


@pytest.mark.integration
def test_bench_runs_each_temperature_with_its_own_tree(toy_drafter, tmp_path):
    target, draft = toy_drafter
    r = runner.invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--prompts", "gsm8k",
                            "--limit", "2", "--max-new-tokens", "10", "--temperatures", "0,1", "--tree", "3,2,5",
                            "--tree-sampled", "2", "--device", "cpu", "--png", str(tmp_path / "b.png"), "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    report = json.loads(r.stdout)
    greedy, hot = report["temperatures"]
    assert (greedy["temperature"], greedy["tree"], greedy["tree_label"]) == (0.0, [3, 2, 5], "3,2,5")
    assert (hot["temperature"], hot["tree"], hot["tree_label"]) == (1.0, [2, 1, 2], "2")
    assert report["tree"] == greedy["tree"] and report["sets"] == greedy["sets"]  # the keys a bench always had
    for sec in (greedy, hot):
        s = sec["sets"][0]
        assert s["temperature"] == sec["temperature"] and s["tree"] == sec["tree_label"] and s["prompts"] == 2
        assert all(v > 0 for v in s["tokens_per_s"].values())
        assert sec["overall"]["prompts"] == 2 and len(sec["trees"]) == 1 and "comparison" not in sec
    assert greedy["sets"][0]["identical_to_plain"] is True and greedy["sets"][0]["identical_to_hf"] is True
    assert hot["sets"][0]["identical_to_plain"] is None  # sampled: not comparable token for token
    assert max(int(k) for k in hot["sets"][0]["accept_length_histogram"]) <= 3  # the chain of 2
    r = runner.invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--prompts", "gsm8k",
                            "--limit", "1", "--max-new-tokens", "6", "--temperatures", "0,1", "--tree", "2",
                            "--device", "cpu", "--no-hf", "--png", str(tmp_path / "c.png")])
    assert r.exit_code == 0, (r.output, r.exception)
    text = " ".join(r.output.split())
    assert "temperature 0, tree 2" in text and "temperature 1, tree 2" in text


@pytest.mark.integration
def test_bench_options_fail_naming_the_option_expected_and_found(toy_drafter):
    target, draft = toy_drafter
    base = ["bench", "--target", str(target), "--draft", str(draft), "--prompts", "gsm8k", "--limit", "1",
            "--device", "cpu"]
    for args, message in (
            (["--temperatures", "0,warm"],
             "--temperatures: expected comma-separated numbers such as 0,1, found '0,warm'"),
            (["--temperatures", "0,-1"], "--temperatures: expected temperatures >= 0, found -1"),
            (["--temperature", "0", "--temperatures", "0,1"], "expected one of the two, found both"),
            (["--tree-sampled", "4,8"], "--tree-sampled: expected DEPTH,TOPK,TOTAL like '6,10,60', DEPTH for a "
                                        "chain, or auto; found '4,8'"),
            (["--tree", "auto", "--tree", "x"], "--tree: expected DEPTH,TOPK,TOTAL"),
            (["--sampled-drafts", "nucleus"], "--sampled-drafts: expected one of top-k, gumbel, found 'nucleus'"),
            (["--hf-baseline", "fast"], "--hf-baseline: expected one of auto, compiled, eager, found 'fast'"),
            (["--tree", "auto", "--calibration-prompts", "nope"], "--calibration-prompts: expected a prompt file, "
                                                                 "one of mt_bench"),
            (["--limit", "80", "--tree", "auto", "--calibration-prompts", "held-out"],
             "--calibration-prompts held-out: expected prompts past --limit in the benchmarked sets, found none")):
        r = runner.invoke(app, base + args)
        assert r.exit_code == 2 and message in " ".join(r.stderr.split()), (args, r.stderr)


@pytest.mark.integration
def test_bench_without_hf_leaves_its_figures_out(toy_drafter, tmp_path):
    target, draft = toy_drafter
    r = runner.invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--prompts", "mt_bench",
                            "--limit", "1", "--max-new-tokens", "8", "--tree", "2", "--device", "cpu", "--no-hf",
                            "--png", str(tmp_path / "b.png"), "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    s = json.loads(r.stdout)["sets"][0]
    assert s["tokens_per_s"]["hf"] == 0 and s["speedup_vs_hf"] is None and s["identical_to_hf"] is None
    assert s["identical_to_plain"] is True and s["speedup_vs_plain"] is not None
    r = runner.invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--prompts", "mt_bench",
                            "--limit", "1", "--max-new-tokens", "8", "--tree", "2", "--device", "cpu", "--no-hf",
                            "--png", str(tmp_path / "b.png")])
    assert r.exit_code == 0 and "│ -" in r.output  # the table shows "-" for what did not run, not 0.0


@pytest.mark.integration
def test_generate_prints_text_and_statistics(toy_drafter):
    target, draft = toy_drafter
    r = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "Hello",
                            "--max-new-tokens", "6", "--device", "cpu", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == out["stats"]["new_tokens"] <= 6
    assert out["stats"]["rounds"] >= 1 and out["stats"]["tau"] >= 1.0
