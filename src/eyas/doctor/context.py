"""The doctor's context: what every stage reads, and where each stage leaves its typed result.

:func:`eyas.doctor.run.run_doctor` fills a :class:`DoctorContext` in three steps, then passes it
through the stage functions in order (each reads what it needs and returns its typed
:class:`~eyas.doctor.common.Stage`):

1. the target's facts (:class:`TargetFacts`) and the chosen engine (:class:`EngineChoice`);
2. the drafter directory and the engine's reading of it (:meth:`DoctorContext.open_directory`);
3. the samples, the trained boundaries, and whether the target fits the drafter
   (:meth:`DoctorContext.load_data`).

Invariants the stages rely on:

- a :class:`Blocker` stops the stages from ``Blocker.first`` on: the first reports the failure (or
  is skipped), the later ones are skipped with its reason; :meth:`DoctorContext.blocked` applies
  it, so a stage function only runs when everything it reads is there;
- the live target runs once (:meth:`DoctorContext.live_capture`, on the first measuring stage's
  request): boundaries 0..L+1 of every sample, their fingerprint statistics, and the labels;
- one drafter is built per set of norm flags (:class:`DrafterCache`): replay, live and every
  search candidate with the same flags share it;
- boundaries that nothing recorded settles (assumed, and no training shards of the drafter's slot
  count) are decided from live accuracy before any stage runs (:meth:`DoctorContext.settle_assumed`,
  :mod:`eyas.doctor.infer`): decided, ``trained`` is the winner and ``trained_note`` says so with
  the figures; undecided, they stay assumed and ``inference.why`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import Tensor

from eyas.contract.contract import SlotFingerprint, ValidationMetrics
from eyas.doctor.capture import LiveCapture, capture_all
from eyas.doctor.common import FAIL, STAGES, DoctorStages, Finding, Stage
from eyas.doctor.evaluate import Accuracy, accuracy
from eyas.doctor.infer import BoundaryInference, FlagInference, data_text, infer_boundaries, infer_flag
from eyas.interop import DrafterDir, build_drafter
from eyas.interop.servers import EngineReading
from eyas.doctor.samples import SampleSet
from eyas.drafter.model import Eagle3Drafter
from eyas.targets import LoadedTarget

DEFAULT_TTT_STEPS = 7  # EAGLE-3's TTT steps (TrainConfig.ttt_steps), when the contract records no per-position metrics


@dataclass(frozen=True)
class TargetFacts:
    """The live target, as the report names it."""

    source: str
    architecture: str
    num_blocks: int  # L
    hidden_size: int  # H
    vocab_size: int  # V (rows of the embedding)
    fingerprint: str  # eyas.contract.weights_fingerprint

    @classmethod
    def of(cls, loaded: LoadedTarget) -> "TargetFacts":
        i = loaded.identity  # hashed once per run
        return cls(loaded.name, i.architecture, i.num_blocks, i.hidden_size, i.vocab_size, i.fingerprint)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "architecture": self.architecture, "num_blocks": self.num_blocks,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "fingerprint": self.fingerprint}


@dataclass(frozen=True)
class EngineChoice:
    """The engine the doctor reads and captures as (``--engine``, ``--engine-version``), normalised."""

    name: str  # eyas | sglang | vllm
    version: str | None
    label: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "label": self.label}


@dataclass(frozen=True)
class DoctorOptions:
    draft: str | Path
    data: str | None = None
    samples: int = 32
    max_length: int = 512
    device: str = "cpu"


@dataclass(frozen=True)
class Blocker:
    """Why the stages from ``first`` on cannot run: ``failure`` (when set) is reported by ``first``
    with the summary ``failure_summary``; every other stage from ``first`` on is skipped with ``why``."""

    first: str  # a name in STAGES
    why: str
    failure: Finding | None = None
    failure_summary: str | None = None


class DrafterCache:
    """The directory's weights built into a drafter, once per set of norm flags (fp32, on ``device``,
    with the target's embedding unless the weights carry one; see
    :func:`eyas.interop.build_drafter`)."""

    def __init__(self, directory: DrafterDir, embedding: Tensor, device: str) -> None:
        self.directory, self.embedding, self.device = directory, embedding, device
        self._built: dict[tuple[tuple[str, bool], ...], tuple[Eagle3Drafter, list[str]]] = {}

    def with_notes(self, flags: dict[str, bool]) -> tuple[Eagle3Drafter, list[str]]:
        """The drafter with norm ``flags`` and the notes on what of the weights did not fit it."""
        key = tuple(sorted(flags.items()))
        if key not in self._built:
            cfg = self.directory.trained.model_copy(update=dict(flags))
            drafter, notes = build_drafter(cfg, self.directory.tensors, self.embedding)
            self._built[key] = (drafter.to(self.device).eval(), notes)
        return self._built[key]

    def get(self, flags: dict[str, bool]) -> Eagle3Drafter:
        return self.with_notes(flags)[0]


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


def capture_dtype(dd: DrafterDir, sset: SampleSet) -> str:
    """The dtype the training features were stored in (the live boundaries are rounded to it)."""
    if sset.source == "shards" and sset.stored_dtype:
        return sset.stored_dtype
    return dd.contract.capture.dtype if dd.contract is not None else "float32"


@dataclass
class DoctorContext:
    """Everything the doctor knows about one run, filled step by step (see the module docstring)."""

    options: DoctorOptions
    engine: EngineChoice
    loaded: LoadedTarget  # the live target: model, tokenizer, L, H, V, and whether a drafter fits it
    target: TargetFacts  # the same target, as the report names it
    embedding: Tensor  # [V, H] the target's token embedding (a drafter without its own uses it)
    say: Callable[[str], None]
    # -- the drafter directory (open_directory) ---------------------------------------------------
    drafter_dir: DrafterDir | None = None
    reading: EngineReading | None = None
    drafters: DrafterCache | None = None
    # -- the data (load_data) -------------------------------------------------------------------------
    samples: SampleSet | None = None
    trained: list[int] = field(default_factory=list)  # the boundaries the drafter was trained on
    trained_note: str | None = None  # set when they come from the training shards or live accuracy, not the directory
    blocker: Blocker | None = None
    # assumed boundaries, decided (or not) from live accuracy (settle_assumed); None when not tried
    inference: BoundaryInference | None = None
    capture_also: set[int] = field(default_factory=set)  # more boundaries the live capture keeps
    flag_inferences: dict[str, FlagInference] = field(default_factory=dict)  # assumed norm flags, decided or not
    # -- the live target (live_capture) ---------------------------------------------------------------
    capture: LiveCapture | None = None
    reference: list[SlotFingerprint] | None = None  # the training fingerprint, one per trained slot
    reference_source: str = ""
    # measured on the live capture, per (slots, sorted norm flags): the longest run asked for (live_accuracy)
    live_accuracies: dict[tuple, Accuracy] = field(default_factory=dict)
    # -- the results --------------------------------------------------------------------------------------
    stages: DoctorStages = field(default_factory=DoctorStages)

    @property
    def model(self) -> Any:
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    # -- filling ----------------------------------------------------------------------------------------

    def open_directory(self, directory: DrafterDir, reading: EngineReading) -> None:
        self.drafter_dir, self.reading = directory, reading
        self.drafters = DrafterCache(directory, self.embedding, self.options.device)

    def unreadable(self, error: Exception) -> None:
        """The drafter directory cannot be read: the static stage fails, every other is skipped."""
        why = "the drafter directory cannot be read"
        self.blocker = Blocker("static", why, Finding(FAIL, "unreadable", f"{self.options.draft}: {error}"), why)

    def load_data(self, samples: SampleSet | None, data_error: str | None) -> None:
        """The samples (or why there are none), the trained boundaries, and the blocker when the
        target does not fit the drafter (first) or there is nothing to evaluate on."""
        dd = self.dd
        self.samples = samples
        self.trained, self.trained_note = (trained_boundaries(dd, samples, self.target.hidden_size)
                                           if samples is not None else (dd.boundaries, None))
        problems = self.loaded.misfits(dd.trained.target_hidden_size, dd.trained.vocab_size, self.trained)
        if problems:
            self.blocker = Blocker("replay", "the target does not fit the drafter (" + "; ".join(problems)
                                   + "): nothing to measure")
        elif samples is None:
            why = data_error or "no samples"
            self.blocker = Blocker("replay", why, Finding(FAIL, "data", why), "no samples to evaluate on")

    @property
    def boundaries_unsettled(self) -> bool:
        """The trained boundaries are an assumption that nothing recorded here settles (no eyas.json
        boundaries, ids the conventions read differently, no training shards of the slot count)."""
        return bool(self.drafter_dir is not None and self.drafter_dir.meta.boundaries_assumed
                    and self.trained_note is None)

    def settle_assumed(self) -> None:
        """Decide unsettled boundaries from the drafter's live accuracy on the samples
        (:func:`eyas.doctor.infer.infer_boundaries`); a clear winner becomes the trained boundaries.
        Then each norm flag the directory states without evidence (``meta.flags_assumed``) on the
        trained boundaries (:func:`eyas.doctor.infer.infer_flag`): a clear winner other than the
        written value becomes the trained flag (``dd.trained``, its source saying so)."""
        if self.blocker is not None or self.samples is None:
            return
        self._settle_boundaries()
        dd = self.dd
        for flag in dd.meta.flags_assumed:
            fi = infer_flag(self, flag, self.trained)
            self.flag_inferences[flag] = fi
            if fi.decided is not None and fi.decided != fi.written:
                dd.trained = dd.trained.model_copy(update={flag: fi.decided})
                dd.trained_source += (f"; {flag}={str(fi.decided).lower()} inferred from live accuracy on "
                                      f"{data_text(self.sample_set)}: {fi.why}")

    def _settle_boundaries(self) -> None:
        if not self.boundaries_unsettled:
            return
        inf = infer_boundaries(self)
        self.inference = inf
        if inf.decided is None or self.loaded.misfits(self.dd.trained.target_hidden_size, self.dd.trained.vocab_size,
                                                      inf.decided):
            return
        self.trained = list(inf.decided)
        self.trained_note = (f"no recorded boundaries ({self.dd.meta.boundaries_assumed}); inferred from live "
                             f"accuracy on {inf.data}: {inf.why}")
        if self.capture is not None:
            self._set_reference(self.capture)

    def blocked(self, name: str) -> Stage | None:
        """The stage ``name`` as the blocker leaves it (failed or skipped); None when it may run."""
        b = self.blocker
        if b is None or STAGES.index(name) < STAGES.index(b.first):
            return None
        st: Stage = Stage(name)
        if name == b.first and b.failure is not None:
            st.findings.append(b.failure)
            return st.settle(b.failure_summary)
        return st.skip(b.why)

    def live_capture(self) -> LiveCapture:
        """The one pass of the live target over the samples (run on the first call).

        Keeps the values of the boundaries any search candidate may use: the trained and served
        ones and their neighbours, the embedding, L-3, L-1, L and L after the final norm (L+1);
        statistics are kept for every boundary. Without a recorded training fingerprint, the live
        target's trained boundaries stand in for one."""
        if self.capture is not None:
            return self.capture
        dd, sset, L = self.dd, self.sample_set, self.target.num_blocks
        ref, ref_source = reference_fingerprint(dd, sset, self.trained)
        self.say(f"capturing boundaries 0..{L} of the target on {len(sset.samples)} samples")
        near = set(self.trained) | set(self.served.boundaries or [])
        keep = near | {b + d for b in near for d in (-1, 1)} | {0, L - 3, L - 1, L, L + 1} | self.capture_also
        cap = capture_all(self.model, sset.samples, capture_dtype(dd, sset), ref[0].channels if ref else None,
                          keep=keep)
        self.capture = cap
        self._set_reference(cap)
        return cap

    def _set_reference(self, cap: LiveCapture) -> None:
        """The training fingerprint of the trained slots; without one recorded, the live target's
        trained boundaries on these samples."""
        ref, ref_source = reference_fingerprint(self.dd, self.sample_set, self.trained)
        if ref is None:
            ref = [cap.stats[b] for b in self.trained]
            ref_source = ("no training fingerprint recorded: the live target's trained boundaries on these samples "
                          "(catches a wrong capture, not a wrong target)")
        self.reference, self.reference_source = ref, ref_source

    def live_accuracy(self, slots: Sequence[int], flags: dict[str, bool], steps: int,
                      subset: Sequence[int] | None = None) -> Accuracy:
        """The drafter built with norm ``flags``, fed the live capture's boundaries ``slots`` (in
        order) and the live target's labels, over ``steps`` draft positions; on every sample, or
        on the samples ``subset`` (indices, the search's screening).

        Measured once per (slots, flags, subset): replay on live features, live and the search ask
        for the same protocol on the same capture, and a shorter ask is the first positions of a
        longer run (:meth:`Accuracy.first`); a longer ask than measured runs again."""
        bs = tuple(int(b) for b in slots)
        which = tuple(subset) if subset is not None else None
        key = (bs, tuple(sorted(flags.items())), which)
        got = self.live_accuracies.get(key)
        if got is None or len(got.accuracy_per_position) < steps:
            cap = self.live_capture()
            idx = list(which) if which is not None else list(range(len(self.sample_set.samples)))
            got = accuracy(self.drafter_cache.get(flags), [self.sample_set.samples[i] for i in idx],
                           lambda j: cap.features(idx[j], bs), [cap.argmax[i] for i in idx], steps)
            self.live_accuracies[key] = got
        return got.first(steps)

    # -- reading --------------------------------------------------------------------------------------

    @property
    def dd(self) -> DrafterDir:
        if self.drafter_dir is None:
            raise RuntimeError("doctor: a stage ran without a readable drafter directory (the blocker should skip it)")
        return self.drafter_dir

    @property
    def served(self) -> EngineReading:
        """The engine's reading of the directory."""
        if self.reading is None:
            raise RuntimeError("doctor: a stage ran without the engine's reading of the directory")
        return self.reading

    @property
    def sample_set(self) -> SampleSet:
        if self.samples is None:
            raise RuntimeError("doctor: a measuring stage ran without samples (the blocker should skip it)")
        return self.samples

    @property
    def drafter_cache(self) -> DrafterCache:
        if self.drafters is None:
            raise RuntimeError("doctor: no drafter directory to build drafters from")
        return self.drafters

    @property
    def metrics(self) -> ValidationMetrics | None:
        """The held-out metrics recorded at training (contract.metrics), when any were."""
        c = self.drafter_dir.contract if self.drafter_dir is not None else None
        return c.metrics if c is not None and c.metrics is not None and c.metrics.recorded else None

    @property
    def steps(self) -> int:
        """Draft positions to measure: as many as training measured, else the TTT default."""
        m = self.metrics
        return len((m.accuracy_per_position if m is not None else None) or []) or DEFAULT_TTT_STEPS
