"""``eyas doctor``: every stage in order, none stopping the others.

    static -> (samples) -> one capture pass of the live target -> replay -> live -> fingerprint
    -> search (when live falls short) -> verdict -> report (JSON / rich / PNG)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from eyas.targets import LoadedTarget, TargetSource, load_target
from eyas.targets.structure import find_embedding
from eyas.contract.contract import SlotFingerprint
from eyas.doctor.capture import LiveCapture, capture_all, stored_labels
from eyas.doctor.common import FAIL, Stage
from eyas.doctor.engines import DrafterDir, EngineReading, normalise_engine, read_drafter_dir, read_engine
from eyas.doctor.evaluate import build_drafter
from eyas.doctor.fingerprint import fingerprint_stage, nearest
from eyas.doctor.live import live_stage
from eyas.doctor.replay import replay_features, replay_stage
from eyas.doctor.report import STAGES, DoctorReport, plot_png
from eyas.doctor.samples import SampleSet, load_samples
from eyas.doctor.search import SearchResult, search_stage
from eyas.doctor.static import static_stage
from eyas.doctor.verdict import verdict
from eyas.errors import EyasError

DEFAULT_TTT_STEPS = 7  # DESIGN.md section 5, when the contract records no per-position metrics


def trained_boundaries(dd: DrafterDir, sset: SampleSet, H: int) -> tuple[list[int], str | None]:
    """What the drafter was trained on: its contract's boundaries; for a directory without a
    contract, given its training shards, the shards' boundaries (config.json's ids are exactly
    what is in doubt)."""
    mc = sset.manifest_contract
    if (dd.contract is None and sset.source == "shards" and sset.stored_boundaries and mc is not None
            and len(sset.stored_boundaries) == dd.trained.num_slots and mc.target.hidden_size == H):
        return list(sset.stored_boundaries), (f"no contract: the training shards' boundaries {sset.stored_boundaries} "
                                              f"are taken as the trained ones")
    return dd.boundaries, None


def reference_fingerprint(dd: DrafterDir, sset: SampleSet, trained: list[int]) -> tuple[list[SlotFingerprint] | None, str]:
    """The training fingerprint of the trained slots: the contract's, else the shards manifest's."""
    c = dd.contract
    if c is not None and c.fingerprint and [f.boundary for f in c.fingerprint] == trained:
        return list(c.fingerprint), "contract.fingerprint (from the training data)"
    mc = sset.manifest_contract
    if mc is not None and mc.fingerprint and [f.boundary for f in mc.fingerprint] == trained:
        return list(mc.fingerprint), f"the shards manifest ({sset.path})"
    return None, ""


def _capture_dtype(dd: DrafterDir, sset: SampleSet) -> str:
    if sset.source == "shards" and sset.stored_dtype:
        return sset.stored_dtype
    return dd.contract.capture.dtype if dd.contract is not None else "float32"


def run_doctor(
    target: str | None,
    draft: str | Path,
    data: str | None = None,
    engine: str = "eyas",
    engine_version: str | None = None,
    samples: int = 32,
    max_length: int = 512,
    png: str | Path | None = None,
    device: str = "cpu",
    model: Any = None,
    tokenizer: Any = None,
    log: Callable[[str], None] | None = None,
) -> DoctorReport:
    """Diagnose the drafter at ``draft`` against ``target`` as ``engine`` would serve it.

    ``model``/``tokenizer`` may be passed already loaded (then ``target`` only names it in the
    report). Raises only for a target that cannot be loaded or a bad ``engine``; every problem with
    the drafter or the data is a finding in the report.
    """
    t0 = time.perf_counter()
    say = log or (lambda m: None)
    engine, engine_version = normalise_engine(engine, engine_version)
    if model is None:
        loaded = load_target(target, dtype=torch.float32, device=device)
    else:
        loaded = LoadedTarget.from_model(model, tokenizer, TargetSource(str(target)))
    model, tokenizer, device = loaded.model, loaded.tokenizer, loaded.device
    L, H, V = loaded.num_blocks, loaded.hidden_size, loaded.vocab_size
    emb = find_embedding(model).weight
    target_info = {"source": loaded.name, **loaded.identity.model_dump(
        include={"architecture", "num_blocks", "hidden_size", "vocab_size", "fingerprint"})}
    stages = {name: Stage(name) for name in STAGES}
    engine_info: dict[str, Any] = {"name": engine, "version": engine_version,
                                   "label": EngineReading(engine, engine_version).label}

    def finish(dd: DrafterDir | None, reading: EngineReading | None, sset: SampleSet | None,
               search: SearchResult | None) -> DoctorReport:
        for st in stages.values():
            if st.status != "skipped":
                st.settle()
        v = verdict(stages, dd, reading, L, search)
        report = DoctorReport(
            healthy=v["healthy"], cause=v["cause"], fix=v["fix"], fix_edits=v["fix_edits"], warnings=v["warnings"],
            problems=v["problems"], engine=engine_info, target=target_info,
            draft={"path": str(draft), "layout": dd.layout if dd else None, "format": dd.meta.format if dd else None,
                   "trained_boundaries": (stages["static"].data.get("trained") or {}).get("boundaries")
                   or (dd.boundaries if dd else None),
                   "trained_flags": dd.trained_flags if dd else None},
            data=sset.to_dict() if sset is not None else None, stages=stages)
        report.wall_s = time.perf_counter() - t0
        if png is not None:
            report.png = str(plot_png(report, png))
        return report

    # --- the drafter directory ---
    say(f"reading {draft}")
    try:
        dd = read_drafter_dir(draft, L)
    except (EyasError, FileNotFoundError, ValueError) as e:
        stages["static"].add(FAIL, "unreadable", f"{draft}: {e}")
        stages["static"].settle("the drafter directory cannot be read")
        for name in STAGES[1:]:
            stages[name].skip("the drafter directory cannot be read")
        return finish(None, None, None, None)
    reading = read_engine(dd, engine, engine_version, L)

    # --- samples ---
    sset: SampleSet | None = None
    data_error = None
    try:
        say("loading samples")
        sset = load_samples(data, model, tokenizer, dd.contract, dd.train_config, samples, max_length)
    except (EyasError, FileNotFoundError, ValueError) as e:
        data_error = f"--data {data}: {e}"

    trained, trained_note = trained_boundaries(dd, sset, H) if sset is not None else (dd.boundaries, None)
    stages["static"] = static_stage(dd, reading, model, tokenizer, L, H, V, sset, trained, trained_note)
    misfit = loaded.misfits(dd.trained.target_hidden_size, dd.trained.vocab_size, trained)
    if misfit:
        why = "the target does not fit the drafter (" + "; ".join(misfit) + "): nothing to measure"
        for name in ("replay", "live", "fingerprint", "search"):
            stages[name].skip(why)
        return finish(dd, reading, sset, None)
    if sset is None:
        stages["replay"].add(FAIL, "data", data_error or "no samples")
        stages["replay"].settle("no samples to evaluate on")
        for name in ("live", "fingerprint", "search"):
            stages[name].skip(data_error or "no samples")
        return finish(dd, reading, None, None)

    # --- one pass of the live target ---
    ref, ref_source = reference_fingerprint(dd, sset, trained)
    say(f"capturing boundaries 0..{L} of the target on {len(sset.samples)} samples")
    near = set(trained) | set(reading.boundaries or [])
    keep = near | {b + d for b in near for d in (-1, 1)} | {0, L - 3, L - 1, L, L + 1}
    cap: LiveCapture = capture_all(model, sset.samples, _capture_dtype(dd, sset), ref[0].channels if ref else None,
                                   keep=keep)
    if ref is None:
        ref = [cap.stats[b] for b in trained]
        ref_source = ("no training fingerprint recorded: the live target's trained boundaries on these samples "
                      "(catches a wrong capture, not a wrong target)")
    metrics = (dd.contract.metrics if dd.contract is not None else None) or {}
    steps = len(metrics.get("accuracy_per_position") or []) or DEFAULT_TTT_STEPS

    drafters: dict[tuple, tuple[Any, list[str]]] = {}

    def drafter_for(flags: dict[str, bool]) -> Any:
        return _drafter(flags)[0]

    def _drafter(flags: dict[str, bool]) -> tuple[Any, list[str]]:
        key = tuple(sorted(flags.items()))
        if key not in drafters:
            drafters[key] = build_drafter(dd, dd.trained.model_copy(update=dict(flags)), emb, device)
        return drafters[key]

    # --- replay ---
    say("replay")
    stored = stored_labels(model, sset.samples) if sset.source == "shards" else None
    feats, labels, how = replay_features(trained, sset, cap, cap.argmax, stored)
    stages["replay"], replay_summary = replay_stage(dd, sset, drafter_for(dd.trained_flags), feats, labels, how, steps)

    # --- live ---
    say(f"live, as {reading.label} serves it")
    served_drafter, notes = _drafter(reading.flags) if reading.flags else (None, [])
    fc = dd.tensors.get("fc.weight")
    fc_in = int(fc.shape[1]) if fc is not None and fc.dim() == 2 else None
    stages["live"], live_summary = live_stage(reading, sset, cap, cap.argmax, served_drafter, notes, fc_in,
                                              replay_summary, metrics, steps)

    # --- fingerprint ---
    served = reading.boundaries if reading.loadable else None
    stages["fingerprint"] = fingerprint_stage(ref, ref_source, served, cap.stats, L, reading.label)

    # --- search ---
    live_short = any(f.code == "live_short" for f in stages["live"].findings)
    why = ("live matches replay" if stages["live"].status != "skipped" else f"no live run: {stages['live'].summary}")
    fp_match = [nearest(r, cap.stats)[0] for r in ref]
    if live_short:
        say("searching the plausible protocols")
        cap.ensure(model, sset.samples, fp_match)
    search = search_stage(live_short, why, served, reading.flags, L, trained, dd.trained_flags, fp_match, cap,
                          sset.samples, cap.argmax, drafter_for, replay_summary, live_summary, steps)
    stages["search"] = search.stage
    return finish(dd, reading, sset, search)
