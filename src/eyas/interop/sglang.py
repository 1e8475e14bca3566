"""SGLang / SpecForge / SafeAILab-EAGLE directory layout: ``LlamaForCausalLMEagle3``.

``config.json`` is a Llama config plus ``draft_vocab_size``, ``target_hidden_size``, the norm flags
and a nested ``eagle_config``; tensors are named as the modules of SGLang's ``llama_eagle3.py``
(``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, optionally
``embed_tokens.weight``), which are exactly eyas' own state_dict names.

This module is the layout only (architecture, tensor names, Llama fields). What SGLang makes of the
layer ids and flags, and the config writer, are SGLang's rules: :mod:`eyas.interop.servers.sglang`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eyas.interop.common import drafter_fields

if TYPE_CHECKING:
    from torch import Tensor

ARCHITECTURE = "LlamaForCausalLMEagle3"


def is_sglang_config(config: dict[str, Any]) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


def config_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """DrafterConfig fields except num_slots (which the fc weight decides) and the norm flags (which
    the serving engine's defaults complete); draft_vocab_size may be None (then the lm_head decides)."""
    fields = drafter_fields(config, where)
    fields["draft_vocab_size"] = config.get("draft_vocab_size")
    fields["target_hidden_size"] = config.get("target_hidden_size") or fields["hidden_size"]
    return fields


# The file's tensor names are eyas' own state_dict names.
def to_file_name(name: str) -> str:
    return name


def tensors_from_file(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return dict(tensors)


def tensors_to_file(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return dict(tensors)

