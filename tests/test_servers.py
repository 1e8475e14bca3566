"""The serving-engine registry (eyas.interop.servers): an engine is one spec, read through one
function, and the CLI offers exactly the registry's names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import pytest

from eyas.convention.boundaries import validate_boundaries
from eyas.interop import read_as, view_engines
from eyas.interop.common import CONFIG_JSON
from eyas.interop.servers import SERVERS, Edit, EngineReading, KeyRead, ServerSpec, get, names, register, unregister

pytestmark = pytest.mark.unit

L = 32


def sglang_dir(d: Path, **extra: Any) -> Path:
    """A third-party SGLang-layout config.json (no weights: reading as an engine needs none)."""
    d.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_hidden_layers": 1, "vocab_size": 128, "draft_vocab_size": 40, "target_hidden_size": 48,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}, **extra,
    }
    (d / CONFIG_JSON).write_text(json.dumps(config))
    return d


class ToyServer(ServerSpec):
    """An engine that reads ``toy_layer_ids`` as block outputs (boundary = id + 1), with two versions."""

    name = "toy"
    title = "Toy"
    layout = None
    rules = ("new", "old")
    id_key = "toy_layer_ids"
    captures_last_boundary = False
    fc_slots = 3

    def read_ids(self, config: dict[str, Any]) -> list[int] | None:
        ids = config.get(self.id_key)
        return [int(i) for i in ids] if ids else None

    def read(self, meta, num_blocks, rule, files_config=None, problems: Sequence[str] = ()) -> EngineReading:
        version = self.rule(rule)
        r = EngineReading(self.name, version, self.label(version), fc_slots=self.fc_slots)
        ids = self.read_ids(meta.config)
        shift = 1 if version == "new" else 2
        r.boundaries = validate_boundaries([i + shift for i in ids], num_blocks) if ids else None
        r.keys.append(KeyRead(self.id_key, ids is not None, ids, r.boundaries, f"+{shift} to every id"))
        r.keys += self.ids_not_read(meta.config)
        self.read_common_keys(r, meta.config, meta.config, self.flag_defaults(meta.layout))
        self.check_capturable(r, num_blocks)
        return r

    def id_edits(self, meta, boundaries, num_blocks, rule):
        return [Edit(CONFIG_JSON, self.id_key, [b - 1 for b in boundaries])], None


@pytest.fixture
def toy_engine():
    spec = register(ToyServer())
    yield spec
    unregister(spec.name)


@pytest.mark.filterwarnings("ignore:.*disagree")  # the directory's SGLang and vLLM ids differ on purpose
def test_a_registered_engine_is_read_through_read_as_and_shown_in_the_view(tmp_path, toy_engine):
    d = sglang_dir(tmp_path / "d", toy_layer_ids=[2, 9, 28], eagle_aux_hidden_state_layer_ids=[3, 10, 29])
    assert "toy" in names() and get("toy") is toy_engine

    r = read_as("toy", d, L)
    assert r.label == "Toy (new rule)" and r.loadable and r.boundaries == [3, 10, 29]
    assert r.flags == dict.fromkeys(r.flags, False) and r.target_hidden_size == 48 and r.fc_slots == 3
    ignored = {k.key: k.note for k in r.keys if k.used is None}
    assert ignored == {"eagle_config.eagle_aux_hidden_state_layer_ids": "not read by Toy",
                       "eagle_aux_hidden_state_layer_ids": "not read by Toy"}
    assert read_as("toy", d, L, rule="old").boundaries == [4, 11, 30]
    with pytest.raises(ValueError, match=r"--toy-rule: expected one of \['new', 'old'\], found 'v9'"):
        read_as("toy", d, L, rule="v9")
    # the engine's rules for the block inputs it captures apply as to every engine
    last = sglang_dir(tmp_path / "last", toy_layer_ids=[1, 15, 31])
    assert not read_as("toy", last, L).loadable and "boundary 32" in read_as("toy", last, L).why_not
    # its edits, in its own convention
    assert get("toy").boundary_edits(None, [3, 10, 29], L, "new") == ([Edit(CONFIG_JSON, "toy_layer_ids", [2, 9, 28])], None)

    # every engine's view has it, one key per rule; the built-in engines are unchanged
    view = view_engines(d, num_target_blocks=L)
    assert view.engines == {"eyas": [2, 16, 29], "sglang": [2, 16, 29], "sglang_legacy": [2, 16, 29],
                            "vllm": [3, 10, 29], "toy": [3, 10, 29], "toy_old": [4, 11, 30]}
    assert view.ids["toy_layer_ids"] == [2, 9, 28]
    assert view.to_dict()["differs"] == ["vllm", "toy", "toy_old"]


def test_unknown_engine_is_named():
    with pytest.raises(ValueError, match=r"--engine: expected one of \['eyas', 'sglang', 'vllm'\], found 'trt'"):
        get("trt")


def test_the_cli_offers_the_registry_names():
    from eyas.cli.common import EngineChoice, ExportChoice, SGLangRuleChoice

    # doctor / trace --engine, export --to and --sglang-rule: the registry's names, in its order
    assert [c.value for c in EngineChoice] == names() == ["eyas", "sglang", "vllm"]
    assert [c.value for c in ExportChoice] == [s.name for s in SERVERS.values() if s.export_names] == ["sglang", "vllm"]
    assert [c.value for c in SGLangRuleChoice] == list(SERVERS["sglang"].rules) == ["pr25454", "legacy"]


def test_the_cli_and_the_registry_import_without_torch():
    """The engine registry is read for the CLI's choices: `eyas --help` must not wait for torch."""
    code = "import sys, eyas.cli.main; assert 'torch' not in sys.modules, 'torch imported'"
    src = Path(__file__).resolve().parents[1] / "src"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(src), "PATH": ""})
    assert res.returncode == 0, res.stderr
