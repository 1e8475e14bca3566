"""speculators / vLLM format: ``Eagle3Speculator``.

Facts this module relies on (read from the sources, not guessed):
- vllm-project/speculators ``src/speculators/models/eagle3/config.py``: ``Eagle3SpeculatorConfig``
  has ``speculators_model_type: "eagle3"``, ``architectures: ["Eagle3Speculator"]``,
  ``transformer_layer_config`` (an HF config dict of the decoder layer), ``draft_vocab_size``,
  ``target_hidden_size``, the top-level layer ids (read as :mod:`eyas.interop.servers.vllm` says) and
  the flags ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output`` (all default
  false there), and rejects
  ``norm_before_fc`` together with ``fc_norm``.
- ``src/speculators/config.py``: ``speculators_config`` = {algorithm, proposal_methods,
  default_proposal_method, verifier: {name_or_path, architectures}}; ``src/speculators/proposals/greedy.py``:
  a greedy method is {proposal_type: "greedy", speculative_tokens, verifier_accept_k, accept_tolerance}.
- ``src/speculators/models/eagle3/core.py``: the decoder layer is ``layers.0`` (where SGLang has
  ``midlayer``); the other tensors are ``fc``, ``norm``, ``lm_head``, ``embed_tokens`` (optional),
  ``d2t``, ``t2d``, ``input_norm``, ``fc_norm.{i}``; ``verifier_norm`` / ``verifier_lm_head`` are
  not saved. ``src/speculators/convert/eagle/eagle3_converter.py`` maps ``midlayer.`` -> ``layers.0.``.
- vllm-project/vllm ``base.py``: ``speculators_config.proposal_methods[0].speculative_tokens`` and
  ``verifier.name_or_path`` must be present.

This module is the layout only. What vLLM makes of the ids and of absent flags, and the config
writer, are vLLM's rules: :mod:`eyas.interop.servers.vllm`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas.interop.common import CheckpointError, drafter_fields

if TYPE_CHECKING:
    from torch import Tensor

ARCHITECTURE = "Eagle3Speculator"
MODEL_TYPE = "eagle3"
FILE_LAYER, EYAS_LAYER = "layers.0.", "midlayer."
# Copies of the target's final norm and lm_head that some speculators versions saved; the drafter
# does not use them.
IGNORED_TENSORS = ("verifier_norm.weight", "verifier_lm_head.weight")


def is_speculators_config(config: dict[str, Any]) -> bool:
    return "speculators_model_type" in config or ARCHITECTURE in (config.get("architectures") or [])


def check_config(config: dict[str, Any], where: str) -> None:
    kind = config.get("speculators_model_type")
    if kind != MODEL_TYPE:
        raise CheckpointError(f"{where}: speculators_model_type: expected {MODEL_TYPE!r}, found {kind!r}")
    if not isinstance(config.get("transformer_layer_config"), dict):
        raise CheckpointError(
            f"{where}: transformer_layer_config: expected an object with the decoder layer's config, "
            f"found {config.get('transformer_layer_config')!r}"
        )


# A Hugging Face hub id: "org/name" (what transformers, speculators and vLLM resolve by download).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
VERIFIER_HINT = ("pass --verifier with the target's hub id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct for the "
                 "embedded smollm2) or a local model directory with a config.json")


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.endswith(".gguf") and not Path(name).exists()


def check_verifier(name: str) -> str:
    """``--verifier`` as given: a hub id, or a local model directory (returned absolute)."""
    p = Path(name).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return str(p.resolve())
    if is_hub_id(name):
        return name
    raise CheckpointError(
        f"verifier: expected a Hugging Face hub id like 'org/name' or a local model directory with a "
        f"config.json (what speculators and vLLM resolve as speculators_config.verifier.name_or_path), "
        f"found {name!r}"
    )


def verifier_reference(source: str | None) -> tuple[str | None, str | None]:
    """``speculators_config.verifier.name_or_path`` for a target recorded as loaded from ``source``
    (the contract's ``target.source``): ``(reference, None)``, or ``(None, why)`` when ``source`` is
    nothing speculators or vLLM can resolve as a model (a display label, a GGUF file, a directory
    without config.json). A local directory is written absolute; one that is not on this machine
    is kept, with a note, since the engine resolves it where it runs."""
    if not source:
        return None, "the drafter's contract does not say where its target was loaded from"
    p = Path(source).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return str(p.resolve()), None
        return None, f"the target was loaded from {source!r}, a directory without config.json"
    if source.endswith(".gguf") or p.is_file():
        return None, f"the target was loaded from {source!r}, a file that speculators and vLLM cannot resolve as a model"
    if is_hub_id(source):
        return source, None
    if source.startswith(("/", "./", "../", "~")):
        return source, (f"the target's directory {source!r} is not on this machine; written as recorded, "
                        "for the machine the engine runs on")
    return None, f"the target is recorded as {source!r}, a label, not a hub id or a model directory"


def _local_config(name: Any) -> dict[str, Any] | None:
    """The config.json of a local model directory ``name`` (never a download), else None."""
    if not isinstance(name, str) or not name:
        return None
    try:
        vcfg = json.loads((Path(name).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return vcfg if isinstance(vcfg, dict) else None


def local_architectures(name: str | None) -> list[str]:
    """The ``architectures`` of a local verifier directory (empty when it is not one)."""
    archs = (_local_config(name) or {}).get("architectures")
    return [str(a) for a in archs] if isinstance(archs, list) else []


def verifier_num_blocks(config: dict[str, Any]) -> int | None:
    """The verifier's block count when ``verifier.name_or_path`` is a local directory (never a download)."""
    name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    vcfg = _local_config(name)
    if vcfg is None:
        return None
    vcfg = vcfg.get("text_config", vcfg)
    n = vcfg.get("num_hidden_layers") if isinstance(vcfg, dict) else None
    return int(n) if isinstance(n, int) else None


CONVERTER_FLAG = "norm_before_residual"  # the flag `speculators convert` writes from its own option


def converter_flags(config: dict[str, Any], where: str) -> dict[str, str]:
    """Norm flags of a config.json that speculators wrote (``speculators_version``) without eyas's
    record, which are what its converter chose rather than what the drafter was trained with:
    flag -> why. The pinned converter (``speculators convert --algorithm eagle3``, 0.9.0) writes
    ``norm_before_residual`` from its own ``--norm-before-residual`` option (default false) and
    never reads the source checkpoint's value, so a drafter trained with it true comes out false;
    the other flags it carries over (or they are proved by the weights)."""
    version = config.get("speculators_version")
    if not version or any(str(k).startswith("eyas_") for k in config):
        return {}
    value = bool(config.get(CONVERTER_FLAG, False))
    return {CONVERTER_FLAG: (
        f"{where}: {CONVERTER_FLAG}: {str(value).lower()} was written by speculators {version} "
        f"(speculators_version), whose converter sets it from its own --norm-before-residual option (default "
        f"false) and never reads the source checkpoint's value; if the drafter was trained with {CONVERTER_FLAG} "
        f"{str(not value).lower()} (its source config.json says), vLLM builds it wrong: set \"{CONVERTER_FLAG}\": "
        f"{str(not value).lower()} in config.json, or convert again with the option that writes it")}


def config_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """DrafterConfig fields except num_slots (which the fc weight decides) and the norm flags (which
    the serving engine's defaults complete); draft_vocab_size may be None (then the lm_head decides)."""
    fields = drafter_fields(config["transformer_layer_config"], f"{where}: transformer_layer_config")
    fields["draft_vocab_size"] = config.get("draft_vocab_size")
    fields["target_hidden_size"] = config.get("target_hidden_size") or fields["hidden_size"]
    return fields


def to_file_name(name: str) -> str:
    return FILE_LAYER + name[len(EYAS_LAYER):] if name.startswith(EYAS_LAYER) else name


def from_file_name(name: str) -> str:
    return EYAS_LAYER + name[len(FILE_LAYER):] if name.startswith(FILE_LAYER) else name


def tensors_from_file(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {from_file_name(n): t for n, t in tensors.items() if n not in IGNORED_TENSORS}


def tensors_to_file(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {to_file_name(n): t for n, t in tensors.items()}
