"""A target's identity: what a dataset or drafter records about the model it was made for, so that
meeting another model (another architecture, depth, width, vocabulary, or another checkpoint of the
same shape) is caught. The contract (:mod:`eyas.contract`) stores it under ``target``."""

from __future__ import annotations

import hashlib

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from eyas.targets.structure import find_decoder_blocks, find_embedding, find_final_norm, text_config


class TargetIdentity(BaseModel):
    model_config = ConfigDict(extra="forbid")

    architecture: str
    model_type: str
    num_blocks: int
    hidden_size: int
    vocab_size: int
    # sha256 over bf16-rounded sampled embedding rows + the final norm weight: catches another
    # checkpoint of the same shape, and is equal for fp32 and bf16 loads of the same weights.
    fingerprint: str
    source: str | None = None  # where it was loaded from; informational, never compared


def weights_fingerprint(model: nn.Module, max_rows: int = 1024) -> str:
    """16 hex digits of sha256 over up to ``max_rows`` evenly spaced embedding rows and the final
    norm's weight, each rounded to bf16 first (so an fp32 and a bf16 load of the same checkpoint
    agree, and the hash costs O(max_rows * H), not O(V * H))."""
    emb = find_embedding(model).weight.detach()
    rows = torch.linspace(0, emb.shape[0] - 1, min(max_rows, emb.shape[0])).round().long()
    h = hashlib.sha256()
    for t in (emb[rows.to(emb.device)], find_final_norm(model).weight.detach()):
        h.update(t.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def target_identity(model: nn.Module, source: str | None = None) -> TargetIdentity:
    """The identity of a loaded HF causal LM. ``vocab_size`` is the embedding's rows (what the
    drafter's ``embed_tokens`` and ``t2d`` must match), not the config's."""
    cfg = text_config(model)
    archs = getattr(model.config, "architectures", None) or [type(model).__name__]
    return TargetIdentity(
        architecture=archs[0],
        model_type=cfg.model_type,
        num_blocks=len(find_decoder_blocks(model)),
        hidden_size=cfg.hidden_size,
        vocab_size=find_embedding(model).weight.shape[0],
        fingerprint=weights_fingerprint(model),
        source=source,
    )
