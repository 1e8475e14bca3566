"""Stage 4, fingerprint: per slot, what reaches the drafter against what it was trained on.

For each slot the observed statistics (mean and spread of the per-token RMS, a few channel means,
every token but the first: the rule of :mod:`eyas.capture.stats`) are held against the training
fingerprint (``contract.fingerprint``, which training copies from the shards manifest) as z-scores:

    rms_z      = (observed mean RMS - trained mean RMS) / trained per-token RMS std
    channel_z  = max over channels |observed mean - trained mean| / trained mean RMS

(a channel's per-token spread is about the slot's RMS). A slot is off when |rms_z| > 3, the RMS
ratio leaves [0.8, 1.25], or channel_z > 0.5. What an off slot resembles is found by comparing the
observed statistics with those of every boundary 0..L of the live target (and boundary L after
the final norm): the nearest one by

    distance(a, b) = |ln(rms_a / rms_b)| + mean over channels |mean_a - mean_b| / max(rms_a, rms_b)

and, the other way round, which live boundary the *training* statistics of the slot resemble
(the boundary the slot should be fed).

The thresholds alone miss a one-block shift at depth (neighbouring boundaries differ by less than
they allow), so resemblance decides too (:func:`match_slot`):

- a slot **shifted**: the boundary it looks like is not the one its training statistics are
  nearest to. It fails, with both distances of each side (a slot off the thresholds fails too),
  except when it is fed exactly the boundary training recorded and the two boundaries are within
  the noise of the match: then the record stands and the stage warns (statistics recorded in
  bf16 on a GPU and checked in float32 on a CPU differ by that much);
- otherwise a slot whose training statistics cannot tell their nearest boundary from the
  runner-up is **indistinct**: the runner-up is not farther by more than
  ``SEPARATION_MARGIN`` times the nearest one's own distance, the noise of the comparison
  (:data:`eyas.doctor.common.SEPARATION_MARGIN`). The stage warns, with the distances, instead of
  claiming a match: the fingerprint does not confirm that slot, the measured accuracy decides.

This module takes plain statistics, so ``eyas trace`` can hold an engine's observed junctions
against the same fingerprint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from eyas.contract.contract import SlotFingerprint
from eyas.doctor.common import (CHANNEL_OFF, FAIL, OK, RMS_RATIO_OFF, RMS_Z_OFF, SEPARATION_MARGIN, WARN, Stage,
                               boundary_name, slot_label)

if TYPE_CHECKING:
    from eyas.doctor.context import DoctorContext


def distance(a: SlotFingerprint, b: SlotFingerprint) -> float:
    ra, rb = max(a.rms_mean, 1e-12), max(b.rms_mean, 1e-12)
    d = abs(math.log(ra / rb))
    pairs = [(x, y) for c, x in zip(a.channels, a.channel_means) for c2, y in zip(b.channels, b.channel_means) if c == c2]
    if pairs:
        d += sum(abs(x - y) for x, y in pairs) / len(pairs) / max(ra, rb)
    return d


def nearest(stats: SlotFingerprint, candidates: dict[int, SlotFingerprint]) -> tuple[int, float]:
    best = min(candidates, key=lambda b: distance(stats, candidates[b]))
    return best, distance(stats, candidates[best])


def separable(d_near: float, d_other: float, margin: float = SEPARATION_MARGIN) -> bool:
    """Whether a boundary at ``d_other`` is told apart from the nearest one at ``d_near``: the gap
    exceeds ``margin`` times ``d_near``, the residual of the best match (the comparison's noise)."""
    return d_other - d_near > margin * d_near


@dataclass(frozen=True)
class SlotMatch:
    """Which live boundary a slot looks like, which one its training statistics match, and the
    distances (:func:`distance`) that decide; ``d_observed_*`` from the observed statistics,
    ``d_trained_*`` from the training statistics, to the boundary each names."""

    looks_like: int  # the live boundary nearest the observed statistics
    trained_matches: int  # the live boundary nearest the training statistics
    runner_up: int | None  # the live boundary second nearest the training statistics (None: only one)
    d_observed_looks: float
    d_observed_match: float
    d_trained_looks: float
    d_trained_match: float
    d_trained_runner_up: float | None

    @property
    def shifted(self) -> bool:
        """The slot looks like another boundary than the one its training statistics match."""
        return self.looks_like != self.trained_matches

    @property
    def shift_within_noise(self) -> bool:
        """A shifted slot whose two boundaries are within noise of each other, seen from training."""
        return self.shifted and not separable(self.d_trained_match, self.d_trained_looks)

    @property
    def indistinct(self) -> bool:
        """Not shifted, but the training statistics cannot tell their match from the runner-up."""
        return (not self.shifted and self.d_trained_runner_up is not None
                and not separable(self.d_trained_match, self.d_trained_runner_up))

    def to_dict(self) -> dict[str, Any]:
        return {"shifted": self.shifted, "indistinct": self.indistinct, "runner_up": self.runner_up,
                "distance_observed_to_looks_like": self.d_observed_looks,
                "distance_observed_to_trained_match": self.d_observed_match,
                "distance_trained_to_looks_like": self.d_trained_looks,
                "distance_trained_to_trained_match": self.d_trained_match,
                "distance_trained_to_runner_up": self.d_trained_runner_up}


def match_slot(observed: SlotFingerprint, trained: SlotFingerprint, live: dict[int, SlotFingerprint]) -> SlotMatch:
    """Observed and training statistics of one slot against every live boundary (``live``)."""
    looks, d_obs_looks = nearest(observed, live)
    by_trained = sorted(live, key=lambda b: distance(trained, live[b]))
    should, runner = by_trained[0], (by_trained[1] if len(by_trained) > 1 else None)
    return SlotMatch(
        looks_like=looks, trained_matches=should, runner_up=runner, d_observed_looks=d_obs_looks,
        d_observed_match=distance(observed, live[should]), d_trained_looks=distance(trained, live[looks]),
        d_trained_match=distance(trained, live[should]),
        d_trained_runner_up=distance(trained, live[runner]) if runner is not None else None)


def shift_text(i: int, m: SlotMatch, L: int) -> str:
    """Why slot ``i`` is shifted, with the distances to both boundaries from each side."""
    looks, should = boundary_name(m.looks_like, L), boundary_name(m.trained_matches, L)
    text = (f"slot {i} looks like {looks} (distance {m.d_observed_looks:.3g}; {m.d_observed_match:.3g} from "
            f"{should}), but the training statistics of slot {i} are nearest {should} of this target (distance "
            f"{m.d_trained_match:.3g}; {m.d_trained_looks:.3g} from {looks})")
    if m.shift_within_noise:
        text += (f"; the two are close for this target (the gap {m.d_trained_looks - m.d_trained_match:.3g} is "
                 f"within {SEPARATION_MARGIN:g} x {m.d_trained_match:.3g}, the noise of the match)")
    return text


def indistinct_text(i: int, m: SlotMatch, L: int) -> str:
    """Why slot ``i``'s match is not confirmed: its two nearest boundaries, with the distances."""
    assert m.runner_up is not None and m.d_trained_runner_up is not None
    should, runner = boundary_name(m.trained_matches, L), boundary_name(m.runner_up, L)
    return (f"slot {i}: {should} and {runner} cannot be told apart on this target: the training statistics of slot "
            f"{i} are {m.d_trained_match:.3g} from {should} and {m.d_trained_runner_up:.3g} from {runner}, a gap "
            f"within {SEPARATION_MARGIN:g} x {m.d_trained_match:.3g} (the noise of the match); the fingerprint does "
            f"not confirm slot {i}, the measured accuracy decides")


@dataclass(frozen=True)
class SlotComparison:
    """Observed slot statistics against the training fingerprint (formulas in the module docstring)."""

    rms_z: float
    rms_ratio: float
    channel_z: float

    @property
    def rms_off(self) -> bool:
        return abs(self.rms_z) > RMS_Z_OFF or not (1 / RMS_RATIO_OFF <= self.rms_ratio <= RMS_RATIO_OFF)

    @property
    def channel_off(self) -> bool:
        return self.channel_z > CHANNEL_OFF

    @property
    def off(self) -> bool:
        return self.rms_off or self.channel_off


def compare_slot(observed: SlotFingerprint, trained: SlotFingerprint) -> SlotComparison:
    rms_z = (observed.rms_mean - trained.rms_mean) / trained.rms_std if trained.rms_std > 0 else (
        0.0 if observed.rms_mean == trained.rms_mean else math.inf)
    ratio = observed.rms_mean / trained.rms_mean if trained.rms_mean > 0 else math.inf
    ch = [abs(o - t) for c, o in zip(observed.channels, observed.channel_means)
          for c2, t in zip(trained.channels, trained.channel_means) if c == c2]
    ch_z = max(ch) / trained.rms_mean if ch and trained.rms_mean > 0 else 0.0
    return SlotComparison(rms_z, ratio, ch_z)


@dataclass
class FingerprintSlot:
    """One slot: the boundary it is fed, its statistics against training's, and what it resembles."""

    slot: int
    served_boundary: int | str  # slot_label: an int, or "L+final_norm"
    trained_boundary: int
    rms_observed: float
    rms_trained: float
    rms_std_trained: float
    comparison: SlotComparison
    match: SlotMatch  # resemblance to every live boundary, with the distances
    looks_like: int | str  # the live boundary the observed statistics are nearest to
    looks_like_name: str
    trained_matches: int | str  # the live boundary the training statistics are nearest to
    trained_matches_name: str
    tokens_observed: int
    tokens_trained: int
    # fed the recorded boundary, leaning within noise towards a neighbour: warned, not failed
    shift_within_noise_of_record: bool = False

    @property
    def rms_z(self) -> float:
        return self.comparison.rms_z

    @property
    def shifted(self) -> bool:
        return self.match.shifted

    @property
    def indistinct(self) -> bool:
        """The fingerprint cannot confirm the slot (a warning): indistinct, or a shift within noise
        while fed the boundary training recorded."""
        return self.match.indistinct or self.shift_within_noise_of_record

    @property
    def off(self) -> bool:
        """Off the thresholds, or shifted (beyond noise, or away from the record): the slot fails the stage."""
        return self.comparison.off or (self.match.shifted and not self.shift_within_noise_of_record)

    def to_dict(self) -> dict[str, Any]:
        c = self.comparison
        return {"slot": self.slot, "served_boundary": self.served_boundary, "trained_boundary": self.trained_boundary,
                "rms_observed": self.rms_observed, "rms_trained": self.rms_trained,
                "rms_std_trained": self.rms_std_trained, "rms_z": c.rms_z, "rms_ratio": c.rms_ratio,
                "channel_z": c.channel_z, "off": self.off, "looks_like": self.looks_like,
                "looks_like_name": self.looks_like_name, "trained_matches": self.trained_matches,
                "trained_matches_name": self.trained_matches_name, "tokens_observed": self.tokens_observed,
                "tokens_trained": self.tokens_trained, **self.match.to_dict()}


@dataclass
class FingerprintResult:
    reference: str  # where the training fingerprint came from
    slots: list[FingerprintSlot]

    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "slots": [s.to_dict() for s in self.slots]}


def fingerprint_stage(ctx: DoctorContext) -> Stage[FingerprintResult]:
    """The served slots of the live capture against the training fingerprint (see the module docstring)."""
    ctx.live_capture()
    reading = ctx.served
    assert ctx.capture is not None
    return compare_fingerprints(ctx.reference, ctx.reference_source, reading.boundaries if reading.loadable else None,
                                ctx.capture.stats, ctx.target.num_blocks, reading.label)


def compare_fingerprints(reference: Sequence[SlotFingerprint] | None, reference_source: str,
                         served: Sequence[int] | None, boundary_stats: dict[int, SlotFingerprint],
                         num_blocks: int, engine_label: str) -> Stage[FingerprintResult]:
    """``served``: the boundary each slot is fed (None: the engine cannot serve); ``boundary_stats``:
    the live target's statistics of every boundary 0..L+1 (L+1 = boundary L after the final norm)."""
    st: Stage[FingerprintResult] = Stage("fingerprint")
    L = num_blocks
    if not reference:
        return st.skip("no training fingerprint")
    if served is None:
        return st.skip(f"{engine_label} cannot serve this directory")
    if len(served) != len(reference):
        return st.skip(f"{engine_label} feeds {len(served)} slots; the fingerprint has {len(reference)}")
    slots = []
    for i, (b, ref) in enumerate(zip(served, reference)):
        obs = boundary_stats[b]
        cmp = compare_slot(obs, ref)
        m = match_slot(obs, ref, boundary_stats)
        looks, should = m.looks_like, m.trained_matches
        slots.append(FingerprintSlot(
            slot=i, served_boundary=slot_label(b, L), trained_boundary=ref.boundary, rms_observed=obs.rms_mean,
            rms_trained=ref.rms_mean, rms_std_trained=ref.rms_std, comparison=cmp, match=m,
            looks_like=slot_label(looks, L), looks_like_name=boundary_name(looks, L),
            trained_matches=slot_label(should, L), trained_matches_name=boundary_name(should, L),
            tokens_observed=obs.num_tokens, tokens_trained=ref.num_tokens,
            shift_within_noise_of_record=m.shift_within_noise and b == ref.boundary))
        if cmp.off:
            st.add(FAIL, "slot_off",
                   f"slot {i} is off: per-token RMS {obs.rms_mean:.4g} against {ref.rms_mean:.4g} at training "
                   f"(z = {cmp.rms_z:+.1f}, ratio {cmp.rms_ratio:.2f}, channel shift {cmp.channel_z:.2f}); "
                   f"slot {i} looks like {boundary_name(looks, L)}; the training statistics of slot {i} match "
                   f"{boundary_name(should, L)} of this target"
                   + (f" (distance {m.d_trained_match:.3g}; {m.d_trained_looks:.3g} from {boundary_name(looks, L)})"
                      if m.shifted else ""),
                   field=f"slot {i}", expected=ref.boundary, found=slot_label(looks, L))
        elif slots[-1].shift_within_noise_of_record:
            # Fed exactly the boundary training recorded, and the statistics only lean, within their
            # noise, towards a neighbour (statistics recorded in bf16 on a GPU, checked in float32 on
            # a CPU, differ by this much): the record stands, the fingerprint does not confirm it.
            st.add(WARN, "slot_shift_within_noise",
                   f"slot {i} is fed {boundary_name(b, L)}, the boundary training recorded for it; "
                   f"{shift_text(i, m, L)}: the fingerprint cannot confirm slot {i}, the measured accuracy decides",
                   field=f"slot {i}", expected=slot_label(should, L), found=slot_label(looks, L))
        elif m.shifted:
            st.add(FAIL, "slot_shifted",
                   f"slot {i} is fed another boundary than its training statistics match, inside the z and ratio "
                   f"thresholds (z = {cmp.rms_z:+.1f}, ratio {cmp.rms_ratio:.2f}, channel shift "
                   f"{cmp.channel_z:.2f}): {shift_text(i, m, L)}",
                   field=f"slot {i}", expected=slot_label(should, L), found=slot_label(looks, L))
        elif m.indistinct:
            st.add(WARN, "slot_indistinct", indistinct_text(i, m, L), field=f"slot {i}",
                   expected=slot_label(should, L), found=slot_label(m.runner_up, L) if m.runner_up is not None else None)
    st.result = FingerprintResult(reference_source, slots)
    off = [r.slot for r in slots if r.off]
    indistinct = [r.slot for r in slots if r.indistinct]
    matched = [r for r in slots if not r.off and not r.indistinct]
    if matched:
        what = "every slot matches" if len(matched) == len(slots) else f"slots {[r.slot for r in matched]} match"
        st.add(OK, "fingerprint", f"{what} the training fingerprint (max |rms_z| "
               f"{max(abs(r.rms_z) for r in matched):.2f}, max channel shift "
               f"{max(r.comparison.channel_z for r in matched):.2f}, each nearest the boundary its training "
               f"statistics match)")
    if off:
        summary = f"slots {off} off the training fingerprint"
    elif indistinct:
        summary = f"slots {indistinct} cannot be told from a neighbouring boundary on this target"
    else:
        summary = "all slots match the training fingerprint"
    return st.settle(summary)
