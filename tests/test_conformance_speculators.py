"""Conformance with speculators' own code (the library that defines the format vLLM reads), not with
our model of it: speculators 0.9.0 (pinned in scripts/setup.sh) loads each eyas vLLM export with its
config and EAGLE-3 model classes, its logits equal eyas's drafter over several draft steps, and its
converter's output (an eyas SGLang export converted the way its docs say) is reported truthfully.

speculators is installed by `make setup`; under CI (CI=true) a missing or broken speculators fails
these tests instead of skipping them, so a skip can never hide a failure there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

SPECULATORS_VERSION = "0.9.0"


def _speculators():
    try:
        import speculators
        from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
    except Exception as e:  # ImportError, or an import-time error of its own deps
        if os.environ.get("CI"):
            raise AssertionError(f"CI must run the speculators conformance tests: speculators does not import ({e!r}); "
                                 "scripts/setup.sh installs it") from e
        pytest.skip(f"speculators {SPECULATORS_VERSION} is not importable ({e!r}); `make setup` installs it")
    return speculators


@pytest.fixture(scope="module")
def speculators():
    return _speculators()


def test_the_pinned_speculators_is_the_one_tested(speculators):
    from importlib.metadata import version

    assert version("speculators") == SPECULATORS_VERSION


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _target(root: Path, num_blocks: int) -> Path:
    from tests.support.toy import make_toy_target

    return make_toy_target(root / "target", num_blocks=num_blocks)


def _drafter(target: Path, boundaries, seed: int = 0, randomise: bool = True, **flags):
    """A drafter for the local target: non-trivial weights everywhere (norms far from 1) and a
    non-identity draft vocabulary, so that a field or tensor read wrongly changes the logits."""
    from transformers import AutoModelForCausalLM

    from eyas.drafter.build import new_drafter

    drafter, contract = new_drafter(AutoModelForCausalLM.from_pretrained(target), boundaries=boundaries,
                                    draft_vocab_size=64, **flags)
    if randomise:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if name == "embed_tokens.weight":  # the target's, which speculators loads from the verifier
                    continue
                if p.ndim == 1:
                    p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
        ids = torch.randperm(drafter.config.vocab_size, generator=g)[: drafter.config.draft_vocab_size].sort().values
        drafter.set_vocab_map(ids)
        assert drafter.d2t.any()  # not the identity prefix
    return drafter.eval(), contract


def _load_with_speculators(spec: Path):
    """speculators' own loading path: its config class, then its model registry (which must pick
    its EAGLE-3 model), then the verifier's embedding from the local target directory."""
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(spec)
    model = SpeculatorModel.from_pretrained(spec, config=config)
    assert type(model) is Eagle3DraftModel
    # The export has no embed_tokens (the engines use the target's). speculators loads it from the
    # verifier only where its NaN sentinel survived from_pretrained, which on our transformers it
    # does not (the weight comes back uninitialised, not NaN); vLLM shares the target's embedding
    # instead. So load it the way speculators' own loader does, from the verifier the export names.
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# the vLLM export, loaded and run by speculators
# ---------------------------------------------------------------------------------------------

FLAG_SETS = {
    "defaults": {},
    "norm_before_residual+fc_norm+norm_output": dict(norm_before_residual=True, fc_norm=True, norm_output=True),
    "norm_before_fc": dict(norm_before_fc=True),
}


@pytest.mark.parametrize("flags", list(FLAG_SETS.values()), ids=list(FLAG_SETS))
def test_speculators_loads_the_vllm_export_and_its_logits_equal_eyas_over_draft_steps(speculators, tmp_path, flags):
    from safetensors.torch import load_file

    from eyas.drafter.model import ConcatKVCache
    from eyas.drafter.ttt import shift_left, ttt_mask
    from eyas.interop import export_drafter, save_drafter

    target = _target(tmp_path, num_blocks=8)
    drafter, contract = _drafter(target, [2, 4, 6], **flags)
    spec = tmp_path / "spec"
    export_drafter(save_drafter(drafter, contract, tmp_path / "eyas"), "vllm", spec, verifier=str(target))

    # load: its config class reads every field eyas wrote as eyas meant it
    model = _load_with_speculators(spec)
    cfg = model.config
    assert cfg.eagle_aux_hidden_state_layer_ids == [2, 4, 6]
    assert cfg.draft_vocab_size == drafter.config.draft_vocab_size
    assert cfg.target_hidden_size == drafter.config.target_hidden_size
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert getattr(cfg, flag) == getattr(drafter.config, flag), flag
    assert cfg.speculators_config.verifier.name_or_path == str(target.resolve())

    # no missing or unexpected keys: every tensor in the file is one of the model's, loaded as
    # written; every model tensor not in the file is one speculators takes from the verifier
    file = load_file(str(spec / "model.safetensors"))
    state = model.state_dict()
    assert not set(file) - set(state), f"unexpected keys: {sorted(set(file) - set(state))}"
    from_verifier = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}
    assert not set(state) - set(file) - from_verifier, f"missing keys: {sorted(set(state) - set(file) - from_verifier)}"
    for k, t in file.items():
        assert torch.equal(state[k], t), k
    # speculators initialises what it never loaded to NaN
    assert not [k for k, t in state.items() if t.is_floating_point() and t.isnan().any()]
    assert torch.equal(model.embed_tokens.weight, drafter.embed_tokens.weight)
    assert torch.equal(model.d2t, drafter.d2t) and torch.equal(model.t2d, drafter.t2d)

    # run: speculators' own multi-step (TTT) forward against eyas's, on the same target features
    # and tokens. speculators' step 0 reads the tokens already shifted by one (its data pipeline
    # does that); step k then reads them shifted by 1 + k, as eyas's step k does.
    steps, T = 4, 128  # T: speculators' default (flex) attention builds its masks in blocks of 128
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, drafter.config.vocab_size, (1, T), generator=g)
    features = torch.randn(1, T, drafter.config.fc_in_features, generator=g)
    positions = torch.arange(T)[None]
    theirs: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: theirs.append(out.detach()))
    try:
        with torch.no_grad():
            drafts = model(hidden_states=features, input_ids=shift_left(tokens, 1),
                           document_ids=torch.zeros(1, T, dtype=torch.long), position_ids=positions, ttt_steps=steps)
    finally:
        hook.remove()
    assert len(theirs) == steps == len(drafts)

    ours, cache, hidden = [], ConcatKVCache(), features
    with torch.no_grad():
        for k in range(steps):
            out = drafter(shift_left(tokens, 1 + k), hidden, positions + k, cache=cache, mask=ttt_mask(T, k, tokens.device),
                          from_target=k == 0)
            ours.append(out.logits)
            hidden = out.hidden
    for k, (a, b) in enumerate(zip(theirs, ours)):
        assert a.dtype == b.dtype == torch.float32
        assert b.abs().max() > 1.0  # logits with a spread, so the tolerance below is a real test
        diff = (a - b).abs().max().item()
        assert diff <= 1e-5, f"draft step {k}: speculators' logits differ from eyas's by {diff:.3g}"
        assert torch.equal(drafts[k][0], b.argmax(-1)[0]), f"draft step {k}: argmax differs"
        # and the draft tokens map to the same target tokens through each one's d2t
        assert torch.equal(drafts[k][0] + model.d2t[drafts[k][0]], drafter.draft_to_target(b.argmax(-1)[0]))


# ---------------------------------------------------------------------------------------------
# speculators' converter on the SGLang export: eyas reports what came out
# ---------------------------------------------------------------------------------------------


def _convert(sglang_dir: Path, target: Path, out: Path, **kwargs) -> dict:
    """`speculators convert --algorithm eagle3 <dir> --verifier <target>` through its Python entry
    point, with its own validation (it reloads the output) on CPU."""
    from speculators.convert.entrypoints import convert_model

    convert_model(str(sglang_dir), str(target), "eagle3", output_path=str(out), validate_device="cpu", **kwargs)
    return json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def converted(speculators, tmp_path_factory):
    """A drafter trained (as far as its contract says) on [3, 6, 9] of a 12-block target, exported
    for SGLang by eyas, converted by speculators as its docs say (no ids on the command line)."""
    from eyas.interop import export_drafter, save_drafter

    root = tmp_path_factory.mktemp("convert")
    target = _target(root, num_blocks=12)
    drafter, contract = _drafter(target, [3, 6, 9], randomise=False)
    sg = root / "sglang"
    export_drafter(save_drafter(drafter, contract, root / "eyas"), "sglang", sg)
    return target, sg, root / "converted", _convert(sg, target, root / "converted")


def test_speculators_converter_drops_the_ids_and_eyas_says_the_boundaries_are_assumed(converted):
    from typer.testing import CliRunner

    from eyas.cli.main import app

    target, _, conv, config = converted
    # what the pinned converter does (docs/engines.md): the ids are gone, vLLM will capture its
    # default [2, 6, 9] for a drafter trained on [3, 6, 9], and nothing of eyas's is left
    assert config.get("eagle_aux_hidden_state_layer_ids") is None
    assert not [k for k in config if k.startswith("eyas_")] and not (conv / "eyas.json").exists()

    for args in (["info", str(conv)], ["info", str(conv), "--target", str(target)]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        out = " ".join(r.output.split())
        assert "trained boundaries [2, 6, 9] are ASSUMED" in out, r.output
        assert "records no eagle_aux_hidden_state_layer_ids" in out, r.output
    r = CliRunner().invoke(app, ["import", str(conv), "--out", str(conv.parent / "imported"), "--target", str(target)])
    assert r.exit_code == 0, r.output
    assert "ASSUMED" in r.output


def test_a_speculators_converted_directory_with_moved_layers_is_never_called_healthy(converted):
    from eyas.doctor import run_doctor

    target, _, conv, _ = converted
    report = run_doctor(str(target), conv, engine="vllm", samples=2, max_length=32)
    assert not report.healthy and report.exit_code != 0
    assert report.status == "unverified" and report.exit_code == 3, (report.status, report.problems)
    assert "[2, 6, 9] are assumed" in report.unverified
    found = {f.code: f for f in report.stages["static"].findings}
    assert "boundaries_assumed" in found


def test_the_converter_given_the_ids_keeps_them_and_eyas_reads_them(converted, tmp_path):
    """The workaround docs/engines.md names: pass the ids on the converter's command line."""
    from eyas.interop.eyas_format import read_checkpoint

    target, sg, _, _ = converted
    config = _convert(sg, target, tmp_path / "with_ids", eagle_aux_hidden_state_layer_ids=[3, 6, 9])
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 6, 9]
    ckpt = read_checkpoint(tmp_path / "with_ids")
    assert ckpt.boundaries == [3, 6, 9] and not ckpt.meta.boundaries_assumed


@pytest.fixture(scope="module")
def converted_nbr(speculators, tmp_path_factory):
    """A drafter trained (as its contract says) with norm_before_residual true, exported for SGLang
    by eyas and converted by speculators as its docs say (no --norm-before-residual)."""
    from eyas.interop import export_drafter, save_drafter

    root = tmp_path_factory.mktemp("convert_nbr")
    target = _target(root, num_blocks=12)
    drafter, contract = _drafter(target, [2, 6, 9], randomise=False, norm_before_residual=True)
    sg = root / "sglang"
    export_drafter(save_drafter(drafter, contract, root / "eyas"), "sglang", sg)
    assert json.loads((sg / "config.json").read_text())["norm_before_residual"] is True
    return target, sg, root / "converted", _convert(sg, target, root / "converted")


def test_the_converter_rewrites_norm_before_residual_and_eyas_says_so(converted_nbr):
    """speculators' converter writes norm_before_residual from its own option: true in the source,
    false out. info, import (and the imported directory afterwards) and the doctor name the field,
    what the converter wrote and the fix, instead of taking false as the trained value."""
    from typer.testing import CliRunner

    from eyas.cli.main import app
    from eyas.doctor import run_doctor
    from eyas.interop import view_engines

    target, _, conv, config = converted_nbr
    assert config["norm_before_residual"] is False  # what the pinned converter does
    why = view_engines(conv, 12).flags_assumed["norm_before_residual"]
    assert "norm_before_residual: false was written by speculators 0.9.0" in why
    assert 'set "norm_before_residual": true in config.json' in why

    imported = conv.parent / "imported"
    for args in (["info", str(conv)], ["import", str(conv), "--out", str(imported), "--target", str(target)],
                 ["info", str(imported)]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        out = " ".join(r.output.split())
        assert "norm_before_residual is ASSUMED" in out, (args, r.output)
        assert "norm_before_residual: false was written by speculators" in out, (args, r.output)
        assert 'set "norm_before_residual": true' in out, (args, r.output)
    assert "norm_before_residual" in json.loads((imported / "eyas.json").read_text())["flags_assumed"]

    report = run_doctor(str(target), conv, engine="vllm", samples=2, max_length=32)
    found = {f.code: f for f in report.stages["static"].findings}
    flag = found["flag_assumed:norm_before_residual"]
    assert flag.level == "warn" and flag.field == "norm_before_residual" and flag.found is False
    assert "was written by speculators" in flag.message and 'set "norm_before_residual": true' in flag.fix
    assert report.status != "healthy"
    # eyas's own export states the flag and records it: nothing is assumed there
    assert view_engines(conv.parent / "eyas").flags_assumed == {}
