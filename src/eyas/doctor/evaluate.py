"""A drafter's per-position accuracy with the training setup (the drafter as an engine builds it
is :func:`eyas.interop.build_drafter`).

Accuracy is measured exactly as the training loop measures held-out accuracy: ``ttt_forward``
(teacher-forced tokens, the drafter's own fed-back hidden state, loss mask shifted with the
tokens) summed by ``Tally``. Only the target's argmax is needed for accuracy, so the
soft labels are a placeholder (the loss it computes is not reported).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from eyas.doctor.samples import Sample
from eyas.drafter.model import Eagle3Drafter
from eyas.training.batches import pad_right
from eyas.drafter.ttt import Tally, TargetLabels, ttt_forward


@torch.no_grad()
def accuracy(drafter: Eagle3Drafter, samples: Sequence[Sample], features: Callable[[int], Tensor],
             labels: Sequence[Tensor], steps: int, batch_size: int = 8) -> dict:
    """Per-position accuracy, conditional accuracy and simulated accept length of ``drafter`` on
    ``samples`` whose target features are ``features(i)`` [T, S*H] and labels ``labels[i]`` [T]."""
    device = drafter.fc.weight.device
    order = sorted(range(len(samples)), key=lambda i: -samples[i].length)  # similar lengths share a batch
    tally = Tally(steps)
    for b0 in range(0, len(order), batch_size):
        idx = order[b0:b0 + batch_size]
        ids = pad_right([samples[i].input_ids for i in idx]).to(device)
        mask = pad_right([samples[i].loss_mask for i in idx]).to(device)
        feats = pad_right([features(i) for i in idx]).to(device)
        argmax = pad_right([labels[i] for i in idx]).to(device)
        lab = TargetLabels(argmax=argmax, draft_logits=feats.new_zeros(*argmax.shape, 1))  # accuracy only
        tally.add(ttt_forward(drafter, ids, feats, lab, mask, steps))
    out = tally.summary()
    out.pop("loss_per_position", None)
    return out


def score(summary: dict, positions: int) -> float:
    """Mean accuracy over the first ``positions`` draft positions (the search's yardstick)."""
    acc = summary["accuracy_per_position"][:positions]
    return sum(acc) / len(acc) if acc else 0.0
