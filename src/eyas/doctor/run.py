"""``eyas doctor``: every stage in order, none stopping the others.

    target facts -> the drafter directory and the engine's reading -> samples
    -> (assumed boundaries or norm flags: decided from live accuracy, eyas.doctor.infer)
    -> static -> replay -> live -> fingerprint -> search -> verdict -> report (JSON / rich / PNG)

Each stage is a function of the :class:`~eyas.doctor.context.DoctorContext` that returns its typed
stage; the one capture pass of the live target runs when replay first asks for it. A stage the
context's blocker stops (an unreadable directory, a target that does not fit, no samples) is
reported failed or skipped instead of run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eyas.doctor.common import SKIPPED, Stage
from eyas.doctor.context import DoctorContext, DoctorOptions, EngineChoice, TargetFacts
from eyas.doctor.fingerprint import fingerprint_stage
from eyas.doctor.live import live_stage
from eyas.doctor.replay import replay_stage
from eyas.doctor.report import DoctorReport, DraftFacts, plot_png
from eyas.doctor.samples import SampleSet, load_samples, training_config
from eyas.doctor.search import search_stage
from eyas.doctor.static import static_stage
from eyas.doctor.verdict import verdict
from eyas.errors import EyasError
from eyas.interop import read_as, read_drafter_dir, servers
from eyas.targets import LoadedTarget, load_target, target_for
from eyas.targets.structure import find_embedding

StageFunction = Callable[[DoctorContext], Stage]
STAGE_FUNCTIONS: tuple[tuple[str, StageFunction], ...] = (
    ("static", static_stage), ("replay", replay_stage), ("live", live_stage), ("fingerprint", fingerprint_stage),
    ("search", search_stage),
)
# What reading a drafter directory or its data may raise: a finding, never a crash.
INPUT_ERRORS = (EyasError, FileNotFoundError, ValueError)


def run_doctor(
    target: str | None,
    draft: str | Path,
    data: str | None = None,
    engine: str = "eyas",
    sglang_rule: str | None = None,
    samples: int = 32,
    max_length: int = 512,
    png: str | Path | None = None,
    device: str = "cpu",
    model: Any = None,
    tokenizer: Any = None,
    log: Callable[[str], None] | None = None,
    ids_convention: str | None = None,
    target_devices: str | None = None,
) -> DoctorReport:
    """Diagnose the drafter at ``draft`` against ``target`` as ``engine`` would serve it (an engine
    with several id rules, SGLang, following ``sglang_rule``; default: its current one).

    ``model``/``tokenizer`` may be passed already loaded (then ``target`` only names it in the
    report). Raises only for a target that cannot be loaded or a bad ``engine``; every problem with
    the drafter or the data is a finding in the report. ``ids_convention`` (specforge | sglang |
    sglang-legacy) says what a directory's third-party nested SGLang ids mean; without it, ids those
    conventions read differently give assumed boundaries, which the static stage warns about.
    ``target_devices`` (``--target-devices``) splits the target over several devices (float32, as
    on one device); the doctor then works on its first device.
    """
    if target_devices and model is None and target is not None:
        split = load_target(target, dtype=torch.float32, target_devices=target_devices)
        model, tokenizer, device = split.model, split.tokenizer, str(split.device)
    threads = cpu_threads(device)
    if threads is None:
        return _run(target, draft, data, engine, sglang_rule, samples, max_length, png, device, model, tokenizer, log,
                    ids_convention)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(target, draft, data, engine, sglang_rule, samples, max_length, png, device, model, tokenizer, log,
                    ids_convention)
    finally:
        torch.set_num_threads(before)


def static_check(loaded: LoadedTarget, draft: str | Path, engine: str = "eyas", sglang_rule: str | None = None,
                 ids_convention: str | None = None, log: Callable[[str], None] | None = None) -> Stage:
    """The static stage alone (nothing runs on the target): the directory as ``engine`` reads it,
    against training and against the already loaded target. What ``eyas serve`` checks at start-up;
    a failed stage carries each finding with its field, expected and found values and the edit or
    the words that fix it."""
    spec = servers.get(engine)
    version = spec.rule(sglang_rule)
    ctx = DoctorContext(
        options=DoctorOptions(draft=draft, device=str(loaded.device)), engine=EngineChoice(spec.name, version,
                                                                                           spec.label(version)),
        loaded=loaded, target=TargetFacts.of(loaded), embedding=find_embedding(loaded.model).weight,
        say=log or (lambda m: None))
    if _open_directory(ctx, ids_convention):
        ctx.load_data(None, "the static stage only: no samples")
    return (ctx.blocked("static") or static_stage(ctx)).settle()


def cpu_threads(device: str) -> int | None:
    """The intra-op threads the doctor runs with on a CPU: half of torch's default (at least 1),
    unless OMP_NUM_THREADS says otherwise (then None: as set). Its many small operations wait at
    every thread barrier; with as many threads as cores, any other busy process stalls them (on 2
    cores shared with other work a run took 56-94 s with 2 threads and 23 s with 1)."""
    if not str(device).startswith("cpu") or os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, torch.get_num_threads() // 2)


def _run(target: str | None, draft: str | Path, data: str | None, engine: str, sglang_rule: str | None,
         samples: int, max_length: int, png: str | Path | None, device: str, model: Any, tokenizer: Any,
         log: Callable[[str], None] | None, ids_convention: str | None) -> DoctorReport:
    t0 = time.perf_counter()
    spec = servers.get(engine)
    name, version = spec.name, spec.rule(sglang_rule)
    loaded = target_for(target, model, tokenizer, dtype=torch.float32, device=device)
    ctx = DoctorContext(
        options=DoctorOptions(draft=draft, data=data, samples=samples, max_length=max_length, device=str(loaded.device)),
        engine=EngineChoice(name, version, spec.label(version)), loaded=loaded, target=TargetFacts.of(loaded),
        embedding=find_embedding(loaded.model).weight, say=log or (lambda m: None))
    if _open_directory(ctx, ids_convention):
        _load_data(ctx)
        ctx.settle_assumed()  # boundaries nothing recorded settles: decided from live accuracy, or said why not
    for stage_name, stage in STAGE_FUNCTIONS:
        ctx.stages[stage_name] = ctx.blocked(stage_name) or stage(ctx)
    return _report(ctx, png, t0)


def _open_directory(ctx: DoctorContext, ids_convention: str | None = None) -> bool:
    """Read the drafter directory (third-party nested ids by ``ids_convention``) and the engine's
    reading of it; False (and the blocker) when it cannot be read."""
    draft, L = ctx.options.draft, ctx.target.num_blocks
    ctx.say(f"reading {draft}")
    try:
        dd = read_drafter_dir(draft, L, ids_convention)
    except INPUT_ERRORS as e:
        ctx.unreadable(e)
        return False
    ctx.open_directory(dd, read_as(ctx.engine.name, dd, L, ctx.engine.version))
    return True


def _load_data(ctx: DoctorContext) -> None:
    """The samples to evaluate on (``--data``, the run's training data, or built-in prompts)."""
    o, dd = ctx.options, ctx.dd
    sset: SampleSet | None = None
    data_error = None
    try:
        ctx.say("loading samples")
        sset = load_samples(o.data, ctx.model, ctx.tokenizer, dd.contract, training_config(dd), o.samples, o.max_length)
    except INPUT_ERRORS as e:
        data_error = f"--data {o.data}: {e}"
    ctx.load_data(sset, data_error)


def _report(ctx: DoctorContext, png: str | Path | None, t0: float) -> DoctorReport:
    for st in ctx.stages.values():
        if st.status != SKIPPED:
            st.settle()
    dd = ctx.drafter_dir
    draft = DraftFacts(str(ctx.options.draft)) if dd is None else DraftFacts(
        str(ctx.options.draft), dd.layout, dd.meta.format, ctx.trained, dd.trained_flags)
    report = DoctorReport(verdict=verdict(ctx.stages, dd, ctx.reading, ctx.target.num_blocks), engine=ctx.engine,
                          target=ctx.target, draft=draft, data=ctx.samples, stages=ctx.stages)
    report.wall_s = time.perf_counter() - t0
    if png is not None:
        report.png = str(plot_png(report, png))
    return report
