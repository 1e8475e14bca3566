"""The layer convention: which residual-stream boundaries feed the drafter.

A target with L decoder blocks has L+1 residual-stream *boundaries*, numbered 0..L:

    boundary 0      = input of block 0 (token embeddings, after any embedding scaling)
    boundary b      = output of block b-1 (``hidden_states + residual``), 1 <= b <= L
    boundary L      = output of the last block, BEFORE the final norm

Every other numbering in the ecosystem is converted to boundaries at the edge of eyas, here, and
nowhere else. Code passes a :class:`CaptureSpec` (never a bare list of "layer ids") across modules.

| convention                           | id k means                         | EAGLE default      |
| ------------------------------------ | ---------------------------------- | ------------------ |
| eyas, SafeAILab/EAGLE, vLLM, specul. | boundary k                         | [2, L//2, L-3]     |
| SGLang explicit ids, SpecForge       | output of block k = boundary k+1   | [1, L//2-1, L-4]   |
| SGLang since PR #25454               | +1 only when the first id is 1     |                    |
| HF ``output_hidden_states`` index i  | boundary i for i < L (i = L is post-norm) |             |
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Sequence
from eyas.errors import EyasError


class BoundaryError(EyasError, ValueError):
    """Boundaries that cannot be captured from, or written for, a target."""


class SGLangRule(str, Enum):
    """How an SGLang version turns ``eagle_config.eagle_aux_hidden_state_layer_ids`` into captures.

    SGLang captures the *input* of layer ``id + 1``, i.e. boundary ``id + 1``.
    """

    LEGACY = "legacy"  # every SGLang before PR #25454: always +1
    PR25454 = "pr25454"  # +1 only when the first id is 1 (SpecForge-style [1, ...] lists)


def default_boundaries(num_blocks: int) -> list[int]:
    """EAGLE-3's default low/middle/high boundaries: ``[2, L//2, L-3]``."""
    if num_blocks < 7:  # below 7 blocks the three values collide (L=6 gives [2, 3, 3])
        raise BoundaryError(
            f"the EAGLE-3 default boundaries [2, L//2, L-3] need at least 7 decoder blocks; "
            f"this target has {num_blocks}: pass boundaries explicitly"
        )
    return [2, num_blocks // 2, num_blocks - 3]


def validate_boundaries(
    boundaries: Sequence[int], num_blocks: int, num_slots: int | None = None
) -> list[int]:
    """Check boundaries against a target with ``num_blocks`` blocks; return them as a list of ints.

    Order is kept: slot order is part of what the drafter was trained on.
    """
    bs = [int(b) for b in boundaries]
    if not bs:
        raise BoundaryError("boundaries: expected at least one boundary, found an empty list")
    out_of_range = [b for b in bs if not 0 <= b <= num_blocks]
    if out_of_range:
        raise BoundaryError(
            f"boundaries: expected values in 0..{num_blocks} for a target with {num_blocks} "
            f"decoder blocks (boundary {num_blocks} = last block output, before the final norm); "
            f"found {out_of_range} in {bs}"
        )
    dupes = sorted({b for b in bs if bs.count(b) > 1})
    if dupes:
        raise BoundaryError(f"boundaries: expected distinct values, found {dupes} repeated in {bs}")
    if num_slots is not None and len(bs) != num_slots:
        raise BoundaryError(
            f"boundaries: the drafter's fc takes {num_slots} slots, expected {num_slots} "
            f"boundaries, found {len(bs)} ({bs})"
        )
    return bs


def parse_boundaries(text: str) -> list[int]:
    """``"2,15,27"`` -> ``[2, 15, 27]`` with a clear error for anything else."""
    try:
        bs = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        bs = []
    if not bs:
        raise BoundaryError(
            f"boundaries: expected comma-separated integers like '2,15,27', found {text!r}"
        )
    return bs


@dataclass(frozen=True)
class CaptureSpec:
    """Which boundaries of which target feed the drafter, in slot order.

    ``boundaries`` are always in the eyas convention (module docstring). Values are the pre-norm
    residual stream.
    """

    boundaries: tuple[int, ...]
    num_blocks: int

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "boundaries", tuple(validate_boundaries(self.boundaries, self.num_blocks))
        )

    @classmethod
    def default(cls, num_blocks: int) -> "CaptureSpec":
        return cls(tuple(default_boundaries(num_blocks)), num_blocks)

    @classmethod
    def create(cls, num_blocks: int, boundaries: Iterable[int] | None = None) -> "CaptureSpec":
        if boundaries is None:
            return cls.default(num_blocks)
        return cls(tuple(boundaries), num_blocks)

    @property
    def num_slots(self) -> int:
        return len(self.boundaries)

    def check_slots(self, num_slots: int) -> None:
        validate_boundaries(self.boundaries, self.num_blocks, num_slots)

    def to_sglang(self, rule: SGLangRule = SGLangRule.PR25454) -> list[int]:
        return boundaries_to_sglang_ids(self.boundaries, self.num_blocks, rule)

    def to_vllm(self) -> list[int]:
        return boundaries_to_vllm_ids(self.boundaries, self.num_blocks)

    def to_hf_indices(self) -> list[int]:
        return boundaries_to_hf_indices(self.boundaries, self.num_blocks)


# ---------------------------------------------------------------------------------------------
# SGLang / SpecForge: explicit ids mean "output of block k" (= boundary k+1), -1 = embeddings.
# ---------------------------------------------------------------------------------------------


def sglang_ids_to_boundaries(
    ids: Sequence[int] | None, num_blocks: int | None, rule: SGLangRule | str = SGLangRule.PR25454
) -> list[int]:
    """What SGLang captures when it reads ``ids`` from ``eagle_config.eagle_aux_hidden_state_layer_ids``.

    ``ids=None`` (key absent) makes SGLang fall back to its default ``[2, L//2, L-3]`` boundaries.
    The result is validated against the target; with ``num_blocks`` unknown (None or 0, e.g. a
    checkpoint read on its own) only the checks that need no target apply (>= 0, distinct).
    """
    rule = SGLangRule(rule)
    if ids is None:
        return default_boundaries(num_blocks)
    ids = [int(i) for i in ids]
    if not ids:
        raise BoundaryError("eagle_aux_hidden_state_layer_ids: expected a non-empty list, found []")
    shift = 1 if (rule is SGLangRule.LEGACY or ids[0] == 1) else 0
    bs = [i + shift for i in ids]
    try:
        if num_blocks:
            return validate_boundaries(bs, num_blocks)
        negative = [b for b in bs if b < 0]
        if negative:
            raise BoundaryError(f"boundaries: expected values >= 0, found {negative} in {bs}")
        return validate_boundaries(bs, max(bs))  # no upper bound known: checks distinctness only
    except BoundaryError as e:
        raise BoundaryError(
            f"eagle_aux_hidden_state_layer_ids {ids} read by SGLang ({rule.value} rule) "
            f"-> {e}"
        ) from None


def boundaries_to_sglang_ids(
    boundaries: Sequence[int], num_blocks: int, rule: SGLangRule | str = SGLangRule.PR25454
) -> list[int]:
    """The ids to write into ``eagle_config.eagle_aux_hidden_state_layer_ids`` so that an SGLang
    following ``rule`` captures exactly ``boundaries``.

    Under the legacy rule every id is ``b - 1``. Under PR #25454, ids are used as written unless the
    first is 1: we write ``b - 1`` when ``b[0] == 2`` (so the list starts with 1 and is the
    SpecForge list, which both rules read the same way) and ``b`` otherwise. A first boundary of 1
    cannot be expressed under PR #25454 (writing 1 means boundary 2, writing 0 means boundary 0).
    """
    rule = SGLangRule(rule)
    bs = validate_boundaries(boundaries, num_blocks)
    if rule is SGLangRule.LEGACY or bs[0] == 2:
        ids = [b - 1 for b in bs]
    elif bs[0] == 1:
        raise BoundaryError(
            f"boundaries {bs}: SGLang after PR #25454 cannot capture boundary 1 as the first slot "
            f"(a first id of 1 is read as boundary 2, a first id of 0 as boundary 0); "
            f"reorder the slots or target the legacy rule"
        )
    else:
        ids = list(bs)
    # Round-trip check: the conversion is only correct if SGLang reads it back as bs.
    assert sglang_ids_to_boundaries(ids, num_blocks, rule) == bs, (bs, ids, rule)
    return ids


def sglang_rules_agree(boundaries: Sequence[int], num_blocks: int) -> bool:
    """True when one id list makes both SGLang rules capture ``boundaries`` (first boundary is 2)."""
    return validate_boundaries(boundaries, num_blocks)[0] == 2


# ---------------------------------------------------------------------------------------------
# vLLM / speculators / SafeAILab-EAGLE: ids are boundaries (the input of layer k).
# ---------------------------------------------------------------------------------------------


def vllm_ids_to_boundaries(ids: Sequence[int] | None, num_blocks: int) -> list[int]:
    """What vLLM captures for top-level ``eagle_aux_hidden_state_layer_ids`` (absent -> default)."""
    if not ids:
        return default_boundaries(num_blocks)
    return validate_boundaries(ids, num_blocks)


def boundaries_to_vllm_ids(boundaries: Sequence[int], num_blocks: int) -> list[int]:
    return validate_boundaries(boundaries, num_blocks)


# ---------------------------------------------------------------------------------------------
# Hugging Face ``output_hidden_states``: index i is boundary i for i < L; index L is post-norm.
# ---------------------------------------------------------------------------------------------


def boundaries_to_hf_indices(boundaries: Sequence[int], num_blocks: int) -> list[int]:
    bs = validate_boundaries(boundaries, num_blocks)
    if num_blocks in bs:
        raise BoundaryError(
            f"boundary {num_blocks} (last block output, before the final norm) has no "
            f"output_hidden_states index: HF's entry {num_blocks} is taken AFTER the final norm; "
            f"capture it with eyas.capture hooks instead"
        )
    return bs


def hf_indices_to_boundaries(indices: Sequence[int], num_blocks: int) -> list[int]:
    idx = [int(i) if i >= 0 else int(i) + num_blocks + 1 for i in indices]
    if num_blocks in idx:
        raise BoundaryError(
            f"output_hidden_states[{num_blocks}] is post-norm and is not a residual-stream "
            f"boundary; use boundary {num_blocks} (pre-norm) if the last block's output was meant"
        )
    return validate_boundaries(idx, num_blocks)
