"""What a regeneration (:func:`eyas.data.regenerate.regenerate`, ``eyas regenerate``) is asked and
what it reports: :class:`RegenerateOptions`, the :class:`GenerationParams` every record carries, the
answer ids and sampling seeds (:func:`answer_id`, :func:`sampling_seed`), :class:`RegenerateError`
and :class:`RegenerateSummary`. The algorithm is described in :mod:`eyas.data.regenerate`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveInt, field_validator

from eyas.data.render import TEMPLATE_DEFAULT, system_prompt_mode
from eyas.data.runs import RunOptions, Throughput
from eyas.errors import EyasError


class RegenerateError(EyasError, ValueError):
    """The output file cannot be resumed (corrupt line, other generation parameters)."""


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

LoopPolicy = Literal["cut", "drop", "keep"]
CacheMode = Literal["auto", "dynamic", "static"]


class GenerationParams(BaseModel):
    """What one temperature's answers depend on, recorded in every record's
    ``provenance.generation``; a resume must use the same (field order = the recorded key order).

    Files written before ``loops`` and ``sort_by_length`` existed lack them; they mean
    :attr:`LEGACY` (answers were never cut, chunks were in input order): such a file resumes only
    with ``loops="keep"`` and ``sort_by_length=False``, never silently with today's defaults, which
    would cut new answers and not old ones and cut other chunks."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    LEGACY: ClassVar[dict[str, Any]] = {"loops": "keep", "sort_by_length": False}

    do_sample: bool
    temperature: float  # 0.0 when greedy
    top_p: float  # 1.0 when greedy
    seed: int | None  # None when greedy
    max_new_tokens: int
    batch_size: int  # batch composition changes the numerics of padded batches
    system_prompt: str  # its mode: template_default | none | custom
    max_prompt_tokens: int | None
    max_turns: int | None
    loops: LoopPolicy  # what a repetition loop in an answer does: cut | drop | keep
    sort_by_length: bool  # chunks cut from the conversations sorted by first-prompt length


def answer_id(conversation: str, temperature: float) -> str:
    """The output id of ``conversation``'s answer at ``temperature``: its own id when greedy,
    ``<id>@t<temperature:g>`` when sampled (``p3@t0.8``)."""
    return conversation if temperature == 0 else f"{conversation}@t{temperature:g}"


def sampling_seed(seed: int, chunk: int, temperature: float, turn: int = 0) -> int:
    """The seed of chunk ``chunk`` sampled at ``temperature``, at its ``turn``-th user turn: a hash of
    the four, so a resumed unit samples the same, and adding a temperature changes no other unit's
    seed (turn 0 hashes as the three alone did before turns had their own seeds)."""
    digest = hashlib.sha256((f"{seed}/{chunk}/{temperature:g}" + (f"/{turn}" if turn else "")).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch seeds are < 2**64; stay positive


class RegenerateOptions(RunOptions):
    """Every option of ``eyas regenerate`` (:func:`regenerate`), flat and typed. Invalid values
    raise :class:`RegenerateError` naming the field, expected and found."""

    error: ClassVar[type[EyasError]] = RegenerateError

    out_path: Path  # JSONL to write: appended to, and resumed, if it exists (failures: <out>.skipped.jsonl)
    # --- what the answers depend on (GenerationParams: recorded, a resume must use the same) ---
    max_new_tokens: PositiveInt = 1024  # per answer; an answer cut there has finish reason "length"
    # Conversations generated together (left-padded batch); also the resume unit. Large batches are
    # nearly free on a GPU: a decode step of a small target is dominated by per-step overhead
    # (SmolLM2-sized on an H200: ~600 tok/s at 64, ~3200 at 256).
    batch_size: PositiveInt = 64
    temperature: NonNegativeFloat = 0.0  # one answer per prompt: 0 greedy; > 0 sampled with top_p
    # Several answers per prompt, one per temperature (e.g. [0, 0.8]); give it or temperature, not both.
    temperatures: list[NonNegativeFloat] | None = None
    top_p: float = 1.0  # nucleus sampling (only with temperature > 0)
    seed: int = 0  # a chunk at a temperature samples with sampling_seed(seed, chunk, temperature)
    # As in eyas.data.render.render; recorded as its mode, and a custom prompt is written into the conversation.
    system_prompt: str = TEMPLATE_DEFAULT
    max_prompt_tokens: NonNegativeInt | None = None  # a turn whose prompt is longer ends the conversation before it
    max_turns: NonNegativeInt | None = None  # answer at most this many user turns per conversation; None or 0: all
    loops: LoopPolicy = "cut"  # an answer with a repetition loop: cut after its first copy | drop it | keep it
    sort_by_length: bool = True  # chunks of conversations of similar first-prompt length (less padding)
    # --- which conversations, and how it runs (not recorded: same answers up to rounding) ---
    limit: NonNegativeInt | None = None  # only the first N conversations (after de-duplication by id); None: all
    cache: CacheMode = "auto"  # KV cache of generate: static (CUDA: compiled decode step) | dynamic | auto
    progress: bool = True  # show a progress bar

    def __init__(self, **values: Any) -> None:
        if "temperature" in values and values.get("temperatures") is not None:
            raise RegenerateError(f"RegenerateOptions: temperature, temperatures: expected one of the two, found "
                                  f"temperature={values['temperature']!r} and temperatures={values['temperatures']!r}")
        super().__init__(**values)

    @field_validator("temperatures")
    @classmethod
    def _distinct_temperatures(cls, v: list[float] | None) -> list[float] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("expected at least one temperature")
        names = [f"{t:g}" for t in v]
        if len(set(names)) != len(names) or any(not math.isfinite(t) for t in v):
            raise ValueError("expected distinct finite temperatures (as written in answer ids, <id>@t<temperature:g>)")
        return [float(t) for t in v]

    def temperature_list(self) -> list[float]:
        """The temperatures to answer at, in order: ``temperatures``, else ``[temperature]``."""
        return list(self.temperatures) if self.temperatures is not None else [float(self.temperature)]

    def generation(self, temperature: float | None = None) -> GenerationParams:
        """What the answers at ``temperature`` (default: the first of :meth:`temperature_list`)
        depend on; the sampling knobs are normalised away when greedy (they change nothing then, so
        a greedy resume does not refuse over them)."""
        t = self.temperature_list()[0] if temperature is None else float(temperature)
        sampled = t > 0
        return GenerationParams(
            do_sample=sampled,
            temperature=t if sampled else 0.0,
            top_p=float(self.top_p) if sampled else 1.0,
            seed=int(self.seed) if sampled else None,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            system_prompt=system_prompt_mode(self.system_prompt),
            max_prompt_tokens=self.max_prompt_tokens,
            max_turns=self.max_turns,
            loops=self.loops,
            sort_by_length=self.sort_by_length,
        )

    def generations(self) -> dict[float, GenerationParams]:
        """:meth:`generation` of every temperature, keyed by it, in order."""
        return {t: self.generation(t) for t in self.temperature_list()}


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


@dataclass
class RegenerateSummary(Throughput):
    out_path: str
    conversations: int = 0  # conversations considered (after de-duplication and limit)
    temperatures: list[float] = field(default_factory=list)
    total: int = 0  # output ids planned: conversations x temperatures
    written: int = 0  # output lines written by this run
    skipped: int = 0  # ids already in the output (or the skipped sidecar) from an earlier run
    failed: int = 0  # attempted, nothing usable (empty first answer / prompt too long / loop dropped): sidecar
    duplicates: int = 0  # input conversations with an id seen earlier in the input (ignored)
    new_tokens: int = 0  # tokens generated by this run (end-of-turn tokens and cut loops included, dummy rows not)
    prompt_tokens: int = 0  # prompt tokens fed to generate by this run (dummy rows not)
    # Answers generated by this run, by finish reason ("loop": cut or dropped at a repetition loop).
    finish: dict[str, int] = field(default_factory=lambda: {"eos": 0, "length": 0, "loop": 0})
    loops_cut: int = 0  # answers cut after a loop's first copy (loops="cut")
    loops_dropped: int = 0  # conversations dropped for a loop in one of their answers (loops="drop")
    engine: str = ""  # what generated: "hf" (Hugging Face generate) | "fast" (eyas.engine.batched)
    cache: str = ""  # how it ran: hf "dynamic" | "static" | "static, compiled"; fast: its rows, cache and compilation
    # Where the time goes: inside generate (prefill + decoding, compilation at the first call) vs the
    # rest (rendering, loop search, decoding text, writing); a call decodes as many steps as its
    # longest answer, every row of the batch at each step.
    generate_s: float = 0.0
    generate_calls: int = 0
    decode_steps: int = 0  # summed over calls: hf, the longest answer of each call (+1 for its eos); fast, its steps
    wall_s: float = 0.0
    skipped_path: str | None = None
    interrupted: bool = False  # stopped by SIGINT between or inside units; rerun to resume

    @property
    def rated_tokens(self) -> int:
        return self.new_tokens
