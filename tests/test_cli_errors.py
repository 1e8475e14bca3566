"""Every CLI error path of `eyas info`, `import` and `export` around the target's block count and
the speculators verifier, and `eyas train`'s options that its config refuses: exit code 2, a one-line
message that names the file, the field, what was expected and found, and what to pass; never a
traceback, never a half-written output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.cli.main import app
from eyas.contract import CaptureContract, Contract, TargetIdentity
from eyas.drafter import DrafterConfig, Eagle3Drafter
from eyas.drafter.build import drafter_flags
from eyas.interop import export_drafter, save_drafter

runner = CliRunner()
L = 32  # the made-up target's decoder blocks


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_user_error(result, *needles: str) -> str:
    """Exit code 2 through the CLI's own error line, not an exception escaping typer."""
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for n in needles:
        assert n in result.output, (n, result.output)
    return result.output


def eyas_dir(root: Path, source: str | None = None) -> Path:
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=128, draft_vocab_size=128, target_hidden_size=48, num_slots=3)
    contract = Contract(
        target=TargetIdentity(architecture="LlamaForCausalLM", model_type="llama", num_blocks=L, hidden_size=48,
                              vocab_size=128, fingerprint="0123456789abcdef", source=source),
        capture=CaptureContract(boundaries=[2, 10, 29]),  # every SGLang id rule agrees
        drafter=drafter_flags(cfg, "trained"),
    )
    return save_drafter(Eagle3Drafter(cfg), contract, root / "eyas")


def third_party(root: Path, to: str, name: str) -> Path:
    """An export with every eyas key removed, as another tool would have written it."""
    out = root / name
    with pytest.warns(UserWarning) if to == "vllm" else _nothing():
        export_drafter(eyas_dir(root / f"src-{name}"), to, out)
    (out / "eyas.json").unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("eyas_")}
    if to == "vllm":
        cfg["speculators_config"]["verifier"]["name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def spec_dir(tmp_path) -> Path:
    return third_party(tmp_path, "vllm", "spec")


@pytest.fixture
def sglang_dir(tmp_path) -> Path:
    return third_party(tmp_path, "sglang", "sg")


# ---------------------------------------------------------------------------------------------
# an unknown block count: asked for, never 0
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_info_on_a_speculators_dir_whose_verifier_is_a_hub_id_asks_for_the_block_count(spec_dir):
    out = assert_user_error(invoke("info", spec_dir), "config.json", "number of decoder blocks",
                            "--target", "--num-target-blocks")
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in out.replace("\n", "")
    assert "0..0" not in out and "0 decoder blocks" not in out
    info = json.loads(invoke("info", spec_dir, "--num-target-blocks", L, "--json").stdout)
    assert info["num_target_blocks"] == L and info["boundaries"] == [2, 10, 29]


@pytest.mark.integration
def test_info_on_an_sglang_dir_without_eyas_keys_asks_for_the_block_count(sglang_dir):
    assert_user_error(invoke("info", sglang_dir), "eyas_num_target_blocks", "--target", "--num-target-blocks")
    info = json.loads(invoke("info", sglang_dir, "--num-target-blocks", L, "--json").stdout)
    assert info["num_target_blocks"] == L and info["engines"]["sglang"] == [2, 10, 29]


@pytest.mark.integration
def test_info_on_a_dir_without_ids_asks_for_the_block_count(sglang_dir):
    cfg = json.loads((sglang_dir / "config.json").read_text())
    del cfg["eagle_config"], cfg["eagle_aux_hidden_state_layer_ids"]
    (sglang_dir / "config.json").write_text(json.dumps(cfg))
    assert_user_error(invoke("info", sglang_dir), "no layer ids", "--num-target-blocks")
    assert json.loads(invoke("info", sglang_dir, "--num-target-blocks", L, "--json").stdout)["boundaries"] == [2, 16, 29]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["spec", "sg"])
def test_import_without_the_block_count_writes_nothing_and_asks_for_it(tmp_path, kind):
    src = third_party(tmp_path, "vllm" if kind == "spec" else "sglang", kind)
    dest = tmp_path / "out"
    assert_user_error(invoke("import", src, "--out", dest), "number of decoder blocks", "--target",
                      "--num-target-blocks")
    assert not dest.exists()
    assert not list(tmp_path.glob(".out.*"))  # no temporary directory left behind
    r = invoke("import", src, "--out", dest, "--num-target-blocks", L, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads((dest / "eyas.json").read_text())["num_target_blocks"] == L


@pytest.mark.integration
@pytest.mark.parametrize("command", ["info", "import"])
def test_a_block_count_that_is_not_positive_or_contradicts_the_directory_fails(tmp_path, spec_dir, command):
    extra = ["--out", tmp_path / "out"] if command == "import" else []
    assert_user_error(invoke(command, spec_dir, *extra, "--num-target-blocks", 0), "--num-target-blocks")
    recorded = eyas_dir(tmp_path / "rec")
    assert_user_error(invoke(command, recorded, *extra, "--num-target-blocks", 30),
                      "num_target_blocks: expected 32", "found 30")
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_an_import_that_fails_its_final_check_leaves_the_output_as_it_was(tmp_path, spec_dir, monkeypatch):
    import eyas.interop.convert as convert
    from eyas.interop.common import CheckpointError

    dest = tmp_path / "out"
    assert invoke("import", spec_dir, "--out", dest, "--num-target-blocks", L).exit_code == 0
    before = {p.name: p.read_bytes() for p in dest.iterdir()}

    def broken(*args, **kwargs):
        raise CheckpointError("simulated: the written directory does not read back")

    other = third_party(tmp_path, "sglang", "sg")  # another drafter, with other config.json keys
    monkeypatch.setattr(convert, "view_engines", broken)
    assert_user_error(invoke("import", other, "--out", dest, "--num-target-blocks", L), "simulated")
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert not list(tmp_path.glob(".out.*"))


# ---------------------------------------------------------------------------------------------
# the speculators verifier
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_export_to_vllm_with_a_label_target_warns_and_writes_null_then_verifier_names_it(tmp_path):
    src = eyas_dir(tmp_path, source="smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf)")
    r = invoke("export", src, "--to", "vllm", "--out", tmp_path / "v1")
    assert r.exit_code == 0, r.output
    assert "warning:" in r.output and "--verifier" in r.output
    verifier = json.loads((tmp_path / "v1" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] is None
    r = invoke("export", src, "--to", "vllm", "--out", tmp_path / "v2", "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert r.exit_code == 0 and "warning:" not in r.output, r.output
    verifier = json.loads((tmp_path / "v2" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.integration
def test_export_refuses_a_verifier_no_engine_resolves_or_one_for_sglang(tmp_path):
    src = eyas_dir(tmp_path)
    assert_user_error(invoke("export", src, "--to", "vllm", "--out", tmp_path / "v", "--verifier", "smollm2 (x.gguf)"),
                      "verifier: expected a Hugging Face hub id")
    assert_user_error(invoke("export", src, "--to", "sglang", "--out", tmp_path / "s", "--verifier", "org/name"),
                      "verifier: expected only for the speculators format")
    assert not (tmp_path / "v").exists() and not (tmp_path / "s").exists()


@pytest.mark.integration
def test_an_unknown_ids_convention_is_refused_before_anything_is_written(sglang_dir, tmp_path):
    assert_user_error(invoke("info", sglang_dir, "--num-target-blocks", L, "--ids-convention", "eagle"),
                      "--ids-convention")
    out = tmp_path / "never"
    assert_user_error(invoke("import", sglang_dir, "--out", out, "--num-target-blocks", L,
                             "--ids-convention", "eagle"), "--ids-convention")
    assert not out.exists()


@pytest.mark.unit
@pytest.mark.parametrize("flags, message", [
    (["--steps", "3", "--time-budget-s", "0"], "time_budget_s: expected None or more than 0, found 0.0"),
    (["--steps", "3", "--epochs", "2"], "give exactly one of steps / epochs; found steps=3, epochs=2.0"),
    # 'default' resolves to the shipped drafter of an embedded target only; a GGUF path is not one
    (["--steps", "3", "--init-from", "default", "--target", "model.gguf"],
     "--init-from default: eyas ships a drafter only for --target smollm2, found --target 'model.gguf'; "
     "pass --init-from DIR"),
])
def test_train_options_its_config_refuses_fail_in_one_line_before_anything_loads(tmp_path, flags, message):
    result = invoke("train", "--target", "smollm2", "--data", tmp_path / "none.jsonl", "--out", tmp_path / "run", *flags)
    assert " ".join(message.split()) in " ".join(assert_user_error(result).split())  # the console wraps lines
    assert not (tmp_path / "run").exists()
