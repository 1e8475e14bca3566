"""Deciding which boundaries a drafter was trained on from its live accuracy, when nothing recorded says.

A directory with no contract and no ids (or ids that the conventions read differently, none named)
only lets the doctor *assume* its trained boundaries. Without training shards there is no stored
reference to hold candidates against, but there is the drafter itself: fed the boundaries it was
trained on, it predicts the target's next token better than fed any other set. So, on the doctor's
samples (a conversations file, or the target's own greedy answers), each candidate boundary set is
scored by the drafter's teacher-forced prediction at draft position 0 (the one position that reads
the target's features directly), built with its trained norm flags, on the one live capture of
the target (every candidate is assembled from it; the target runs once). Per counted token t (an
assistant token the draft vocabulary can express, as training counts them) it records the
log-probability the drafter gives the target's next token, ``lp_t``, and whether its argmax is it.

Candidates (:func:`candidate_sets`), deduplicated, each of the drafter's slot count, inside 0..L:

- the bases: the assumed boundaries, the EAGLE-3 default ``[2, L//2, L-3]``, each convention's
  reading of the directory's ids (SpecForge, SGLang, SGLang legacy), the boundaries the chosen
  engine captures from the directory, and the default with the embedding output (boundary 0) as
  its first slot;
- each base with every boundary one block earlier and later (a numbering convention), and with
  each slot alone one block earlier and later.

The margin rule (:func:`decide`). Candidates are ranked by mean ``lp`` (the drafter's own
training objective at position 0: a one-block shift of one deep slot rarely moves the argmax of
a few hundred tokens, but it lowers the likelihood of nearly all of them). With ``d_t = lp_t(best)
- lp_t(runner-up)`` on the same tokens (paired), the best set is the trained one only when

    n >= INFER_MIN_TOKENS                                   enough counted tokens,
    accuracy(best) >= INFER_MIN_ACCURACY                    the drafter does read the best set,
    mean(d) > max(INFER_MIN_LEAD, INFER_SIGMAS * std(d) / sqrt(n))
                                                            a lead beyond the noise of the tokens.

(The standard error treats tokens as independent; tokens of one answer are not, hence 4 standard
errors rather than 2 or 3.) Otherwise the doctor says it cannot decide, with the top two figures:
an untrained drafter predicts nothing with any candidate, and two sets the drafter barely tells
apart stay undecided rather than guessed. Invariant: a decided set is one of the candidates, and
every candidate was measured on the same tokens with the same drafter. Candidates far behind on a
few samples are ruled out there (``SCREEN_SIGMAS``: twice the decision's standard errors), so the
decision is among the rest, each measured on every sample.

The same rule settles a norm flag that config.json states but nothing says is the trained one (the
flag speculators' converter writes from its own option, :func:`eyas.interop.speculators.converter_flags`):
the drafter built with the flag as written and toggled, both fed the trained boundaries, scored
alike at position 0 (:func:`infer_flag`; ``norm_before_residual`` acts at position 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from eyas.doctor.common import SCREEN_SAMPLES
from eyas.doctor.samples import Sample, evenly
from eyas.drafter.model import ConcatKVCache, Eagle3Drafter
from eyas.drafter.ttt import shift_left, ttt_mask
from eyas.training.batches import pad_right

if TYPE_CHECKING:
    from eyas.doctor.context import DoctorContext

INFER_MIN_TOKENS = 100  # fewer counted tokens cannot separate two candidates
INFER_MIN_ACCURACY = 0.10  # below this at position 0 with its best set, the drafter reads no set as trained
INFER_MIN_LEAD = 0.01  # nats of mean log-likelihood per token: a smaller lead is no evidence...
INFER_SIGMAS = 4.0  # ...nor one within 4 standard errors of the paired difference
# Screening: with at least 2 x SCREEN_SAMPLES samples every candidate is scored on SCREEN_SAMPLES
# evenly spaced ones first; one that the best there leads by more than SCREEN_SIGMAS standard errors
# (and INFER_MIN_LEAD) is ruled out, the others are scored on every sample and decided by the rule.
SCREEN_SIGMAS = 8.0


@dataclass(frozen=True)
class ScoredSet:
    """One candidate boundary set and the drafter's live position-0 accuracy with it."""

    boundaries: list[int]
    label: str
    log_likelihood: float  # mean lp over the counted tokens (nats)
    accuracy: float  # position 0
    tokens: int
    lp: Tensor | None = None  # [tokens] per-token lp, for the paired comparison (not reported)
    screened_out_on: int | None = None  # ruled out on this many samples (figures measured on them only)

    def to_dict(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries, "label": self.label, "log_likelihood": self.log_likelihood,
                "accuracy": self.accuracy, "tokens": self.tokens, "screened_out_on": self.screened_out_on}


@dataclass
class BoundaryInference:
    """The decision: the candidates, best first; the boundaries decided (None: cannot decide); the
    lead the best one needed; and the sentence that says so, with the figures."""

    candidates: list[ScoredSet] = field(default_factory=list)
    decided: list[int] | None = None
    lead: float | None = None  # the best set's mean lead in log-likelihood over the runner-up
    lead_needed: float | None = None
    why: str = ""
    data: str = ""  # what the accuracy was measured on

    def to_dict(self) -> dict[str, Any]:
        return {"decided": self.decided, "lead": self.lead, "lead_needed": self.lead_needed, "why": self.why,
                "data": self.data, "candidates": [c.to_dict() for c in self.candidates]}


def candidate_sets(bases: Sequence[tuple[Sequence[int] | None, str]], num_slots: int,
                   num_blocks: int) -> list[tuple[list[int], str]]:
    """Each base and its one-block shifts (all slots together, then each slot alone), in order,
    deduplicated; only sets of ``num_slots`` distinct boundaries inside 0..L."""
    L = num_blocks
    out: list[tuple[list[int], str]] = []
    seen: set[tuple[int, ...]] = set()

    def add(bs: Sequence[int], label: str) -> None:
        t = tuple(int(b) for b in bs)
        if len(t) != num_slots or len(set(t)) != len(t) or any(not 0 <= b <= L for b in t) or t in seen:
            return
        seen.add(t)
        out.append((list(t), label))

    valid = [(list(b), label) for b, label in bases if b is not None]
    for bs, label in valid:
        add(bs, label)
    for bs, label in valid:
        for d in (1, -1):
            add([b + d for b in bs], f"{label}, every boundary {d:+d}")
        for i in range(len(bs)):
            for d in (1, -1):
                add([b + d if j == i else b for j, b in enumerate(bs)], f"{label}, slot {i} {d:+d}")
    return out


def decide(scored: Sequence[ScoredSet]) -> tuple[ScoredSet | None, float | None, float | None, str]:
    """The clear winner of ``scored`` by the margin rule (None when there is none), its lead over
    the runner-up and the lead it needed (nats per token), and why, with the figures."""
    ranked = sorted(scored, key=lambda s: -s.log_likelihood)
    if not ranked:
        return None, None, None, "no candidate boundary set fits the drafter"
    best = ranked[0]
    n = best.tokens
    head = (f"{best.boundaries} ({best.label}) gives the target's next token a mean log-likelihood of "
            f"{best.log_likelihood:.3f} at draft position 0 (accuracy {best.accuracy:.3f})")
    if n < INFER_MIN_TOKENS:
        return None, None, None, f"only {n} tokens counted (at least {INFER_MIN_TOKENS} are needed)" + (
            f": {head}" if n else " (no answer token is in the draft vocabulary)")
    if best.accuracy < INFER_MIN_ACCURACY:
        return None, None, None, (f"the drafter predicts the target's next token poorly with every candidate set "
                                  f"(best: {head}; a drafter that read one set as trained reaches at least "
                                  f"{INFER_MIN_ACCURACY:g})")
    if len(ranked) == 1:  # nothing to hold it against: no evidence that it, rather than another, was trained on
        return None, None, None, f"{head}; it is the only candidate that fits the drafter, so nothing tells it apart"
    second = ranked[1]
    lead, need = paired_lead(best, second)
    figures = (f"{head}, the runner-up {second.boundaries} ({second.label}) {second.log_likelihood:.3f} (accuracy "
               f"{second.accuracy:.3f}), over {n} tokens: a lead of {lead:.3f} nats per token where a clear winner "
               f"needs more than {need:.3f} (max of {INFER_MIN_LEAD:g} and {INFER_SIGMAS:g} standard errors of "
               f"the paired difference)")
    if lead <= need:
        return None, lead, need, f"no clear winner: {figures}"
    return best, lead, need, figures


def paired_lead(best: ScoredSet, other: ScoredSet) -> tuple[float, float]:
    """``best``'s mean lead in per-token log-likelihood over ``other`` on the same tokens, and the
    lead the rule needs: max(INFER_MIN_LEAD, INFER_SIGMAS x the standard error of the mean)."""
    lead, se = _lead_and_se(best, other)
    return lead, max(INFER_MIN_LEAD, INFER_SIGMAS * se)


@torch.inference_mode()
def position0(drafter: Eagle3Drafter, samples: Sequence[Sample], features: Callable[[int], Tensor],
              labels: Sequence[Tensor], batch_size: int = 8) -> tuple[Tensor, Tensor]:
    """Per counted token at draft position 0, in a fixed order: the log-probability the drafter
    gives the target's next token (draft vocabulary), and whether its argmax is that token.

    Counted as training counts step 0 (:func:`eyas.drafter.ttt.ttt_forward`): position t reads
    token x_{t+1} and the target's features at t, predicts the target's argmax at t+1, and counts
    when x_{t+2} is an assistant token the draft vocabulary can express."""
    device = drafter.fc.weight.device
    Vd = drafter.d2t.shape[0]
    to_draft = torch.full((drafter.t2d.shape[0],), -1, dtype=torch.long, device=device)
    to_draft[drafter.draft_to_target(torch.arange(Vd, device=device))] = torch.arange(Vd, device=device)
    lps, rights = [], []
    for b0 in range(0, len(samples), batch_size):
        idx = list(range(b0, min(b0 + batch_size, len(samples))))
        ids = pad_right([samples[i].input_ids for i in idx]).to(device)
        mask = pad_right([samples[i].loss_mask for i in idx]).to(device)
        feats = pad_right([features(i) for i in idx]).to(device)
        argmax = pad_right([labels[i] for i in idx]).to(device)
        T = ids.shape[1]
        target = shift_left(argmax, 1)
        draft_id = to_draft[target]
        counted = shift_left(mask, 2).bool() & (draft_id >= 0)
        out = drafter(shift_left(ids, 1), feats, torch.arange(T, device=device).expand(len(idx), T),
                      cache=ConcatKVCache(), mask=ttt_mask(T, 0, device), from_target=True,
                      logits_at=counted)  # [N, Vd]: the lm_head only where a token counts
        logp = F.log_softmax(out.logits.float(), dim=-1).gather(-1, draft_id[counted][:, None])[:, 0]
        right = drafter.draft_to_target(out.logits.argmax(-1)) == target[counted]
        lps.append(logp.cpu())
        rights.append(right.cpu())
    return torch.cat(lps), torch.cat(rights)


def data_text(sset: Any) -> str:
    """What the samples are, for a sentence (``... on <data_text>``)."""
    if sset.source == "generated":
        return "the target's greedy answers to the built-in prompts"
    return f"{sset.source} {sset.path or ''}".strip()


def infer_boundaries(ctx: DoctorContext) -> BoundaryInference:
    """Score every candidate set on the live capture (one target pass; the drafter's position 0
    only, per candidate) and decide by the margin rule. Reads the directory, its engine reading and
    the samples from ``ctx``; the live capture keeps every candidate's boundaries (``ctx.capture_also``)."""
    from eyas.convention.boundaries import default_boundaries

    dd, L = ctx.dd, ctx.target.num_blocks
    S = dd.trained.num_slots
    try:
        default: list[int] | None = default_boundaries(L)
    except ValueError:
        default = None
    bases: list[tuple[Sequence[int] | None, str]] = [(dd.boundaries, "the assumed boundaries"),
                                                     (default, "the EAGLE-3 default")]
    for conv, reading in dd.meta.id_readings.items():
        if isinstance(reading, list):
            bases.append((reading, f"the ids read by the {conv} convention"))
    served = ctx.served
    if served.loadable and served.boundaries is not None:
        bases.append((served.boundaries, f"what {served.label} captures"))
    if default is not None:
        bases.append(([0] + default[1:], "the default with the embedding output first"))
    sets = candidate_sets(bases, S, L)
    ctx.capture_also.update(b for bs, _ in sets for b in bs)
    sset = ctx.sample_set
    data = data_text(sset)
    ctx.say(f"deciding the trained boundaries from live accuracy ({len(sets)} candidate sets)")
    cap = ctx.live_capture()
    drafter = ctx.drafter_cache.get(dd.trained_flags)

    def score(bs: list[int], label: str, idx: list[int]) -> ScoredSet:
        lp, right = position0(drafter, [sset.samples[i] for i in idx], lambda j: cap.features(idx[j], bs),
                              [cap.argmax[i] for i in idx])
        n = int(lp.numel())
        return ScoredSet(bs, label, float(lp.double().mean()) if n else -math.inf,
                         float(right.double().mean()) if n else 0.0, n, lp)

    everything = list(range(len(sset.samples)))
    ruled_out: list[ScoredSet] = []
    if len(everything) >= 2 * SCREEN_SAMPLES:
        screen = evenly(everything, SCREEN_SAMPLES)
        first = [score(bs, label, screen) for bs, label in sets]
        top = max(first, key=lambda s: s.log_likelihood)
        kept = []
        for (bs, label), s in zip(sets, first):
            lead, se = _lead_and_se(top, s)
            if s is not top and lead > max(INFER_MIN_LEAD, SCREEN_SIGMAS * se):
                ruled_out.append(replace(s, screened_out_on=len(screen), lp=None))
            else:
                kept.append((bs, label))
        sets = kept
    scored = [score(bs, label, everything) for bs, label in sets]
    best, lead, need, why = decide(scored)
    if ruled_out:
        why += (f"; {len(ruled_out)} other candidate sets were ruled out on {SCREEN_SAMPLES} samples (the best "
                f"there led each by more than {SCREEN_SIGMAS:g} standard errors)")
    scored.sort(key=lambda s: -s.log_likelihood)
    ruled_out.sort(key=lambda s: -s.log_likelihood)
    return BoundaryInference(scored + ruled_out, best.boundaries if best is not None else None, lead, need, why,
                             data)


def _lead_and_se(best: ScoredSet, other: ScoredSet) -> tuple[float, float]:
    """``best``'s mean per-token lead in log-likelihood over ``other`` (paired) and its standard error."""
    if best.lp is None or other.lp is None or best.lp.numel() != other.lp.numel() or best.lp.numel() < 2:
        return best.log_likelihood - other.log_likelihood, math.inf
    d = (best.lp - other.lp).double()
    return float(d.mean()), float(d.std()) / math.sqrt(d.numel())


@dataclass
class FlagInference:
    """A norm flag config.json states without evidence that it is the trained one, decided (or
    not) by the drafter's live prediction with the flag as written against it toggled."""

    flag: str
    written: bool
    decided: bool | None  # None: cannot decide
    why: str
    candidates: list[ScoredSet] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "written": self.written, "decided": self.decided, "why": self.why,
                "candidates": [c.to_dict() for c in self.candidates]}


def infer_flag(ctx: DoctorContext, flag: str, boundaries: Sequence[int]) -> FlagInference:
    """Score the drafter with ``flag`` as the directory states it and toggled, fed ``boundaries``
    (the trained ones) of the live capture, at position 0; decide by the margin rule."""
    dd = ctx.dd
    written = dd.trained_flags
    cap = ctx.live_capture()
    bs = [int(b) for b in boundaries]
    scored = []
    for value in (bool(written[flag]), not written[flag]):
        flags = dict(written, **{flag: value})
        label = f"{flag}={str(value).lower()}" + (" (as written)" if value == written[flag] else "")
        lp, right = position0(ctx.drafter_cache.get(flags), ctx.sample_set.samples,
                              lambda i: cap.features(i, bs), cap.argmax)
        n = int(lp.numel())
        scored.append(ScoredSet(bs, label, float(lp.double().mean()) if n else -math.inf,
                                float(right.double().mean()) if n else 0.0, n, lp))
    best, _, _, why = decide(scored)
    decided = None if best is None else (bool(written[flag]) if best is scored[0] else not written[flag])
    why = why.replace(f"{bs} ({scored[0].label})", scored[0].label).replace(f"{bs} ({scored[1].label})",
                                                                            scored[1].label)
    scored.sort(key=lambda s: -s.log_likelihood)
    return FlagInference(flag, bool(written[flag]), decided, why, scored)
