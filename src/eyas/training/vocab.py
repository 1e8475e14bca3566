"""The draft vocabulary: the N most frequent loss-masked target tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor


@dataclass
class DraftVocab:
    ids: Tensor  # [N] target ids, ascending: draft id i <-> target id ids[i]
    coverage: float  # fraction of training targets (loss-masked tokens) inside the vocabulary
    num_targets: int  # loss-masked tokens counted
    widened_from: int | None = None  # --init-from's draft vocabulary size, when this run widened it


def count_targets(samples: Iterable[tuple[Tensor, Tensor]], vocab_size: int) -> Tensor:
    """Histogram [vocab_size] of the tokens the drafter is trained to predict (loss_mask == 1)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in samples:
        counts += torch.bincount(input_ids[loss_mask.bool()].long(), minlength=vocab_size)
    return counts


def build_draft_vocab(counts: Tensor, size: int) -> DraftVocab:
    """Top-``size`` ids by count (ties broken by id, so the choice is deterministic).

    Ids never seen fill the remainder in ascending order, so a small corpus still yields exactly
    ``size`` ids (those extra ids can never hurt: they only add rows to lm_head).
    """
    vocab_size = counts.numel()
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft_vocab_size: expected 1..{vocab_size}, found {size}")
    # Stable sort on -count keeps ascending id order among equal counts.
    return vocab_of(torch.sort(-counts, stable=True).indices[:size], counts)


def vocab_of(ids: Tensor, counts: Tensor) -> DraftVocab:
    """The draft vocabulary of target ``ids`` (any order; e.g. the drafter's that a run starts
    from), ascending, with its coverage of the targets in ``counts``."""
    ids = torch.sort(ids.to(torch.long).cpu()).values
    total = int(counts.sum())
    return DraftVocab(ids=ids, coverage=int(counts[ids].sum()) / total if total else 0.0, num_targets=total)
