"""Stage 6, verdict: healthy, unverified or not healthy; the cause in one sentence, and the fix.

Healthy means no stage failed (warnings are listed, they do not fail) and the trained boundaries are
known. Unverified means nothing failed but the trained boundaries are an assumption that no evidence
here settled (no eyas.json, no training shards, no clear winner of the drafter's live accuracy on the
samples; ids that mean different boundaries to different tools, or no ids at all): unknown is not
healthy. Boundaries decided by live accuracy (:mod:`eyas.doctor.infer`) are known. Otherwise the cause
is the most fundamental failure, in this order: the directory cannot be read or loaded by the engine;
the target is not the one trained for; shapes and vocabularies do not fit; the engine captures other
boundaries; it builds the drafter with other norm flags; the chat template differs; then what only the
measurements show (a protocol the search found, replay short of training, live short of replay, a slot
off its fingerprint or fed another boundary than its training statistics match). The fix is the set of
config edits, in the chosen engine's convention, that every config-fixable failure needs (boundaries and
flags together when both are wrong), or the fix in words when no edit can help.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eyas.doctor.common import FAIL, WARN, DoctorStages, Edit, Finding, boundary_name, edits_text, slots_text
from eyas.doctor.fingerprint import FingerprintResult
from eyas.doctor.search import SearchResult
from eyas.interop.directory import DrafterDir
from eyas.interop.engines import boundary_edits
from eyas.interop.servers import EngineReading, flag_edit

PRIORITY = ("unreadable", "engine_cannot_load", "target_mismatch", "target_hidden_size", "fc_width", "vocab_size",
            "draft_vocab_size", "embedding", "d2t", "t2d", "boundaries_range", "uncapturable", "boundaries", "flag:",
            "template_mismatch", "checkpoint")


def _rank(f: Finding) -> int:
    for i, p in enumerate(PRIORITY):
        if f.code == p or (p.endswith(":") and f.code.startswith(p)):
            return i
    return len(PRIORITY)


def describe_boundaries(trained: list[int], served: list[int], L: int) -> str:
    S = len(trained)
    if served == [0] + trained[:-1]:
        return (f"slot 0 is the embedding output (boundary 0), every trained slot moves one place right and the last "
                f"one ({boundary_name(trained[-1], L)}) is dropped")
    if trained == [0] + served[:-1]:
        return (f"slot 0 was trained on the embedding output (boundary 0), which is not served: every slot is fed "
                f"the boundary of the next slot and a new last slot ({boundary_name(served[-1], L)}) is added")
    diffs = [s - t for s, t in zip(served, trained)]
    if len(set(diffs)) == 1 and abs(diffs[0]) == 1:
        return (f"every slot is fed the boundary one block {'after' if diffs[0] > 0 else 'before'} the one it was "
                f"trained on (off by one: the ids are read in another layer-numbering convention)")
    if sorted(served) == sorted(trained):
        return "the slots are fed in another order"
    parts = []
    for i, (t, s) in enumerate(zip(trained, served)):
        if t == s:
            continue
        if t == 0:
            parts.append(f"slot {i} was trained on the embedding output (boundary 0) but is fed {boundary_name(s, L)}")
        elif s == 0:
            parts.append(f"slot {i} is fed the embedding output (boundary 0) instead of {boundary_name(t, L)}")
        else:
            parts.append(f"slot {i} was trained on {boundary_name(t, L)} but is fed {boundary_name(s, L)}")
    return "; ".join(parts) if parts else f"{S} slots differ"


@dataclass
class Verdict:
    healthy: bool
    cause: str | None = None  # the most fundamental failure, in one sentence
    # Why nothing failed yet the doctor cannot call the drafter healthy (None: it could): the trained
    # boundaries are assumed and no evidence here settled them. Such a run is neither healthy nor failed.
    unverified: str | None = None
    fix: str | None = None  # the config edits in words, then the fix in words when no edit helps
    fix_edits: list[Edit] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # "stage: message" of every warning
    problems: list[str] = field(default_factory=list)  # "code: message" of every failure


def _fingerprint_evidence(fp: FingerprintResult | None) -> str:
    rows = [r for r in (fp.slots if fp is not None else []) if r.off]
    if not rows:
        return ""
    bits = [f"slot {r.slot} looks like {r.looks_like_name} (RMS z = {r.rms_z:+.1f} against training"
            + (f"; its training statistics match {r.trained_matches_name}" if r.shifted else "") + ")"
            for r in rows[:3]]
    return "; the fingerprint shows " + ", ".join(bits)


def _search_evidence(search: SearchResult | None) -> str:
    if search is None or search.winner is None:
        return ""
    k = search.positions_scored
    return (f"; the search confirms it: with {search.winner.protocol.label}, live accuracy (mean over the first {k} "
            f"draft positions) returns to {search.winner.score:.3f} (replay {search.reference_score:.3f}, as served "
            f"{search.served_score:.3f})")


def verdict(stages: DoctorStages, dd: DrafterDir | None, reading: EngineReading | None, L: int) -> Verdict:
    fails = [f for st in stages.values() for f in st.findings if f.level == FAIL]
    warnings = [f"{name}: {f.message}" for name, st in stages.items() for f in st.findings if f.level == WARN]
    out = Verdict(healthy=not fails, warnings=warnings, problems=[f"{f.code}: {f.message}" for f in fails])
    if not fails:
        # Unknown is not healthy: boundaries the directory does not record, which no training shards
        # settled, leave every check above comparing the drafter with an assumption.
        assumed = next((f for f in stages.static.findings if f.code == "boundaries_assumed"), None)
        if assumed is not None:
            out.healthy = False
            out.unverified = (f"{assumed.message}. Every check passed against those boundaries, but no evidence here "
                              f"says the drafter was trained on them: give the doctor its training shards (--data), "
                              f"a directory with an eyas.json, or conversations (--data) on which the drafter's "
                              f"live accuracy clearly prefers one boundary set, or name the ids' convention "
                              f"(--ids-convention) if you know it")
        return out
    static_fails = sorted(stages.static.failures(), key=_rank)
    label = reading.label if reading is not None else "the engine"
    search = stages.search.result
    fingerprint = stages.fingerprint.result

    # Every config-fixable static failure contributes its edits (boundaries and flags together).
    edits: list[Edit] = []
    for f in static_fails:
        for e in f.edits:
            if e not in edits:
                edits.append(e)
    cause: str | None = None
    words: str | None = None

    if static_fails:
        top = static_fails[0]
        if top.code == "boundaries" and isinstance(top.found, list) and dd is not None and reading is not None:
            trained, served = list(top.expected), list(top.found)
            cause = (f"{label} feeds the drafter boundaries {served} ({reading.boundaries_note}) but it was trained on "
                     f"{trained}: {describe_boundaries(trained, served, L)}"
                     + (f" ({reading.why_not})" if not reading.loadable and reading.why_not else "")
                     + _fingerprint_evidence(fingerprint) + _search_evidence(search))
            if not top.edits:
                words = top.fix or top.message
        elif top.code.startswith("flag:"):
            cause = top.message + _search_evidence(search)
        else:
            cause = top.message
            words = top.fix
    elif search is not None and search.winner is not None and dd is not None and reading is not None:
        # Nothing recorded says what is wrong, but a protocol restores the accuracy: fix towards it.
        wp = search.winner.protocol
        slots = list(wp.slots)
        if slots != list(reading.boundaries or []):
            if L + 1 in slots:
                words = (f"the drafter was trained on boundary {L} AFTER the target's final norm, which no engine "
                         f"captures: retrain it on pre-norm features (eyas train)")
            else:
                e, problem = boundary_edits(dd, reading, slots, L)
                edits += e
                words = problem
        for f, v in wp.flag_dict.items():
            if reading.flags.get(f) != v:
                edits.append(flag_edit(f, v))
        cause = (f"served as {label} serves it (boundaries {slots_text(reading.boundaries or [], L)}) the drafter falls "
                 f"short of its replay accuracy, and with {wp.label} (boundaries {slots_text(slots, L)}) it returns"
                 + _fingerprint_evidence(fingerprint))
    else:
        order = ("replay", "live", "fingerprint")
        first = next((f for name in order for f in stages[name].findings if f.level == FAIL), fails[0])
        cause = first.message
        if first.code == "replay_short":
            words = ("the drafter does not reproduce its training accuracy on its own samples: check that the weights "
                     "are the trained ones and that the target is the training target, or retrain")
        elif first.code == "live_short":
            cause += "; no plausible protocol restores it"
            words = "no config edit found: compare the engine's capture with `eyas trace`"
        elif first.code in ("slot_off", "slot_shifted"):
            words = "feed each slot the boundary its training statistics match (see the fingerprint stage)"
    out.cause = cause
    out.fix_edits = edits
    fix = edits_text(edits, str(dd.path)) if edits and dd is not None else None
    if words and fix:
        fix = f"{fix}; {words}"
    out.fix = fix or words
    return out
