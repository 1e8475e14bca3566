"""Export an eyas drafter to an engine's format, and import one from another trainer's format.

Both go through :func:`~eyas.interop.eyas_format.read_checkpoint` (every check) and copy the stored
tensors unchanged (names mapped, dtype and bits kept).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from eyas.convention.boundaries import SGLangRule, sglang_ids_to_boundaries, sglang_rules_agree
from eyas.targets.structure import find_decoder_blocks
from eyas.contract.contract import enforce
from eyas.interop import sglang
from eyas.interop.common import CheckpointError
from eyas.interop.engines import engine_view
from eyas.interop.eyas_format import against_target, new_contract, read_checkpoint, write_checkpoint

EXPORT_TARGETS = {"sglang": "sglang", "vllm": "speculators", "speculators": "speculators"}


def export_drafter(
    src_dir: str | Path,
    to: str,
    out_dir: str | Path,
    sglang_rule: SGLangRule | str = SGLangRule.PR25454,
    speculative_tokens: int = 3,
) -> dict[str, Any]:
    """Write the drafter at ``src_dir`` for ``to`` ("sglang", or "vllm" = speculators format).

    Returns a report: {"format", "path", "boundaries", "num_target_blocks", "ids_written",
    "sglang_rule", "sglang_rules_agree", "notes", "view"} where ``view`` is :func:`engine_view` of
    the written directory (what each engine will capture).
    """
    layout = EXPORT_TARGETS.get(str(to).lower())
    if layout is None:
        raise CheckpointError(f"to: expected one of {sorted(EXPORT_TARGETS)}, found {to!r}")
    ckpt = read_checkpoint(src_dir)
    bs, L = ckpt.boundaries, ckpt.num_target_blocks
    written = write_checkpoint(
        out_dir, ckpt.config, ckpt.tensors, bs, L, ckpt.contract, layout, sglang_rule, speculative_tokens
    )
    notes: list[str] = []
    agree = None
    if layout == "sglang":
        ids = written["ids_written"][sglang.NESTED_IDS]
        agree = sglang_rules_agree(bs, L if L is not None else max(bs))
        if not agree:
            other = SGLangRule.LEGACY if written["sglang_rule"] == SGLangRule.PR25454.value else SGLangRule.PR25454
            notes.append(
                f"SGLang's two id rules disagree for boundaries {bs} (they agree only when the first "
                f"boundary is 2): ids {ids} are written for the {written['sglang_rule']} rule; an SGLang "
                f"following the {other.value} rule would capture "
                f"{sglang_ids_to_boundaries(ids, L if L is not None else max(bs), other)}"
            )
    if ckpt.config.num_slots != 3:
        # Both engines' llama_eagle3.py size fc as 3 * target_hidden_size.
        notes.append(
            f"the drafter has {ckpt.config.num_slots} slots; SGLang's and vLLM's llama_eagle3 build fc for 3"
        )
    if L is not None and L in bs:
        # Both engines capture at the INPUT of a layer (boundaries 0..L-1): boundary L never arrives.
        notes.append(
            f"boundary {L} (the last block's output) is a slot, but SGLang and vLLM only capture block "
            f"inputs (boundaries 0..{L - 1}): served by them, this drafter gets {len(bs) - 1} slots and fails"
        )
    if L is None:
        notes.append("the target's number of blocks is unknown: default ids cannot be resolved")
    return {
        "format": layout,
        "path": str(written["path"]),
        "boundaries": bs,
        "num_target_blocks": L,
        "ids_written": written["ids_written"],
        "sglang_rule": written["sglang_rule"],
        "sglang_rules_agree": agree,
        "notes": notes,
        "view": engine_view(written["path"]),
    }


def import_drafter(
    src_dir: str | Path,
    out_dir: str | Path,
    num_target_blocks: int | None = None,
    target: nn.Module | None = None,
    force: bool = False,
) -> Path:
    """Convert an SGLang/SpecForge/EAGLE-3 or speculators directory to an eyas directory.

    Layer ids are read in the source format's convention (SpecForge: boundary = id + 1; speculators:
    ids are boundaries); absent ids mean the default ``[2, L//2, L-3]``, which needs
    ``num_target_blocks`` or ``target``. With ``target`` the drafter is checked against it (see
    :func:`~eyas.interop.load_drafter`) and the contract records it.
    """
    blocks = len(find_decoder_blocks(target)) if target is not None else None
    if num_target_blocks is not None and blocks is not None and num_target_blocks != blocks:
        raise CheckpointError(
            f"num_target_blocks: expected {blocks} (the target's decoder blocks), found {num_target_blocks} (passed in)"
        )
    ckpt = read_checkpoint(src_dir, num_target_blocks, default_num_blocks=blocks)
    contract = ckpt.contract
    if target is not None:
        forced = enforce(against_target(ckpt, target), f"importing {ckpt.meta.path} for target {type(target).__name__}", force)
        if contract is None and not forced:  # never record a target the drafter does not fit
            contract = new_contract(ckpt, target)
    L = ckpt.num_target_blocks
    write_checkpoint(out_dir, ckpt.config, ckpt.tensors, ckpt.boundaries, L, contract, layout="eyas")
    return Path(out_dir)
