"""The GPU benchmark scripts in benchmarks/ run end to end on a CPU with a toy target: the report of
spec_gpu.py holds every decoder, set and temperature, and greedy speculative output equals plain;
train_smollm2_drafter.py mixes prompts, regenerates, trains and keeps the best drafter; regen_fast_gpu.py
times the fast engine and HF generate, which agree in float32."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.support import DATA
from tests.support.triton_kernels import require_triton

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def test_spec_gpu_reports_every_decoder_set_and_temperature(toy_drafter, tmp_path):
    target, draft = toy_drafter
    spec_gpu = load_script("spec_gpu")
    out = tmp_path / "bench"
    code = spec_gpu.main(["--target", str(target), "--draft", str(draft), "--device", "cpu",
                          "--sets", "mt_bench,gsm8k", "--prompts-per-set", "2", "--hf-eager-prompts", "1",
                          "--select-prompts", "1", "--max-new-tokens", "8", "--trees", "3,2,5", "--chains", "2",
                          "--temperatures", "0,1", "--profile-rounds", "2", "--profile-skip", "0",
                          "--out-dir", str(out), "--commit", "test"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "done" and res["errors"] == [], res["errors"]
    assert res["meta"]["commit"] == "test" and res["meta"]["target_impl"] == "fast"
    sel = res["tree_selection"]
    assert sel["best_tree"] == "3,2,5" and sel["best_chain"] == "2,1,2" and sel["prompts"] == 1
    assert set(res["results"]) == {"t0", "t1"}
    for tkey, tres in res["results"].items():
        assert set(tres["sets"]) == {"mt_bench", "gsm8k"}
        for s in list(tres["sets"].values()) + [tres["overall"]]:
            for d in ("spec_tree", "spec_chain", "eyas_plain", "hf_static"):
                assert s[d]["prompts"] == (2 if s is not tres["overall"] else 4) and s[d]["tokens_per_s"] > 0
            assert s["hf_eager"]["prompts"] == (1 if s is not tres["overall"] else 2)
            assert s["spec_tree"]["tau"] >= 1 and len(s["spec_tree"]["acceptance_at_depth"]) >= 1
            assert set(s["spec_tree"]["ms_per_round"]) == {"draft", "verify", "bookkeeping", "total"}
            assert s["speedups"]["spec_tree/eyas_plain"]["prompts"] == (2 if s is not tres["overall"] else 4)
            assert s["speedups"]["spec_tree/hf_eager"]["prompts"] == (1 if s is not tres["overall"] else 2)
            if tkey == "t0":  # greedy speculative decoding is lossless
                for d in ("spec_tree", "spec_chain"):
                    ident = s["identical_to_plain"][d]
                    assert ident["fraction"] == 1.0 and ident["first_difference"] == [], (d, ident)
                assert s["identical_to_plain"]["hf_static"]["compared"] >= 1
    assert res["profile"]["spec_tree"]["rounds"] >= 1 and res["profile"]["eyas_plain"]["rounds"] >= 1
    assert "aten::" in (out / "profile.txt").read_text()
    md = (out / "results.md").read_text()
    assert "## Temperature 0.0" in md and "## Temperature 1.0" in md and "| **overall** |" in md


def test_spec_gpu_splits_a_profiles_gpu_idle_time_into_short_and_long_gaps():
    """device_idle: the span less the union of the activities (overlaps merged), each gap short (a
    launch) or long (a wait for the host), per round, the longest first with what lies around it."""
    spec_gpu = load_script("spec_gpu")
    spans = [("d", 40, 45), ("a", 0, 10), ("b", 11, 20), ("c", 15, 30), ("e", 46, 50), ("f", 47, 49)]
    idle = spec_gpu.device_idle(spans, window=2)
    assert (idle["span_us_per_round"], idle["busy_us_per_round"], idle["idle_us_per_round"]) == (25.0, 19.0, 6.0)
    assert (idle["short_gaps_per_round"], idle["short_gap_us_per_round"]) == (1.0, 1.0)
    assert (idle["long_gaps_per_round"], idle["long_gap_us_per_round"]) == (0.5, 5.0)
    assert idle["longest_gaps"][0] == {"us": 10.0, "after": "c", "before": "d"} and len(idle["longest_gaps"]) == 3
    assert "GPU idle 6.0 us a round of a 25.0 us span" in spec_gpu.idle_text(idle) and spec_gpu.device_idle([], 1) == {}


def test_draft_topk_gpu_times_every_selection_and_checks_its_values_on_the_cpu(tmp_path):
    """--tiny: top-k by torch.topk and by stable sorts (chunked and whole), and the level's sort, at
    two row counts; every variant's values equal torch.topk's, and the report is written."""
    script = load_script("draft_topk_gpu")
    out = tmp_path / "topk.json"
    assert script.main(["--tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["rows"]) for r in rows[:6]] == [(v, 1) for v in ("topk-chunked", "topk", "sort-chunked",
                                                                               "sort", "level-sort", "level-topk")]
    assert len(rows) == 12 and all(r["same"] and r["us"] > 0 for r in rows)


def test_round_cost_gpu_reports_rounds_in_plain_steps_and_whole_requests_on_the_cpu(tmp_path):
    """--tiny: a toy target and an untrained drafter on the CPU. Each tree's round in plain steps, the
    speedup its given accept length implies (tau x plain step / round), whole requests per decoder
    and clock mode, split into start, first, median and last rounds, the profile of a round and a
    plain step and the requests again after it; the report is written."""
    script = load_script("round_cost_gpu")
    out = tmp_path / "rc.json"
    assert script.main(["--tiny", "--trees", "3,2,4", "2", "--tau", "1.5", "--rounds", "2", "--repeats", "2",
                        "--requests", "1", "--new-tokens", "6", "--profile", "--requests-after-profile",
                        "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    plain, (tree, chain) = res["plain_step_ms"], res["trees"]
    assert (tree["tree"], chain["tree"], len(tree["round_ms_all"])) == ("3,2,4", "2,1,2", 2)
    assert tree["speedup_at_tau"] == pytest.approx(1.5 * plain / tree["round_ms"], rel=1e-2) and "tau" not in chain
    assert tree["round_in_plain_steps"] == pytest.approx(tree["round_ms"] / plain, rel=1e-2)
    assert [(r["decoder"], r["timing"]) for r in res["requests"]] == [
        (d, t) for t in ("off", "events") for d in ("plain", "3,2,4", "2,1,2")]
    assert all(r["ms_start"] > 0 and r["ms_last_three_rounds"] > 0 and r["rounds_per_request"] >= 1
               for r in res["requests"])
    # one round and one plain step profiled, then the same requests again after the profiler
    assert res["profiles"]["spec_round"]["rounds"] >= 1 and res["profiles"]["plain_step"]["rounds"] >= 1
    assert [(r["decoder"], r["timing"]) for r in res["profiles"]["requests_after"]] == [
        (r["decoder"], r["timing"]) for r in res["requests"]]


def test_round_cost_gpu_runs_a_prompt_sets_requests_per_decoder_and_collector_mode(toy_drafter, tmp_path):
    """--target with --prompt-set: the set's prompts through every decoder in turn, per garbage-collector
    mode and phase clock, each step's wall time summed up, then with Hugging Face's decoder between
    them and after it (--hf-compiled); the report is written."""
    target, draft = toy_drafter
    script = load_script("round_cost_gpu")
    out = tmp_path / "rs.json"
    assert script.main(["--target", str(target), "--draft", str(draft), "--prompt-set", "qa", "--prompts", "2",
                        "--new-tokens", "5", "--trees", "2,2,3", "--gc", "default", "freeze", "--timings", "off",
                        "events", "--hf-compiled", "--requests-only", "--out", str(out)]) == 0
    import gc

    assert not gc.get_freeze_count()  # the collector as it was
    rows = json.loads(out.read_text())["request_sets"]
    # then with HF generate run between the requests (on the CPU its step is not compiled), then after it
    assert [(r["phase"], r["gc"], r["timing"], r["decoder"]) for r in rows] == [
        ("alone", g, t, d) for g in ("default", "freeze") for t in ("off", "events") for d in ("plain", "2,2,3")] + [
        (p, "default", t, d) for p in ("hf-interleaved", "after-hf") for t in ("off", "events")
        for d in ("plain", "2,2,3")]
    for r in rows:
        assert r["requests"] == 2 and 2 <= r["new_tokens"] <= 10 and r["steps"] >= 2
        assert r["ms_step_p50"] <= r["ms_step_p90"] <= r["ms_step_p99"] <= r["ms_step_max"]
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["seconds"], rel=1e-2)
        assert (r["tau"] is None) == (r["decoder"] == "plain") and ("ms_per_step_phases" in r) == (r["timing"] != "off")


def test_spec_gpu_budget_keeps_partial_results(toy_drafter, tmp_path):
    """A budget too small for the main loop still leaves a complete report of what was done."""
    target, draft = toy_drafter
    spec_gpu = load_script("spec_gpu")
    out = tmp_path / "bench"
    code = spec_gpu.main(["--target", str(target), "--draft", str(draft), "--device", "cpu", "--sets", "qa",
                          "--prompts-per-set", "3", "--select-prompts", "1", "--max-new-tokens", "4",
                          "--trees", "2,2,3", "--chains", "", "--temperatures", "0", "--no-profile",
                          "--skip", "hf_eager,hf_compiled", "--budget-s", "0.5", "--reserve-s", "0",
                          "--out-dir", str(out)])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "done"
    assert any("budget reached" in n for n in res["notes"]) or any("selection stopped" in n for n in res["notes"])
    assert (out / "results.md").exists()


def test_train_script_mixes_prompts_then_regenerates_trains_and_keeps_the_best(toy_drafter, tmp_path):
    target, _ = toy_drafter
    train = load_script("train_smollm2_drafter")
    prompts = tmp_path / "prompts.jsonl"
    assert train.main(["prepare", "--shared", str(DATA), "--out", str(prompts), "--val-prompts", "3"]) == 0
    rows = [json.loads(x) for x in prompts.read_text().splitlines()]
    val = [json.loads(x) for x in (tmp_path / "val_prompts.jsonl").read_text().splitlines()]
    assert len(rows) > 50 and len({r["id"] for r in rows}) == len(rows)
    assert len(val) == 3 and not {v["id"] for v in val} & {r["id"] for r in rows}  # held out
    assert all(r["messages"][-1]["role"] == "user" for r in rows)
    assert any(len([m for m in r["messages"] if m["role"] == "user"]) == 2 for r in rows)  # follow-up turns
    sources = json.loads((tmp_path / "prompts.sources.json").read_text())
    assert sources["prompts"] == len(rows) and "gsm8k/train.jsonl" in sources["sources"]

    work = tmp_path / "work"
    code = train.main(["run", "--target", str(target), "--prompts", str(prompts), "--val-prompts",
                       str(tmp_path / "val_prompts.jsonl"), "--work", str(work), "--device", "cpu",
                       "--budget-s", "600", "--limit", "8", "--regen-batch", "4", "--max-new-tokens", "8",
                       "--cache", "dynamic", "--epochs", "2", "--tokens-per-batch", "512", "--max-length", "128",
                       "--draft-vocab", "256", "--eval-every", "2", "--patience", "2", "--val-limit", "2",
                       "--val-max-new-tokens", "4", "--val-tree", "2", "--min-train-s", "0", "--no-copy-to-out",
                       "--before-src", str(BENCHMARKS.parent / "src"), "--before-prompts", "4", "--before-steps", "2"])
    assert code == 0
    summary = json.loads((work / "summary.json").read_text())
    before = summary["before"]  # the "old code" stage (here today's src), with the flags old code takes
    assert before["regenerate"]["exit"] == 0 and before["regenerate"]["conversations"] == 4
    assert before["regenerate"]["tokens_per_s"] > 0
    assert before["train"]["exit"] == 0 and before["train"]["steps"] == 2 and before["train"]["tokens_per_s"] > 0
    assert summary["regenerate"]["exit"] == 0 and summary["regenerate"]["conversations"] == 8
    from_file = summary["regenerate"]["from_file"]  # what the answers file says, without the child's summary
    assert from_file["conversations"] == 8 and from_file["turns"] >= 8
    assert from_file["kept_new_tokens"] == summary["regenerate"]["new_tokens"]  # no loops cut at 8 tokens
    assert sum(from_file["finish"].values()) == from_file["turns"]
    assert summary["train"]["exit"] == 0 and summary["train"]["steps_done"] > 0
    assert summary["train"]["evaluations"] and all(e["tau"] is not None for e in summary["train"]["evaluations"])
    assert summary["drafter_from"] == "final" and (work / "drafter" / "eyas.json").exists()
    files = summary["drafter_bf16"]["files"]
    assert {"config.json", "eyas.json"} <= set(files)
    assert all((work / "drafter_bf16" / f).stat().st_size <= 15 * 2**20 for f in files)
    from eyas.interop import load_drafter
    from eyas.targets import load_target

    loaded = load_target(str(target))
    small, _ = load_drafter(work / "drafter_bf16", target=loaded)
    full, _ = load_drafter(work / "drafter", target=loaded)
    for k, v in full.state_dict().items():  # the same weights, rounded to bf16 (the embedding: the target's)
        if k == "embed_tokens.weight":
            continue
        w = small.state_dict()[k]
        assert torch.equal(w.float(), v.to(torch.bfloat16).float()) if v.is_floating_point() else torch.equal(w, v), k


def test_answers_written_reads_a_killed_runs_file(tmp_path):
    """A regeneration killed mid-write leaves whole records and maybe a torn last line: the count
    comes from the records' provenance and skips the torn line."""
    train = load_script("train_smollm2_drafter")
    f = tmp_path / "answers.jsonl"
    rec = lambda i, toks, fin: json.dumps({"id": str(i), "messages": [], "provenance": {"new_tokens": toks, "finish_reasons": fin}})
    f.write_text(rec(0, [10, 5], ["eos", "loop"]) + "\n" + rec(1, [256], ["length"]) + "\n" + '{"id": "2", "mess')
    got = train.answers_written(f)
    assert got == {"conversations": 2, "turns": 3, "kept_new_tokens": 271, "finish": {"eos": 1, "length": 1, "loop": 1}}
    assert train.answers_written(tmp_path / "missing.jsonl")["conversations"] == 0


def test_regen_fast_gpu_times_both_engines_which_agree_in_float32(tmp_path):
    regen = load_script("regen_fast_gpu")
    out = tmp_path / "regen.json"
    report = regen.main(["--tiny", "--device", "cpu", "--limit", "12", "--rows", "4,16", "--max-new-tokens", "6",
                         "--hf-batch", "6", "--hf-limit", "12", "--chunk", "6", "--end-to-end", "--out", str(out)])
    assert json.loads(out.read_text())["total_s"] == report["total_s"]
    for stage in ("fast_4", "fast_16", "hf", "end_to_end"):
        assert "error" not in report[stage], report[stage].get("traceback")
    assert report["fast_4"]["answers"] == 12 and report["fast_4"]["tokens_per_s"] > 0
    assert report["fast_4"]["chunked"]["new_tokens"] == report["fast_4"]["new_tokens"]
    assert report["agreement_fast_hf"]["identical"] == 1.0 and report["agreement_fast_rows"]["identical"] == 1.0
    e2e = report["end_to_end"]
    assert (e2e["engine"], e2e["rows"], e2e["batch_size"]) == ("fast", 6, 6) and e2e["written"] + e2e["failed"] == 12


def test_spec_gpu_chooses_the_tree_at_every_temperature_served(toy_drafter, tmp_path):
    """--select-per-temperature: a selection per temperature (its table in the report), and each
    temperature's rounds run the tree chosen at it."""
    target, draft = toy_drafter
    spec_gpu = load_script("spec_gpu")
    out = tmp_path / "bench"
    code = spec_gpu.main(["--target", str(target), "--draft", str(draft), "--device", "cpu", "--sets", "qa",
                          "--prompts-per-set", "1", "--select-prompts", "1", "--max-new-tokens", "6",
                          "--trees", "3,2,5", "2,2,3", "--chains", "2", "--temperatures", "0,1", "--no-profile",
                          "--no-tree-auto", "--skip", "hf_eager,hf_compiled", "--select-per-temperature",
                          "--out-dir", str(out)])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "done" and res["errors"] == [], res["errors"]
    by_t = res["tree_selection_by_temperature"]
    assert set(by_t) == {"t0", "t1"} and res["tree_selection"] == by_t["t0"]
    for tkey, sel in by_t.items():
        assert sel["temperature"] == float(tkey[1:]) and sel["prompts"] == 1
        assert [c["label"] for c in sel["candidates"]] == ["3,2,5", "2,2,3", "2,1,2"]
        assert sel["best_tree"] in ("3,2,5", "2,2,3") and sel["best_chain"] == "2,1,2"
    for tkey in ("t0", "t1"):
        assert res["results"][tkey]["overall"]["spec_tree"]["prompts"] == 1
    from eyas.engine import TreeSpec

    t0, t1 = (str(TreeSpec.parse(by_t[k]["best_tree"])) for k in ("t0", "t1"))
    # one tree for both temperatures is named once; two are named per temperature
    assert res["decoders"]["spec_tree"] == (f"eyas speculative {t0}" if t0 == t1 else
                                            f"eyas speculative t=0: {t0}; t=1: {t1}")
    md = (out / "results.md").read_text()
    assert "## Tree selection (MT-bench, temperature 0," in md and "## Tree selection (MT-bench, temperature 1," in md


def test_decode_attention_gpu_times_both_attentions_on_the_cpu_in_the_interpreter(tmp_path):
    """--tiny: a toy block, eager attention and one split-KV tiling (Triton's interpreter), a plain
    step and a tree bucket, written as JSON."""
    require_triton("the split-KV kernels")
    script = load_script("decode_attention_gpu")
    out = tmp_path / "decode_attention.json"
    assert script.main(["--tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["tokens"]) for r in rows] == [("tiny", 1), ("tiny", 4)]
    for r in rows:
        assert r["eager"]["us"] > 0 and [t.get("error") for t in r["split_kv"]] == [None]
        assert r["best_split_kv"]["block_n"] == 16 and r["best_split_kv"]["us"] > 0


def test_matvec_gpu_times_the_products_on_the_cpu_in_the_interpreter_and_writes_the_best_tilings(tmp_path):
    """--tiny: two toy products, cuBLAS and two tilings each plus the engine's own (Triton's
    interpreter), the report as JSON and the best tiling of each added to a table of tilings."""
    require_triton("the matvec kernels")
    script = load_script("matvec_gpu")
    out, table = tmp_path / "matvec.json", tmp_path / "tilings.json"
    table.write_text(json.dumps({"cpu": {"1x1/none": [1, 16, 1, True]}}))  # kept: the table is added to
    assert script.main(["--tiny", "--out", str(out), "--write-tilings", str(table)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["product"], r["N"], r["K"], r["prologue"]) for r in rows] == [("qkv", 48, 64, "rms"),
                                                                           ("down", 64, 40, "silu")]
    for r in rows:
        assert r["cublas_us"] > 0 and len(r["tilings"]) == 3 and all(t["us"] > 0 for t in r["tilings"])
        assert r["best"]["us"] == min(t["us"] for t in r["tilings"]) and sum(t["default"] for t in r["tilings"]) == 1
    written = json.loads(table.read_text())["cpu"]
    assert set(written) == {"1x1/none", "48x64/rms", "64x40/silu"}
    assert written["48x64/rms"] == [rows[0]["best"][k] for k in ("block_n", "block_k", "warps", "evict_first")]
    assert script.main(["--tiny", "--rows", "5", "--out", str(out), "--write-tilings", str(table)]) == 0
    few = json.loads(out.read_text())
    assert few["x_rows"] == 5 and [len(r["tilings"]) for r in few["rows"]] == [3, 3]  # the few-row kernel's
    assert all(t["us"] > 0 for r in few["rows"] for t in r["tilings"])
    written = json.loads(table.read_text())["cpu"]  # its best, under keys with the rows padded to 16
    assert set(written) == {"1x1/none", "48x64/rms", "64x40/silu", "48x64/rms/r16", "64x40/silu/r16"}
    assert written["64x40/silu/r16"] == [few["rows"][1]["best"][k] for k in ("block_n", "block_k", "warps", "evict_first")]
    with pytest.raises(SystemExit, match=r"--rows: expected 1..64, found 65"):
        script.main(["--tiny", "--rows", "65"])


def test_plot_serve_load_draws_each_setting_and_marks_the_levels_that_compiled(tmp_path, capsys):
    """plot_serve_load.py: a line per setting and temperature, the levels in which the server
    compiled over half a second marked; a file that is no serve_load report is named, with exit 2."""
    plot = load_script("plot_serve_load")
    level = (lambda s, t, c, tok, comp: {"speculation": s, "temperature": t, "clients": c, "throughput_tok_s": tok,
                                         "server": {"compile_s": comp, "target_compile_s": 0.0, "steps": {}}})
    report = tmp_path / "load.json"
    report.write_text(json.dumps({"levels": [level("auto", 0.0, 1, 1700.0, 0.0), level("auto", 0.0, 4, 450.0, 10.9),
                                             level("off", 0.0, 4, 1300.0, 0.2), level("off", 0.0, 1, 560.0, 0.0),
                                             level("off", 1.0, 1, 620.0, 0.0)]}))
    assert plot.main([str(report), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert Path(out["plot"]) == report.with_suffix(".png") and report.with_suffix(".png").stat().st_size > 0
    assert [(r["temperature"], r["speculation"], r["clients"], r["compile_s"]) for r in out["levels"]] == [
        (0.0, "auto", 1, 0.0), (0.0, "auto", 4, 10.9), (0.0, "off", 1, 0.0), (0.0, "off", 4, 0.2), (1.0, "off", 1, 0.0)]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    assert plot.main([str(bad)]) == 2
    assert f"{bad}: expected a serve_load.py --json report with 'levels'" in capsys.readouterr().err


def _bench_report(path: Path, figures: dict[float, dict[str, tuple[float, float]]], tree: str = "4,8,15") -> Path:
    """An `eyas bench --out` report holding (tau, first-draft acceptance) per temperature and set."""
    temps = [{"temperature": t, "sets": [{"set": name, "tree": tree, "temperature": t, "prompts": 2, "tau": tau,
                                          "acceptance_per_position": [first, first / 2], "speedup_vs_plain": 1.1}
                                         for name, (tau, first) in sets.items()]} for t, sets in figures.items()]
    path.write_text(json.dumps({"tree": [4, 8, 15], "temperatures": temps}))
    return path


def test_compare_drafters_tables_both_reports_against_the_bars_and_refuses_other_sets(tmp_path, capsys):
    compare = load_script("compare_drafters")
    a = _bench_report(tmp_path / "a.json", {0.0: {"mt_bench": (3.3, 0.85), "sum": (3.25, 0.79)},
                                            1.0: {"mt_bench": (2.7, 0.6), "sum": (2.6, 0.5)}})
    b = _bench_report(tmp_path / "b.json", {0.0: {"mt_bench": (3.4, 0.9), "sum": (3.3, 0.81)},
                                            1.0: {"mt_bench": (2.5, 0.6), "sum": (2.6, 0.5)}})
    md, png = tmp_path / "t.md", tmp_path / "t.png"
    assert compare.main([f"new={a}", f"old={b}", "--md", str(md), "--png", str(png), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [(r["temperature"], r["set"], r["new"]["tau"], r["old"]["first"]) for r in result["rows"]] == [
        (0.0, "mt_bench", 3.3, 0.9), (0.0, "sum", 3.25, 0.81), (1.0, "mt_bench", 2.7, 0.6), (1.0, "sum", 2.6, 0.5)]
    # T=0: every set's tau >= 3.2 and first-draft acceptance >= 0.8; T=1: the sets' mean tau >= 2.6
    assert result["summary"]["new"]["0"] == {"mean_tau": 3.275, "mean_first": 0.82, "sets_below_bar": ["sum"],
                                             "meets_bar": False}
    assert result["summary"]["old"]["0"]["meets_bar"] and result["summary"]["new"]["1"]["meets_bar"]
    assert not result["summary"]["old"]["1"]["meets_bar"]  # mean 2.55
    assert "| 0 | sum | 3.25 | 0.79 | 1.10 | 3.30 | 0.81 | 1.10 |" in md.read_text()
    assert png.stat().st_size > 0
    c = _bench_report(tmp_path / "c.json", {0.0: {"mt_bench": (3.3, 0.85)}, 1.0: {"mt_bench": (2.7, 0.6)}})
    with pytest.raises(SystemExit, match=r"other: expected the sets and tree of new at temperature 0 "
                                         r"\(\['mt_bench', 'sum'\]\), found \['mt_bench'\]"):
        compare.main([f"new={a}", f"other={c}"])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit, match=r"x=.*bad.json: expected an `eyas bench --out` JSON report"):
        compare.main([f"new={a}", f"x={tmp_path / 'bad.json'}"])


def test_sampled_tau_bound_counts_rounds_that_emit_every_sampled_token_once():
    bound = load_script("sampled_tau_bound")
    assert bound.tau_bound([0] * 6, depth=4, top_k=1) == (6, 2)  # 4 drafted + the bonus, then the last token alone
    assert bound.tau_bound([3, 0, 0], depth=4, top_k=1) == (3, 2)  # rank 3 misses a chain: its bonus alone
    assert bound.tau_bound([3, 0, 0], depth=4, top_k=4) == (3, 1)  # in the top 4: one round of 2 drafted + bonus
    ranks = [0, 5, 1, 0, 0, 2, 9, 0, 1, 1, 0, 0, 0, 0, 0, 3]
    for depth in (1, 2, 4):
        for k in (1, 2, 4, 8):
            emitted, rounds = bound.tau_bound(ranks, depth, k)
            assert emitted == len(ranks) and 1 <= emitted / rounds <= depth + 1
    assert bound.tau_bound(ranks, 4, 8)[1] < bound.tau_bound(ranks, 4, 2)[1] < bound.tau_bound(ranks, 4, 1)[1]


def test_plot_data_size_draws_every_series_and_extends_only_rising_trends_to_their_goal(tmp_path, capsys):
    """plot_data_size.py: every series of the file is drawn (a fifth one was dropped when the colours
    were a list of four), the y axis says how tau was measured, and the log-linear trend through a
    series' first and last points is extended to its goal only when it rises."""
    import matplotlib.pyplot as plt

    plot = load_script("plot_data_size")
    point = (lambda targets, tau: {"conversations": 1, "training_targets": targets, "tau": tau, "source": "x.md"})
    series = [{"name": f"s{i}", "goal": None, "points": [point(1_000_000, 2.0)]} for i in range(3)]
    series += [{"name": "rising", "goal": 3.5, "points": [point(10_000_000, 3.0), point(1_000_000, 2.0)]},
               {"name": "falling", "goal": 3.2, "points": [point(10_000_000, 3.04), point(20_000_000, 3.0)]}]
    points = tmp_path / "size.json"
    points.write_text(json.dumps({"y_label": "tau, six-set mean", "series": series}))
    assert plot.main([str(points), "--json"]) == 0
    rows = {r["series"]: r for r in json.loads(capsys.readouterr().out)}
    # 2 -> 3 over a decade: 3.5 is half a decade further, at 1e7 * 10 ** 0.5 targets
    assert rows["rising"]["targets_for_goal_by_trend"] == round(1e7 * 10 ** 0.5)
    assert rows["falling"]["targets_for_goal_by_trend"] is None and rows["s0"]["targets_for_goal_by_trend"] is None
    ax = plt.gcf().axes[0]
    assert ax.get_legend_handles_labels()[1] == ["s0", "s1", "s2", "rising", "falling"]
    assert ax.get_ylabel() == "tau, six-set mean" and points.with_suffix(".png").stat().st_size > 0
    plt.close("all")


def test_draft_vocab_coverage_counts_answer_tokens_inside_the_vocabulary_and_copied_from_the_prompt():
    cover = load_script("draft_vocab_coverage")
    in_vocab = torch.tensor([True, True, False, False, True])
    # prompt 1 holds 2 and 4; its answer 2 (copied, outside), 4 (copied, inside), 3 (outside), 0 (inside)
    row = cover.coverage([[2, 4], [1]], [[2, 4, 3, 0], [3, 1]], in_vocab, decode=lambda ids: f"<{ids[0]}>")
    assert (row["tokens"], row["in_vocab"], row["copied"]) == (6, 0.5, 0.5)
    assert (row["in_vocab_of_copied"], row["in_vocab_of_rest"]) == (round(2 / 3, 4), round(1 / 3, 4))
    assert row["top_missing"] == [{"id": 3, "count": 2, "text": "<3>"}, {"id": 2, "count": 1, "text": "<2>"}]
    # oracle tau, depth 3: answer 1 [out, in, out, in] -> rounds [2] (its bonus alone), [4, 3] (4 accepted, 3 the
    # bonus), [0] (last token): 4 tokens in 3 rounds; answer 2 [out, in] -> [3], [1]: 2 in 2. 6 / 5.
    assert row["oracle_tau"] == 1.2
    long = cover.coverage([[]], [[0, 1, 4, 0, 1]], in_vocab, depth=3)  # all inside: 3 drafted + the bonus, then 1
    assert long["oracle_tau"] == 2.5 and cover.coverage([[]], [[0, 1, 4, 0, 1]], in_vocab, depth=1)["oracle_tau"] == round(5 / 3, 4)
    assert cover.coverage([[1]], [[]], in_vocab)["in_vocab"] is None


def test_draft_vocab_coverage_answers_a_set_with_the_batched_engine_and_reads_the_drafters_t2d(toy_drafter, tmp_path,
                                                                                               capsys):
    cover = load_script("draft_vocab_coverage")
    target, drafter = toy_drafter
    out = tmp_path / "cover.json"
    assert cover.main(["--target", str(target), "--draft", str(drafter), "--sets", "mt_bench", "--limit", "2",
                       "--max-new-tokens", "6", "--rows", "2", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text()) and report["draft_vocab_size"] == 512
    row = report["sets"]["mt_bench"]
    assert 0 < row["tokens"] <= 12 and 0 <= row["in_vocab"] <= 1
    assert report["head_fit"]["held_out_rows"] == 512 - int(0.8 * 512) and -1 <= report["head_fit"]["cosine_mean"] <= 1


def test_head_fit_predicts_held_out_rows_of_a_head_that_is_a_linear_map_of_the_targets():
    cover = load_script("draft_vocab_coverage")
    g = torch.Generator().manual_seed(0)
    target_head = torch.randn(64, 6, generator=g)
    ids = torch.arange(10, 50)
    fit = cover.head_fit(target_head[ids] @ torch.randn(6, 5, generator=g), ids, target_head)
    assert fit["held_out_rows"] == 8 and fit["cosine_mean"] > 0.999
    noise = cover.head_fit(torch.randn(40, 5, generator=g), ids, target_head)
    assert noise["cosine_mean"] < 0.9


def test_widen_drafter_writes_a_whole_vocabulary_drafter_that_keeps_the_old_rows(toy_drafter, tmp_path, capsys):
    from eyas.interop import load_drafter

    widen = load_script("widen_drafter")
    target, drafter = toy_drafter
    assert widen.main(["--target", str(target), "--draft", str(drafter), "--out", str(tmp_path / "wide")]) == 0
    report = json.loads(capsys.readouterr().out)
    old, _ = load_drafter(drafter)
    wide, contract = load_drafter(tmp_path / "wide")
    V = old.config.vocab_size
    assert report["draft_vocab_size"] == {"before": 512, "after": V} and wide.config.draft_vocab_size == V
    assert contract.drafter.draft_vocab_size == V and bool(wide.t2d.all())
    old_ids = old.draft_to_target(torch.arange(512))
    # the whole vocabulary, ascending: draft id i is target id i; the old rows kept (bf16 on disk)
    assert torch.equal(wide.draft_to_target(torch.arange(V)), torch.arange(V))
    assert torch.equal(wide.lm_head.weight[old_ids], old.lm_head.weight.to(torch.bfloat16).float())
    assert torch.equal(wide.fc.weight, old.fc.weight.to(torch.bfloat16).float())


def test_step_profile_unions_overlapping_kernels_and_row_speculation_reports_a_profile_per_setting(tmp_path, capsys):
    step_profile = load_script("step_profile")
    assert step_profile._union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert step_profile._union_us([]) == 0
    rows = load_script("row_speculation_cpu")
    code = rows.main(["--target", "smollm2", "--rows", "2", "--depths", "2", "--temperatures", "0", "--steps", "2",
                      "--sets", "mt_bench", "--profile", str(tmp_path / "prof"), "--profile-steps", "2", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [(x["depth"], x["profile"]["steps"]) for x in report["results"]] == [(0, 2), (2, 2)]
    assert all(x["profile"]["wall_ms"] > 0 and "busy_share" not in x["profile"] for x in report["results"])  # CPU
    table = (tmp_path / "prof" / "t0-rows2-2.txt").read_text()
    assert table.startswith("# by host self time") and "aten::" in table


def test_parallel_sessions_answers_each_prompt_as_one_target_alone_from_threads_and_the_batch(capsys):
    """Sessions stepped by threads side by side (each its own fast target) give each prompt exactly the
    tokens one target gives it alone (float32, greedy), and every decoder reports a rate."""
    script = load_script("parallel_sessions_gpu")
    code = script.main(["--target", "smollm2", "--sessions", "1,2", "--prompts-each", "1", "--max-new-tokens", "8",
                        "--tree", "3,2,5", "--temperatures", "0", "--sets", "mt_bench,gsm8k", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["sessions"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["equal_to_alone"] is True and r["batch_equal_to_alone"] is True
        assert r["round_robin_equal_to_alone"] is True
        assert min(r["threads_spec"], r["round_robin_spec"], r["threads_plain"], r["batch_plain"]) > 0
