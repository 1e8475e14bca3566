"""``eyas trace``: shape and statistics at the three junctions of the eyas engine, per round, held
against the training fingerprint.

Junctions (one JSONL record each, per round):

    boundary   each captured boundary as the target's forward produced it (one record per slot),
               through eyas' one capture path (:class:`~eyas.capture.hooks.BoundaryCapture`)
    concat     the concatenated features as the drafter receives them (``DraftState.extend``: the
               prompt after prefill, the accepted path after each verification), with the slot
               order recovered from the values themselves (which captured boundary is in chunk i)
    fc_input   the input of ``drafter.fc``, after ``input_norm`` / ``fc_norm`` when configured

Round 0 is the prefill (the target reads the prompt, the drafter reads its features); round r >= 1
is the r-th verification (the target reads the drafted tree, the drafter re-reads the accepted
path). The round in which generation stops has no concat / fc_input record: the drafter never
reads it.

Statistics follow the fingerprint token rule of :mod:`eyas.capture.stats`: position 0 (the
attention sink, whose residual stream carries a massive activation) is left out of every statistic
and reported alone as ``first_token_rms``. ``rms`` is the mean over tokens of the per-token RMS,
the quantity the training fingerprint records (``rms_std`` its spread), ``mean``/``std``/``absmax``
are over every element of the counted tokens.

Free when off: the engine has no tracing code. :class:`Tracer` registers forward hooks (a
BoundaryCapture on the target's blocks, a pre-hook and a hook on the target model, a pre-hook on
the drafter and one on ``drafter.fc``) on ``__enter__`` and removes every one on ``__exit__``.

The summary holds the concatenation's per-slot statistics (every token the drafter read, but the
first) against the training fingerprint with the doctor's comparison and thresholds
(:func:`eyas.doctor.fingerprint.compare_slot`), and names what each slot resembles with the
doctor's resemblance (:func:`eyas.doctor.fingerprint.nearest` over every boundary of the live
target on the same tokens). A slot is off when it is fed another boundary than it was trained on,
when its RMS is off (|z| > 3 or a ratio outside [0.8, 1.25]), or when its channel means are off
and it does not match its trained boundary of the live target either. One request is not the
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

from eyas.capture.hooks import BoundaryCapture
from eyas.capture.stats import FingerprintAccumulator
from eyas.contract.contract import SlotFingerprint
from eyas.doctor.common import CHANNEL_OFF, RMS_RATIO_OFF, RMS_Z_OFF, jsonable, boundary_name, slot_label
from eyas.doctor.fingerprint import compare_slot, nearest
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


def _positions(p: Any, n: int, device: torch.device) -> Tensor:
    if isinstance(p, Tensor):
        return p.reshape(-1)
    return torch.arange(n, device=device)


class Tracer(AbstractContextManager):
    """Record the three junctions of the eyas engine while speculative decoding runs.

    >>> with Tracer(target, drafter, "trace.jsonl") as tr:
    ...     result = speculative_generate(target, drafter, prompt_ids)
    >>> tr.records                 # every junction record, as written
    >>> tr.summary(fingerprint)    # per slot: observed vs training statistics, what an off slot resembles

    ``target`` is an :class:`~eyas.engine.target.HFTarget` (its ``model`` and ``spec`` are read);
    ``out`` a JSONL path (None: records in memory only); ``header``: extra facts for the first line;
    ``channels``: the fingerprint channels to accumulate (the training fingerprint's).
    """

    def __init__(self, target: Any, drafter: Any, out: str | Path | None = None, header: dict[str, Any] | None = None,
                 channels: Sequence[int] | None = None) -> None:
        self.target, self.drafter = target, drafter
        self.model = target.model
        self.spec = target.spec
        cfg = drafter.config
        self.width = int(cfg.target_hidden_size)
        self.fc_in = int(cfg.fc_in_features)
        self.out = Path(out) if out is not None else None
        self.header = dict(header or {})
        self.records: list[dict[str, Any]] = []
        self.round = -1
        self.acc = FingerprintAccumulator(self.spec.boundaries, self.width, channels)
        self.slot_orders: list[tuple[int | None, ...]] = []
        self._fc = {"tokens": 0, "rms_sum": 0.0, "slot_rms_sum": [0.0] * self.spec.num_slots, "widths": set()}
        self._handles: list[Any] = []
        self._capture: BoundaryCapture | None = None
        self._file: Any = None
        self._phase = "prefill"
        self._target_pos: Tensor | None = None
        self._first_rows: list[Tensor] | None = None
        self._draft_keep: Tensor | None = None

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return bool(self._handles)

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
                    "fc_norm": bool(self.drafter.config.fc_norm), **self.header}
            self._write({"header": head})
            self._file.flush()
        self._capture = BoundaryCapture(self.model, self.spec).__enter__()
        self._handles = [
            self.model.register_forward_pre_hook(self._target_start, with_kwargs=True),
            self.model.register_forward_hook(self._target_end),
            self.drafter.register_forward_pre_hook(self._drafter_start, with_kwargs=True),
            self.drafter.fc.register_forward_pre_hook(self._fc_start),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._capture is not None:
            self._capture.__exit__(*exc)
            self._capture = None
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

    # -- hooks ----------------------------------------------------------------------------------

    def _target_start(self, _mod: Any, args: tuple, kwargs: dict) -> None:
        if self._file is not None:
            self._file.flush()  # the previous round is complete
        self.round += 1
        self._phase = "prefill" if self.target.cache_len == 0 else "verify"
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[-1]) if isinstance(ids, Tensor) else 0
        device = ids.device if isinstance(ids, Tensor) else torch.device("cpu")
        self._target_pos = _positions(kwargs.get("position_ids"), n, device)
        assert self._capture is not None
        self._capture.clear()

    def _target_end(self, _mod: Any, _args: tuple, _out: Any) -> None:
        assert self._capture is not None
        slots = self._capture.slots()  # each [1, T, H]
        pos = self._target_pos
        for i, (b, x) in enumerate(zip(self.spec.boundaries, slots)):
            rows = x.reshape(-1, x.shape[-1])
            p = pos if pos is not None and pos.numel() == rows.shape[0] else _positions(None, len(rows), rows.device)
            rec = {"junction": "boundary", "slot": i, "boundary": b, "shape": list(x.shape), "dtype": _dtype(x),
                   "positions": [int(p.min()), int(p.max())], **tensor_stats(rows[p != 0])}
            if bool((p == 0).any()):
                rec["first_token_rms"] = rows[p == 0].float().pow(2).mean(-1).sqrt().mean().item()
            self._record(rec)
        self._first_rows = [x.reshape(-1, x.shape[-1])[0] for x in slots]
        self._capture.clear()

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

    def _drafter_start(self, _mod: Any, args: tuple, kwargs: dict) -> None:
        self._draft_keep = None
        hidden = args[1] if len(args) > 1 else kwargs.get("hidden")
        if not isinstance(hidden, Tensor):
            return
        from_target = kwargs.get("from_target", args[6] if len(args) > 6 else None)
        if from_target is None:
            from_target = self.fc_in != self.drafter.config.hidden_size and hidden.shape[-1] == self.fc_in
        if not from_target or hidden.shape[-1] != self.fc_in:
            return  # a drafting step on the drafter's own fed-back state: not a junction
        x = hidden.detach().reshape(-1, self.fc_in)
        p = args[2] if len(args) > 2 else kwargs.get("position_ids")
        p = _positions(p, x.shape[0], x.device)
        if p.numel() != x.shape[0]:
            p = _positions(None, x.shape[0], x.device)
        keep = p != 0  # drafter entry t reads f_t at position t: position 0 is the sink's features
        chunks = x.split(self.width, dim=-1)
        order = self._match(chunks)
        self.slot_orders.append(order)
        counted = x[keep]
        self._record({"junction": "concat", "shape": list(hidden.shape), "dtype": _dtype(hidden),
                      "slot_order": list(order), "boundaries": list(self.spec.boundaries),
                      "positions": [int(p.min()), int(p.max())], **tensor_stats(counted),
                      "slot_rms": _slot_rms(counted, self.width)})
        self.acc.update(counted.reshape(-1, self.spec.num_slots, self.width))
        self._draft_keep = keep

    def _fc_start(self, _mod: Any, args: tuple) -> None:
        x = args[0].detach()
        rows = x.reshape(-1, x.shape[-1])
        keep = self._draft_keep
        if keep is None or keep.numel() != rows.shape[0]:
            keep = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        self._draft_keep = None
        counted = rows[keep]
        stats = tensor_stats(counted)
        slot_rms = _slot_rms(counted, self.width) if rows.shape[-1] % self.width == 0 else []
        self._record({"junction": "fc_input", "shape": list(x.shape), "dtype": _dtype(x),
                      "expected_width": self.fc_in, **stats, "slot_rms": slot_rms})
        fc = self._fc
        fc["widths"].add(int(x.shape[-1]))
        if stats["tokens"]:
            fc["tokens"] += stats["tokens"]
            fc["rms_sum"] += stats["rms"] * stats["tokens"]
            if len(slot_rms) == len(fc["slot_rms_sum"]):
                fc["slot_rms_sum"] = [s + r * stats["tokens"] for s, r in zip(fc["slot_rms_sum"], slot_rms)]

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
        reference the live target's trained boundaries stand in for one.
        """
        L = self.spec.num_blocks
        served = list(self.spec.boundaries)
        trained = list(trained) if trained is not None else (
            [f.boundary for f in reference] if reference else list(served))
        problems: list[str] = []
        warnings: list[str] = []
        live = self.live_boundary_stats(sequence, capture_dtype) if sequence is not None else None
        ref = list(reference) if reference else None
        source = reference_source or ("the training fingerprint" if ref else "")
        if ref is None and live is not None and all(b in live for b in trained):
            ref = [live[b] for b in trained]
            source = ("no training fingerprint: the live target's trained boundaries on this request "
                      "(catches a wrong capture, not a wrong target)")
        if ref is not None and len(ref) != len(served):
            problems.append(f"the engine feeds {len(served)} slots, the training fingerprint has {len(ref)}")
            ref = None
        if len(trained) != len(served):
            problems.append(f"the engine captures {len(served)} boundaries {served}, the drafter was trained on "
                            f"{len(trained)} {trained}")

        # slot order, as recovered from the values
        counts = Counter(self.slot_orders)
        order = list(counts.most_common(1)[0][0]) if counts else None
        if len(counts) > 1:
            problems.append(f"the slot order of the concatenation changes between rounds: "
                            f"{[list(o) for o in counts]}")
        if order is not None:
            for i, (got, want) in enumerate(zip(order, served)):
                if got != want:
                    what = "none of the captured boundaries" if got is None else f"boundary {got}"
                    problems.append(f"chunk {i} of the drafter's input holds {what}, the engine captured boundary "
                                    f"{want} for slot {i}")

        fc = self._fc
        widths = sorted(fc["widths"])
        fc_summary = {"width": widths[0] if len(widths) == 1 else widths, "expected_width": self.fc_in,
                      "tokens": fc["tokens"],
                      "rms": fc["rms_sum"] / fc["tokens"] if fc["tokens"] else None,
                      "slot_rms": [s / fc["tokens"] for s in fc["slot_rms_sum"]] if fc["tokens"] else None}
        if widths and widths != [self.fc_in]:
            problems.append(f"fc input width {widths}, expected {self.fc_in} "
                            f"({self.spec.num_slots} slots x {self.width})")

        obs = self.observed()
        rows = []
        for i, b in enumerate(served):
            row: dict[str, Any] = {"slot": i, "served_boundary": b,
                                   "observed_boundary": order[i] if order is not None and i < len(order) else None,
                                   "trained_boundary": trained[i] if i < len(trained) else None}
            row["boundary_mismatch"] = row["trained_boundary"] is not None and b != row["trained_boundary"]
            o = obs[i] if obs is not None else None
            r = ref[i] if ref is not None else None
            row.update({"rms_observed": o.rms_mean if o else None, "rms_std_observed": o.rms_std if o else None,
                        "tokens_observed": o.num_tokens if o else 0,
                        "rms_trained": r.rms_mean if r else None, "rms_std_trained": r.rms_std if r else None,
                        "tokens_trained": r.num_tokens if r else None})
            cmp = compare_slot(o, r) if (o is not None and r is not None) else None
            row.update(cmp or {"rms_z": None, "rms_ratio": None, "channel_z": None, "off": None})
            row["fingerprint_off"] = row.pop("off")  # the doctor's rule (any of RMS z, ratio, channel shift)
            looks = should = None
            if live is not None:
                if o is not None:
                    looks = nearest(o, live)[0]
                if r is not None:
                    should = nearest(r, live)[0]
            row.update({"looks_like": slot_label(looks, L) if looks is not None else None,
                        "looks_like_name": boundary_name(looks, L) if looks is not None else None,
                        "trained_matches": slot_label(should, L) if should is not None else None,
                        "trained_matches_name": boundary_name(should, L) if should is not None else None})
            # The RMS scale of a boundary hardly depends on the text; channel means do, and one
            # request is not the training data. A channel shift alone fails a slot only when the
            # slot does not also match its trained boundary of the live target on these very tokens.
            row["rms_off"] = None if cmp is None else (
                abs(cmp["rms_z"]) > RMS_Z_OFF or not (1 / RMS_RATIO_OFF <= cmp["rms_ratio"] <= RMS_RATIO_OFF))
            row["channel_off"] = None if cmp is None else cmp["channel_z"] > CHANNEL_OFF
            trained_b = row["trained_boundary"]
            looks_right = None if looks is None or trained_b is None else looks == trained_b
            channel_fails = bool(row["channel_off"]) and looks_right is not True
            row["order_mismatch"] = order is not None and row["observed_boundary"] != b
            row["off"] = bool(row["rms_off"]) or channel_fails or row["boundary_mismatch"] or row["order_mismatch"]
            if row["rms_off"] or channel_fails:
                msg = (f"slot {i} is off: per-token RMS {o.rms_mean:.4g} against {r.rms_mean:.4g} at training "
                       f"(z = {cmp['rms_z']:+.1f}, ratio {cmp['rms_ratio']:.2f}, channel shift {cmp['channel_z']:.2f})")
                if looks is not None:
                    msg += f"; slot {i} looks like {boundary_name(looks, L)}"
                if should is not None:
                    msg += f"; the training statistics of slot {i} match {boundary_name(should, L)} of this target"
                problems.append(msg)
            elif row["channel_off"]:
                warnings.append(f"slot {i}: channel means {cmp['channel_z']:.2f} x RMS away from training on this "
                                f"request (its text, not the capture: the slot matches {boundary_name(looks, L)}, "
                                f"the trained one, of the live target on the same tokens)")
            if row["boundary_mismatch"]:
                problems.append(f"slot {i} is fed {boundary_name(b, L)} but was trained on "
                                f"{boundary_name(trained_b, L)}")
            row["verdict"] = _verdict(row, L)
            rows.append(row)
        return TraceSummary(rounds=self.round + 1, records=len(self.records), served_boundaries=served,
                            trained_boundaries=trained, slot_order=order, reference=source if ref else None,
                            slots=rows, fc_input=fc_summary, problems=problems, warnings=warnings,
                            tokens_observed=self.acc.count)


def _verdict(row: dict[str, Any], L: int) -> str:
    if row["off"]:
        parts = []
        if row["boundary_mismatch"]:
            parts.append(f"fed boundary {row['served_boundary']}, trained on {row['trained_boundary']}")
        if row["order_mismatch"]:
            parts.append(f"the drafter's input holds {row['observed_boundary']} here")
        if row["fingerprint_off"]:
            parts.append(f"looks like {row['looks_like_name']}" if row["looks_like"] is not None
                         else "statistics off the training fingerprint")
        return "OFF: " + "; ".join(parts)
    if not row["tokens_observed"]:
        return "not checked (the drafter read nothing)"
    if row["fingerprint_off"] is None:
        return "not checked (no reference)"
    return "ok (channel means differ: this request's text)" if row["channel_off"] else "ok"


@dataclass
class TraceSummary:
    rounds: int
    records: int
    served_boundaries: list[int]
    trained_boundaries: list[int]
    slot_order: list[int | None] | None  # recovered from the concatenation's values
    reference: str | None  # what the observed statistics were held against
    slots: list[dict[str, Any]]
    fc_input: dict[str, Any]
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
            "slots": self.slots, "fc_input": self.fc_input,
        })


# ---------------------------------------------------------------------------------------------
# The whole command
# ---------------------------------------------------------------------------------------------


@dataclass
class TraceReport:
    summary: TraceSummary
    out: str
    engine: dict[str, Any]
    target: dict[str, Any]
    draft: dict[str, Any]
    generation: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.summary.healthy

    @property
    def exit_code(self) -> int:
        return self.summary.exit_code

    def to_dict(self) -> dict[str, Any]:
        return jsonable({"healthy": self.healthy, "out": self.out, "engine": self.engine, "target": self.target,
                          "draft": self.draft, "generation": self.generation, "notes": self.notes,
                          "summary": self.summary.to_dict()})


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
    engine_version: str | None = None,
    device: str = "cpu",
    model: Any = None,
    tokenizer: Any = None,
    log: Callable[[str], None] | None = None,
) -> TraceReport:
    """Serve the drafter at ``draft`` with the eyas engine the way ``engine`` reads the directory
    (its boundaries, in its slot order, and its norm flags), answer ``prompt`` greedily with the
    trace on, write the junction records to ``out`` and hold them against the training fingerprint.

    ``model``/``tokenizer`` may be passed already loaded. Raises :class:`TraceError` when the engine
    cannot serve the directory or the drafter does not fit the target.
    """
    from eyas.convention.boundaries import CaptureSpec
    from eyas.targets import LoadedTarget, TargetSource, load_target
    from eyas.targets.structure import find_embedding
    from eyas.data.render import render_prompt
    from eyas.doctor.engines import normalise_engine, read_drafter_dir, read_engine, served_config
    from eyas.doctor.evaluate import build_drafter
    from eyas.engine import HFTarget, TreeSpec, speculative_generate

    say = log or (lambda m: None)
    engine, engine_version = normalise_engine(engine, engine_version)
    spec_tree = tree if isinstance(tree, TreeSpec) else TreeSpec.parse(str(tree))
    if model is None:  # bf16 on a GPU, float32 on the CPU
        loaded = load_target(target, dtype="auto", device=device)
    else:
        loaded = LoadedTarget.from_model(model, tokenizer, TargetSource(str(target)))
    model, tokenizer, source = loaded.model, loaded.tokenizer, loaded.name
    if tokenizer is None:
        raise TraceError("a tokenizer is needed to render the prompt")
    L = loaded.num_blocks
    emb = find_embedding(model).weight

    say(f"reading {draft}")
    dd = read_drafter_dir(draft, L)
    reading = read_engine(dd, engine, engine_version, L)
    if not reading.loadable or reading.boundaries is None:
        raise TraceError(f"{reading.label} cannot serve {draft}: {reading.why_not}")
    cfg = served_config(dd, reading)
    misfit = loaded.misfits(cfg.target_hidden_size, cfg.vocab_size, reading.boundaries)
    if len(reading.boundaries) != cfg.num_slots:
        misfit.append(f"{reading.label} captures {len(reading.boundaries)} boundaries {reading.boundaries}; the "
                      f"drafter's fc takes {cfg.num_slots} slots")
    if misfit:
        raise TraceError(f"{draft} does not fit the target: " + "; ".join(misfit))
    drafter, notes = build_drafter(dd, cfg, emb, loaded.device)
    drafter = drafter.to(loaded.device, dtype=loaded.dtype).eval()
    tgt = HFTarget(model, CaptureSpec(tuple(reading.boundaries), L))

    contract = dd.contract
    reference = list(contract.fingerprint) if contract is not None and contract.fingerprint else None
    if reference is not None:
        trained = [f.boundary for f in reference]
        ref_source = "contract.fingerprint (from the training data)"
    else:
        trained = list(contract.capture.boundaries) if contract is not None else list(dd.boundaries)
        ref_source = ""
    capture_dtype = contract.capture.dtype if contract is not None else "float32"

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = render_prompt(messages, tokenizer).to(loaded.device)
    engine_info = {"name": engine, "version": engine_version, "label": reading.label,
                   "boundaries": list(reading.boundaries), "boundaries_note": reading.boundaries_note,
                   "flags": {f: bool(getattr(cfg, f)) for f in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                                  "norm_output")}}
    header = {"engine": engine_info, "target": source, "draft": str(draft), "trained_boundaries": trained,
              "prompt_tokens": int(ids.numel()), "tree": [spec_tree.depth, spec_tree.top_k, spec_tree.total_tokens],
              "max_new_tokens": max_new_tokens}
    say(f"tracing {reading.label}: boundaries {reading.boundaries}, {ids.numel()} prompt tokens")
    with Tracer(tgt, drafter, out, header=header, channels=reference[0].channels if reference else None) as tr:
        result = speculative_generate(tgt, drafter, ids, tree=spec_tree, max_new_tokens=max_new_tokens,
                                      eos_token_ids=loaded.eos_ids)
    say("holding the trace against the training fingerprint")
    sequence = ids.reshape(-1).tolist() + result.tokens
    summary = tr.summary(reference, trained, ref_source, sequence=sequence, capture_dtype=capture_dtype)
    tr.append({"summary": summary.to_dict()})
    if summary.tokens_observed == 0:
        raise TraceError(f"the drafter read no target features but the first token's in {summary.rounds} round(s) "
                         f"(generation stopped at once): nothing to hold against the fingerprint; raise "
                         f"--max-new-tokens")
    stats = result.stats.to_dict()
    generation = {"text": tokenizer.decode(result.tokens, skip_special_tokens=True), "new_tokens": stats["new_tokens"],
                  "rounds": stats["rounds"], "tau": stats["tau"], "stop_reason": stats["stop_reason"],
                  "acceptance_at_depth": stats["acceptance_at_depth"]}
    target_info = {"source": source, **loaded.identity.model_dump(
        include={"num_blocks", "hidden_size", "vocab_size", "fingerprint"})}
    return TraceReport(summary=summary, out=str(out), engine=engine_info, target=target_info,
                       draft={"path": str(draft), "layout": dd.layout, "trained_boundaries": trained},
                       generation=generation, notes=list(notes))


def render_trace(report: TraceReport, console: Any) -> None:
    """The summary as a rich table, with the verdict."""
    from rich.markup import escape as e
    from rich.panel import Panel
    from rich.table import Table

    s, g = report.summary, report.generation
    console.print(f"[bold]eyas trace[/]  drafter {e(report.draft['path'])}  target {e(str(report.target['source']))}"
                  f"  engine [bold]{e(report.engine['label'])}[/] (boundaries {e(str(report.engine['boundaries']))})")
    tau = g.get("tau")
    console.print(f"  {g['new_tokens']} new tokens in {s.rounds} rounds"
                  + (f" (tau {tau:.2f})" if isinstance(tau, float) and math.isfinite(tau) else "")
                  + f"; {s.records} junction records -> {e(report.out)}")
    order = "-" if s.slot_order is None else str(s.slot_order)
    console.print(f"  concatenation slot order {e(order)} (trained {e(str(s.trained_boundaries))}); fc input width "
                  f"{s.fc_input['width']} (expected {s.fc_input['expected_width']})")
    for n in report.notes:
        console.print(f"  [dim]{e(n)}[/]")
    t = Table(title=f"slots vs {e(s.reference or 'no reference')} ({s.tokens_observed} tokens traced)",
              title_justify="left")
    for c in ("slot", "boundary", "trained", "RMS observed", "RMS training", "z", "channel", "looks like", "verdict"):
        t.add_column(c)

    def num(x: Any, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)

    for r in s.slots:
        train = num(r["rms_trained"], ".4g") + (f" ± {r['rms_std_trained']:.2g}" if r["rms_std_trained"] else "")
        verdict = f"[bold red]{e(r['verdict'])}[/]" if r["off"] else (
            "[green]ok[/]" if r["verdict"] == "ok" else e(r["verdict"]))
        looks = "-" if r["looks_like"] is None else str(r["looks_like"])
        t.add_row(str(r["slot"]), str(r["served_boundary"]), str(r["trained_boundary"]), num(r["rms_observed"], ".4g"),
                  train, num(r["rms_z"], "+.1f"), num(r["channel_z"], ".2f"), e(looks), verdict)
    console.print(t)
    for w in s.warnings:
        console.print(f"  [yellow]warning[/] {e(w)}")
    if s.healthy:
        console.print(Panel("[bold green]MATCHES[/]: every slot the drafter reads is what it was trained on.",
                            title="trace", border_style="green"))
    else:
        body = "[bold red]OFF[/]\n" + "\n".join(f"- {e(p)}" for p in s.problems)
        console.print(Panel(body, title="trace", border_style="red"))
