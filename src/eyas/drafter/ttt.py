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
        """From full target logits [B, T, V] (online training), in the logits' own dtype: the
        argmax over V and the gather of the Vd draft columns read the logits as they are; only the
        [B, T, Vd] part is made float32 (a float32 copy of [B, T, V] would cost B*T*V*4 bytes of
        memory traffic for nothing: bf16 -> fp32 is exact, so the argmax is the same)."""
        return cls(argmax=logits.argmax(-1), draft_logits=logits[..., draft_ids].float())

    @classmethod
    def from_last_hidden(cls, last_hidden: Tensor, final_norm: torch.nn.Module, lm_head: torch.nn.Module,
                         draft_ids: Tensor) -> "TargetLabels":
        """From boundary L (pre-norm last hidden) [B, T, H_t] (offline training from shards)."""
        return cls.from_logits(lm_head(final_norm(last_hidden)), draft_ids)


@dataclass
class StepCounts:
    """Per-step counts of one TTT forward, kept on the device (each a [steps] tensor), so that a
    training step never reads a value back to the host (a read is a device sync; on a launch-bound
    GPU it stalls the queue of kernel launches). :class:`Tally` sums them, still on the device, and
    reads them once when a summary is asked for.

    step_loss:    [steps] float32  mean soft cross-entropy over the counted positions (detached)
    correct:      [steps] int64    counted positions where drafter argmax == target argmax
    total:        [steps] int64    counted positions
    cond_correct: [steps] int64    ...right among positions all earlier steps got right
    cond_total:   [steps] int64    counted positions all earlier steps got right
    """

    step_loss: Tensor
    correct: Tensor
    total: Tensor
    cond_correct: Tensor
    cond_total: Tensor


@dataclass
class TTTResult(StepCounts):
    """``loss``: scalar, the weighted sum over steps (the one with a graph); the counts of
    :class:`StepCounts` over the positions the loss counts; ``subset``: the same counts over the
    positions ``ttt_forward``'s ``count_mask`` keeps (None without one); ``logits``: keep_logits only,
    per step [B, T, Vd], the drafter's logits for x_{t+2+k}."""

    loss: Tensor = None  # type: ignore[assignment]  # always set by ttt_forward
    subset: StepCounts | None = None
    logits: list[Tensor] = field(default_factory=list)


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
    count_mask: Tensor | None = None,  # [B, T] bool, a subset of loss_mask: also count over these x_t
) -> TTTResult:
    """The TTT loss and per-step counts of one batch (see the module docstring).

    Nothing here reads a value back to the host: the counts stay [steps] tensors on the device.
    With ``count_mask`` the counts are also taken over the positions whose predicted token
    x_{t+2+k} it keeps (``result.subset``; the held-out metrics without repetition loops); the
    conditional counts there use the same "all earlier steps right" as the full counts.
    """
    B, T = input_ids.shape
    device = input_ids.device
    positions = torch.arange(T, device=device).expand(B, T)
    cache = ConcatKVCache()
    in_draft_vocab = drafter.t2d[labels.argmax]  # [B, T]: can the drafter express the target's token?
    hidden = features
    loss = features.new_zeros((), dtype=torch.float32)
    still_right = torch.ones(B, T, dtype=torch.bool, device=device)
    masks = [loss_mask] + ([count_mask] if count_mask is not None else [])
    # rows[m][k]: [5] counts of mask m at step k: loss sum, correct, total, cond_correct, cond_total
    rows: list[list[Tensor]] = [[] for _ in masks]
    logits_kept: list[Tensor] = []
    for k in range(steps):
        # Step k at position t: token x_{t+1+k}, label p_{t+1+k}, counted iff x_{t+2+k} is assistant.
        tokens = shift_left(input_ids, 1 + k)
        target_argmax = shift_left(labels.argmax, 1 + k)
        target_logits = shift_left(labels.draft_logits, 1 + k)
        expressible = shift_left(in_draft_vocab, 1 + k, False)
        counted = shift_left(loss_mask, 2 + k).bool() & expressible
        out = drafter(tokens, hidden, positions + k, cache=cache, mask=ttt_mask(T, k, device),
                      from_target=k == 0)
        logp = F.log_softmax(out.logits.float(), dim=-1)  # [B, T, Vd]
        p = F.softmax(target_logits.float(), dim=-1)
        per_pos = -(p * logp).sum(-1)  # [B, T]
        n = counted.sum()
        step_loss = (per_pos * counted).sum() / n.clamp(min=1)
        loss = loss + decay**k * step_loss
        with torch.no_grad():
            right = drafter.draft_to_target(out.logits.argmax(-1)) == target_argmax  # [B, T]
            if keep_logits:  # evaluation (serving's acceptance, --tree auto's calibration), not training
                logits_kept.append(out.logits.detach())
            pl = per_pos.detach()
            for m, mask in enumerate(masks):
                c = counted if m == 0 else shift_left(mask, 2 + k).bool() & expressible
                cond = c & still_right
                rows[m].append(torch.stack([(pl * c).sum().double(), (right & c).sum().double(),
                                            c.sum().double(), (right & cond).sum().double(),
                                            cond.sum().double()]))
            still_right = still_right & right
        hidden = out.hidden

    def counts(r: list[Tensor]) -> StepCounts:
        t = torch.stack(r, dim=1) if r else torch.zeros(5, 0, dtype=torch.float64, device=device)  # [5, steps]
        total = t[2].long()
        return StepCounts(step_loss=(t[0] / t[2].clamp(min=1)).float(), correct=t[1].long(), total=total,
                          cond_correct=t[3].long(), cond_total=t[4].long())

    main = counts(rows[0])
    return TTTResult(**vars(main), loss=loss, subset=counts(rows[1]) if count_mask is not None else None,
                     logits=logits_kept)


def accept_length(cond_acc: list[float]) -> float:
    """Simulated accept length of a chain: 1 + sum_k prod_{i<=k} cond_acc_i."""
    total, prod = 1.0, 1.0
    for a in cond_acc:
        prod *= a
        total += prod
    return total


class Tally:
    """Counts summed over batches (and ranks) -> per-position accuracies and accept length.

    The sums live on the device of the first result added ([5, steps] float64: loss*n, correct,
    total, cond_correct, cond_total) and are read back to the host only by :meth:`summary`, so
    adding a training step's result costs no device sync. float64 keeps counts exact up to 2^53.
    """

    def __init__(self, steps: int) -> None:
        self.t = torch.zeros(5, steps, dtype=torch.float64)

    def add(self, r: StepCounts) -> None:
        """Add one result's counts (a :class:`TTTResult` or its ``subset``); no host read."""
        if self.t.device != r.total.device:
            self.t = self.t.to(r.total.device)
        total = r.total.double()
        self.t += torch.stack([r.step_loss.double() * total, r.correct.double(), total, r.cond_correct.double(),
                               r.cond_total.double()])

    def all_reduce(self) -> None:
        """Sum the counts over the ranks of a torchrun job (a no-op in a single process)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.t)

    def summary(self) -> ValidationMetrics:
        """Per-position means of the counts (rounded to 5 places), without a step (the caller's).
        One host read of the [5, steps] sums."""
        loss_n, correct, total, cc, ct = self.t.cpu()
        acc = (correct / total.clamp(min=1)).tolist()
        cond = (cc / ct.clamp(min=1)).tolist()
        return ValidationMetrics(
            loss_per_position=[round(x, 5) for x in (loss_n / total.clamp(min=1)).tolist()],
            accuracy_per_position=[round(x, 5) for x in acc],
            conditional_accuracy_per_position=[round(x, 5) for x in cond],
            simulated_accept_length=round(accept_length(cond), 5),
            tokens_counted=int(total[0]),
        )
