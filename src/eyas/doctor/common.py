"""What every doctor stage shares: findings, stages, config edits, thresholds and names.

A stage reports a status (``pass`` | ``warn`` | ``fail`` | ``skipped``), a one-line summary, a list
of :class:`Finding` and its typed result (a dataclass with ``to_dict()``, e.g.
:class:`eyas.doctor.replay.ReplayResult`; None when the stage measured nothing). A finding with
level ``fail`` makes the drafter unhealthy; ``warn`` is reported but does not; ``info`` is context.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from dataclasses import field as _field
from typing import TYPE_CHECKING, Any, Generic, Iterator, TypeVar

if TYPE_CHECKING:
    from eyas.doctor.fingerprint import FingerprintResult
    from eyas.doctor.live import LiveResult
    from eyas.doctor.replay import ReplayResult
    from eyas.doctor.search import SearchResult
    from eyas.doctor.static import StaticResult

from eyas.drafter.config import NORM_FLAGS  # noqa: F401 - the doctor's stages read them from here
from eyas.interop.servers import Edit

# ---------------------------------------------------------------------------------------------
# Thresholds (one place, each with its reason)
# ---------------------------------------------------------------------------------------------

# Live vs replay run on the SAME token sequences, so a healthy serving path gives the same numbers
# up to float rounding; a broken one loses a large fraction. "Short" = below the reference by more
# than max(LIVE_ABS_TOL, LIVE_REL_TOL * reference).
LIVE_ABS_TOL = 0.03
LIVE_REL_TOL = 0.10
# Replay vs the accuracy recorded at training: other samples (unless the held-out split is
# reproduced), so sampling noise counts: max(REPLAY_ABS_TOL, REPLAY_SIGMAS * binomial std error).
REPLAY_ABS_TOL = 0.05
REPLAY_SIGMAS = 3.0
# Fingerprint: a slot is off when its mean per-token RMS is RMS_Z_OFF per-token standard
# deviations away from training, or outside [1/RMS_RATIO_OFF, RMS_RATIO_OFF] times it, or when a
# channel mean moved by more than CHANNEL_OFF times the slot's typical per-token magnitude (RMS).
RMS_Z_OFF = 3.0
RMS_RATIO_OFF = 1.25
CHANNEL_OFF = 0.5
# Fingerprint resemblance: the live boundary nearest a slot's training statistics is told apart from
# the runner-up only when the runner-up is farther by more than SEPARATION_MARGIN times the nearest
# one's own distance. That distance is what is left between training and its best live match (other
# texts, capture dtype, a quantised target): the noise of the comparison. A gap inside it (the
# runner-up less than twice as far, relative gap (d2 - d1) / d2 <= 1/2) is not evidence of which
# boundary the slot was trained on.
SEPARATION_MARGIN = 1.0
# Search: the first SEARCH_POSITIONS draft positions are scored (position 0 sees the target's
# features, position 1 the drafter's own fed-back state: together they exercise every norm flag).
SEARCH_POSITIONS = 2
# Search screening: a candidate is first scored on SCREEN_SAMPLES evenly spaced samples (when there
# are at least twice as many); it is ruled out, unscored on the rest, when even SCREEN_SIGMAS binomial
# standard errors above its screening score it stays short of the replay (short_by). A candidate that
# could restore is never ruled out by noise: SCREEN_SIGMAS = 3 leaves it about 1 chance in 700.
SCREEN_SAMPLES = 4
SCREEN_SIGMAS = 3.0

FAIL, WARN, INFO, OK = "fail", "warn", "info", "ok"
PASS, SKIPPED = "pass", "skipped"

# ---------------------------------------------------------------------------------------------
# Config edits (each an eyas.interop.servers.Edit, in the engine's own convention)
# ---------------------------------------------------------------------------------------------


def edits_text(edits: list[Edit], directory: str) -> str:
    by_file: dict[str, list[Edit]] = {}
    for e in edits:
        by_file.setdefault(e.file, []).append(e)
    return "; ".join(f"in {directory}/{f} set " + ", ".join(str(e) for e in es) for f, es in by_file.items())


# ---------------------------------------------------------------------------------------------
# Findings and stages
# ---------------------------------------------------------------------------------------------


@dataclass
class Finding:
    level: str  # fail | warn | info | ok
    code: str  # machine-readable kind, e.g. "boundaries", "flag:norm_before_fc", "target_mismatch"
    message: str
    field: str | None = None
    expected: Any = None
    found: Any = None
    edits: list[Edit] = _field(default_factory=list)  # the config edits that fix it, when there are
    fix: str | None = None  # the fix in words, when it is not a config edit

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "edits" and v is not None}
        if self.edits:
            d["edits"] = [e.to_dict() for e in self.edits]
        return d


R = TypeVar("R")


@dataclass
class Stage(Generic[R]):
    name: str
    status: str = PASS  # pass | warn | fail | skipped
    summary: str = ""
    findings: list[Finding] = _field(default_factory=list)
    result: R | None = None  # the stage's typed measurements; None when it measured nothing

    def add(self, level: str, code: str, message: str, **kw: Any) -> Finding:
        f = Finding(level, code, message, **kw)
        self.findings.append(f)
        return f

    def settle(self, summary: str | None = None) -> "Stage":
        """Status from the findings (unless skipped)."""
        if self.status != SKIPPED:
            levels = {f.level for f in self.findings}
            self.status = FAIL if FAIL in levels else WARN if WARN in levels else PASS
        if summary is not None:
            self.summary = summary
        return self

    def skip(self, why: str) -> "Stage":
        self.status, self.summary = SKIPPED, why
        return self

    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.level == FAIL]

    def to_dict(self) -> dict[str, Any]:
        """The JSON of the stage: status, summary, findings, then the result's keys at the same level."""
        result = jsonable(self.result) if self.result is not None else {}
        return {"status": self.status, "summary": self.summary,
                "findings": [f.to_dict() for f in self.findings], **result}


STAGES = ("static", "replay", "live", "fingerprint", "search")


@dataclass
class DoctorStages:
    """The doctor's five stages in their order, each with its typed result. ``stages["live"]``
    reads a stage by name (the report's loops); ``stages.live.result`` reads it typed."""

    static: Stage[StaticResult] = _field(default_factory=lambda: Stage("static"))
    replay: Stage[ReplayResult] = _field(default_factory=lambda: Stage("replay"))
    live: Stage[LiveResult] = _field(default_factory=lambda: Stage("live"))
    fingerprint: Stage[FingerprintResult] = _field(default_factory=lambda: Stage("fingerprint"))
    search: Stage[SearchResult] = _field(default_factory=lambda: Stage("search"))

    def __getitem__(self, name: str) -> Stage:
        if name not in STAGES:
            raise KeyError(f"no doctor stage {name!r}: expected one of {list(STAGES)}")
        return getattr(self, name)

    def __setitem__(self, name: str, stage: Stage) -> None:
        if name not in STAGES or stage.name != name:
            raise KeyError(f"doctor stage {name!r}: expected one of {list(STAGES)} holding a stage of that name, "
                           f"found {stage.name!r}")
        setattr(self, name, stage)

    def __iter__(self) -> Iterator[str]:
        return iter(STAGES)

    def items(self) -> list[tuple[str, Stage]]:
        return [(name, self[name]) for name in STAGES]

    def values(self) -> list[Stage]:
        return [self[name] for name in STAGES]


def jsonable(x: Any) -> Any:
    """Plain JSON values: dicts, lists, finite floats (inf and nan -> None), and objects through
    their ``to_dict()`` (dataclasses) or ``model_dump()`` (pydantic models)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "to_dict"):
        return jsonable(x.to_dict())
    if hasattr(x, "model_dump"):
        return jsonable(x.model_dump())
    return x


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------


def boundary_name(b: int, num_blocks: int) -> str:
    L = num_blocks
    if b == 0:
        return "boundary 0 (the embedding output)"
    if b == L:
        return f"boundary {L} (the last block's output, before the final norm)"
    if b == L + 1:
        return f"boundary {L} AFTER the final norm"
    return f"boundary {b} (output of block {b - 1})"


def slot_label(b: int, num_blocks: int) -> str | int:
    """A boundary id for JSON: the int, or a string for the post-norm pseudo-boundary."""
    return f"{num_blocks}+final_norm" if b == num_blocks + 1 else b


def slots_text(bs: Any, num_blocks: int) -> str:
    return "[" + ", ".join(str(slot_label(b, num_blocks)) for b in bs) + "]"


def short_by(value: float, reference: float, abs_tol: float = LIVE_ABS_TOL, rel_tol: float = LIVE_REL_TOL) -> bool:
    return value < reference - max(abs_tol, rel_tol * reference)


def replay_tolerance(p: float, n: int) -> float:
    se = math.sqrt(max(p * (1 - p), 1e-4) / max(n, 1))
    return max(REPLAY_ABS_TOL, REPLAY_SIGMAS * se)


def fmt_acc(xs: list[float] | None) -> str:
    return "-" if not xs else "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"
