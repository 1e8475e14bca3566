"""The layer convention: which residual-stream boundaries feed the drafter.

A target with L decoder blocks has L+1 residual-stream *boundaries*, numbered 0..L:

    boundary 0      = input of block 0 (token embeddings, after any embedding scaling)
    boundary b      = output of block b-1 (``hidden_states + residual``), 1 <= b <= L
    boundary L      = output of the last block, BEFORE the final norm

Engines number layers their own way; each serving engine's ids <-> boundaries rules live in its
module of :mod:`eyas.interop.servers` (SGLang's ``+1`` rules in ``servers/sglang.py``, vLLM's "ids
are boundaries" in ``servers/vllm.py``). This module holds the convention itself: the EAGLE-3
default, validation, the :class:`CaptureSpec` that code passes across modules (never a bare list
of "layer ids"), and Hugging Face ``output_hidden_states`` indices:

| numbering                            | index i means                                        |
| ------------------------------------ | ---------------------------------------------------- |
| eyas boundary                        | boundary i                                           |
| HF ``output_hidden_states`` index i  | boundary i for i < L (i = L is post-norm: never used) |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence
from eyas.errors import EyasError


class BoundaryError(EyasError, ValueError):
    """Boundaries that cannot be captured from, or written for, a target."""


def default_boundaries(num_blocks: int) -> list[int]:
    """EAGLE-3's default low/middle/high boundaries: ``[2, L//2, L-3]``."""
    if num_blocks < 7:  # below 7 blocks the three values collide (L=6 gives [2, 3, 3])
        raise BoundaryError(
            f"the EAGLE-3 default boundaries [2, L//2, L-3] need at least 7 decoder blocks; "
            f"this target has {num_blocks}: pass boundaries explicitly"
        )
    return [2, num_blocks // 2, num_blocks - 3]


def validate_boundaries(
    boundaries: Sequence[int], num_blocks: int | None, num_slots: int | None = None
) -> list[int]:
    """Check boundaries against a target with ``num_blocks`` blocks; return them as a list of ints.

    Order is kept: slot order is part of what the drafter was trained on. With ``num_blocks``
    unknown (None or 0: a checkpoint read on its own) only what needs no target is checked:
    values >= 0, distinct, and the slot count.
    """
    bs = [int(b) for b in boundaries]
    if not bs:
        raise BoundaryError("boundaries: expected at least one boundary, found an empty list")
    if not num_blocks:
        negative = [b for b in bs if b < 0]
        if negative:
            raise BoundaryError(f"boundaries: expected values >= 0, found {negative} in {bs}")
    else:
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

    def to_hf_indices(self) -> list[int]:
        return boundaries_to_hf_indices(self.boundaries, self.num_blocks)


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
