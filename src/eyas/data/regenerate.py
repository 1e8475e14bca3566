"""Answer training prompts with the target itself (docs/data.md: train on the target's own answers).

A drafter learns to predict what the *target* would write next, so the answers it trains on must
be the target's: regenerated here, turn by turn for multi-turn prompts (MT-bench style: user turns
only; assistant turns already in a ShareGPT record are dropped and rewritten by the target).

Output: JSON Lines, one answered conversation per line, in the shape
:func:`eyas.data.conversations.read_conversations` reads back (``openai``)::

    {"id": "...", "messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...],
     "provenance": {"source": file, "line": n, "format": ..., "target": ..., "target_fingerprint": ...,
                    "generation": {...}, "finish_reasons": ["eos" | "length" | "loop", ...], "new_tokens": [...]}}

Several answers per prompt. Every conversation is answered once per temperature of
``temperatures`` (in that order). The greedy answer (temperature 0) keeps the conversation's id; a
sampled one is written as ``<id>@t<temperature:g>`` (:func:`answer_id`). Each record's
``provenance.generation`` holds the :class:`GenerationParams` of its own temperature.

Order. Conversations are de-duplicated by id (the first wins), cut to ``limit`` in input order,
then (``sort_by_length``, the default) stably sorted by the token length of their first rendered
prompt, so that a batch pads little. The order is a function of the input, the tokenizer and the
options alone.

Resumable. The ordered conversations are cut into fixed chunks of ``batch_size`` by position. The
unit of work is (chunk, temperature), in chunk order and then temperature order (with
``sort_by_length``, the chunks are visited in an order shuffled with ``seed``, so that a run
stopped early holds prompts of every length, not only the shortest): each unit is
generated as one batch and its lines are appended, flushed and fsynced together. On start the
existing file is read, a torn last line (crash mid-write) is cut off, and every unit whose answer
ids are all present is skipped. A unit that is partly present is generated again *with its original
members* and only the missing lines are appended: the batch composition, hence every greedy answer
(and every sampled one: the sampling seed is per chunk and temperature, :func:`sampling_seed`), is
the same as in an uninterrupted run, so the file ends up byte-identical and without duplicates.
The cache implementation (``cache``) is not part of the generation parameters: like the device and
the dtype it changes floating-point rounding, not what is sampled; resume with the same one for a
byte-identical file.

Engines (``generator``, ``eyas regenerate --engine``). The answers come from a
:class:`eyas.data.generation.BatchGenerator`: by default :class:`HFGenerator` (Hugging Face
``generate``, below), or eyas' own batched Llama-family forward
(:class:`eyas.engine.batched.BatchedLlama`, continuous batching over a fixed number of rows), which
the CLI builds and passes in (this package does not import the engine). Each (unit, turn) is one
``generate`` call with the unit's prompts of that turn, so the resume unit, its members and its
seeds are the same whichever engine runs. The engine is *not* recorded in
``provenance.generation``: greedy answers are the target's argmax either way (token-identical in
float32, ``tests/test_batched.py``; in bf16 the two forwards round differently, as the static and
dynamic caches do), and sampled answers are draws from the same distribution whose random numbers
each engine takes its own way (a per-prompt counter-based stream in the fast engine, torch's global
generator in ``generate``). Like the device, the dtype and the cache, the engine is then a matter of
rounding and of which random numbers, not of what the answers are: a resume with the other engine
is allowed, and only a resume with the same one is byte-identical. The summary says which ran.

Seeds. A sampled unit's call at turn ``t`` draws with :func:`sampling_seed` ``(seed, chunk,
temperature, t)``: each call is reproducible by itself (turn 0's seed is the unit's seed of files
written before turns had their own).

Repetition loops (``loops``, :mod:`eyas.data.loops`). Each answer's token ids are searched for a
loop before they are decoded. ``cut``: the answer keeps the loop's first copy, its finish reason is
``"loop"`` and the conversation ends after that turn. ``drop``: the conversation goes to the
sidecar. ``keep``: nothing is searched.

Conversations that produce nothing usable (the first answer is empty, the first prompt is longer
than ``max_prompt_tokens``, or a loop under ``loops="drop"``) are not written to the output; they
are listed in a sidecar ``<out>.skipped.jsonl`` (one line per answer id) so that a resumed run
knows they were attempted.

Speed (``cache``). ``static`` gives ``generate`` one transformers ``StaticCache`` for the whole run
(batch ``batch_size``, length ``max_prompt_tokens + max_new_tokens``, or the longest first prompt
of the run + ``max_new_tokens``, grown if a later turn is longer), reset before each batch; every
batch is padded to ``batch_size`` rows with copies of its first prompt (their answers discarded),
so on CUDA the decode step compiled with CUDA graphs (``CompileConfig(fullgraph=True,
mode="reduce-overhead")``) is captured once and replayed. On a CPU nothing is compiled. ``auto``:
static on CUDA, dynamic elsewhere.
"""


from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveInt, field_validator
from tqdm.auto import tqdm

from eyas import __version__
from eyas.data.conversations import Conversation, conversation_id
from eyas.data.generation import BatchGenerator, BatchParams
from eyas.data.loops import cut_at_first_loop, rows_with_loops
from eyas.data.render import TEMPLATE_DEFAULT, render_prompt, system_prompt_mode
from eyas.data.runs import RunOptions, Throughput, changed_params, eval_mode
from eyas.errors import EyasError
from eyas.targets.structure import eos_token_ids


class RegenerateError(EyasError, ValueError):
    """The output file cannot be resumed (corrupt line, other generation parameters)."""


# ---------------------------------------------------------------------------------------------
# Ids and resumable JSONL files
# ---------------------------------------------------------------------------------------------


def read_resumable_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file that a crash may have left with a torn last line.

    The torn tail (bytes after the last newline) is cut off the file itself, so the next append
    starts on a fresh line. A bad line anywhere else is real corruption: error naming file and line.
    Lines end at b"\n" only: the records are written with ensure_ascii=False, so an answer may hold
    U+2028, U+0085 or a form feed raw, which str.splitlines() would take for line ends (an H200
    regeneration of 43k answers was refused as corrupt at its line 11,664 that way).
    """
    if not path.exists():
        return []
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
    if cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
    records = []
    for n, raw in enumerate(data[:cut].split(b"\n"), start=1):
        line = raw.decode("utf-8")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise RegenerateError(f"{path}:{n}: not valid JSON ({e.msg}); the file is corrupt, "
                                  f"not just torn at the end: fix or remove it") from None
        if not isinstance(rec, dict) or "id" not in rec:
            raise RegenerateError(f"{path}:{n}: expected an object with an 'id', found {line[:80]!r}")
        records.append(rec)
    return records


def _append_lines(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append records as JSON lines in one write, then flush and fsync (crash-safe up to a torn
    last line, which :func:`read_resumable_jsonl` repairs)."""
    if not records:
        return
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
# Generation
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


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a turn; refuses a target with none (an answer would never end)."""
    ids = eos_token_ids(model, tokenizer)
    if not ids:
        raise RegenerateError(f"{type(tokenizer).__name__} has no eos token: cannot tell where an answer ends")
    return ids


def _hf_generation_config(params: BatchParams, pad_id: int, eos_ids: list[int], compiled: bool) -> Any:
    """The transformers GenerationConfig of ``params``; ``compiled``: generate compiles its decode
    step (static cache on CUDA) with CUDA graphs, else it never compiles."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    # Every knob set explicitly: generate() fills unset (None) fields from the model's own
    # generation_config, which may carry top_k / repetition_penalty defaults we do not want.
    kw: dict[str, Any] = dict(max_new_tokens=params.max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=eos_ids, repetition_penalty=1.0, num_beams=1)
    if not params.greedy:
        kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
    else:
        kw.update(do_sample=False)
    if compiled:
        kw.update(compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    else:
        kw.update(disable_compile=True)
    return GenerationConfig(**kw)


class _LeftPadding:
    """Temporarily: padding on the left (generation continues at the right end of every row) and a
    pad token (eos when the tokenizer has none)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def __enter__(self) -> int:
        self.side, self.pad = self.tok.padding_side, self.tok.pad_token
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        return int(self.tok.pad_token_id)

    def __exit__(self, *exc: Any) -> None:
        self.tok.padding_side = self.side
        if self.pad is None:
            self.tok.pad_token = None


class _StaticKV:
    """One transformers ``StaticCache`` for a whole run: [batch_size, ..., max_cache_len].

    Invariants: every batch given to :meth:`prepare` is padded to ``batch_size`` rows (copies of
    its first prompt), and the cache object is reset, not rebuilt, between batches, so its tensors
    keep their addresses and shapes and a compiled decode step (CUDA graphs) replays instead of
    recapturing. Only a prompt longer than planned (a later turn, with no ``max_prompt_tokens``)
    rebuilds it, longer (rounded up to 256 tokens, so rebuilds are rare)."""

    def __init__(self, model: Any, batch_size: int, max_cache_len: int, max_new_tokens: int) -> None:
        self.model, self.batch_size, self.max_new_tokens = model, batch_size, max_new_tokens
        self.max_cache_len = max_cache_len
        self.cache: Any = None
        self.rebuilds = 0

    def prepare(self, prompts: list[list[int]]) -> tuple[list[list[int]], Any]:
        """(prompts padded to ``batch_size`` rows, the reset cache to pass to generate)."""
        from transformers import StaticCache

        if not 0 < len(prompts) <= self.batch_size:
            raise ValueError(f"static cache: expected 1..{self.batch_size} prompts, found {len(prompts)}")
        need = max(len(p) for p in prompts) + self.max_new_tokens
        if need > self.max_cache_len:
            self.max_cache_len = -(-need // 256) * 256
            self.cache = None
            self.rebuilds += 1
        if self.cache is None:
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        else:
            self.cache.reset()
        return prompts + [prompts[0]] * (self.batch_size - len(prompts)), self.cache


@torch.no_grad()
def _generate_batch(model: Any, tokenizer: Any, prompts: list[list[int]], gen_config: Any,
                    eos_ids: list[int], static: _StaticKV | None = None) -> list[tuple[list[int], str]]:
    """Greedy/sampled continuations of a batch of prompts -> per prompt (answer ids without the
    end-of-turn token, finish reason "eos" | "length"). The eos token itself is counted by the caller.
    ``static``: decode with that run-wide static cache (the batch padded to its size with dummy
    rows, whose answers are not returned); None: generate's own dynamic cache."""
    n = len(prompts)
    extra: dict[str, Any] = {}
    if static is not None:
        # past_key_values: the name every transformers 5.x release reads (newer ones also take `cache`
        # and warn that past_key_values is deprecated; an unknown `cache` would be silently ignored
        # by an older one, which would decode on a dynamic cache).
        prompts, extra["past_key_values"] = static.prepare(prompts)
    enc = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")  # left-padded [B, T]
    device = next(model.parameters()).device
    input_ids, attn = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*")
        out = model.generate(input_ids=input_ids, attention_mask=attn, generation_config=gen_config, **extra)
    new = out[:n, input_ids.shape[1]:].tolist()  # [n, <= max_new_tokens], finished rows padded
    results = []
    eos = set(eos_ids)
    for row in new:
        stop = next((j for j, t in enumerate(row) if t in eos), None)
        # Without an eos the row ran to max_new_tokens: no padding inside it (a row is only
        # padded after it emitted eos), so all of it is the answer.
        results.append((row, "length") if stop is None else (row[:stop], "eos"))
    return results


class HFGenerator:
    """The ``hf`` engine (:class:`eyas.data.generation.BatchGenerator`): Hugging Face ``generate`` on
    a left-padded batch.

    ``cache`` as :attr:`RegenerateOptions.cache`: static (one run-wide :class:`_StaticKV` of
    ``batch_size`` rows, sized by :meth:`reserve`; compiled with CUDA graphs on CUDA) or dynamic.
    A sampled call seeds torch's global generator with ``params.seed`` first (``generate`` draws
    from it), so each call is reproducible by itself."""

    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, cache: CacheMode = "auto", batch_size: int = 64) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.static = _use_static_cache(cache, model)
        self.compiled = self.static and next(model.parameters()).device.type == "cuda"
        self.implementation = "static, compiled" if self.compiled else "static" if self.static else "dynamic"
        self.kv: _StaticKV | None = None
        self.last_decode_steps = 0
        self._configs: dict[tuple, Any] = {}

    def reserve(self, max_prompt_tokens: int, max_new_tokens: int) -> None:
        if self.static:
            self.kv = _StaticKV(self.model, self.batch_size, max_prompt_tokens + max_new_tokens, max_new_tokens)

    def generate(self, prompts: list[list[int]], params: BatchParams) -> list[tuple[list[int], str]]:
        if self.static and self.kv is None:  # reserve() not called: size the cache for this batch
            self.reserve(max(len(p) for p in prompts), params.max_new_tokens)
        with _LeftPadding(self.tokenizer) as pad_id:
            key = (params.max_new_tokens, params.eos_ids, params.temperature, params.top_p, pad_id)
            if key not in self._configs:
                self._configs[key] = _hf_generation_config(params, pad_id, list(params.eos_ids), self.compiled)
            if not params.greedy and params.seed is not None:
                torch.manual_seed(params.seed)
            answers = _generate_batch(self.model, self.tokenizer, prompts, self._configs[key], list(params.eos_ids),
                                      self.kv)
        self.last_decode_steps = max(len(a) + (f == "eos") for a, f in answers)
        return answers


def _turns(conv: Conversation, system_prompt: str, max_turns: int | None) -> tuple[list[dict], list[str]]:
    """(leading system messages to keep in the output, user turn texts). Source assistant turns are
    dropped: the target writes its own."""
    head: list[dict] = []
    if system_prompt == TEMPLATE_DEFAULT:
        head = [dict(m) for m in conv.messages if m["role"] == "system"][:1]
    elif system_prompt_mode(system_prompt) == "custom":
        # Written into the conversation so that a later render (template_default) sees the same prefix.
        head = [{"role": "system", "content": system_prompt}]
    users = [m["content"] for m in conv.messages if m["role"] == "user"]
    return head, users[:max_turns] if max_turns else users


def _first_prompt_tokens(conv: Conversation, tokenizer: Any, options: RegenerateOptions) -> int:
    """Token length of the first prompt the target would be given for ``conv`` (0: no user turn)."""
    head, users = _turns(conv, options.system_prompt, options.max_turns)
    if not users:
        return 0
    return int(render_prompt(head + [{"role": "user", "content": users[0]}], tokenizer,
                             system_prompt=options.system_prompt).numel())


# ---------------------------------------------------------------------------------------------
# regenerate: plan -> resume -> generate -> write -> finalise
# ---------------------------------------------------------------------------------------------

_Item = tuple[str, Conversation]  # (conversation id, conversation)


@dataclass(frozen=True)
class _Unit:
    """One resume unit: a chunk (by index, with all its original members) at one temperature."""

    chunk: int
    temperature: float
    members: list[_Item]

    def ids(self) -> list[str]:
        return [answer_id(cid, self.temperature) for cid, _ in self.members]


def _select(conversations: Sequence[Conversation], limit: int | None) -> tuple[list[_Item], int]:
    """Step 1, plan: the conversations to answer, and how many were dropped as duplicates.

    Invariant: de-duplicated by id (the first wins) and then cut to ``limit``, in input order; the
    chunks are fixed by position in this list (after :func:`_sort_by_length`), so a rerun on the
    same input cuts the same chunks."""
    items: list[_Item] = []
    seen: set[str] = set()
    duplicates = 0
    for i, conv in enumerate(conversations):
        cid = conversation_id(conv, i)
        if cid in seen:
            duplicates += 1
            continue
        seen.add(cid)
        items.append((cid, conv))
    return (items[:limit] if limit is not None else items), duplicates


def _sort_by_length(items: list[_Item], lengths: list[int]) -> tuple[list[_Item], list[int]]:
    """``items`` (and their ``lengths``) stably sorted by first-prompt token length, shortest first:
    ties keep input order, so the order is a function of the input alone."""
    order = sorted(range(len(items)), key=lengths.__getitem__)
    return [items[i] for i in order], [lengths[i] for i in order]


def _check_generation(output: Path, existing: list[dict[str, Any]], generations: dict[float, GenerationParams]) -> None:
    """Refuse an output written with other generation parameters (RegenerateError naming the file,
    each differing field, what the file has and what this run has).

    Every record is compared with this run's parameters *for its own temperature*; a record at a
    temperature this run does not use is refused too. A temperature with no record yet is fine (its
    answers are added). Records from before ``loops`` / ``sort_by_length`` existed are read as
    :attr:`GenerationParams.LEGACY`; a legacy file of sampled answers cannot be resumed at all (its
    sampled answers carry the plain conversation id and another seed rule)."""
    now = {t: g.model_dump() for t, g in generations.items()}
    temps = ", ".join(f"{t:g}" for t in now)
    seen: set[str] = set()
    for rec in existing:
        theirs = (rec.get("provenance") or {}).get("generation")
        if not isinstance(theirs, dict):
            continue
        key = json.dumps(theirs, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        legacy = [k for k in GenerationParams.LEGACY if k not in theirs]
        theirs = {**{k: GenerationParams.LEGACY[k] for k in legacy}, **theirs}
        t = theirs.get("temperature", 0.0)
        if legacy and theirs.get("do_sample"):
            raise RegenerateError(
                f"{output}: record {rec['id']!r} is a sampled answer written before eyas recorded "
                f"{' and '.join(legacy)} (expected a generation with them, found none): its id and seed "
                f"follow an older rule, so it cannot be resumed; write to a new file")
        if t not in now:
            raise RegenerateError(
                f"{output}: record {rec['id']!r} was answered at temperature {t:g}; expected one of this "
                f"run's temperatures ({temps}): resume with the same temperatures or write to a new file")
        changed = changed_params(theirs, now[t], now[t], "file has")
        if changed:
            hint = ""
            if legacy:
                hint = (f" (the file was written before eyas recorded {' and '.join(legacy)}: its answers were not "
                        f"cut at loops and its chunks are in input order; resume it with --loops keep "
                        f"--no-sort-by-length)")
            raise RegenerateError(
                f"{output}: written with other generation parameters at temperature {t:g} "
                f"({', '.join(changed)}){hint}; resume with the same parameters or write to a new file")


@dataclass
class _OutputFiles:
    """The output JSONL and its ``.skipped.jsonl`` sidecar, and the ids each already holds.

    Invariant: an id is appended at most once to each file (resume never duplicates); a unit's
    sidecar lines are appended before its output lines, so a crash between the two leaves the
    unit incomplete in the output, and the rerun generates it again."""

    output: Path
    sidecar: Path
    written: set[str]  # ids in the output
    failed: set[str]  # ids in the sidecar

    @classmethod
    def resume(cls, output: Path, generations: dict[float, GenerationParams]) -> "_OutputFiles":
        """Step 2, resume: read what an earlier run wrote (a torn last line is cut off); refuse an
        output written with other generation parameters (:func:`_check_generation`)."""
        existing = read_resumable_jsonl(output)
        _check_generation(output, existing, generations)
        sidecar = output.with_name(output.name + ".skipped.jsonl")
        return cls(output, sidecar, {r["id"] for r in existing}, {r["id"] for r in read_resumable_jsonl(sidecar)})

    def holds(self, answer: str) -> bool:
        return answer in self.written or answer in self.failed

    def append(self, records: list[dict], failures: list[dict]) -> tuple[list[dict], list[dict]]:
        """Step 4, write: append the unit's records and failures that the files do not hold yet
        (one fsynced write each); -> (records appended, failures appended)."""
        new_records = [r for r in records if r["id"] not in self.written]
        new_failures = [r for r in failures if r["id"] not in self.failed]
        _append_lines(self.sidecar, new_failures)  # sidecar first: a crash before the output line
        _append_lines(self.output, new_records)  # leaves the unit incomplete, so it is redone
        self.written.update(r["id"] for r in new_records)
        self.failed.update(r["id"] for r in new_failures)
        return new_records, new_failures


def _use_static_cache(mode: CacheMode, model: Any) -> bool:
    """``cache`` resolved for ``model``: auto is static on CUDA, dynamic elsewhere (and for a target
    split across devices, ``--target-devices``: one run-wide static cache would sit on one device)."""
    if mode == "auto":
        split = len(set(dict(getattr(model, "hf_device_map", None) or {}).values())) > 1
        return next(model.parameters()).device.type == "cuda" and not split
    return mode == "static"


def regenerate(
    model: Any,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    options: RegenerateOptions,
    *,
    source: str | None = None,
    on_chunk_written: Callable[[int, list[dict[str, Any]]], None] | None = None,
    generator: BatchGenerator | None = None,
) -> RegenerateSummary:
    """Answer every user turn of ``conversations`` with ``model`` at every temperature and append
    them to ``options.out_path``: plan -> resume -> generate -> write -> finalise.

    Args:
        conversations: prompts (user turns, optional system message); assistant turns are ignored.
        options: see :class:`RegenerateOptions`.
        source: the target's name for provenance (e.g. ``str(TargetSource)``).
        on_chunk_written: called as ``f(chunk_index, records)`` after each unit (chunk at one
            temperature) is on disk.
        generator: what answers each batch (module docstring, Engines); default
            :class:`HFGenerator` with ``options.cache``. ``model`` still gives the target's
            fingerprint and eos ids.

    Returns: a :class:`RegenerateSummary`.
    """
    from eyas.contract import weights_fingerprint

    t0 = time.perf_counter()
    options.out_path.parent.mkdir(parents=True, exist_ok=True)
    summary = RegenerateSummary(out_path=str(options.out_path))
    generations = options.generations()
    temperatures = list(generations)
    items, summary.duplicates = _select(conversations, options.limit)
    if generator is None:
        generator = HFGenerator(model, tokenizer, options.cache, options.batch_size)
    lengths: list[int] = []
    if options.sort_by_length or options.max_prompt_tokens is None:
        lengths = [_first_prompt_tokens(conv, tokenizer, options) for _, conv in items]
    if options.sort_by_length:
        items, lengths = _sort_by_length(items, lengths)
    summary.conversations, summary.temperatures = len(items), temperatures
    summary.total = len(items) * len(temperatures)
    files = _OutputFiles.resume(options.out_path, generations)
    starts = list(range(0, len(items), options.batch_size))
    order = list(range(len(starts)))
    if options.sort_by_length:  # chunks of similar length, visited in a seeded order (see the docstring)
        random.Random(options.seed).shuffle(order)
    units = [_Unit(k, t, items[starts[k]:starts[k] + options.batch_size]) for k in order for t in temperatures]
    todo = [u for u in units if not all(files.holds(a) for a in u.ids())]
    summary.skipped = sum(1 for u in units for a in u.ids() if files.holds(a))
    if todo:
        longest = options.max_prompt_tokens if options.max_prompt_tokens is not None else max(lengths, default=1)
        generator.reserve(longest, options.max_new_tokens)
    summary.engine, summary.cache = generator.name, generator.implementation
    target_info = {"target": source, "target_fingerprint": weights_fingerprint(model)}
    _generate(model, tokenizer, todo, options, generations, generator, files, target_info, summary,
              on_chunk_written)
    summary.cache = generator.implementation  # as it ran (a failed compilation or capture falls back)
    summary.skipped_path = str(files.sidecar) if files.sidecar.exists() else None  # step 5, finalise
    summary.wall_s = time.perf_counter() - t0
    return summary


def _generate(model: Any, tokenizer: Any, todo: list[_Unit], options: RegenerateOptions,
              generations: dict[float, GenerationParams], generator: BatchGenerator,
              files: _OutputFiles, target_info: dict[str, Any], summary: RegenerateSummary,
              on_chunk_written: Callable[[int, list[dict[str, Any]]], None] | None) -> None:
    """Step 3 and 4, generate and write: each unit still to do, in order, answered as one batch
    (per turn) and appended before the next one starts.

    Invariant: a unit is generated with all its original members, also when some of them are
    already in the output, and sampled with its own seed: its answers are those of an
    uninterrupted run, and only the missing lines are appended."""
    eos_ids = _eos_ids(model, tokenizer)
    t0 = time.perf_counter()
    bar = tqdm(total=sum(len(u.members) for u in todo), desc="regenerate", unit="conv",
               disable=not options.progress, dynamic_ncols=True)
    try:
        with eval_mode(model):
            for unit in todo:
                records, failures = _answer_unit(generator, tokenizer, unit, options, generations[unit.temperature],
                                                 eos_ids, summary)
                for r in records:
                    r["provenance"].update(target_info)
                new_records, new_failures = files.append(records, failures)
                summary.written += len(new_records)
                summary.failed += len(new_failures)
                bar.update(len(unit.members))
                bar.set_postfix(tok_s=f"{summary.new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
                if on_chunk_written is not None:
                    on_chunk_written(unit.chunk, new_records)
    except KeyboardInterrupt:
        # Ctrl-C or a scheduler's SIGINT: every unit written so far is complete on disk (a rerun
        # resumes after it); stop here and let the caller report what this run did.
        summary.interrupted = True
    finally:
        bar.close()


@dataclass
class _Dialogue:
    """One conversation of a unit, answered turn by turn."""

    id: str  # the answer id (answer_id of the conversation id and the unit's temperature)
    conv: Conversation
    messages: list[dict]  # the output so far: the kept system message, then user / assistant turns
    users: list[str]  # the user turns to answer, in order
    finish: list[str] = field(default_factory=list)  # per answered turn: "eos" | "length" | "loop"
    new_tokens: list[int] = field(default_factory=list)  # per answered turn, as kept (end-of-turn token included)
    stop: str | None = None  # why it ended before its last user turn (or, when dropped, why)
    dropped: bool = False  # a loop under loops="drop": the whole conversation goes to the sidecar

    def record(self, generation: GenerationParams) -> dict[str, Any]:
        """The output line: messages, and the source's provenance with this generation's."""
        prov = {k: v for k, v in self.conv.provenance.items()
                if k not in ("target", "target_fingerprint", "generation", "finish_reasons", "new_tokens")}
        prov.update(generation=generation.model_dump(), finish_reasons=self.finish, new_tokens=self.new_tokens,
                    eyas_version=__version__)
        if self.stop:
            prov["stopped"] = self.stop
        return {"id": self.id, "messages": self.messages, "provenance": prov}

    def failure(self) -> dict[str, Any]:
        """The sidecar line of a conversation that produced no usable answer."""
        return {"id": self.id, "reason": self.stop or "no user turn", "provenance": dict(self.conv.provenance)}

    @property
    def usable(self) -> bool:
        return bool(self.finish) and not self.dropped


def _find_loops(answers: list[list[int]], policy: LoopPolicy) -> list[tuple[list[int], Any]]:
    """Per answer, (the ids to keep, the first loop or None): ``cut_at_first_loop`` on the rows that
    :func:`eyas.data.loops.rows_with_loops` flags; nothing is searched under ``keep``."""
    if policy == "keep":
        return [(a, None) for a in answers]
    flagged = rows_with_loops(answers)
    return [cut_at_first_loop(a) if f else (a, None) for a, f in zip(answers, flagged)]


def _answer_unit(generator: BatchGenerator, tokenizer: Any, unit: _Unit, options: RegenerateOptions,
                 generation: GenerationParams, eos_ids: list[int],
                 summary: RegenerateSummary) -> tuple[list[dict], list[dict]]:
    """Answer all conversations of one unit turn by turn: at turn t the conversations that still
    have a t-th user turn form one batch (one ``generate`` call, sampled with the unit's seed of turn
    t: a resumed unit samples the same). -> (output records, failure records), in chunk order."""
    dialogues = [_Dialogue(answer_id(cid, unit.temperature), conv,
                           *_turns(conv, options.system_prompt, options.max_turns)) for cid, conv in unit.members]
    for t in range(max(len(d.users) for d in dialogues)):
        active, prompts = [], []
        for d in dialogues:
            if d.stop is not None or t >= len(d.users):
                continue
            d.messages.append({"role": "user", "content": d.users[t]})
            # render_prompt applies the same system-prompt handling as training-time render().
            ids = render_prompt(d.messages, tokenizer, system_prompt=options.system_prompt).tolist()
            if options.max_prompt_tokens is not None and len(ids) > options.max_prompt_tokens:
                d.messages.pop()
                d.stop = f"prompt of turn {t} has {len(ids)} tokens > max_prompt_tokens {options.max_prompt_tokens}"
                continue
            active.append(d)
            prompts.append(ids)
        if not active:
            break
        params = BatchParams(
            max_new_tokens=generation.max_new_tokens, eos_ids=tuple(eos_ids), temperature=generation.temperature,
            top_p=generation.top_p,
            seed=sampling_seed(options.seed, unit.chunk, unit.temperature, t) if generation.do_sample else None)
        t_generate = time.perf_counter()
        answers = generator.generate(prompts, params)
        summary.generate_s += time.perf_counter() - t_generate
        summary.generate_calls += 1
        summary.decode_steps += generator.last_decode_steps
        cuts = _find_loops([a for a, _ in answers], options.loops)
        for d, ids, (ans, finish), (kept, loop) in zip(active, prompts, answers, cuts):
            summary.new_tokens += len(ans) + (finish == "eos")
            summary.prompt_tokens += len(ids)
            if loop is not None:
                where = (f"repetition loop in the answer to turn {t} "
                         f"(period {loop.period}, tokens {loop.start}..{loop.end})")
                summary.finish["loop"] += 1
                if options.loops == "drop":
                    summary.loops_dropped += 1
                    d.messages.pop()
                    d.dropped, d.stop = True, f"{where}; loops=drop"
                    continue
                summary.loops_cut += 1
                ans, finish = kept, "loop"
            else:
                summary.finish[finish] += 1
            text = tokenizer.decode(ans, skip_special_tokens=True)
            n_new = len(ans) + (finish == "eos")
            if not text.strip():  # an empty answer is not a training example; stop here
                d.messages.pop()
                d.stop = f"empty answer at turn {t} ({finish} after {n_new} tokens)"
                continue
            d.messages.append({"role": "assistant", "content": text})
            d.finish.append(finish)
            d.new_tokens.append(n_new)
            if loop is not None and t + 1 < len(d.users):
                d.stop = f"{where}: cut after its first copy, later turns not answered"
    records = [d.record(generation) for d in dialogues if d.usable]
    failures = [d.failure() for d in dialogues if not d.usable]
    return records, failures
