"""``eyas trace``: shape and statistics at the three junctions of the eyas engine, per round, held
against the training fingerprint.

Junctions (one JSONL record each, per round):

    boundary   each captured boundary as the target's forward returned it (one record per slot,
               split from the features the engine got: HFTarget captures them through eyas' one
               capture path, :class:`~eyas.capture.hooks.BoundaryCapture`; LlamaTarget inside its
               forward), at the position ids the engine passed
    concat     the concatenated features as the drafter receives them (``DraftState.extend``: the
               prompt after prefill, the accepted path after each verification), with the slot
               order recovered from the values themselves (which captured boundary is in chunk i)
    fc_input   the input of ``drafter.fc``, after ``input_norm`` / ``fc_norm`` when configured
               (the concatenation through the drafter's own norms, ``Eagle3Drafter.fc_input``)

Round 0 is the prefill (the target reads the prompt, the drafter reads its features); round r >= 1
is the r-th verification (the target reads the drafted tree, the drafter re-reads the accepted
path). The round in which generation stops has no concat / fc_input record: the drafter never
reads it.

Statistics follow the fingerprint token rule of :mod:`eyas.capture.stats`: position 0 (the
attention sink, whose residual stream carries a massive activation) is left out of every statistic
and reported alone as ``first_token_rms``. ``rms`` is the mean over tokens of the per-token RMS,
the quantity the training fingerprint records (``rms_std`` its spread), ``mean``/``std``/``absmax``
are over every element of the counted tokens.

Free when off: the engine calls an observer only when given one (:mod:`eyas.engine.observe`).
:class:`Tracer` is one, passed as ``observer=`` for the traced request: the engine shows it the
features of the target's forward (prefill, each verification) and those the drafter reads (the
prompt, each re-read of the accepted path). No hook is registered on any module, so a trace sees
the same tensors whatever computes them (HFTarget, LlamaTarget, with or without CUDA graphs).

The summary holds the concatenation's per-slot statistics (every token the drafter read, but the
first) against the training fingerprint with the doctor's comparison and thresholds
(:func:`eyas.doctor.fingerprint.compare_slot`), and names what each slot resembles with the
doctor's resemblance (:func:`eyas.doctor.fingerprint.nearest` over every boundary of the live
target on the same tokens). A slot is off when it is fed another boundary than it was trained on,
when its RMS is off (|z| > 3 or a ratio outside [0.8, 1.25]), when its channel means are off
and it does not match its trained boundary of the live target either, or when it is **shifted**
by the fingerprint stage's rule (:func:`eyas.doctor.fingerprint.match_slot`): it looks like
another live boundary than the one its training statistics are nearest to, beyond the noise of
the match or away from the boundary training recorded (a one-block shift at depth stays inside the
thresholds); fed the recorded boundary and leaning within noise to a neighbour, it is a warning. One request is not the
training data: its channel means move with its text (SmolLM2-135M, boundary 27, "Why is the sky
blue?": a shift of 0.83 x RMS with the right capture), while the RMS scale hardly does; a channel
shift of a slot that is what it should be is a warning.

JSONL layout: a ``{"header": {...}}`` line, the junction records (each has ``round``, ``phase``
and ``junction``), and, from :func:`run_trace`, a last ``{"summary": {...}}`` line.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from eyas.capture.stats import FingerprintAccumulator
from eyas.contract.contract import SlotFingerprint
from eyas.doctor.common import NORM_FLAGS, boundary_name, jsonable, slot_label
from eyas.doctor.context import TargetFacts
from eyas.doctor.fingerprint import SlotComparison, SlotMatch, compare_slot, match_slot, nearest, shift_text
from eyas.engine.observe import RoundObserver
from eyas.errors import EyasError

JUNCTIONS = ("boundary", "concat", "fc_input")
# A chunk of the concatenation is recognised as boundary b when its first row equals b's first
# row of the same forward to this relative tolerance (room for a drafter in another dtype).
MATCH_TOL = 2e-2


class TraceError(EyasError, ValueError):
    """A drafter that cannot be traced as asked (the engine cannot serve it, or it does not fit the target)."""


def _dtype(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_stats(x: Tensor) -> dict[str, Any]:
    """Statistics of ``x`` [..., H] over its tokens (every leading index is a token): ``tokens``,
    ``rms`` (mean of the per-token RMS), ``rms_std`` (population std of the per-token RMS), and
    ``mean``, ``std``, ``absmax`` over every element. Computed in float32, summed in float64."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    n = int(x.shape[0])
    if n == 0:
        return {"tokens": 0, "rms": None, "rms_std": None, "mean": None, "std": None, "absmax": None}
    rms = x.pow(2).mean(-1).sqrt().double()
    xd = x.double()
    return {"tokens": n, "rms": rms.mean().item(), "rms_std": rms.std(unbiased=False).item(),
            "mean": xd.mean().item(), "std": xd.std(unbiased=False).item(), "absmax": x.abs().max().item()}


def _slot_rms(x: Tensor, width: int) -> list[float | None]:
    """Mean per-token RMS of each ``width``-wide chunk of ``x`` [N, S * width]."""
    if x.shape[0] == 0:
        return [None] * (x.shape[-1] // width)
    return [c.float().pow(2).mean(-1).sqrt().double().mean().item() for c in x.split(width, dim=-1)]


def _positions(p: Tensor | None, n: int, device: torch.device) -> Tensor:
    """The n position ids the engine passed (flattened), or 0..n-1 when they do not fit."""
    if isinstance(p, Tensor) and p.numel() == n:
        return p.reshape(-1)
    return torch.arange(n, device=device)


class Tracer(RoundObserver, AbstractContextManager):
    """Record the three junctions of the eyas engine while speculative decoding runs: an engine
    observer (:class:`~eyas.engine.observe.RoundObserver`), given to the engine for one request.

    >>> with Tracer(target, drafter, "trace.jsonl") as tr:
    ...     result = speculative_generate(target, drafter, prompt_ids, observer=tr)
    >>> tr.records                 # every junction record, as written
    >>> tr.summary(fingerprint)    # per slot: observed vs training statistics, what an off slot resembles

    ``target`` is any :class:`~eyas.engine.target.Target` (its ``spec`` and ``implementation`` are
    read; its Hugging Face ``model``, which HFTarget and LlamaTarget hold, serves the summary's
    resemblance); ``out`` a JSONL path (None: records in memory only), opened on ``__enter__`` with
    the header line and closed on ``__exit__``; ``header``: extra facts for the first line;
    ``channels``: the fingerprint channels to accumulate (the training fingerprint's).
    """

    def __init__(self, target: Any, drafter: Any, out: str | Path | None = None, header: dict[str, Any] | None = None,
                 channels: Sequence[int] | None = None) -> None:
        self.target, self.drafter = target, drafter
        self.model = getattr(target, "model", None)
        self.spec = target.spec
        cfg = drafter.config
        self.width = int(cfg.target_hidden_size)
        self.fc_in = int(cfg.fc_in_features)
        self.dtype = drafter.fc.weight.dtype  # the drafter reads the features in its dtype (DraftState.extend)
        self.out = Path(out) if out is not None else None
        self.header = dict(header or {})
        self.records: list[dict[str, Any]] = []
        self.round = -1
        self.acc = FingerprintAccumulator(self.spec.boundaries, self.width, channels)
        self.slot_orders: list[tuple[int | None, ...]] = []
        self._fc = FcInputTally([0.0] * self.spec.num_slots)
        self._active = False
        self._file: Any = None
        self._phase = "prefill"
        self._first_rows: list[Tensor] | None = None

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._active

    def __enter__(self) -> "Tracer":
        if self.active or self.round >= 0:
            raise RuntimeError("Tracer: one per request (this one is active or has run)")
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.out.open("w")
            head = {"boundaries": list(self.spec.boundaries), "num_blocks": self.spec.num_blocks,
                    "target_hidden_size": self.width, "fc_in_features": self.fc_in,
                    "drafter_dtype": _dtype(self.drafter.fc.weight),
                    "norm_before_fc": bool(self.drafter.config.norm_before_fc),
                    "fc_norm": bool(self.drafter.config.fc_norm),
                    "target_impl": getattr(self.target, "implementation", None), **self.header}
            self._write({"header": head})
            self._file.flush()
        self._active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        if self._file is not None:
            self._file.close()
            self._file = None

    def append(self, obj: dict[str, Any]) -> None:
        """Add a line to the JSONL (after the trace, e.g. the summary)."""
        if self.out is None:
            return
        with self.out.open("a") as f:
            f.write(json.dumps(jsonable(obj)) + "\n")

    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(jsonable(obj)) + "\n")

    def _record(self, rec: dict[str, Any]) -> None:
        rec = {"round": self.round, "phase": self._phase, **rec}
        self.records.append(rec)
        self._write(rec)

    # -- the engine's calls -------------------------------------------------------------------

    def target_forward(self, round: int, phase: str, positions: Tensor, features: Tensor) -> None:
        """The boundary records: ``features`` [1, T, S*H] split per slot (each [1, T, H])."""
        if self._file is not None:
            self._file.flush()  # the previous round is complete
        self.round, self._phase = round, phase
        features = features.detach()
        slots = features.split(features.shape[-1] // self.spec.num_slots, dim=-1)  # each [1, T, H]
        p = _positions(positions, features.shape[-2], features.device)
        for i, (b, x) in enumerate(zip(self.spec.boundaries, slots)):
            rows = x.reshape(-1, x.shape[-1])
            rec = {"junction": "boundary", "slot": i, "boundary": b, "shape": list(x.shape), "dtype": _dtype(x),
                   "positions": [int(p.min()), int(p.max())], **tensor_stats(rows[p != 0])}
            if bool((p == 0).any()):
                rec["first_token_rms"] = rows[p == 0].float().pow(2).mean(-1).sqrt().mean().item()
            self._record(rec)
        self._first_rows = [x.reshape(-1, x.shape[-1])[0].clone() for x in slots]  # the target's buffers: copied

    def _match(self, chunks: Sequence[Tensor]) -> tuple[int | None, ...]:
        """Which captured boundary each chunk of the concatenation holds: its first row against the
        first row of every boundary of this round's target forward (row 0 of what the drafter reads
        is row 0 of the forward: the first prompt token, or the tree's root)."""
        if self._first_rows is None:
            return tuple(None for _ in chunks)
        out = []
        for c in chunks:
            row = c[0].float()
            errs = [((row - r.float()).norm() / r.float().norm().clamp_min(1e-12)).item() for r in self._first_rows]
            best = min(range(len(errs)), key=errs.__getitem__)
            out.append(self.spec.boundaries[best] if errs[best] <= MATCH_TOL else None)
        return tuple(out)

    def drafter_reads(self, round: int, phase: str, positions: Tensor, tokens: Tensor, features: Tensor) -> None:
        """The concat record (``features`` [n, S*H] in the drafter's dtype, as it receives them) and
        the fc_input record (them through the drafter's own norms, :meth:`Eagle3Drafter.fc_input`)."""
        self.round, self._phase = round, phase
        x = features.detach().to(self.dtype)
        x = x.reshape(-1, x.shape[-1])
        p = _positions(positions, x.shape[0], x.device)
        keep = p != 0  # drafter entry t reads f_t at position t: position 0 is the sink's features
        order = self._match(x.split(self.width, dim=-1))
        self.slot_orders.append(order)
        counted = x[keep]
        self._record({"junction": "concat", "shape": [1, *x.shape], "dtype": _dtype(x),
                      "slot_order": list(order), "boundaries": list(self.spec.boundaries),
                      "positions": [int(p.min()), int(p.max())], **tensor_stats(counted),
                      "slot_rms": _slot_rms(counted, self.width)})
        self.acc.update(counted.reshape(-1, self.spec.num_slots, self.width))
        with torch.no_grad():
            fc = self.drafter.fc_input(x[None])  # [1, n, fc_in]
        rows = fc.reshape(-1, fc.shape[-1])[keep]
        stats = tensor_stats(rows)
        slot_rms = _slot_rms(rows, self.width) if rows.shape[-1] % self.width == 0 else []
        self._record({"junction": "fc_input", "shape": list(fc.shape), "dtype": _dtype(fc),
                      "expected_width": self.fc_in, **stats, "slot_rms": slot_rms})
        self._fc.add(int(fc.shape[-1]), stats["tokens"], stats["rms"], slot_rms)

    # -- summary --------------------------------------------------------------------------------

    def observed(self) -> list[SlotFingerprint] | None:
        """Per slot (in the engine's slot order), the statistics of every token the drafter read
        from the target but the first (None before any)."""
        return self.acc.result() if self.acc.count else None

    def live_boundary_stats(self, sequence: Sequence[int] | Tensor,
                            dtype: str = "float32") -> dict[int, SlotFingerprint]:
        """The live target's statistics of every boundary 0..L (and L after the final norm, id
        L+1) on ``sequence``, by the doctor's capture pass (the fingerprint token rule)."""
        from eyas.doctor.capture import capture_all
        from eyas.doctor.samples import Sample

        ids = torch.as_tensor(sequence, dtype=torch.long).reshape(-1).cpu()
        sample = Sample(id="trace", input_ids=ids, loss_mask=torch.zeros_like(ids))
        # keep: the values of one boundary only (the statistics cover all of them)
        return capture_all(self.model, [sample], dtype, self.acc.channels, keep=[0]).stats

    def summary(self, reference: Sequence[SlotFingerprint] | None = None, trained: Sequence[int] | None = None,
                reference_source: str = "", sequence: Sequence[int] | Tensor | None = None,
                capture_dtype: str = "float32") -> "TraceSummary":
        """Hold the trace against ``reference`` (the training fingerprint, one per trained slot).

        ``trained``: the trained boundaries (default: the reference's, else the served ones).
        ``sequence``: the whole token sequence (prompt + output); with it, what each slot
        resembles is named from every boundary of the live target on it, and without a
        reference the live target's trained boundaries stand in for one (a target without a
        Hugging Face ``model`` has no live pass: ``sequence`` is then ignored).

        Problems, in order: slot counts, the slot order of the concatenation, the fc input width,
        then per slot its statistics and its boundary (:func:`slot_row`, :func:`slot_findings`).
        """
        L = self.spec.num_blocks
        served = list(self.spec.boundaries)
        trained = list(trained) if trained is not None else (
            [f.boundary for f in reference] if reference else list(served))
        live = (self.live_boundary_stats(sequence, capture_dtype)
                if sequence is not None and self.model is not None else None)
        ref, source = reference_for(reference, reference_source, live, trained)
        problems: list[str] = []
        ref = check_slot_counts(ref, trained, served, problems)
        order = recovered_slot_order(self.slot_orders, served, problems)
        fc_input = self._fc.summary(self.fc_in)
        if fc_input.widths and fc_input.widths != [self.fc_in]:
            problems.append(f"fc input width {fc_input.widths}, expected {self.fc_in} "
                            f"({self.spec.num_slots} slots x {self.width})")
        obs = self.observed()
        warnings: list[str] = []
        rows = []
        for i, b in enumerate(served):
            row = slot_row(i, b, order, trained, obs[i] if obs is not None else None,
                           ref[i] if ref is not None else None, live, L)
            slot_problems, slot_warnings = slot_findings(row, L)
            problems += slot_problems
            warnings += slot_warnings
            rows.append(row)
        return TraceSummary(rounds=self.round + 1, records=len(self.records), served_boundaries=served,
                            trained_boundaries=trained, slot_order=order, reference=source if ref else None,
                            slots=rows, fc_input=fc_input, problems=problems, warnings=warnings,
                            tokens_observed=self.acc.count)


# ---------------------------------------------------------------------------------------------
# The summary's parts
# ---------------------------------------------------------------------------------------------


@dataclass
class FcInputSummary:
    """What reached ``drafter.fc``: its width(s), and the mean per-token RMS over every counted token
    (overall and per slot-wide chunk)."""

    widths: list[int]  # every width seen (one, when healthy)
    expected_width: int
    tokens: int
    rms: float | None
    slot_rms: list[float] | None

    @property
    def width(self) -> int | list[int]:
        return self.widths[0] if len(self.widths) == 1 else self.widths

    def to_dict(self) -> dict[str, Any]:
        return {"width": self.width, "expected_width": self.expected_width, "tokens": self.tokens, "rms": self.rms,
                "slot_rms": self.slot_rms}


@dataclass
class FcInputTally:
    """Token-weighted sums of the fc input's statistics over the rounds."""

    slot_rms_sum: list[float]  # per slot: sum over tokens of the chunk's per-token RMS
    tokens: int = 0
    rms_sum: float = 0.0
    widths: set[int] = field(default_factory=set)

    def add(self, width: int, tokens: int, rms: float | None, slot_rms: list[float | None]) -> None:
        self.widths.add(width)
        if not tokens or rms is None:
            return
        self.tokens += tokens
        self.rms_sum += rms * tokens
        if len(slot_rms) == len(self.slot_rms_sum):
            self.slot_rms_sum = [s + (r or 0.0) * tokens for s, r in zip(self.slot_rms_sum, slot_rms)]

    def summary(self, expected_width: int) -> FcInputSummary:
        n = self.tokens
        return FcInputSummary(sorted(self.widths), expected_width, n, self.rms_sum / n if n else None,
                              [x / n for x in self.slot_rms_sum] if n else None)


def reference_for(reference: Sequence[SlotFingerprint] | None, reference_source: str,
                  live: dict[int, SlotFingerprint] | None, trained: list[int]) -> tuple[list[SlotFingerprint] | None, str]:
    """The statistics to hold the slots against, and what they are: the training fingerprint, else
    (given the live target's statistics on the request) its trained boundaries."""
    ref = list(reference) if reference else None
    source = reference_source or ("the training fingerprint" if ref else "")
    if ref is None and live is not None and all(b in live for b in trained):
        ref = [live[b] for b in trained]
        source = ("no training fingerprint: the live target's trained boundaries on this request "
                  "(catches a wrong capture, not a wrong target)")
    return ref, source


def check_slot_counts(ref: list[SlotFingerprint] | None, trained: list[int], served: list[int],
                      problems: list[str]) -> list[SlotFingerprint] | None:
    """The reference when it has one entry per served slot (else None); appends the count problems."""
    if ref is not None and len(ref) != len(served):
        problems.append(f"the engine feeds {len(served)} slots, the training fingerprint has {len(ref)}")
        ref = None
    if len(trained) != len(served):
        problems.append(f"the engine captures {len(served)} boundaries {served}, the drafter was trained on "
                        f"{len(trained)} {trained}")
    return ref


def recovered_slot_order(slot_orders: list[tuple[int | None, ...]], served: list[int],
                         problems: list[str]) -> list[int | None] | None:
    """The slot order the concatenation held most often (None before any draft); appends a problem
    when it changes between rounds and one per chunk that holds another boundary than captured."""
    counts = Counter(slot_orders)
    order = list(counts.most_common(1)[0][0]) if counts else None
    if len(counts) > 1:
        problems.append(f"the slot order of the concatenation changes between rounds: {[list(o) for o in counts]}")
    if order is not None:
        for i, (got, want) in enumerate(zip(order, served)):
            if got != want:
                what = "none of the captured boundaries" if got is None else f"boundary {got}"
                problems.append(f"chunk {i} of the drafter's input holds {what}, the engine captured boundary "
                                f"{want} for slot {i}")
    return order


@dataclass
class SlotRow:
    """One slot of the concatenation: what was captured for it, what the drafter's input held, what
    it was trained on, and its statistics against the reference.

    A slot is off when it is fed another boundary than trained (``boundary_mismatch``), holds another
    than captured (``order_mismatch``), its RMS is off, or its channel means are off and it does not
    match its trained boundary of the live target either (one request's text moves channel means)."""

    slot: int
    served_boundary: int  # captured by the engine for this slot
    observed_boundary: int | None  # recovered from the concatenation's values
    trained_boundary: int | None
    observed: SlotFingerprint | None  # every token the drafter read but the first
    reference: SlotFingerprint | None
    comparison: SlotComparison | None  # observed against reference (None without either)
    looks_like: int | str | None  # the live boundary the observed statistics are nearest to (slot_label)
    looks_like_name: str | None
    trained_matches: int | str | None  # the live boundary the reference is nearest to (slot_label)
    trained_matches_name: str | None
    order_mismatch: bool  # a slot order was recovered and this chunk does not hold the captured boundary
    # the fingerprint stage's resemblance (eyas.doctor.fingerprint.match_slot): observed and training
    # statistics against every live boundary on the same tokens, with the distances; None without them
    match: SlotMatch | None = None

    @property
    def shifted(self) -> bool:
        """Fed another boundary than its training statistics match, beyond the noise of the match
        or away from the boundary training recorded (the fingerprint stage's rule): off even inside
        the z and ratio thresholds, where a one-block shift at depth stays."""
        m = self.match
        if m is None or not m.shifted:
            return False
        return not (m.shift_within_noise and self.reference is not None
                    and self.served_boundary == self.reference.boundary)

    @property
    def shift_within_noise_of_record(self) -> bool:
        """Fed the boundary training recorded, its statistics leaning within noise to a neighbour: a warning."""
        m = self.match
        return m is not None and m.shifted and not self.shifted

    @property
    def boundary_mismatch(self) -> bool:
        return self.trained_boundary is not None and self.served_boundary != self.trained_boundary

    @property
    def tokens_observed(self) -> int:
        return self.observed.num_tokens if self.observed is not None else 0

    @property
    def rms_z(self) -> float | None:
        return self.comparison.rms_z if self.comparison else None

    @property
    def fingerprint_off(self) -> bool | None:
        """The doctor's rule (any of RMS z, ratio, channel shift); None without a comparison."""
        return self.comparison.off if self.comparison else None

    @property
    def rms_off(self) -> bool | None:
        return self.comparison.rms_off if self.comparison else None

    @property
    def channel_off(self) -> bool | None:
        return self.comparison.channel_off if self.comparison else None

    @property
    def channel_fails(self) -> bool:
        """A channel shift that counts: the slot does not (or cannot be shown to) match its trained
        boundary of the live target on the same tokens."""
        looks_right = (None if self.looks_like is None or self.trained_boundary is None
                       else self.looks_like == self.trained_boundary)
        return bool(self.channel_off) and looks_right is not True

    @property
    def off(self) -> bool:
        return (bool(self.rms_off) or self.channel_fails or self.boundary_mismatch or self.order_mismatch
                or self.shifted)

    @property
    def verdict(self) -> str:
        if self.off:
            parts = []
            if self.boundary_mismatch:
                parts.append(f"fed boundary {self.served_boundary}, trained on {self.trained_boundary}")
            if self.order_mismatch:
                parts.append(f"the drafter's input holds {self.observed_boundary} here")
            if self.fingerprint_off:
                parts.append(f"looks like {self.looks_like_name}" if self.looks_like is not None
                             else "statistics off the training fingerprint")
            if self.shifted and not self.fingerprint_off:
                parts.append(f"shifted: looks like {self.looks_like_name}, its training statistics match "
                             f"{self.trained_matches_name}")
            return "OFF: " + "; ".join(parts)
        if not self.tokens_observed:
            return "not checked (the drafter read nothing)"
        if self.fingerprint_off is None:
            return "not checked (no reference)"
        return "ok (channel means differ: this request's text)" if self.channel_off else "ok"

    def to_dict(self) -> dict[str, Any]:
        o, r, c = self.observed, self.reference, self.comparison
        return {"slot": self.slot, "served_boundary": self.served_boundary, "observed_boundary": self.observed_boundary,
                "trained_boundary": self.trained_boundary, "boundary_mismatch": self.boundary_mismatch,
                "rms_observed": o.rms_mean if o else None, "rms_std_observed": o.rms_std if o else None,
                "tokens_observed": self.tokens_observed,
                "rms_trained": r.rms_mean if r else None, "rms_std_trained": r.rms_std if r else None,
                "tokens_trained": r.num_tokens if r else None,
                "rms_z": c.rms_z if c else None, "rms_ratio": c.rms_ratio if c else None,
                "channel_z": c.channel_z if c else None, "fingerprint_off": self.fingerprint_off,
                "looks_like": self.looks_like, "looks_like_name": self.looks_like_name,
                "trained_matches": self.trained_matches, "trained_matches_name": self.trained_matches_name,
                "rms_off": self.rms_off, "channel_off": self.channel_off, "order_mismatch": self.order_mismatch,
                "shifted": self.shifted, "shift_within_noise_of_record": self.shift_within_noise_of_record,
                **({"match": self.match.to_dict()} if self.match is not None else {}),
                "off": self.off, "verdict": self.verdict}


def slot_row(i: int, served: int, order: list[int | None] | None, trained: list[int],
             observed: SlotFingerprint | None, reference: SlotFingerprint | None,
             live: dict[int, SlotFingerprint] | None, num_blocks: int) -> SlotRow:
    """Slot ``i``'s row; what it and its reference resemble is named from ``live`` (every boundary
    of the live target on the same tokens) when given."""
    L = num_blocks
    match = match_slot(observed, reference, live) if (live and observed is not None and reference is not None) \
        else None
    looks = (match.looks_like if match is not None else
             nearest(observed, live)[0] if live is not None and observed is not None else None)
    should = (match.trained_matches if match is not None else
              nearest(reference, live)[0] if live is not None and reference is not None else None)
    observed_boundary = order[i] if order is not None and i < len(order) else None
    return SlotRow(
        slot=i, served_boundary=served, observed_boundary=observed_boundary,
        order_mismatch=order is not None and observed_boundary != served,
        trained_boundary=trained[i] if i < len(trained) else None, observed=observed, reference=reference,
        comparison=compare_slot(observed, reference) if (observed is not None and reference is not None) else None,
        looks_like=slot_label(looks, L) if looks is not None else None,
        looks_like_name=boundary_name(looks, L) if looks is not None else None,
        trained_matches=slot_label(should, L) if should is not None else None,
        trained_matches_name=boundary_name(should, L) if should is not None else None, match=match)


def slot_findings(row: SlotRow, num_blocks: int) -> tuple[list[str], list[str]]:
    """(problems, warnings) of one slot: its statistics off (or only its channel means, on a slot
    that is what it should be: a warning); inside the thresholds, shifted (a problem naming both
    boundaries with the distances) or leaning within noise from its recorded boundary (a warning);
    and another boundary than trained."""
    L, i = num_blocks, row.slot
    problems: list[str] = []
    warnings: list[str] = []
    c, o, r = row.comparison, row.observed, row.reference
    if c is not None and o is not None and r is not None and (row.rms_off or row.channel_fails):
        msg = (f"slot {i} is off: per-token RMS {o.rms_mean:.4g} against {r.rms_mean:.4g} at training "
               f"(z = {c.rms_z:+.1f}, ratio {c.rms_ratio:.2f}, channel shift {c.channel_z:.2f})")
        if row.looks_like_name is not None:
            msg += f"; slot {i} looks like {row.looks_like_name}"
        if row.trained_matches_name is not None:
            msg += f"; the training statistics of slot {i} match {row.trained_matches_name} of this target"
        problems.append(msg)
    elif c is not None and row.channel_off:
        warnings.append(f"slot {i}: channel means {c.channel_z:.2f} x RMS away from training on this "
                        f"request (its text, not the capture: the slot matches {row.looks_like_name}, "
                        f"the trained one, of the live target on the same tokens)")
    statistics_off = c is not None and o is not None and r is not None and (row.rms_off or row.channel_fails)
    if row.match is not None and row.shifted and not statistics_off:  # inside the thresholds: resemblance names it
        problems.append(f"slot {i} is fed another boundary than its training statistics match, inside the z and "
                        f"ratio thresholds: {shift_text(i, row.match, L)}")
    if row.match is not None and row.shift_within_noise_of_record and not statistics_off and not row.channel_off:
        # (a channel shift already says this request's text moved the statistics)
        warnings.append(f"slot {i} is fed {boundary_name(row.served_boundary, L)}, the boundary training recorded "
                        f"for it; {shift_text(i, row.match, L)}: this request cannot confirm slot {i}")
    if row.boundary_mismatch:
        assert row.trained_boundary is not None
        problems.append(f"slot {i} is fed {boundary_name(row.served_boundary, L)} but was trained on "
                        f"{boundary_name(row.trained_boundary, L)}")
    return problems, warnings


@dataclass
class TraceSummary:
    rounds: int
    records: int
    served_boundaries: list[int]
    trained_boundaries: list[int]
    slot_order: list[int | None] | None  # recovered from the concatenation's values
    reference: str | None  # what the observed statistics were held against
    slots: list[SlotRow]
    fc_input: FcInputSummary
    problems: list[str] = field(default_factory=list)  # any problem: the slot is off (exit code 1)
    warnings: list[str] = field(default_factory=list)
    tokens_observed: int = 0

    @property
    def healthy(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def to_dict(self) -> dict[str, Any]:
        return jsonable({
            "healthy": self.healthy, "problems": self.problems, "warnings": self.warnings, "rounds": self.rounds,
            "records": self.records,
            "served_boundaries": self.served_boundaries, "trained_boundaries": self.trained_boundaries,
            "slot_order": self.slot_order, "reference": self.reference, "tokens_observed": self.tokens_observed,
            "slots": [r.to_dict() for r in self.slots], "fc_input": self.fc_input.to_dict(),
        })


# ---------------------------------------------------------------------------------------------
# The whole command
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceEngine:
    """How the engine serves the directory: the boundaries it captures (its slot order) and its flags."""

    name: str
    version: str | None
    label: str
    boundaries: list[int]
    boundaries_note: str
    flags: dict[str, bool]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "label": self.label, "boundaries": self.boundaries,
                "boundaries_note": self.boundaries_note, "flags": self.flags}


@dataclass(frozen=True)
class TraceDraft:
    path: str
    layout: str
    trained_boundaries: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "layout": self.layout, "trained_boundaries": self.trained_boundaries}


@dataclass(frozen=True)
class TraceGeneration:
    """The traced answer, with the engine's per-request statistics."""

    text: str
    new_tokens: int
    rounds: int
    tau: float
    stop_reason: str
    acceptance_at_depth: list[float]

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "new_tokens": self.new_tokens, "rounds": self.rounds, "tau": self.tau,
                "stop_reason": self.stop_reason, "acceptance_at_depth": self.acceptance_at_depth}


@dataclass
class TraceReport:
    summary: TraceSummary
    out: str
    engine: TraceEngine
    target: TargetFacts
    draft: TraceDraft
    generation: TraceGeneration
    notes: list[str] = field(default_factory=list)
    target_impl: str | None = None  # the engine's target that ran: "hf", "fast", "fast+cuda-graphs"

    @property
    def healthy(self) -> bool:
        return self.summary.healthy

    @property
    def exit_code(self) -> int:
        return self.summary.exit_code

    def to_dict(self) -> dict[str, Any]:
        return jsonable({"healthy": self.healthy, "out": self.out, "engine": self.engine, "target": self.target,
                          "target_impl": self.target_impl, "draft": self.draft, "generation": self.generation,
                          "notes": self.notes, "summary": self.summary.to_dict()})


@dataclass
class _ServedDrafter:
    """The drafter directory as the engine serves it, built for the eyas engine."""

    directory: Any  # eyas.interop.DrafterDir
    engine: TraceEngine
    target: Any  # the engine's Target (eyas.engine.build_target) capturing the engine's boundaries
    drafter: Any  # Eagle3Drafter in the target's dtype and device
    notes: list[str]


def _serve(draft: str | Path, engine: str, version: str | None, loaded: Any,
           target_impl: str = "auto", ids_convention: str | None = None) -> _ServedDrafter:
    """Read ``draft`` as ``engine`` does and build what it would serve, on the engine's target
    ``target_impl`` (:func:`eyas.engine.build_target`); TraceError when it cannot serve it or the
    drafter does not fit the target (UnsupportedTarget when ``fast`` cannot run the target)."""
    from eyas.convention.boundaries import CaptureSpec
    from eyas.interop import build_drafter, read_as, read_drafter_dir, served_config
    from eyas.engine import build_target
    from eyas.targets.structure import find_embedding

    L = loaded.num_blocks
    dd = read_drafter_dir(draft, L, ids_convention)
    reading = read_as(engine, dd, L, version)
    if not reading.loadable or reading.boundaries is None:
        raise TraceError(f"{reading.label} cannot serve {draft}: {reading.why_not}")
    cfg = served_config(dd, reading)
    misfit = loaded.misfits(cfg.target_hidden_size, cfg.vocab_size, reading.boundaries)
    if len(reading.boundaries) != cfg.num_slots:
        misfit.append(f"{reading.label} captures {len(reading.boundaries)} boundaries {reading.boundaries}; the "
                      f"drafter's fc takes {cfg.num_slots} slots")
    if misfit:
        raise TraceError(f"{draft} does not fit the target: " + "; ".join(misfit))
    drafter, notes = build_drafter(cfg, dd.tensors, find_embedding(loaded.model).weight)
    drafter = drafter.to(loaded.device, dtype=loaded.dtype).eval()
    served = TraceEngine(engine, version, reading.label, list(reading.boundaries), reading.boundaries_note,
                         {f: bool(getattr(cfg, f)) for f in NORM_FLAGS})
    target = build_target(loaded.model, CaptureSpec(tuple(reading.boundaries), L), target_impl)
    return _ServedDrafter(dd, served, target, drafter, notes)


def _training_reference(dd: Any) -> tuple[list[SlotFingerprint] | None, list[int], str, str]:
    """(training fingerprint or None, trained boundaries, what the fingerprint is, capture dtype)."""
    contract = dd.contract
    if contract is not None and contract.fingerprint:
        reference = list(contract.fingerprint)
        return reference, [f.boundary for f in reference], "contract.fingerprint (from the training data)", \
            contract.capture.dtype
    trained = list(contract.capture.boundaries) if contract is not None else list(dd.boundaries)
    return None, trained, "", contract.capture.dtype if contract is not None else "float32"


def run_trace(
    target: str | None,
    draft: str | Path,
    prompt: str,
    out: str | Path,
    *,
    system: str | None = None,
    max_new_tokens: int = 64,
    tree: Any = "5",
    engine: str = "eyas",
    sglang_rule: str | None = None,
    device: str = "cpu",
    target_impl: str = "auto",
    model: Any = None,
    tokenizer: Any = None,
    log: Callable[[str], None] | None = None,
    ids_convention: str | None = None,
) -> TraceReport:
    """Serve the drafter at ``draft`` with the eyas engine the way ``engine`` reads the directory
    (its boundaries, in its slot order, and its norm flags), answer ``prompt`` greedily with the
    trace on, write the junction records to ``out`` and hold them against the training fingerprint.

    ``target_impl``: the engine's target (``auto``, ``fast``, ``hf``: :func:`eyas.engine.build_target`);
    the one that ran is in the header and the report (``target_impl``).

    ``ids_convention`` (specforge | sglang | sglang-legacy): what the directory's third-party nested
    SGLang ids mean; without it, boundaries those conventions read differently are assumed, which
    the header says (``trained_boundaries_assumed``).

    ``model``/``tokenizer`` may be passed already loaded. Raises :class:`TraceError` when the engine
    cannot serve the directory or the drafter does not fit the target.
    """
    from eyas.data.render import render_prompt
    from eyas.engine import TreeSpec, speculative_generate
    from eyas.interop import servers
    from eyas.targets import target_for

    say = log or (lambda m: None)
    spec = servers.get(engine)
    engine, engine_version = spec.name, spec.rule(sglang_rule)
    spec_tree = tree if isinstance(tree, TreeSpec) else TreeSpec.parse(str(tree))
    loaded = target_for(target, model, tokenizer, dtype="auto", device=device)  # bf16 on a GPU
    model, tokenizer, source = loaded.model, loaded.tokenizer, loaded.name
    if tokenizer is None:
        raise TraceError("a tokenizer is needed to render the prompt")
    facts = TargetFacts.of(loaded)
    say(f"reading {draft}")
    served = _serve(draft, engine, engine_version, loaded, target_impl, ids_convention)
    reference, trained, ref_source, capture_dtype = _training_reference(served.directory)

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = render_prompt(messages, tokenizer).to(loaded.device)
    header = {"engine": served.engine.to_dict(), "target": source, "draft": str(draft), "trained_boundaries": trained,
              "prompt_tokens": int(ids.numel()), "tree": [spec_tree.depth, spec_tree.top_k, spec_tree.total_tokens],
              "max_new_tokens": max_new_tokens,
              "trained_boundaries_assumed": served.directory.meta.boundaries_assumed}
    say(f"tracing {served.engine.label}: boundaries {served.engine.boundaries}, {ids.numel()} prompt tokens, "
        f"target {served.target.implementation}")
    with Tracer(served.target, served.drafter, out, header=header,
                channels=reference[0].channels if reference else None) as tr:
        result = speculative_generate(served.target, served.drafter, ids, tree=spec_tree, max_new_tokens=max_new_tokens,
                                      eos_token_ids=list(loaded.eos_ids), observer=tr)
    say("holding the trace against the training fingerprint")
    sequence = ids.reshape(-1).tolist() + result.tokens
    summary = tr.summary(reference, trained, ref_source, sequence=sequence, capture_dtype=capture_dtype)
    tr.append({"summary": summary.to_dict()})
    if summary.tokens_observed == 0:
        raise TraceError(f"the drafter read no target features but the first token's in {summary.rounds} round(s) "
                         f"(generation stopped at once): nothing to hold against the fingerprint; raise "
                         f"--max-new-tokens")
    stats = result.stats
    generation = TraceGeneration(tokenizer.decode(result.tokens, skip_special_tokens=True), stats.new_tokens,
                                 stats.rounds, stats.tau, stats.stop_reason, stats.acceptance_at_depth)
    return TraceReport(summary=summary, out=str(out), engine=served.engine, target=facts,
                       draft=TraceDraft(str(draft), served.directory.layout, trained), generation=generation,
                       notes=list(served.notes), target_impl=served.target.implementation)


def render_trace(report: TraceReport, console: Any) -> None:
    """The summary as a rich table, with the verdict."""
    from rich.markup import escape as e
    from rich.panel import Panel
    from rich.table import Table

    s, g = report.summary, report.generation
    console.print(f"[bold]eyas trace[/]  drafter {e(report.draft.path)}  target {e(str(report.target.source))}"
                  f"  engine [bold]{e(report.engine.label)}[/] (boundaries {e(str(report.engine.boundaries))})")
    tau = g.tau
    console.print(f"  {g.new_tokens} new tokens in {s.rounds} rounds"
                  + (f" (tau {tau:.2f})" if isinstance(tau, float) and math.isfinite(tau) else "")
                  + f"; {s.records} junction records -> {e(report.out)}"
                  + (f" (target {e(report.target_impl)})" if report.target_impl else ""))
    order = "-" if s.slot_order is None else str(s.slot_order)
    console.print(f"  concatenation slot order {e(order)} (trained {e(str(s.trained_boundaries))}); fc input width "
                  f"{s.fc_input.width} (expected {s.fc_input.expected_width})")
    for n in report.notes:
        console.print(f"  [dim]{e(n)}[/]")
    t = Table(title=f"slots vs {e(s.reference or 'no reference')} ({s.tokens_observed} tokens traced)",
              title_justify="left")
    for c in ("slot", "boundary", "trained", "RMS observed", "RMS training", "z", "channel", "looks like", "verdict"):
        t.add_column(c)

    def num(x: Any, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)

    for r in s.slots:
        ref, c = r.reference, r.comparison
        train = num(ref.rms_mean if ref else None, ".4g") + (f" ± {ref.rms_std:.2g}" if ref and ref.rms_std else "")
        verdict = f"[bold red]{e(r.verdict)}[/]" if r.off else ("[green]ok[/]" if r.verdict == "ok" else e(r.verdict))
        looks = "-" if r.looks_like is None else str(r.looks_like)
        t.add_row(str(r.slot), str(r.served_boundary), str(r.trained_boundary),
                  num(r.observed.rms_mean if r.observed else None, ".4g"), train, num(r.rms_z, "+.1f"),
                  num(c.channel_z if c else None, ".2f"), e(looks), verdict)
    console.print(t)
    for w in s.warnings:
        console.print(f"  [yellow]warning[/] {e(w)}")
    if s.healthy:
        console.print(Panel("[bold green]MATCHES[/]: every slot the drafter reads is what it was trained on.",
                            title="trace", border_style="green"))
    else:
        body = "[bold red]OFF[/]\n" + "\n".join(f"- {e(p)}" for p in s.problems)
        console.print(Panel(body, title="trace", border_style="red"))
