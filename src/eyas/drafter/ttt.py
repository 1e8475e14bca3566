"""Training-time test (TTT), as in EAGLE-3.

Notation for one sequence of tokens x_0 .. x_{T-1}:
    f_t     target features at position t (the captured boundaries, num_slots * H_t wide)
    p_t     the target's next-token distribution at t (it predicts x_{t+1})

Step 0 at position t reads (f_t, x_{t+1}) and predicts x_{t+2}; its label is p_{t+1}.
Step k at position t reads (g^{k-1}_t, x_{t+1+k}) -- g is the drafter's own hidden state from the
previous step -- and predicts x_{t+2+k} with label p_{t+1+k}. Tokens are teacher-forced; the hidden
state is the drafter's own, exactly as at serving time. Position ids are t + k, as when serving
(the k-th draft token sits k places further on).

Attention of step k at position t: step 0 at positions <= t (the causal prefix), plus steps
1..k at position t only (the same position of earlier steps).

Loss = sum_k decay^k * soft cross-entropy(drafter, p restricted to the draft vocab), over the
positions whose predicted token x_{t+2+k} is an assistant token (loss_mask shifted with the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from eyas.contract.contract import ValidationMetrics
from eyas.drafter.model import ConcatKVCache, Eagle3Drafter


@dataclass
class TargetLabels:
    """What the target says at every position, restricted to what the loss needs.

    argmax:       [B, T]      the target's top token over the full vocabulary (target ids)
    draft_logits: [B, T, Vd]  the target's logits at the draft vocabulary's ids
    """

    argmax: Tensor
    draft_logits: Tensor

    @classmethod
    def from_logits(cls, logits: Tensor, draft_ids: Tensor) -> "TargetLabels":
        """From full target logits [B, T, V] (online training)."""
        return cls(argmax=logits.argmax(-1), draft_logits=logits[..., draft_ids].float())

    @classmethod
    def from_last_hidden(cls, last_hidden: Tensor, final_norm: torch.nn.Module, lm_head: torch.nn.Module,
                         draft_ids: Tensor) -> "TargetLabels":
        """From boundary L (pre-norm last hidden) [B, T, H_t] (offline training from shards)."""
        return cls.from_logits(lm_head(final_norm(last_hidden)), draft_ids)


@dataclass
class TTTResult:
    loss: Tensor  # scalar, the weighted sum over steps
    step_loss: list[Tensor] = field(default_factory=list)  # per step, mean over counted positions
    correct: list[int] = field(default_factory=list)  # per step: drafter argmax == target argmax
    cond_correct: list[int] = field(default_factory=list)  # ...among positions all earlier steps got right
    cond_total: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)  # counted positions per step
    logits: list[Tensor] = field(default_factory=list)  # keep_logits only: per step [B, T, Vd], the drafter's for x_{t+2+k}


def ttt_mask(T: int, step: int, device: torch.device) -> Tensor:
    """Bool [1, 1, T, (step+1)*T]: True where a query of ``step`` may attend a key."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    diag = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)[None, None]


def shift_left(x: Tensor, n: int, fill: float | int = 0) -> Tensor:
    """x[:, t] <- x[:, t + n] along dim 1, padding the end with ``fill`` (all ``fill`` when n >= T)."""
    n = min(n, x.shape[1])
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_forward(
    drafter: Eagle3Drafter,
    input_ids: Tensor,  # [B, T] target ids
    features: Tensor,  # [B, T, num_slots * H_t]
    labels: TargetLabels,
    loss_mask: Tensor,  # [B, T] 1 where x_t is an assistant token
    steps: int = 7,
    decay: float = 0.8,
    keep_logits: bool = False,
) -> TTTResult:
    B, T = input_ids.shape
    device = input_ids.device
    positions = torch.arange(T, device=device).expand(B, T)
    cache = ConcatKVCache()
    in_draft_vocab = drafter.t2d[labels.argmax]  # [B, T]: can the drafter express the target's token?
    hidden = features
    result = TTTResult(loss=features.new_zeros((), dtype=torch.float32))
    still_right = torch.ones(B, T, dtype=torch.bool, device=device)
    for k in range(steps):
        # Step k at position t: token x_{t+1+k}, label p_{t+1+k}, counted iff x_{t+2+k} is assistant.
        tokens = shift_left(input_ids, 1 + k)
        target_argmax = shift_left(labels.argmax, 1 + k)
        target_logits = shift_left(labels.draft_logits, 1 + k)
        counted = shift_left(loss_mask, 2 + k).bool() & shift_left(in_draft_vocab, 1 + k, False)
        out = drafter(tokens, hidden, positions + k, cache=cache, mask=ttt_mask(T, k, device),
                      from_target=k == 0)
        logp = F.log_softmax(out.logits.float(), dim=-1)  # [B, T, Vd]
        p = F.softmax(target_logits, dim=-1)
        per_pos = -(p * logp).sum(-1)  # [B, T]
        n = counted.sum()
        step_loss = (per_pos * counted).sum() / n.clamp(min=1)
        result.loss = result.loss + decay**k * step_loss
        result.step_loss.append(step_loss.detach())
        with torch.no_grad():
            right = drafter.draft_to_target(out.logits.argmax(-1)) == target_argmax
            if keep_logits:  # evaluation (serving's acceptance, --tree auto's calibration), not training
                result.logits.append(out.logits.detach())
            result.correct.append(int((right & counted).sum()))
            result.total.append(int(n))
            cond = counted & still_right
            result.cond_correct.append(int((right & cond).sum()))
            result.cond_total.append(int(cond.sum()))
            still_right = still_right & right
        hidden = out.hidden
    return result


def accept_length(cond_acc: list[float]) -> float:
    """Simulated accept length of a chain: 1 + sum_k prod_{i<=k} cond_acc_i."""
    total, prod = 1.0, 1.0
    for a in cond_acc:
        prod *= a
        total += prod
    return total


class Tally:
    """Counts summed over batches (and ranks) -> per-position accuracies and accept length."""

    def __init__(self, steps: int) -> None:
        self.t = torch.zeros(5, steps, dtype=torch.float64)  # loss*n, correct, total, cond_correct, cond_total

    def add(self, r: TTTResult) -> None:
        for k in range(self.t.shape[1]):
            n = r.total[k]
            self.t[:, k] += torch.tensor([float(r.step_loss[k]) * n, r.correct[k], n, r.cond_correct[k], r.cond_total[k]],
                                         dtype=torch.float64)

    def all_reduce(self) -> None:
        """Sum the counts over the ranks of a torchrun job (a no-op in a single process)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.t)

    def summary(self) -> ValidationMetrics:
        """Per-position means of the counts (rounded to 5 places), without a step (the caller's)."""
        loss_n, correct, total, cc, ct = self.t
        acc = (correct / total.clamp(min=1)).tolist()
        cond = (cc / ct.clamp(min=1)).tolist()
        return ValidationMetrics(
            loss_per_position=[round(x, 5) for x in (loss_n / total.clamp(min=1)).tolist()],
            accuracy_per_position=[round(x, 5) for x in acc],
            conditional_accuracy_per_position=[round(x, 5) for x in cond],
            simulated_accept_length=round(accept_length(cond), 5),
            tokens_counted=int(total[0]),
        )
