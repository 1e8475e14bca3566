"""The doctor's fingerprint stage on constructed slot statistics: a one-block shift at depth stays
inside the z and ratio thresholds, so resemblance (the nearest live boundary, by
:func:`eyas.doctor.fingerprint.distance`) must decide; and two boundaries that the statistics cannot
tell apart are reported as such, never as a match.

The live target: 12 blocks whose per-token RMS grows 6 % a block, with two channels drifting a
little; the spread of the per-token RMS (0.4) is wide, so neighbouring boundaries are well inside
|z| <= 3 and the ratio band of each other. Training statistics are the live ones, 0.5 % off (other
texts).
"""

from __future__ import annotations

import pytest

from eyas.contract import SlotFingerprint
from eyas.doctor.common import DoctorStages, boundary_name
from eyas.doctor.fingerprint import compare_fingerprints, compare_slot, match_slot, separable
from eyas.doctor.verdict import verdict

L = 12


def fp(b: int, rms: float, means: tuple[float, float], std: float = 0.4, n: int = 500) -> SlotFingerprint:
    return SlotFingerprint(boundary=b, rms_mean=rms, rms_std=std, channels=[0, 1], channel_means=list(means),
                           num_tokens=n)


def live_target(flat: tuple[int, int] | None = None) -> dict[int, SlotFingerprint]:
    """Boundaries 0..L+1; ``flat=(a, b)``: boundary b made a copy of boundary a, 0.1 % louder."""
    live = {b: fp(b, 1.06 ** b, (0.02 * b, -0.01 * b)) for b in range(L + 1)}
    live[L + 1] = fp(L + 1, 3.0, (0.5, 0.5))  # after the final norm
    if flat is not None:
        a, b = flat
        live[b] = fp(b, live[a].rms_mean * 1.001, tuple(live[a].channel_means))
    return live


def training(live: dict[int, SlotFingerprint], boundaries: list[int], scale: float = 1.005) -> list[SlotFingerprint]:
    return [fp(b, live[b].rms_mean * scale, tuple(live[b].channel_means)) for b in boundaries]


@pytest.mark.unit
def test_a_one_block_shift_inside_the_thresholds_fails_with_the_distances():
    live = live_target()
    reference = training(live, [3, 6, 9])
    # the defect: served [2, ...] for trained [3, ...] is inside every threshold, so the old stage passed it
    assert not compare_slot(live[2], reference[0]).off
    st = compare_fingerprints(reference, "the shards manifest", [2, 6, 9], live, L, "vLLM")
    assert st.status == "fail" and "[0]" in st.summary
    fails = [f for f in st.findings if f.level == "fail"]
    assert [(f.code, f.field, f.expected, f.found) for f in fails] == [("slot_shifted", "slot 0", 3, 2)]
    m = match_slot(live[2], reference[0], live)
    assert m.shifted and (m.looks_like, m.trained_matches) == (2, 3) and not m.shift_within_noise
    assert m.d_trained_match < m.d_trained_looks and m.d_observed_looks == 0 < m.d_observed_match
    msg = fails[0].message
    assert "slot 0 looks like boundary 2 (output of block 1)" in msg
    assert "nearest boundary 3 (output of block 2)" in msg
    for d in (m.d_trained_match, m.d_trained_looks, m.d_observed_match):
        assert f"{d:.3g}" in msg
    slot0 = st.result.slots[0]
    assert slot0.off and slot0.shifted and slot0.looks_like == 2 and slot0.trained_matches == 3
    assert slot0.to_dict()["distance_trained_to_trained_match"] == m.d_trained_match
    assert not any(s.off for s in st.result.slots[1:])
    # the verdict fails on it and names the slot, the boundary it looks like and the one training matches
    v = verdict(_with(st), None, None, L)
    assert not v.healthy and v.cause == msg and "feed each slot the boundary" in v.fix


@pytest.mark.unit
def test_a_healthy_slot_set_still_passes():
    live = live_target()
    st = compare_fingerprints(training(live, [3, 6, 9]), "the shards manifest", [3, 6, 9], live, L, "vLLM")
    assert st.status == "pass" and st.summary == "all slots match the training fingerprint"
    assert [f.level for f in st.findings] == ["ok"] and st.findings[0].message.startswith("every slot matches")
    assert all(not s.off and not s.shifted and not s.indistinct for s in st.result.slots)


@pytest.mark.unit
def test_boundaries_the_statistics_cannot_tell_apart_are_reported_not_matched():
    live = live_target(flat=(6, 7))  # boundary 7 is boundary 6, 0.1 % louder: a block that writes nearly nothing
    reference = training(live, [3, 6, 9], scale=0.99)  # training 1 % quieter (other texts): more than 6 vs 7 differ
    m = match_slot(live[6], reference[1], live)
    assert (m.trained_matches, m.runner_up) == (6, 7) and not m.shifted and m.indistinct
    assert not separable(m.d_trained_match, m.d_trained_runner_up)
    st = compare_fingerprints(reference, "the shards manifest", [3, 6, 9], live, L, "SGLang")
    assert st.status == "warn" and "[1]" in st.summary and "told" in st.summary
    warn = next(f for f in st.findings if f.level == "warn")
    assert warn.code == "slot_indistinct" and warn.field == "slot 1"
    assert boundary_name(6, L) in warn.message and boundary_name(7, L) in warn.message
    assert "cannot be told apart" in warn.message
    assert f"{m.d_trained_match:.3g}" in warn.message and f"{m.d_trained_runner_up:.3g}" in warn.message
    ok = next(f for f in st.findings if f.level == "ok")
    assert ok.message.startswith("slots [0, 2] match")  # no claim that every slot matches
    assert st.result.slots[1].indistinct and not st.result.slots[1].off
    assert verdict(_with(st), None, None, L).healthy  # a warning: the measured accuracy decides
    # fed the neighbour the statistics cannot tell apart: still a failure (a shift), said to be within noise
    st = compare_fingerprints(reference, "the shards manifest", [3, 7, 9], live, L, "SGLang")
    shifted = [f for f in st.findings if f.code == "slot_shifted"]
    assert st.status == "fail" and len(shifted) == 1 and shifted[0].field == "slot 1"
    assert "the two are close for this target" in shifted[0].message


@pytest.mark.unit
def test_fed_the_recorded_boundary_a_lean_within_noise_is_a_warning():
    """The shipped SmolLM2 drafter: fingerprint recorded in bf16 on a GPU, checked in float32 on a
    CPU; slot 1 is fed boundary 15 as recorded, its statistics lean within noise to 14. The record
    stands (a warning); the same lean with a served boundary other than the record fails (above)."""
    live = live_target(flat=(6, 7))
    reference = training(live, [3, 6, 9], scale=0.99)
    reference[1] = fp(7, reference[1].rms_mean, tuple(reference[1].channel_means))  # recorded: trained on 7
    m = match_slot(live[7], reference[1], live)
    assert m.shifted and m.shift_within_noise and (m.looks_like, m.trained_matches) == (7, 6)
    st = compare_fingerprints(reference, "the contract", [3, 7, 9], live, L, "eyas")
    assert st.status == "warn" and not [f for f in st.findings if f.level == "fail"]
    warn = next(f for f in st.findings if f.code == "slot_shift_within_noise")
    assert warn.field == "slot 1" and "the boundary training recorded" in warn.message
    assert st.result.slots[1].indistinct and not st.result.slots[1].off
    assert verdict(_with(st), None, None, L).healthy
    # served away from the record (7 for a recorded 6), the same lean fails
    st2 = compare_fingerprints(training(live, [3, 6, 9], scale=0.99), "the contract", [3, 7, 9], live, L, "SGLang")
    assert st2.status == "fail" and any(f.code == "slot_shifted" for f in st2.findings)


@pytest.mark.unit
def test_separation_margin():
    assert separable(0.01, 0.021) and not separable(0.01, 0.0199) and not separable(0.0, 0.0)
    assert separable(0.0, 1e-9)  # an exact match: any gap tells the boundaries apart


def _with(st) -> DoctorStages:
    stages = DoctorStages()
    stages.fingerprint = st
    return stages


@pytest.mark.unit
def test_trace_names_a_shifted_slot_with_the_fingerprint_stages_match():
    """`eyas trace` holds each slot with the same resemblance: a slot fed boundary 2 whose training
    statistics (recorded as boundary 2: the record itself is wrong) match boundary 3 is off, inside the
    thresholds, and named with the distances; fed the recorded boundary within noise, it warns."""
    from eyas.doctor.trace import slot_findings, slot_row

    live = live_target()
    reference = training(live, [3, 6, 9])
    recorded_as_2 = fp(2, reference[0].rms_mean, tuple(reference[0].channel_means))
    row = slot_row(0, 2, None, [2, 6, 9], live[2], recorded_as_2, live, L)
    assert not row.boundary_mismatch and not row.comparison.off  # the old checks saw nothing
    assert row.shifted and row.off and row.match.trained_matches == 3 and row.looks_like == 2
    problems, warnings = slot_findings(row, L)
    assert len(problems) == 1 and "inside the z and ratio thresholds" in problems[0]
    assert "slot 0 looks like boundary 2 (output of block 1)" in problems[0]
    assert "nearest boundary 3 (output of block 2)" in problems[0] and f"{row.match.d_trained_match:.3g}" in problems[0]
    assert row.verdict.startswith("OFF: shifted") and row.to_dict()["shifted"] is True
    # fed the boundary its statistics match: nothing to say
    ok = slot_row(0, 3, None, [3, 6, 9], live[3], reference[0], live, L)
    assert not ok.shifted and not ok.off and slot_findings(ok, L) == ([], [])
    # fed the recorded boundary, leaning within noise towards a neighbour: a warning, not a problem
    flat = live_target(flat=(6, 7))
    ref7 = fp(7, flat[6].rms_mean * 0.99, tuple(flat[6].channel_means))  # recorded 7, statistics nearer 6
    lean = slot_row(1, 7, None, [3, 7, 9], flat[7], ref7, flat, L)
    assert lean.match.shifted and not lean.shifted and lean.shift_within_noise_of_record and not lean.off
    problems, warnings = slot_findings(lean, L)
    assert problems == [] and len(warnings) == 1 and "this request cannot confirm slot 1" in warnings[0]
