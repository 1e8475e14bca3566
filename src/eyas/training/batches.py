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
    num_tokens: int  # real (unpadded) tokens in the batch, counted on the host (no device read)

    @property
    def padded_tokens(self) -> int:
        """B * T: the tokens the batch's shape costs, padding included."""
        return self.input_ids.shape[0] * self.input_ids.shape[1]


def padded_length(lengths: Sequence[int], multiple: int = 1) -> int:
    """The longest length rounded up to a multiple of ``multiple`` (bucketed batches use 64, so
    only a few shapes occur and kernels and allocator blocks are reused)."""
    T = max(lengths)
    return -(-T // multiple) * multiple


def pad_right(seqs: Sequence[Tensor], value: float | int = 0, multiple: int = 1) -> Tensor:
    """[T_i, ...] tensors -> [B, T, ...], padded at the end; T = max T_i rounded up to ``multiple``."""
    T = padded_length([s.shape[0] for s in seqs], multiple)
    out = seqs[0].new_full((len(seqs), T, *seqs[0].shape[1:]), value)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
    return out


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """Copy a fresh host tensor to ``device`` without making the host wait for the GPU: through
    pinned memory on CUDA (an asynchronous copy, queued behind the work already launched)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class OnlineBatches:
    """Samples are dicts with ``input_ids`` and ``loss_mask`` [T]; features come from the live target."""

    def __init__(self, model: Any, spec: CaptureSpec, draft_ids: Tensor, device: torch.device,
                 autocast_dtype: torch.dtype | None = None) -> None:
        self.model, self.spec, self.draft_ids, self.device = model, spec, draft_ids.to(device), device
        self.autocast_dtype = autocast_dtype

    @torch.no_grad()
    def make(self, samples: Sequence[dict[str, Tensor]], multiple: int = 1) -> Batch:
        """One batch padded to the longest sample rounded up to ``multiple``.

        The target runs without an attention mask: padding is on the right and attention is
        causal, so a real position never sees a padded one and its features and logits are those
        of the unpadded sequence (padded positions are never counted: loss_mask is 0 there). A
        mask would also make the model check it on the host (a device sync per step).
        The labels come from the logits in the model's dtype (:meth:`TargetLabels.from_logits`).
        """
        ids = to_device(pad_right([s["input_ids"] for s in samples], multiple=multiple), self.device)
        mask = to_device(pad_right([s["loss_mask"] for s in samples], multiple=multiple), self.device)
        with BoundaryCapture(self.model, self.spec) as cap, torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        ):
            logits = self.model(input_ids=ids).logits  # [B, T, V], the model's dtype
        labels = TargetLabels.from_logits(logits, self.draft_ids)
        return Batch(ids, mask, cap.features().float(), labels, sum(int(s["input_ids"].shape[0]) for s in samples))


class OfflineBatches:
    """Samples from ShardDataset: ``input_ids``, ``loss_mask``, ``features`` or ``slots``, ``last_hidden``.

    The target's labels are recomputed from boundary L with the target's own final norm and
    lm_head, so shards stay small (H_t per token instead of a vocabulary of logits). ``normed``:
    the shards store the final norm's output instead (imported from SpecForge): lm_head only.
    """

    def __init__(self, model: Any, draft_ids: Tensor, device: torch.device, normed: bool = False) -> None:
        self.final_norm = torch.nn.Identity() if normed else find_final_norm(model)
        self.lm_head = model.get_output_embeddings()
        self.draft_ids, self.device = draft_ids.to(device), device

    @staticmethod
    def features_of(sample: dict[str, Tensor]) -> Tensor:
        if "features" in sample:
            return sample["features"]
        slots = sample["slots"]  # [T, S, H] -> [T, S * H], slots in order
        return slots.reshape(slots.shape[0], -1)

    @torch.no_grad()
    def make(self, samples: Sequence[dict[str, Tensor]], multiple: int = 1) -> Batch:
        """One batch padded to the longest sample rounded up to ``multiple``."""
        ids = to_device(pad_right([s["input_ids"].long() for s in samples], multiple=multiple), self.device)
        mask = to_device(pad_right([s["loss_mask"].long() for s in samples], multiple=multiple), self.device)
        # copied in the stored dtype (bf16 shards: half the bytes), made float32 on the device
        feats = to_device(pad_right([self.features_of(s) for s in samples], multiple=multiple), self.device).float()
        last = to_device(pad_right([s["last_hidden"] for s in samples], multiple=multiple), self.device)
        dtype = self.lm_head.weight.dtype
        labels = TargetLabels.from_last_hidden(last.to(dtype), self.final_norm, self.lm_head, self.draft_ids)
        return Batch(ids, mask, feats, labels, sum(int(s["input_ids"].shape[0]) for s in samples))
