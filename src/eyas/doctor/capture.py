"""One pass of the live target over the doctor's token sequences, through eyas' one capture path.

Every boundary 0..L is captured (plus boundary L after the final norm, slot id L+1, for the
"last boundary before or after the final norm" protocol), rounded to the dtype the training
features were stored in. The values of the boundaries any plausible protocol uses are kept, so
those protocols are assembled afterwards without running the target again (another boundary costs
one more pass: :meth:`LiveCapture.ensure`). The same pass records the target's argmax at every position
(the labels) and the fingerprint statistics of every boundary under the fingerprint token rule of
:mod:`eyas.capture.stats` (every token but the first of each sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from eyas.convention.boundaries import CaptureSpec
from eyas.capture.hooks import BoundaryCapture
from eyas.targets.structure import find_decoder_blocks, find_final_norm, text_config
from eyas.capture.stats import FingerprintAccumulator, default_channels
from eyas.contract.contract import SlotFingerprint
from eyas.doctor.samples import Sample

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LiveCapture:
    num_blocks: int
    hidden_size: int
    dtype: str  # the dtype the boundaries are rounded to (the training features' dtype)
    kept: list[int]  # the boundary ids stored (0..L, and L+1 = boundary L after the final norm)
    boundaries: list[Tensor]  # per sample [T, len(kept), H], in the order of ``kept``
    argmax: list[Tensor]  # per sample [T]: the target's top token (target ids)
    stats: dict[int, SlotFingerprint]  # per boundary id 0..L+1 (all of them), every token but the first
    channels: list[int]

    def features(self, i: int, slots: Sequence[int]) -> Tensor:
        """[T, S * H] float32: sample i's captured boundaries ``slots``, concatenated in order."""
        x = self.boundaries[i]
        return torch.cat([x[:, self.kept.index(b)] for b in slots], dim=-1).float()

    @torch.no_grad()
    def ensure(self, model: Any, samples: Sequence[Sample], wanted: Sequence[int]) -> None:
        """Store ``wanted`` boundaries too (one more pass of the target over the samples if any is missing)."""
        missing = sorted({int(b) for b in wanted} - set(self.kept))
        if not missing:
            return
        extra = _capture(model, samples, missing, DTYPES.get(self.dtype, torch.float32))[0]
        self.boundaries = [torch.cat([x, e], dim=1) for x, e in zip(self.boundaries, extra)]
        self.kept = self.kept + missing


def _capture(model: Any, samples: Sequence[Sample], keep: Sequence[int], store_dtype: torch.dtype,
             acc: FingerprintAccumulator | None = None) -> tuple[list[Tensor], list[Tensor]]:
    L = len(find_decoder_blocks(model))
    final_norm = find_final_norm(model)
    device = next(model.parameters()).device
    spec = CaptureSpec(tuple(range(L + 1)), L)
    bounds, argmax = [], []
    with BoundaryCapture(model, spec) as cap:
        for s in samples:
            cap.clear()
            logits = model(input_ids=s.input_ids[None].to(device), use_cache=False).logits[0]
            argmax.append(logits.argmax(-1).cpu())
            post = final_norm(cap.boundary(L))[0]
            at = {b: (post if b == L + 1 else cap.boundary(b)[0]) for b in range(L + 2)}
            if acc is not None:  # statistics of every boundary, on the values as stored
                acc.update_sequence(torch.stack([at[b] for b in range(L + 2)], dim=1).to(store_dtype))
            bounds.append(torch.stack([at[b] for b in keep], dim=1).to(store_dtype).cpu())  # [T, K, H]
    return bounds, argmax


@torch.no_grad()
def capture_all(model: Any, samples: Sequence[Sample], dtype: str = "float32",
                channels: Sequence[int] | None = None, keep: Sequence[int] | None = None) -> LiveCapture:
    """Run the target once per sample (no padding: exact per-sample values). Statistics are kept
    for every boundary; the values only for ``keep`` (default: all of 0..L+1)."""
    L = len(find_decoder_blocks(model))
    H = int(text_config(model).hidden_size)
    chans = list(channels) if channels is not None else default_channels(H)
    store_dtype = DTYPES.get(dtype, torch.float32)
    kept = sorted({int(b) for b in keep} & set(range(L + 2))) if keep is not None else list(range(L + 2))
    acc = FingerprintAccumulator(list(range(L + 2)), H, chans)
    bounds, argmax = _capture(model, samples, kept, store_dtype, acc)
    stats = {fp.boundary: fp for fp in acc.result()}
    return LiveCapture(L, H, dtype if dtype in DTYPES else "float32", kept, bounds, argmax, stats, chans)


@torch.no_grad()
def stored_labels(model: Any, samples: Sequence[Sample], normed: bool = False) -> list[Tensor]:
    """The target's argmax from stored boundary L (shards): its own final norm and lm_head, as
    offline training computes its labels (``normed``: the stored state is already the norm's output,
    as in shards imported from SpecForge: lm_head only)."""
    head = model.get_output_embeddings()
    norm = (lambda h: h) if normed else find_final_norm(model)
    device = next(model.parameters()).device
    out = []
    for s in samples:
        h = s.last_hidden.to(device=device, dtype=head.weight.dtype)
        out.append(head(norm(h)).argmax(-1).cpu())
    return out
