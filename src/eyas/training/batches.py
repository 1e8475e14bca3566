"""Training batches from either data source, through the same capture code.

Online: conversations are rendered once; each step runs the target under BoundaryCapture.
Offline: samples come from hidden-state shards written by `eyas capture` (the same BoundaryCapture).
Either way a step sees the same four tensors:

    input_ids  [B, T]             right-padded with 0
    loss_mask  [B, T]             1 on assistant tokens, 0 on padding
    features   [B, T, S * H_t]    the captured boundaries, in slot order
    labels     TargetLabels       the target's argmax [B, T] and draft-vocab logits [B, T, Vd]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from eyas.convention.boundaries import CaptureSpec
from eyas.capture.hooks import BoundaryCapture
from eyas.targets.structure import find_final_norm
from eyas.drafter.ttt import TargetLabels


@dataclass
class Batch:
    input_ids: Tensor
    loss_mask: Tensor
    features: Tensor
    labels: TargetLabels
    num_tokens: int  # real (unpadded) tokens in the batch


def pad_right(seqs: Sequence[Tensor], value: float | int = 0) -> Tensor:
    """[T_i, ...] tensors -> [B, max T, ...], padded at the end."""
    T = max(s.shape[0] for s in seqs)
    out = seqs[0].new_full((len(seqs), T, *seqs[0].shape[1:]), value)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
    return out


class OnlineBatches:
    """Samples are dicts with ``input_ids`` and ``loss_mask`` [T]; features come from the live target."""

    def __init__(self, model: Any, spec: CaptureSpec, draft_ids: Tensor, device: torch.device,
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.model, self.spec, self.draft_ids, self.device = model, spec, draft_ids.to(device), device
        self.autocast_dtype = autocast_dtype

    @torch.no_grad()
    def make(self, samples: Sequence[dict[str, Tensor]]) -> Batch:
        ids = pad_right([s["input_ids"] for s in samples]).to(self.device)
        mask = pad_right([s["loss_mask"] for s in samples]).to(self.device)
        attn = pad_right([torch.ones_like(s["input_ids"]) for s in samples]).to(self.device)
        with BoundaryCapture(self.model, self.spec) as cap, torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        ):
            logits = self.model(input_ids=ids, attention_mask=attn).logits
        labels = TargetLabels.from_logits(logits.float(), self.draft_ids)
        return Batch(ids, mask, cap.features().float(), labels, int(attn.sum()))


class OfflineBatches:
    """Samples from ShardDataset: ``input_ids``, ``loss_mask``, ``features`` or ``slots``, ``last_hidden``.

    The target's labels are recomputed from boundary L with the target's own final norm and
    lm_head, so shards stay small (H_t per token instead of a vocabulary of logits).
    """

    def __init__(self, model: Any, draft_ids: Tensor, device: torch.device) -> None:
        self.final_norm = find_final_norm(model)
        self.lm_head = model.get_output_embeddings()
        self.draft_ids, self.device = draft_ids.to(device), device

    @staticmethod
    def features_of(sample: dict[str, Tensor]) -> Tensor:
        if "features" in sample:
            return sample["features"]
        slots = sample["slots"]  # [T, S, H] -> [T, S * H], slots in order
        return slots.reshape(slots.shape[0], -1)

    @torch.no_grad()
    def make(self, samples: Sequence[dict[str, Tensor]]) -> Batch:
        ids = pad_right([s["input_ids"].long() for s in samples]).to(self.device)
        mask = pad_right([s["loss_mask"].long() for s in samples]).to(self.device)
        feats = pad_right([self.features_of(s).float() for s in samples]).to(self.device)
        last = pad_right([s["last_hidden"] for s in samples]).to(self.device)
        dtype = self.lm_head.weight.dtype
        labels = TargetLabels.from_last_hidden(last.to(dtype), self.final_norm, self.lm_head, self.draft_ids)
        return Batch(ids, mask, feats, labels, sum(int(s["input_ids"].shape[0]) for s in samples))
