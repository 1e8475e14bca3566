"""The `eyas` command end to end: new -> info -> export -> import, on the embedded SmolLM2 and on a
tiny local target, through typer's runner (the same entry point as the console script)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli.main import app
from tests.support.toy import make_toy_target

runner = CliRunner()


def run(*args: str, ok: bool = True) -> str:
    result = runner.invoke(app, list(args))
    if ok:
        assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout  # progress bars go to stderr; --json output is stdout alone


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A 32-block tiny Llama with the SmolLM2 tokenizer, saved as a local HF directory."""
    return make_toy_target(tmp_path_factory.mktemp("tiny32"), num_blocks=32, hidden=32)


@pytest.mark.integration
def test_new_info_export_import_keep_the_boundaries(tiny_target, tmp_path):
    out = tmp_path / "d"
    run("new", "--target", str(tiny_target), "--out", str(out), "--boundaries", "3,10,29", "--draft-vocab", "64")
    info = json.loads(run("info", str(out), "--json"))
    assert info["boundaries"] == [3, 10, 29] and info["num_target_blocks"] == 32
    assert info["engines"]["eyas"] == [3, 10, 29]
    assert info["engines"]["vllm"] == [3, 10, 29]
    assert info["engines"]["sglang"] == [3, 10, 29]  # written for SGLang's current rule...
    assert info["engines"]["sglang_legacy"] == [4, 11, 30]  # ...which an old SGLang reads off by one
    assert info["contract"]["drafter"]["draft_vocab_size"] == 64

    run("export", str(out), "--to", "sglang", "--sglang-rule", "legacy", "--out", str(tmp_path / "sg"))
    sg = json.loads(run("info", str(tmp_path / "sg"), "--json"))
    assert sg["engines"]["sglang_legacy"] == [3, 10, 29] and sg["engines"]["sglang"] == [2, 9, 28]
    cfg = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 9, 28]

    run("export", str(out), "--to", "vllm", "--out", str(tmp_path / "vl"))
    table = run("info", str(tmp_path / "vl"))
    assert "vllm" in table and "sglang_legacy" in table and "DIFFERS" in table
    back = json.loads(run("import", str(tmp_path / "vl"), "--out", str(tmp_path / "back"), "--json"))
    assert back["boundaries"] == [3, 10, 29]

    # A directory that does not say its target's block count: --target counts them.
    (tmp_path / "vl" / "eyas.json").unlink()
    cfg = json.loads((tmp_path / "vl" / "config.json").read_text())
    del cfg["eyas_num_target_blocks"]
    cfg["speculators_config"]["verifier"]["name_or_path"] = "org/not-local"
    (tmp_path / "vl" / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["info", str(tmp_path / "vl")])
    assert r.exit_code == 2 and "--target" in r.output
    assert json.loads(run("info", str(tmp_path / "vl"), "--target", str(tiny_target), "--json"))["num_target_blocks"] == 32
    r = runner.invoke(app, ["info", str(tmp_path / "vl"), "--target", str(tiny_target), "--num-target-blocks", "30"])
    assert r.exit_code == 2 and "--num-target-blocks: expected 32" in r.output


@pytest.mark.integration
def test_bad_boundaries_and_missing_target_fail_with_a_message(tiny_target, tmp_path):
    r = runner.invoke(app, ["new", "--target", str(tiny_target), "--out", str(tmp_path / "x"), "--boundaries", "3,3,40"])
    assert r.exit_code == 2
    assert "boundaries" in r.output and "40" in r.output
    r = runner.invoke(app, ["new", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "y")])
    assert r.exit_code == 2 and "--target" in r.output
    r = runner.invoke(app, ["info", str(tmp_path / "nothing-here")])
    assert r.exit_code == 2


@pytest.mark.slow
def test_embedded_smollm2_demo(tmp_path):
    """The main job of `make demo`: a drafter for the embedded SmolLM2 (30 blocks, hidden 576)."""
    out = tmp_path / "smol"
    info = json.loads(run("new", "--target", "smollm2", "--out", str(out), "--draft-vocab", "4096", "--json"))
    assert info["boundaries"] == [2, 15, 27] and info["num_target_blocks"] == 30
    c = info["contract"]
    assert (c["target"]["hidden_size"], c["target"]["vocab_size"]) == (576, 49152)
    assert c["tokenisation"]["eos_token"] == "<|im_end|>"
    # [2, ...] is the one case where both SGLang rules agree: every engine captures what was trained.
    assert all(v == [2, 15, 27] for v in info["engines"].values())


@pytest.mark.unit
def test_info_and_import_name_each_reading_of_third_party_ids_and_mark_the_boundaries_assumed(tmp_path):
    from tests.test_interop import specforge_dir

    sf = tmp_path / "sf"
    specforge_dir(sf, {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]})
    text = " ".join(run("info", str(sf), "--num-target-blocks", "32").split())
    assert "specforge: [3, 16, 28]; sglang (PR #25454): [2, 15, 27]; sglang-legacy: [3, 16, 28]" in text
    assert "trained boundaries [3, 16, 28] are ASSUMED" in text and "--ids-convention" in text
    info = json.loads(run("info", str(sf), "--num-target-blocks", "32", "--json"))
    assert info["boundaries"] == [3, 16, 28] and info["boundaries_assumed"] is True
    assert info["id_readings"] == {"specforge": [3, 16, 28], "sglang": [2, 15, 27], "sglang-legacy": [3, 16, 28]}

    named = json.loads(run("info", str(sf), "--num-target-blocks", "32", "--ids-convention", "specforge", "--json"))
    assert named["boundaries"] == [3, 16, 28] and named["boundaries_assumed"] is False
    assert named["ids_convention"] == "specforge" and named["boundaries_assumed_why"] is None
    text = " ".join(run("info", str(sf), "--num-target-blocks", "32", "--ids-convention", "sglang").split())
    assert "ASSUMED" not in text and "read by the sglang convention (--ids-convention)" in text

    text = " ".join(run("import", str(sf), "--out", str(tmp_path / "a"), "--num-target-blocks", "32").split())
    assert "(trained boundaries [3, 16, 28] ASSUMED)" in text and "sglang (PR #25454): [2, 15, 27]" in text
    assert json.loads(run("info", str(tmp_path / "a"), "--json"))["boundaries_assumed"] is True
    imported = json.loads(run("import", str(sf), "--out", str(tmp_path / "b"), "--num-target-blocks", "32",
                              "--ids-convention", "sglang", "--json"))
    assert imported["boundaries"] == [2, 15, 27] and imported["boundaries_assumed"] is False
    assert imported["ids_convention"] == "sglang"


@pytest.mark.unit
def test_an_eyas_directory_ignores_ids_convention_and_says_so(tmp_path):
    from eyas.interop import save_drafter
    from tests.test_interop import synthetic

    drafter, contract = synthetic(boundaries=(3, 10, 29))
    d = save_drafter(drafter, contract, tmp_path / "eyas")
    plain = json.loads(run("info", str(d), "--json"))
    named = json.loads(run("info", str(d), "--ids-convention", "sglang", "--json"))
    assert plain == named and plain["boundaries"] == [3, 10, 29] and plain["boundaries_assumed"] is False
    text = " ".join(run("info", str(d), "--ids-convention", "sglang").split())
    assert "--ids-convention sglang not used" in text and "ASSUMED" not in text


@pytest.mark.integration
@pytest.mark.usefixtures("one_thread")
def test_regenerate_reports_temperatures_loops_finish_reasons_and_speed(tmp_path):
    """`eyas regenerate` with several temperatures, a loop policy and a cache: --json carries the
    counts, the table names new tokens/s and the answers per finish reason."""
    from tests.support.chat import chat_target, chat_tokenizer

    tok = chat_tokenizer()
    tdir = tmp_path / "target"
    chat_target(tok).save_pretrained(tdir)
    tok.save_pretrained(tdir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [f"question {i}?"]}) + "\n" for i in range(3)))
    out = tmp_path / "answers.jsonl"
    base = ["regenerate", "--target", str(tdir), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "30", "--batch-size", "2", "--device", "cpu"]
    rep = json.loads(run(*base, "--temperatures", "0,0.8", "--loops", "drop", "--cache", "static", "--json"))
    assert (rep["conversations"], rep["total"], rep["temperatures"], rep["cache"]) == (3, 6, [0.0, 0.8], "static")
    assert set(rep["finish"]) == {"eos", "length", "loop"} and "tokens_per_s" in rep
    assert rep["written"] + rep["failed"] == 6 and rep["loops_dropped"] == rep["finish"]["loop"]
    assert rep["loops_cut"] == 0
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert any(i.endswith("@t0.8") for i in ids) or rep["loops_dropped"] > 0
    table = run(*base, "--temperatures", "0,0.8", "--loops", "drop", "--cache", "static")
    assert "new tokens/s" in table and "loop" in table and "already there" in table
    # A resume with another loop policy is refused, naming the file and the field.
    result = runner.invoke(app, [*base, "--temperatures", "0,0.8", "--loops", "cut"])
    assert result.exit_code == 2 and "loops: file has 'drop', now 'cut'" in " ".join(result.output.split())
    result = runner.invoke(app, [*base, "--temperature", "0", "--temperatures", "0,0.8"])
    assert result.exit_code == 2 and "expected one of the two" in " ".join(result.output.split())
    result = runner.invoke(app, [*base, "--temperatures", "0,warm"])
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "--temperatures: expected comma-separated numbers" in message


@pytest.mark.integration
@pytest.mark.usefixtures("one_thread")
def test_regenerate_rows_mean_what_they_say(tmp_path):
    """issue 34: `--rows 512` ran 64 rows (--batch-size defaulted to 64 and capped them). The fast
    engine now decodes --rows rows, fed 4 x --rows conversations at a time unless --batch-size says
    otherwise; a --batch-size below --rows is refused in one line, before the model loads."""
    from tests.support.chat import chat_target, chat_tokenizer

    tok = chat_tokenizer()
    tdir = tmp_path / "target"
    chat_target(tok).save_pretrained(tdir)
    tok.save_pretrained(tdir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [f"question {i}?"]}) + "\n" for i in range(5)))
    base = ["regenerate", "--target", str(tdir), "--prompts", str(prompts), "--max-new-tokens", "8", "--device", "cpu",
            "--engine", "fast"]
    rep = json.loads(run(*base, "--out", str(tmp_path / "a.jsonl"), "--rows", "3", "--json"))
    assert (rep["engine"], rep["rows"], rep["batch_size"], rep["written"]) == ("fast", 3, 12, 5)
    # --progress keeps the bars (on stderr) under --json, whose stdout stays one JSON object: a pipeline
    # that parses the summary still sees in its log where the time goes.
    shown = runner.invoke(app, [*base, "--out", str(tmp_path / "c.jsonl"), "--rows", "3", "--json", "--progress"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["written"] == 5
    assert "prompt lengths" in shown.stderr and "regenerate" in shown.stderr
    quiet = runner.invoke(app, [*base, "--out", str(tmp_path / "d.jsonl"), "--rows", "3", "--json"])
    assert quiet.exit_code == 0 and "prompt lengths" not in quiet.stderr
    result = runner.invoke(app, [*base, "--out", str(tmp_path / "b.jsonl"), "--rows", "4", "--batch-size", "2"])
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "--rows 4 with --batch-size 2" in message and "pass --batch-size 16" in message
    assert not (tmp_path / "b.jsonl").exists()
