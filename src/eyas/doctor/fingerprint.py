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
(the boundary the slot should be fed). This module takes plain statistics, so ``eyas trace`` can
hold an engine's observed junctions against the same fingerprint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from eyas.contract.contract import SlotFingerprint
from eyas.doctor.common import CHANNEL_OFF, FAIL, OK, RMS_RATIO_OFF, RMS_Z_OFF, Stage, boundary_name, slot_label

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
    looks_like: int | str  # the live boundary the observed statistics are nearest to
    looks_like_name: str
    trained_matches: int | str  # the live boundary the training statistics are nearest to
    trained_matches_name: str
    tokens_observed: int
    tokens_trained: int

    @property
    def rms_z(self) -> float:
        return self.comparison.rms_z

    @property
    def off(self) -> bool:
        return self.comparison.off

    def to_dict(self) -> dict[str, Any]:
        c = self.comparison
        return {"slot": self.slot, "served_boundary": self.served_boundary, "trained_boundary": self.trained_boundary,
                "rms_observed": self.rms_observed, "rms_trained": self.rms_trained,
                "rms_std_trained": self.rms_std_trained, "rms_z": c.rms_z, "rms_ratio": c.rms_ratio,
                "channel_z": c.channel_z, "off": c.off, "looks_like": self.looks_like,
                "looks_like_name": self.looks_like_name, "trained_matches": self.trained_matches,
                "trained_matches_name": self.trained_matches_name, "tokens_observed": self.tokens_observed,
                "tokens_trained": self.tokens_trained}


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
        looks, _ = nearest(obs, boundary_stats)
        should, _ = nearest(ref, boundary_stats)
        slots.append(FingerprintSlot(
            slot=i, served_boundary=slot_label(b, L), trained_boundary=ref.boundary, rms_observed=obs.rms_mean,
            rms_trained=ref.rms_mean, rms_std_trained=ref.rms_std, comparison=cmp, looks_like=slot_label(looks, L),
            looks_like_name=boundary_name(looks, L), trained_matches=slot_label(should, L),
            trained_matches_name=boundary_name(should, L), tokens_observed=obs.num_tokens,
            tokens_trained=ref.num_tokens))
        if cmp.off:
            st.add(FAIL, "slot_off",
                   f"slot {i} is off: per-token RMS {obs.rms_mean:.4g} against {ref.rms_mean:.4g} at training "
                   f"(z = {cmp.rms_z:+.1f}, ratio {cmp.rms_ratio:.2f}, channel shift {cmp.channel_z:.2f}); "
                   f"slot {i} looks like {boundary_name(looks, L)}; the training statistics of slot {i} match "
                   f"{boundary_name(should, L)} of this target",
                   field=f"slot {i}", expected=ref.boundary, found=slot_label(looks, L))
    st.result = FingerprintResult(reference_source, slots)
    off = [r.slot for r in slots if r.off]
    if not off:
        st.add(OK, "fingerprint", f"every slot matches the training fingerprint (max |rms_z| "
               f"{max(abs(r.rms_z) for r in slots):.2f}, max channel shift "
               f"{max(r.comparison.channel_z for r in slots):.2f})")
    return st.settle(f"slots {off} off the training fingerprint" if off else "all slots match the training fingerprint")
