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


def verifier_num_blocks(config: dict[str, Any]) -> int | None:
    """The verifier's block count when ``verifier.name_or_path`` is a local directory (never a download)."""
    name = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not name:
        return None
    path = Path(name) / "config.json"
    try:
        vcfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vcfg = vcfg.get("text_config", vcfg) if isinstance(vcfg, dict) else {}
    n = vcfg.get("num_hidden_layers")
    return int(n) if isinstance(n, int) else None


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
