"""A drafter's per-position accuracy with the training setup (the drafter as an engine builds it
is :func:`eyas.interop.build_drafter`).

Accuracy is measured exactly as the training loop measures held-out accuracy: ``ttt_forward``
(teacher-forced tokens, the drafter's own fed-back hidden state, loss mask shifted with the
tokens) summed by ``Tally``. Only the target's argmax is needed for accuracy, so the
soft labels are a placeholder (the loss it computes is not reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from eyas.doctor.samples import Sample
from eyas.drafter.model import Eagle3Drafter
from eyas.training.batches import pad_right
from eyas.drafter.ttt import Tally, TargetLabels, accept_length, ttt_forward

@dataclass(frozen=True)
class Accuracy:
    """A drafter's per-position accuracy on the doctor's samples, as the training loop measures
    held-out accuracy (:class:`eyas.drafter.ttt.Tally`), without the loss.

    ``accuracy_per_position[k]``: P(step k's argmax == the target's argmax) over the counted
    positions; ``conditional_accuracy_per_position[k]``: the same among positions whose steps
    0..k-1 were all right; ``simulated_accept_length`` = 1 + sum_k prod_{i<=k} cond_acc_i;
    ``tokens_counted``: the positions counted at step 0.
    """

    accuracy_per_position: list[float]
    conditional_accuracy_per_position: list[float]
    simulated_accept_length: float
    tokens_counted: int

    def score(self, positions: int) -> float:
        """Mean accuracy over the first ``positions`` draft positions (the search's yardstick)."""
        acc = self.accuracy_per_position[:positions]
        return sum(acc) / len(acc) if acc else 0.0

    def first(self, positions: int) -> Accuracy:
        """The first ``positions`` draft positions only: what a run of that many steps measures
        (position k depends on steps 0..k alone; the accept length is recomputed from them)."""
        if positions >= len(self.accuracy_per_position):
            return self
        cond = self.conditional_accuracy_per_position[:positions]
        return Accuracy(self.accuracy_per_position[:positions], cond, round(accept_length(cond), 5), self.tokens_counted)

    def to_dict(self) -> dict[str, Any]:
        return {"accuracy_per_position": self.accuracy_per_position,
                "conditional_accuracy_per_position": self.conditional_accuracy_per_position,
                "simulated_accept_length": self.simulated_accept_length, "tokens_counted": self.tokens_counted}


@torch.inference_mode()
def accuracy(drafter: Eagle3Drafter, samples: Sequence[Sample], features: Callable[[int], Tensor],
             labels: Sequence[Tensor], steps: int, batch_size: int = 8) -> Accuracy:
    """Per-position accuracy, conditional accuracy and simulated accept length of ``drafter`` on
    ``samples`` whose target features are ``features(i)`` [T, S*H] and labels ``labels[i]`` [T].

    Runs under ``torch.inference_mode`` (no autograd graph: the loss ``ttt_forward`` computes is
    not reported). Position k's counts depend only on steps 0..k, so the first positions of a
    longer run are exactly what a shorter run would measure."""
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
    m = tally.summary()
    assert m.accuracy_per_position is not None and m.conditional_accuracy_per_position is not None
    assert m.simulated_accept_length is not None and m.tokens_counted is not None  # a Tally fills them all
    return Accuracy(m.accuracy_per_position, m.conditional_accuracy_per_position, m.simulated_accept_length,
                    m.tokens_counted)
