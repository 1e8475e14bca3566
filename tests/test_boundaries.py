"""The layer convention (docs/conventions.md) and the converters to every engine's ids (each in its
server module of eyas.interop.servers)."""

from __future__ import annotations

import random

import pytest

from eyas.convention.boundaries import (
    BoundaryError,
    CaptureSpec,
    boundaries_to_hf_indices,
    default_boundaries,
    hf_indices_to_boundaries,
    parse_boundaries,
    validate_boundaries,
)
from eyas.interop.servers.sglang import (
    SGLangRule,
    boundaries_to_sglang_ids,
    sglang_ids_to_boundaries,
    sglang_rules_agree,
)
from eyas.interop.servers.vllm import boundaries_to_vllm_ids, vllm_ids_to_boundaries

pytestmark = pytest.mark.unit

LEGACY, PR = SGLangRule.LEGACY, SGLangRule.PR25454


# ---------------------------------------------------------------------------------------------
# defaults and validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "L, expected",
    [(7, [2, 3, 4]), (10, [2, 5, 7]), (24, [2, 12, 21]), (30, [2, 15, 27]), (32, [2, 16, 29]),
     (61, [2, 30, 58]), (80, [2, 40, 77])],
)
def test_default_boundaries(L, expected):
    assert default_boundaries(L) == expected
    assert CaptureSpec.default(L).boundaries == tuple(expected)
    assert CaptureSpec.create(L).boundaries == tuple(expected)
    assert CaptureSpec.create(L, None).num_slots == 3


@pytest.mark.parametrize("L", [0, 1, 4, 5, 6])
def test_default_boundaries_too_few_blocks(L):
    # With L = 5 or 6 the formula would give repeated boundaries ([2, 2, 2], [2, 3, 3]).
    with pytest.raises(BoundaryError, match=rf"at least 7 decoder blocks; this target has {L}"):
        default_boundaries(L)


@pytest.mark.parametrize("bs", [[0], [0, 1, 2], [2, 16, 29], [32, 0, 5], [5, 0, 9], [31, 32]])
def test_validate_keeps_values_and_order(bs):
    assert validate_boundaries(bs, 32) == bs
    assert validate_boundaries(tuple(bs), 32) == bs
    assert CaptureSpec(tuple(bs), 32).boundaries == tuple(bs)


@pytest.mark.parametrize("bs, bad", [([2, 16, 33], [33]), ([-1, 5, 9], [-1]), ([40, -2, 3], [40, -2])])
def test_validate_out_of_range(bs, bad):
    with pytest.raises(BoundaryError) as e:
        validate_boundaries(bs, 32)
    msg = str(e.value)
    assert "expected values in 0..32" in msg
    assert "32 decoder blocks" in msg
    assert f"found {bad} in {bs}" in msg
    with pytest.raises(BoundaryError, match=r"0\.\.32"):
        CaptureSpec(tuple(bs), 32)


def test_validate_duplicates():
    with pytest.raises(BoundaryError, match=r"expected distinct values, found \[2, 5\] repeated in \[2, 5, 2, 5, 9\]"):
        validate_boundaries([2, 5, 2, 5, 9], 32)
    with pytest.raises(BoundaryError, match="distinct"):
        CaptureSpec((3, 3, 4), 32)


def test_validate_empty():
    with pytest.raises(BoundaryError, match="at least one boundary, found an empty list"):
        validate_boundaries([], 32)


@pytest.mark.parametrize("bs, slots", [([2, 16], 3), ([2, 16, 29, 30], 3), ([2, 16, 29], 4), ([2], 2)])
def test_validate_slot_count(bs, slots):
    with pytest.raises(BoundaryError) as e:
        validate_boundaries(bs, 32, num_slots=slots)
    assert f"fc takes {slots} slots, expected {slots} boundaries, found {len(bs)} ({bs})" in str(e.value)
    with pytest.raises(BoundaryError, match=f"found {len(bs)}"):
        CaptureSpec(tuple(bs), 32).check_slots(slots)


def test_validate_slot_count_ok():
    assert validate_boundaries([2, 16, 29], 32, num_slots=3) == [2, 16, 29]
    CaptureSpec((2, 16, 29), 32).check_slots(3)  # no error


def test_capture_spec_is_frozen_and_normalised():
    spec = CaptureSpec([2, 16, 29], 32)  # type: ignore[arg-type]  # a list is accepted and stored as a tuple
    assert spec.boundaries == (2, 16, 29) and isinstance(spec.boundaries, tuple)
    with pytest.raises(Exception):
        spec.num_blocks = 4  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# parse_boundaries
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [("2,15,27", [2, 15, 27]), (" 2, 15 ,27 ", [2, 15, 27]), ("0", [0]), ("27,2,15", [27, 2, 15]),
     ("2,15,27,", [2, 15, 27])],
)
def test_parse_boundaries(text, expected):
    assert parse_boundaries(text) == expected


@pytest.mark.parametrize("text", ["", " ", ",", "2;15;27", "2,x,27", "2.5,3", "[2,15,27]", "two"])
def test_parse_boundaries_errors(text):
    with pytest.raises(BoundaryError) as e:
        parse_boundaries(text)
    assert "expected comma-separated integers like '2,15,27'" in str(e.value)
    assert f"found {text!r}" in str(e.value)


# ---------------------------------------------------------------------------------------------
# SGLang / SpecForge explicit ids: output of block k = boundary k+1, -1 = embeddings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", [LEGACY, PR, "legacy", "pr25454"])
@pytest.mark.parametrize("L", [10, 30, 32, 61])
def test_sglang_default_both_rules_agree(rule, L):
    """The EAGLE default [2, L//2, L-3] is written [1, L//2-1, L-4], read the same by both rules."""
    bs = default_boundaries(L)
    ids = [1, L // 2 - 1, L - 4]
    assert boundaries_to_sglang_ids(bs, L, rule) == ids
    assert sglang_ids_to_boundaries(ids, L, rule) == bs
    assert sglang_rules_agree(bs, L)
    assert boundaries_to_sglang_ids(CaptureSpec.default(L).boundaries, L, SGLangRule(rule)) == ids


@pytest.mark.parametrize("rule", [LEGACY, PR])
def test_sglang_absent_key_means_default(rule):
    assert sglang_ids_to_boundaries(None, 32, rule) == [2, 16, 29]


def test_sglang_empty_ids():
    with pytest.raises(BoundaryError, match=r"expected a non-empty list, found \[\]"):
        sglang_ids_to_boundaries([], 32)


def test_specforge_61_blocks():
    """A SpecForge list for a 61-block target (DeepSeek-V3 / Kimi-K2): [1, 29, 57] -> [2, 30, 58]."""
    for rule in (LEGACY, PR):
        assert sglang_ids_to_boundaries([1, 29, 57], 61, rule) == [2, 30, 58]
        assert boundaries_to_sglang_ids([2, 30, 58], 61, rule) == [1, 29, 57]


# The non-default case that breaks real deployments: boundaries [3, 10, 29] of a 32-block target.
NON_DEFAULT = [3, 10, 29]
WRITTEN = {LEGACY: [2, 9, 28], PR: [3, 10, 29]}


@pytest.mark.parametrize("rule", [LEGACY, PR])
def test_sglang_non_default_written_and_read_back(rule):
    assert not sglang_rules_agree(NON_DEFAULT, 32)
    ids = boundaries_to_sglang_ids(NON_DEFAULT, 32, rule)
    assert ids == WRITTEN[rule]
    assert sglang_ids_to_boundaries(ids, 32, rule) == NON_DEFAULT
    assert boundaries_to_sglang_ids(CaptureSpec(tuple(NON_DEFAULT), 32).boundaries, 32, rule) == WRITTEN[rule]


@pytest.mark.parametrize(
    "written_for, read_by, captured",
    [
        # legacy ids [2, 9, 28] under PR #25454: first id is not 1 -> no shift: one block too low
        (LEGACY, PR, [2, 9, 28]),
        # PR #25454 ids [3, 10, 29] under legacy: always +1 -> one block too high
        (PR, LEGACY, [4, 11, 30]),
    ],
)
def test_sglang_cross_reading_is_wrong(written_for, read_by, captured):
    ids = boundaries_to_sglang_ids(NON_DEFAULT, 32, written_for)
    got = sglang_ids_to_boundaries(ids, 32, read_by)
    assert got == captured
    assert got != NON_DEFAULT


def test_sglang_embeddings():
    """Boundary 0 (the embeddings) is SGLang id -1 under the legacy rule and 0 under PR #25454."""
    bs = [0, 16, 29]
    assert boundaries_to_sglang_ids(bs, 32, LEGACY) == [-1, 15, 28]
    assert sglang_ids_to_boundaries([-1, 15, 28], 32, LEGACY) == bs
    assert boundaries_to_sglang_ids(bs, 32, PR) == [0, 16, 29]
    assert sglang_ids_to_boundaries([0, 16, 29], 32, PR) == bs
    # cross-reading: PR #25454 ids under legacy capture [1, 17, 30] ...
    assert sglang_ids_to_boundaries([0, 16, 29], 32, LEGACY) == [1, 17, 30]
    # ... and legacy ids under PR #25454 ask for a boundary -1 that does not exist.
    with pytest.raises(BoundaryError) as e:
        sglang_ids_to_boundaries([-1, 15, 28], 32, PR)
    assert "[-1, 15, 28] read by SGLang (pr25454 rule)" in str(e.value)
    assert "found [-1]" in str(e.value)


def test_sglang_embeddings_not_first_legacy():
    assert boundaries_to_sglang_ids([5, 0, 9], 32, LEGACY) == [4, -1, 8]
    assert sglang_ids_to_boundaries([4, -1, 8], 32, LEGACY) == [5, 0, 9]


def test_sglang_boundary_one_first_unrepresentable_under_pr25454():
    bs = [1, 16, 29]
    with pytest.raises(BoundaryError) as e:
        boundaries_to_sglang_ids(bs, 32, PR)
    msg = str(e.value)
    assert "[1, 16, 29]" in msg and "PR #25454" in msg and "boundary 1" in msg
    assert "legacy" in msg  # names the way out
    # ... while legacy writes it as [0, 15, 28].
    assert boundaries_to_sglang_ids(bs, 32, LEGACY) == [0, 15, 28]
    assert sglang_ids_to_boundaries([0, 15, 28], 32, LEGACY) == bs
    # Boundary 1 elsewhere than first is fine under PR #25454.
    assert boundaries_to_sglang_ids([16, 1, 29], 32, PR) == [16, 1, 29]
    assert sglang_ids_to_boundaries([16, 1, 29], 32, PR) == [16, 1, 29]


@pytest.mark.parametrize("rule, ids", [(LEGACY, [1, 15, 31]), (PR, [1, 15, 31])])
def test_sglang_last_boundary(rule, ids):
    """Boundary L (last block output, pre-norm) is a valid boundary; [2, 16, 32] starts with 2."""
    assert boundaries_to_sglang_ids([2, 16, 32], 32, rule) == ids
    assert sglang_ids_to_boundaries(ids, 32, rule) == [2, 16, 32]


@pytest.mark.parametrize("rule, ids", [(LEGACY, [2, 15, 32]), (PR, [3, 15, 33]), (LEGACY, [-2, 4, 8])])
def test_sglang_ids_out_of_range(rule, ids):
    with pytest.raises(BoundaryError) as e:
        sglang_ids_to_boundaries(ids, 32, rule)
    assert f"{ids} read by SGLang ({rule.value} rule)" in str(e.value)
    assert "0..32" in str(e.value)


def test_sglang_bad_rule():
    with pytest.raises(ValueError):
        sglang_ids_to_boundaries([1, 2, 3], 32, "v2")
    with pytest.raises(ValueError):
        boundaries_to_sglang_ids([2, 3, 4], 32, "v2")


def test_sglang_writer_validates():
    with pytest.raises(BoundaryError, match="0..32"):
        boundaries_to_sglang_ids([2, 16, 33], 32, LEGACY)
    with pytest.raises(BoundaryError, match="distinct"):
        boundaries_to_sglang_ids([2, 2, 5], 32, PR)


@pytest.mark.parametrize("rule", [LEGACY, PR])
def test_sglang_roundtrip_property(rule):
    """For random valid boundary lists, writing then reading under one rule is the identity
    whenever the list is representable (only "boundary 1 first" under PR #25454 is not)."""
    rng = random.Random(1234)
    seen_unrepresentable = 0
    for _ in range(2000):
        L = rng.randint(1, 100)
        n = rng.randint(1, min(5, L + 1))
        bs = rng.sample(range(L + 1), n)
        if rng.random() < 0.15 and L >= 2:  # make the edge cases frequent
            bs = [rng.choice([0, 1, 2])] + [b for b in bs if b not in (0, 1, 2)][: n - 1]
        if rule is PR and bs[0] == 1:
            seen_unrepresentable += 1
            with pytest.raises(BoundaryError):
                boundaries_to_sglang_ids(bs, L, rule)
            continue
        ids = boundaries_to_sglang_ids(bs, L, rule)
        assert sglang_ids_to_boundaries(ids, L, rule) == bs, (L, bs, ids)
        if rule is LEGACY:
            assert ids == [b - 1 for b in bs]
        # The other rule reads the same list back exactly when the first boundary is 2; otherwise
        # it captures other boundaries or cannot read the list at all.
        other = PR if rule is LEGACY else LEGACY
        try:
            cross = sglang_ids_to_boundaries(ids, L, other)
        except BoundaryError:
            cross = None
        assert (cross == bs) == sglang_rules_agree(bs, L) == (bs[0] == 2), (L, bs, ids, cross)
    if rule is PR:
        assert seen_unrepresentable > 0


# ---------------------------------------------------------------------------------------------
# vLLM / speculators / SafeAILab-EAGLE: ids are boundaries
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [[2, 16, 29], [3, 10, 29], [0, 16, 29], [1, 16, 29], [2, 16, 32], [29, 2]])
def test_vllm_ids_are_boundaries(bs):
    assert boundaries_to_vllm_ids(bs, 32) == bs
    assert vllm_ids_to_boundaries(bs, 32) == bs
    assert boundaries_to_vllm_ids(CaptureSpec(tuple(bs), 32).boundaries, 32) == bs


@pytest.mark.parametrize("ids", [None, []])
def test_vllm_absent_ids_mean_default(ids):
    assert vllm_ids_to_boundaries(ids, 32) == [2, 16, 29]


def test_vllm_ids_validated():
    with pytest.raises(BoundaryError, match=r"found \[33\]"):
        vllm_ids_to_boundaries([2, 16, 33], 32)
    with pytest.raises(BoundaryError, match=r"found \[-1\]"):
        boundaries_to_vllm_ids([-1, 16, 29], 32)


# ---------------------------------------------------------------------------------------------
# Hugging Face output_hidden_states indices
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [[2, 16, 29], [0, 1, 31], [31, 0]])
def test_hf_indices_are_boundaries_below_L(bs):
    assert boundaries_to_hf_indices(bs, 32) == bs
    assert hf_indices_to_boundaries(bs, 32) == bs
    assert CaptureSpec(tuple(bs), 32).to_hf_indices() == bs


def test_last_boundary_has_no_hf_index():
    spec = CaptureSpec((2, 16, 32), 32)  # allowed: boundary L = last block output, before the norm
    assert spec.boundaries == (2, 16, 32)
    with pytest.raises(BoundaryError) as e:
        spec.to_hf_indices()
    msg = str(e.value)
    assert "boundary 32" in msg and "no output_hidden_states index" in msg and "AFTER the final norm" in msg


@pytest.mark.parametrize(
    "indices, expected",
    [([-31, -17, -4], [2, 16, 29]), ([-33, -2], [0, 31]), ([2, -2], [2, 31]), ([-33], [0])],
)
def test_hf_negative_indices(indices, expected):
    # output_hidden_states has L+1 entries: index -1 is L (post-norm), -(L+1) is 0 (embeddings).
    assert hf_indices_to_boundaries(indices, 32) == expected


@pytest.mark.parametrize("indices", [[2, 16, 32], [2, 16, -1]])
def test_hf_post_norm_index_rejected(indices):
    with pytest.raises(BoundaryError) as e:
        hf_indices_to_boundaries(indices, 32)
    assert "output_hidden_states[32] is post-norm" in str(e.value)
    assert "use boundary 32 (pre-norm)" in str(e.value)


@pytest.mark.parametrize("indices", [[33], [-34], [2, 2]])
def test_hf_invalid_indices(indices):
    with pytest.raises(BoundaryError):
        hf_indices_to_boundaries(indices, 32)


@pytest.mark.parametrize("unknown", [None, 0])
def test_sglang_ids_with_unknown_block_count(unknown):
    """Reading a checkpoint on its own (no target at hand): what needs no target is still checked."""
    assert sglang_ids_to_boundaries([1, 29, 57], unknown, LEGACY) == [2, 30, 58]
    assert sglang_ids_to_boundaries([3, 10, 29], unknown, PR) == [3, 10, 29]
    with pytest.raises(BoundaryError, match=r"expected values >= 0, found \[-1\]"):
        sglang_ids_to_boundaries([-1, 15, 28], unknown, PR)
    with pytest.raises(BoundaryError, match="distinct"):
        sglang_ids_to_boundaries([4, 4, 9], unknown, LEGACY)
