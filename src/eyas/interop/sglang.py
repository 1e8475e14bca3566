"""SGLang / SpecForge / SafeAILab-EAGLE format: ``LlamaForCausalLMEagle3``.

``config.json`` is a Llama config plus ``draft_vocab_size``, ``target_hidden_size`` and a nested
``eagle_config``; tensors are named as the modules of SGLang's ``llama_eagle3.py`` (``fc.weight``,
``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, optionally
``embed_tokens.weight``), which are exactly eyas' own state_dict names.

Layer ids, read by SGLang from ``eagle_config.eagle_aux_hidden_state_layer_ids`` only:
- SpecForge writes the output-of-block convention: id k = boundary k+1, so a third-party directory
  is imported with boundary = id + 1 (``[1, 29, 57]`` of a 61-block target = ``[2, 30, 58]``);
- absent ids mean SGLang's default ``[2, L//2, L-3]`` boundaries, which needs L;
- what a given SGLang captures from the ids depends on its version (``SGLangRule``): see
  :mod:`eyas.convention.boundaries`.
eyas also writes the boundaries under ``eyas_boundaries`` (unambiguous) and top-level
``eagle_aux_hidden_state_layer_ids`` (read as boundaries by vLLM and by the SafeAILab reference).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
from torch import Tensor

from eyas.convention.boundaries import (
    BoundaryError,
    SGLangRule,
    boundaries_to_sglang_ids,
    sglang_ids_to_boundaries,
    validate_boundaries,
)
from eyas.drafter.config import DrafterConfig
from eyas.interop.common import (
    NORM_FLAGS, CheckpointError, default_boundaries_or_none, drafter_fields, llama_fields,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"
NESTED_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"


def is_sglang_config(config: dict[str, Any]) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


def ids_for(boundaries: Sequence[int], num_blocks: int, rule: SGLangRule | str) -> tuple[list[int], SGLangRule]:
    """The nested ids for ``rule``, and the rule they were written for.

    A first boundary of 1 cannot be written for SGLang after PR #25454; rather than refuse to save a
    trained drafter, the ids are then written for the legacy rule (and engine_view shows which
    SGLang captures what).
    """
    rule = SGLangRule(rule)
    try:
        return boundaries_to_sglang_ids(boundaries, num_blocks, rule), rule
    except BoundaryError as e:
        if rule is not SGLangRule.PR25454:
            raise
        warnings.warn(f"{e}; writing the ids for the legacy rule instead", stacklevel=3)
        return boundaries_to_sglang_ids(boundaries, num_blocks, SGLangRule.LEGACY), SGLangRule.LEGACY


def build_config(
    cfg: DrafterConfig,
    boundaries: Sequence[int],
    num_blocks: int,
    rule: SGLangRule | str = SGLangRule.PR25454,
    dtype: torch.dtype | None = None,
) -> tuple[dict[str, Any], list[int], SGLangRule]:
    """``config.json`` for SGLang; returns (config, the nested ids written, the rule they follow)."""
    bs = validate_boundaries(boundaries, num_blocks, cfg.num_slots)
    ids, rule = ids_for(bs, num_blocks, rule)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        **llama_fields(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # Written explicitly: loaders disagree on what an absent flag means.
        **{flag: getattr(cfg, flag) for flag in NORM_FLAGS},
        # vLLM (and the SafeAILab reference) read top-level ids as boundaries.
        "eagle_aux_hidden_state_layer_ids": bs,
        # SGLang reads only these, in its own convention (see module docstring).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        # The unambiguous record: boundaries in the eyas convention, and what the ids were written for.
        "eyas_boundaries": bs,
        "eyas_num_target_blocks": num_blocks,
        "eyas_sglang_rule": rule.value,
    }
    return config, ids, rule


def nested_ids(config: dict[str, Any]) -> list[int] | None:
    eagle = config.get("eagle_config")
    if isinstance(eagle, dict) and eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
        return [int(i) for i in eagle["eagle_aux_hidden_state_layer_ids"]]
    return None


def boundaries_from_config(
    config: dict[str, Any], num_blocks: int | None, where: str
) -> tuple[list[int] | None, str]:
    """The boundaries a third-party SGLang-format drafter was trained on, by the format's own
    convention; ``(None, why)`` when that needs ``num_blocks`` and it is unknown."""
    ids = nested_ids(config)
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        # SpecForge semantics: output of block k = boundary k+1, always (the legacy SGLang rule).
        # With explicit ids the converter does not use the block count.
        try:
            bs = sglang_ids_to_boundaries(ids, num_blocks or 0, SGLangRule.LEGACY)
        except BoundaryError as e:
            raise CheckpointError(f"{where}: {NESTED_IDS}: {e}") from None
        if top and [int(i) for i in top] != bs:
            warnings.warn(
                f"{where}: {NESTED_IDS} {ids} (SpecForge convention: boundaries {bs}) and top-level "
                f"eagle_aux_hidden_state_layer_ids {list(top)} (boundaries) disagree; using {bs}, "
                f"which SGLang reads",
                stacklevel=3,
            )
        return bs, f"{NESTED_IDS} {ids} (SpecForge convention: boundary = id + 1)"
    if top:
        return [int(i) for i in top], "top-level eagle_aux_hidden_state_layer_ids (boundaries)"
    return default_boundaries_or_none(num_blocks, where, "layer ids")


def config_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """DrafterConfig fields except num_slots (which the fc weight decides); draft_vocab_size may be
    None (then the lm_head decides)."""
    fields = drafter_fields(config, where)
    fields["draft_vocab_size"] = config.get("draft_vocab_size")
    fields["target_hidden_size"] = config.get("target_hidden_size") or fields["hidden_size"]
    # SGLang's and SafeAILab's loaders treat every absent flag as false.
    for flag in NORM_FLAGS:
        fields[flag] = bool(config.get(flag, False))
    return fields


# The file's tensor names are eyas' own state_dict names.
def to_file_name(name: str) -> str:
    return name


def from_file_name(name: str) -> str:
    return name


def tensors_from_file(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return dict(tensors)


def tensors_to_file(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return dict(tensors)


def check_config(config: dict[str, Any], where: str) -> None:
    if not is_sglang_config(config):
        raise CheckpointError(
            f"{where}: architectures: expected [{ARCHITECTURE!r}], found {config.get('architectures')!r}"
        )
