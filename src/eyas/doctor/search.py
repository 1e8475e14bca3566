"""Stage 5, search: when live falls short of replay, which protocol would restore it.

Starting from the engine's protocol (its boundaries in its slot order, its norm flags), every
plausible way the two sides can disagree is tried on the live capture of the same tokens:

- the trained protocol as recorded (eyas.json), and the boundaries the training fingerprint
  matches on this target;
- every boundary shifted by one (all slots together: a numbering convention; each slot alone);
- the embedding in or out: boundary 0 prepended (last slot dropped) or put in place of slot 0;
  slot 0 dropped and a late boundary appended;
- every other slot order;
- boundary L after the final norm instead of before it (and as the last slot, either way: a
  trainer that took HF ``output_hidden_states[-1]`` fed the post-norm state);
- each norm flag toggled; then, if nothing restores, the best boundaries with each flag toggled.

Each candidate is scored by its mean accuracy over the first two draft positions (position 0
reads the target's features, position 1 the drafter's fed-back state, so every flag shows); it
restores when it is no further below the replay than a healthy live would be. Candidates are
screened first on a few samples (:class:`_Scorer`): one that cannot restore even allowing for
the noise of so few tokens is ruled out there, so the worst case (nothing restores) costs about a
quarter of scoring every candidate on every sample. The trained
protocol wins when it restores, and then the search stops there (it is tried first; the other
candidates could not change the winner); otherwise the best restoring candidate.

Each measurement on the live capture is made once per (slots, flags) and shared with replay and
live (:meth:`eyas.doctor.context.DoctorContext.live_accuracy`): the trained protocol's score is
the replay's own run when replay ran on the live capture, and the winner's run over every draft
position is reused when it was already made.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eyas.doctor.common import (NORM_FLAGS, OK, SCREEN_SAMPLES, SCREEN_SIGMAS, SEARCH_POSITIONS, WARN, Stage, short_by,
                               slots_text)
from eyas.doctor.evaluate import Accuracy
from eyas.doctor.fingerprint import nearest
from eyas.doctor.samples import evenly

if TYPE_CHECKING:
    from eyas.doctor.context import DoctorContext


@dataclass(frozen=True)
class Protocol:
    slots: tuple[int, ...]  # boundary per slot; L+1 = boundary L after the final norm
    flags: tuple[tuple[str, bool], ...]
    label: str
    kind: str = "boundaries"  # trained | fingerprint | boundaries | flags | combined | served

    @property
    def flag_dict(self) -> dict[str, bool]:
        return dict(self.flags)

    def key(self) -> tuple:
        return (self.slots, self.flags)


def _flags(d: dict[str, bool]) -> tuple[tuple[str, bool], ...]:
    return tuple((f, bool(d[f])) for f in NORM_FLAGS)


def candidates(served: list[int], served_flags: dict[str, bool], L: int, trained: list[int] | None,
               trained_flags: dict[str, bool] | None, fingerprint_match: list[int] | None) -> list[Protocol]:
    S = len(served)
    post = L + 1
    sf = _flags(served_flags)
    out: list[Protocol] = []

    def add(slots: Any, label: str, kind: str = "boundaries", flags: tuple = sf) -> None:
        slots = tuple(int(b) for b in slots)
        if len(slots) != S or len(set(slots)) != S or any(not 0 <= b <= post for b in slots):
            return
        if post in slots and L in slots:
            return
        fd = dict(flags)
        if fd.get("norm_before_fc") and fd.get("fc_norm"):
            return
        p = Protocol(slots, tuple(flags), label, kind)
        if p.key() != (tuple(served), sf) and all(p.key() != q.key() for q in out):
            out.append(p)

    if trained is not None and trained_flags is not None:
        add(trained, "the trained boundaries and norm flags", "trained", _flags(trained_flags))
        add(trained, "the trained boundaries")
    if fingerprint_match is not None:
        add(fingerprint_match, "the boundaries the training fingerprint matches on this target", "fingerprint")
    for d in (1, -1):
        add([b + d for b in served], f"every boundary {'+1' if d > 0 else '-1'} (the other layer-id convention)")
    for i in range(S):
        for d in (1, -1):
            add([b + d if j == i else b for j, b in enumerate(served)], f"slot {i} {'+1' if d > 0 else '-1'}")
    add([0] + served[:-1], "embedding in: boundary 0 prepended, last slot dropped")
    add([0] + served[1:], "embedding in: boundary 0 in place of slot 0")
    for extra in dict.fromkeys((L - 3, L - 1, L)):
        add(served[1:] + [extra], f"embedding out: slot 0 dropped, boundary {extra} appended")
    for perm in itertools.permutations(range(S)):
        if list(perm) != list(range(S)):
            add([served[p] for p in perm], f"slot order {list(perm)}")
    if L in served:
        add([post if b == L else b for b in served], f"boundary {L} after the final norm")
    if post in served:
        add([L if b == post else b for b in served], f"boundary {L} before the final norm")
    add(served[:-1] + [post], f"last slot: boundary {L} after the final norm (HF output_hidden_states[-1])")
    add(served[:-1] + [L], f"last slot: boundary {L} before the final norm")
    for flag in NORM_FLAGS:
        toggled = dict(served_flags, **{flag: not served_flags[flag]})
        add(served, f"{flag}={str(not served_flags[flag]).lower()}", "flags", _flags(toggled))
    return out


@dataclass
class ScoredProtocol:
    """A candidate protocol and how the drafter does with it on the live capture."""

    protocol: Protocol
    boundaries: str  # the slots as text (slot L+1 written "L+final_norm")
    score: float  # mean accuracy over the first positions_scored draft positions
    accuracy_per_position: list[float]  # those first positions
    restores: bool  # no further below the replay than a healthy live would be
    screened_out_on: int | None = None  # ruled out on this many samples (score measured on them only)

    def to_dict(self) -> dict[str, Any]:
        p = self.protocol
        return {"label": p.label, "kind": p.kind, "boundaries": self.boundaries, "flags": p.flag_dict,
                "score": self.score, "accuracy_per_position": self.accuracy_per_position, "restores": self.restores,
                "screened_out_on": self.screened_out_on}


@dataclass
class SearchResult:
    positions_scored: int
    reference_score: float  # the replay's score
    served_score: float  # the engine's protocol's score (live)
    candidates: list[ScoredProtocol]  # best score first
    winner: ScoredProtocol | None = None
    winner_accuracy: Accuracy | None = None  # the winner over every draft position

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"positions_scored": self.positions_scored, "reference_score": self.reference_score,
                             "served_score": self.served_score, "candidates": [c.to_dict() for c in self.candidates]}
        if self.winner is not None and self.winner_accuracy is not None:
            w = self.winner.to_dict()
            d["winner"] = {k: w[k] for k in ("label", "kind", "boundaries", "flags", "score")} | self.winner_accuracy.to_dict()
        return d


def hopeless(screen_score: float, tokens: int, reference: float) -> bool:
    """Whether a candidate scoring ``screen_score`` over ``tokens`` screening tokens cannot restore
    the ``reference``: even ``SCREEN_SIGMAS`` binomial standard errors higher it is short of it."""
    se = math.sqrt(max(screen_score * (1 - screen_score), 1e-4) / max(tokens, 1))
    return short_by(min(1.0, screen_score + SCREEN_SIGMAS * se), reference)


class _Scorer:
    """Scores protocols on the live capture: the drafter built with the protocol's flags, fed the
    protocol's slots of the same samples, over the first ``positions`` draft positions.

    Screening: with at least 2 x SCREEN_SAMPLES samples, a candidate other than the trained one is
    first scored on SCREEN_SAMPLES evenly spaced samples and, when :func:`hopeless`, ruled out
    there (its row says on how many samples); the others are scored on every sample. Only a
    candidate scored on every sample can restore."""

    def __init__(self, ctx: DoctorContext, positions: int, reference: float) -> None:
        self.ctx, self.positions, self.reference = ctx, positions, reference
        self.scored: list[ScoredProtocol] = []
        n = len(ctx.sample_set.samples)
        self.screen = tuple(evenly(range(n), SCREEN_SAMPLES)) if n >= 2 * SCREEN_SAMPLES else None

    def accuracy(self, p: Protocol, positions: int) -> Accuracy:
        return self.ctx.live_accuracy(p.slots, p.flag_dict, positions)  # the replay's run, for the trained protocol

    def run(self, p: Protocol) -> ScoredProtocol:
        L = self.ctx.target.num_blocks
        if self.screen is not None and p.kind != "trained":
            a = self.ctx.live_accuracy(p.slots, p.flag_dict, self.positions, subset=self.screen)
            score = a.score(self.positions)
            if hopeless(score, a.tokens_counted, self.reference):
                row = ScoredProtocol(p, slots_text(p.slots, L), score, a.accuracy_per_position, False, len(self.screen))
                self.scored.append(row)
                return row
        a = self.accuracy(p, self.positions)
        score = a.score(self.positions)
        row = ScoredProtocol(p, slots_text(p.slots, L), score, a.accuracy_per_position,
                             not short_by(score, self.reference))
        self.scored.append(row)
        return row


def _combined(best: Protocol) -> list[Protocol]:
    """``best``'s slots with each norm flag toggled (never norm_before_fc together with fc_norm)."""
    out = []
    for flag in NORM_FLAGS:
        fl = dict(best.flag_dict, **{flag: not best.flag_dict[flag]})
        if fl.get("norm_before_fc") and fl.get("fc_norm"):
            continue
        out.append(Protocol(best.slots, _flags(fl), f"{best.label}, and {flag}={str(fl[flag]).lower()}", "combined"))
    return out


def search_stage(ctx: DoctorContext) -> Stage[SearchResult]:
    """Run only when live falls short of replay: score the candidate protocols, the trained one
    first (when it restores it wins and the rest are not scored); if none restores, the best
    boundaries with each flag toggled; else the best restoring one wins. The winner is then
    measured over every draft position."""
    st: Stage[SearchResult] = Stage("search")
    live, reading = ctx.stages.live, ctx.served
    served = reading.boundaries if reading.loadable else None
    if not any(f.code == "live_short" for f in live.findings) or served is None:
        return st.skip("live matches replay" if live.status != "skipped" else f"no live run: {live.summary}")
    replay = ctx.stages.replay.result
    assert replay is not None and live.result is not None  # live_short compares the two
    cap, L = ctx.live_capture(), ctx.target.num_blocks
    assert ctx.reference is not None
    fingerprint_match = [nearest(r, cap.stats)[0] for r in ctx.reference]  # the boundary each trained slot resembles
    ctx.say("searching the plausible protocols")
    cap.ensure(ctx.model, ctx.sample_set.samples, fingerprint_match)
    k = min(ctx.steps, SEARCH_POSITIONS)
    ref, base = replay.accuracy.score(k), live.result.accuracy.score(k)
    scorer = _Scorer(ctx, k, ref)
    dd = ctx.dd
    for p in candidates(served, reading.flags, L, ctx.trained, dd.trained_flags, fingerprint_match):
        if scorer.run(p).restores and p.kind == "trained":
            break  # decided: the trained protocol wins when it restores, whatever the others score
    if not any(r.restores for r in scorer.scored):
        best = max((r for r in scorer.scored if r.protocol.kind in ("boundaries", "fingerprint")),
                   key=lambda r: r.score, default=None)
        if best is not None:
            seen = {r.protocol.key() for r in scorer.scored}
            for p in _combined(best.protocol):
                if p.key() not in seen:
                    scorer.run(p)
    rows = scorer.scored
    restoring = [r for r in rows if r.restores]
    winner = next((r for r in restoring if r.protocol.kind == "trained"), None) or (
        max(restoring, key=lambda r: r.score) if restoring else None)
    rows.sort(key=lambda r: -r.score)
    st.result = SearchResult(k, ref, base, rows)
    if winner is None:
        st.add(WARN, "no_protocol", f"none of {len(rows)} plausible protocols restores the replay accuracy "
               f"(best {rows[0].score:.3f} with {rows[0].protocol.label}, replay {ref:.3f}, served {base:.3f})"
               if rows else "no candidate protocol")
        return st.settle("no plausible protocol restores the replay accuracy")
    wp = winner.protocol
    st.result.winner, st.result.winner_accuracy = winner, scorer.accuracy(wp, ctx.steps)
    st.add(OK, "restored", f"with {wp.label} (boundaries {winner.boundaries}) the replay accuracy returns: "
           f"{winner.score:.3f} over the first {k} positions against {ref:.3f} in replay and {base:.3f} as served")
    return st.settle(f"restored by {wp.label}")
