"""Build a fresh drafter for a live target, with its contract."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from eyas.contract.contract import CaptureContract, Contract, DrafterFlags, tokenisation_of
from eyas.convention.boundaries import CaptureSpec
from eyas.targets.loaded import LoadedTarget
from eyas.targets.structure import find_embedding
from eyas.drafter.config import DrafterConfig
from eyas.drafter.model import Eagle3Drafter


def drafter_flags(cfg: DrafterConfig, vocab_map: str = "identity_prefix") -> DrafterFlags:
    return DrafterFlags(
        norm_before_residual=cfg.norm_before_residual,
        norm_before_fc=cfg.norm_before_fc,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        target_hidden_size=cfg.target_hidden_size,
        num_slots=cfg.num_slots,
        draft_vocab_size=cfg.draft_vocab_size,
        vocab_map=vocab_map,  # type: ignore[arg-type]
    )


def new_drafter(
    target: LoadedTarget | nn.Module,
    tokenizer: Any | None = None,
    boundaries: Sequence[int] | None = None,
    draft_vocab_size: int | None = None,
    source: str | None = None,
    capture_dtype: str = "bfloat16",
    seed: int = 0,
    **config_overrides: Any,
) -> tuple[Eagle3Drafter, Contract]:
    """An untrained drafter for ``target`` (a LoadedTarget, whose cached identity is used, or an HF
    model) and its contract.

    Until a training run supplies a frequency-based draft vocabulary, the draft vocabulary is
    the tokenizer's first ``draft_vocab_size`` ids.
    """
    loaded = LoadedTarget.of(target)
    model = loaded.model
    spec = CaptureSpec.create(loaded.num_blocks, boundaries)
    cfg = DrafterConfig.for_target(
        model.config, num_slots=spec.num_slots, draft_vocab_size=draft_vocab_size, **config_overrides
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(find_embedding(model).weight.detach().float())
    drafter.set_vocab_map(torch.arange(cfg.draft_vocab_size))
    contract = Contract(
        target=loaded.identity if source is None else loaded.identity.model_copy(update={"source": source}),
        capture=CaptureContract(boundaries=list(spec.boundaries), dtype=capture_dtype),
        tokenisation=tokenisation_of(tokenizer) if tokenizer is not None else None,
        drafter=drafter_flags(cfg),
    )
    return drafter, contract
