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
restores when it is no further below the replay than a healthy live would be. The trained
protocol wins when it restores; otherwise the best restoring candidate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor

from eyas.doctor.capture import LiveCapture
from eyas.doctor.common import NORM_FLAGS, OK, SEARCH_POSITIONS, WARN, Stage, short_by, slots_text
from eyas.doctor.evaluate import accuracy, score


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
class SearchResult:
    stage: Stage
    winner: Protocol | None = None
    winner_summary: dict | None = None
    evaluated: list[dict] = field(default_factory=list)


def search_stage(needed: bool, why_not: str, served: list[int] | None, served_flags: dict[str, bool], L: int,
                 trained: list[int] | None, trained_flags: dict[str, bool] | None,
                 fingerprint_match: list[int] | None, cap: LiveCapture, samples: list, labels: list[Tensor],
                 drafter_for: Callable[[dict[str, bool]], Any], reference: dict, served_summary: dict | None,
                 steps: int) -> SearchResult:
    st = Stage("search")
    if not needed or served is None:
        return SearchResult(st.skip(why_not))
    k = min(steps, SEARCH_POSITIONS)
    ref = score(reference, k)
    base = score(served_summary, k) if served_summary else 0.0
    rows: list[dict] = []
    cands = candidates(served, served_flags, L, trained, trained_flags, fingerprint_match)

    def run(p: Protocol) -> dict:
        s = accuracy(drafter_for(p.flag_dict), samples, lambda i: cap.features(i, p.slots), labels, k)
        row = {"label": p.label, "kind": p.kind, "boundaries": slots_text(p.slots, L), "flags": p.flag_dict,
               "score": score(s, k), "accuracy_per_position": s["accuracy_per_position"],
               "restores": not short_by(score(s, k), ref), "protocol": p}
        rows.append(row)
        return row

    for p in cands:
        run(p)
    if not any(r["restores"] for r in rows):
        best = max((r for r in rows if r["kind"] in ("boundaries", "fingerprint")), key=lambda r: r["score"], default=None)
        if best is not None:
            bp: Protocol = best["protocol"]
            seen = {r["protocol"].key() for r in rows}
            for flag in NORM_FLAGS:
                fl = dict(bp.flag_dict, **{flag: not bp.flag_dict[flag]})
                if fl.get("norm_before_fc") and fl.get("fc_norm"):
                    continue
                p = Protocol(bp.slots, _flags(fl), f"{bp.label}, and {flag}={str(fl[flag]).lower()}", "combined")
                if p.key() not in seen:
                    run(p)
    restoring = [r for r in rows if r["restores"]]
    winner_row = next((r for r in restoring if r["kind"] == "trained"), None) or (
        max(restoring, key=lambda r: r["score"]) if restoring else None)
    rows.sort(key=lambda r: -r["score"])
    st.data.update({"positions_scored": k, "reference_score": ref, "served_score": base,
                    "candidates": [{kk: v for kk, v in r.items() if kk != "protocol"} for r in rows]})
    if winner_row is None:
        st.add(WARN, "no_protocol", f"none of {len(rows)} plausible protocols restores the replay accuracy "
               f"(best {rows[0]['score']:.3f} with {rows[0]['label']}, replay {ref:.3f}, served {base:.3f})"
               if rows else "no candidate protocol")
        return SearchResult(st.settle("no plausible protocol restores the replay accuracy"), evaluated=rows)
    wp: Protocol = winner_row["protocol"]
    full = accuracy(drafter_for(wp.flag_dict), samples, lambda i: cap.features(i, wp.slots), labels, steps)
    st.data["winner"] = {"label": wp.label, "kind": wp.kind, "boundaries": slots_text(wp.slots, L),
                         "flags": wp.flag_dict, "score": winner_row["score"], **full}
    st.add(OK, "restored", f"with {wp.label} (boundaries {slots_text(wp.slots, L)}) the replay accuracy returns: "
           f"{winner_row['score']:.3f} over the first {k} positions against {ref:.3f} in replay and {base:.3f} as served")
    return SearchResult(st.settle(f"restored by {wp.label}"), wp, full, rows)

