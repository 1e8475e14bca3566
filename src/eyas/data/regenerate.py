"""Answer training prompts with the target itself (docs/data.md: train on the target's own answers).

A drafter learns to predict what the *target* would write next, so the answers it trains on must
be the target's: regenerated here, turn by turn for multi-turn prompts (MT-bench style: user turns
only; assistant turns already in a ShareGPT record are dropped and rewritten by the target).

Output: JSON Lines, one conversation per line, in the shape :func:`eyas.data.conversations.read_conversations`
reads back (``openai``)::

    {"id": "...", "messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...],
     "provenance": {"source": file, "line": n, "format": ..., "target": ..., "target_fingerprint": ...,
                    "generation": {...}, "finish_reasons": ["eos" | "length", ...], "new_tokens": [...]}}

Resumable. Conversations are cut into fixed chunks of ``batch_size`` (by position in the input,
after de-duplication and ``limit``). Each chunk is generated as one batch and its lines are
appended, flushed and fsynced together. On start the existing file is read, a torn last line
(crash mid-write) is cut off, and every chunk whose conversations are all present is skipped. A
chunk that is partly present is generated again *with its original members* and only the missing
lines are appended: the batch composition, hence every greedy answer (and every sampled one: the
sampling seed is per chunk), is the same as in an uninterrupted run, so the file ends up
byte-identical and without duplicates.

Conversations that produce nothing usable (the first answer is empty, or the first prompt is
longer than ``max_prompt_tokens``) are not written to the output; they are listed in a sidecar
``<out>.skipped.jsonl`` so that a resumed run knows they were attempted.
"""


from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt
from tqdm.auto import tqdm

from eyas import __version__
from eyas.data.conversations import Conversation, conversation_id
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
    for n, line in enumerate(data[:cut].decode("utf-8").splitlines(), start=1):
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


class GenerationParams(BaseModel):
    """What the answers depend on, recorded in every record's ``provenance.generation``; a resume
    must use the same (field order = the recorded key order)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    do_sample: bool
    temperature: float  # 0.0 when greedy
    top_p: float  # 1.0 when greedy
    seed: int | None  # None when greedy
    max_new_tokens: int
    batch_size: int  # batch composition changes the numerics of padded batches
    system_prompt: str  # its mode: template_default | none | custom
    max_prompt_tokens: int | None
    max_turns: int | None


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
    temperature: float = 0.0  # 0: greedy; > 0: sampled with top_p, seeded per chunk from seed
    top_p: float = 1.0  # nucleus sampling (only with temperature > 0)
    seed: int = 0  # chunk k samples with torch seed seed * 1_000_003 + k: a resumed chunk samples the same
    # As in eyas.data.render.render; recorded as its mode, and a custom prompt is written into the conversation.
    system_prompt: str = TEMPLATE_DEFAULT
    max_prompt_tokens: NonNegativeInt | None = None  # a turn whose prompt is longer ends the conversation before it
    max_turns: NonNegativeInt | None = None  # answer at most this many user turns per conversation; None or 0: all
    # --- which conversations, and how it runs ---
    limit: NonNegativeInt | None = None  # only the first N conversations (after de-duplication by id); None: all
    progress: bool = True  # show a progress bar

    def generation(self) -> GenerationParams:
        """What the answers depend on; the sampling knobs are normalised away when greedy (they
        change nothing then, so a greedy resume does not refuse over them)."""
        sampled = self.temperature > 0
        return GenerationParams(
            do_sample=sampled,
            temperature=float(self.temperature) if sampled else 0.0,
            top_p=float(self.top_p) if sampled else 1.0,
            seed=int(self.seed) if sampled else None,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            system_prompt=system_prompt_mode(self.system_prompt),
            max_prompt_tokens=self.max_prompt_tokens,
            max_turns=self.max_turns,
        )


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


@dataclass
class RegenerateSummary(Throughput):
    out_path: str
    total: int = 0  # conversations considered (after de-duplication and limit)
    written: int = 0  # conversations written by this run
    skipped: int = 0  # already in the output (or the skipped sidecar) from an earlier run
    failed: int = 0  # attempted, nothing usable (empty first answer / prompt too long): sidecar
    duplicates: int = 0  # input conversations with an id seen earlier in the input (ignored)
    new_tokens: int = 0  # tokens generated by this run (including end-of-turn tokens)
    prompt_tokens: int = 0  # prompt tokens fed to generate by this run
    finish: dict[str, int] = field(default_factory=lambda: {"eos": 0, "length": 0})
    wall_s: float = 0.0
    skipped_path: str | None = None

    @property
    def rated_tokens(self) -> int:
        return self.new_tokens


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a turn; refuses a target with none (an answer would never end)."""
    ids = eos_token_ids(model, tokenizer)
    if not ids:
        raise RegenerateError(f"{type(tokenizer).__name__} has no eos token: cannot tell where an answer ends")
    return ids



def _hf_generation_config(params: GenerationParams, pad_id: int, eos_ids: list[int]) -> Any:
    from transformers import GenerationConfig

    # Every knob set explicitly: generate() fills unset (None) fields from the model's own
    # generation_config, which may carry top_k / repetition_penalty defaults we do not want.
    kw: dict[str, Any] = dict(max_new_tokens=params.max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=eos_ids, repetition_penalty=1.0, num_beams=1)
    if params.do_sample:
        kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
    else:
        kw.update(do_sample=False)
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


@torch.no_grad()
def _generate_batch(model: Any, tokenizer: Any, prompts: list[list[int]], gen_config: Any,
                    eos_ids: list[int]) -> list[tuple[list[int], str]]:
    """Greedy/sampled continuations of a batch of prompts -> per prompt (answer ids without the
    end-of-turn token, finish reason "eos" | "length"). The eos token itself is counted by the caller."""
    enc = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")  # left-padded [B, T]
    device = next(model.parameters()).device
    input_ids, attn = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    out = model.generate(input_ids=input_ids, attention_mask=attn, generation_config=gen_config)
    new = out[:, input_ids.shape[1]:].tolist()  # [B, <= max_new_tokens], finished rows padded
    results = []
    eos = set(eos_ids)
    for row in new:
        stop = next((j for j, t in enumerate(row) if t in eos), None)
        # Without an eos the row ran to max_new_tokens: no padding inside it (a row is only
        # padded after it emitted eos), so all of it is the answer.
        results.append((row, "length") if stop is None else (row[:stop], "eos"))
    return results


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



# ---------------------------------------------------------------------------------------------
# regenerate: plan -> resume -> generate -> write -> finalise
# ---------------------------------------------------------------------------------------------

_Item = tuple[str, Conversation]  # (conversation id, conversation)


def _select(conversations: Sequence[Conversation], limit: int | None) -> tuple[list[_Item], int]:
    """Step 1, plan: the conversations to answer, and how many were dropped as duplicates.

    Invariant: de-duplicated by id (the first wins) and then cut to ``limit``, in input order; the
    chunks are fixed by position in this list, so a rerun on the same input cuts the same chunks."""
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


@dataclass
class _OutputFiles:
    """The output JSONL and its ``.skipped.jsonl`` sidecar, and the ids each already holds.

    Invariant: an id is appended at most once to each file (resume never duplicates); a chunk's
    sidecar lines are appended before its output lines, so a crash between the two leaves the
    chunk incomplete in the output, and the rerun generates it again."""

    output: Path
    sidecar: Path
    written: set[str]  # ids in the output
    failed: set[str]  # ids in the sidecar

    @classmethod
    def resume(cls, output: Path, generation: GenerationParams) -> "_OutputFiles":
        """Step 2, resume: read what an earlier run wrote (a torn last line is cut off); refuse an
        output written with other generation parameters (RegenerateError naming each one)."""
        existing = read_resumable_jsonl(output)
        now = generation.model_dump()
        for rec in existing[:1]:
            theirs = (rec.get("provenance") or {}).get("generation")
            if theirs is not None and theirs != now:
                raise RegenerateError(
                    f"{output}: written with other generation parameters "
                    f"({', '.join(changed_params(theirs, now, now, 'file has'))}); "
                    f"resume with the same parameters or write to a new file")
        sidecar = output.with_name(output.name + ".skipped.jsonl")
        return cls(output, sidecar, {r["id"] for r in existing}, {r["id"] for r in read_resumable_jsonl(sidecar)})

    def holds(self, cid: str) -> bool:
        return cid in self.written or cid in self.failed

    def append(self, records: list[dict], failures: list[dict]) -> tuple[list[dict], list[dict]]:
        """Step 4, write: append the chunk's records and failures that the files do not hold yet
        (one fsynced write each); -> (records appended, failures appended)."""
        new_records = [r for r in records if r["id"] not in self.written]
        new_failures = [r for r in failures if r["id"] not in self.failed]
        _append_lines(self.sidecar, new_failures)  # sidecar first: a crash before the output line
        _append_lines(self.output, new_records)  # leaves the chunk incomplete, so it is redone
        self.written.update(r["id"] for r in new_records)
        self.failed.update(r["id"] for r in new_failures)
        return new_records, new_failures


def regenerate(
    model: Any,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    options: RegenerateOptions,
    *,
    source: str | None = None,
    on_chunk_written: Callable[[int, list[dict[str, Any]]], None] | None = None,
) -> RegenerateSummary:
    """Answer every user turn of ``conversations`` with ``model`` and append them to
    ``options.out_path``: plan -> resume -> generate -> write -> finalise.

    Args:
        conversations: prompts (user turns, optional system message); assistant turns are ignored.
        options: see :class:`RegenerateOptions`.
        source: the target's name for provenance (e.g. ``str(TargetSource)``).
        on_chunk_written: called as ``f(chunk_index, records)`` after each chunk is on disk.

    Returns: a :class:`RegenerateSummary`.
    """
    from eyas.contract import weights_fingerprint

    t0 = time.perf_counter()
    options.out_path.parent.mkdir(parents=True, exist_ok=True)
    summary = RegenerateSummary(out_path=str(options.out_path))
    generation = options.generation()
    items, summary.duplicates = _select(conversations, options.limit)
    summary.total = len(items)
    files = _OutputFiles.resume(options.out_path, generation)
    chunks = [items[i:i + options.batch_size] for i in range(0, len(items), options.batch_size)]
    todo = [(k, c) for k, c in enumerate(chunks) if not all(files.holds(cid) for cid, _ in c)]
    summary.skipped = sum(1 for cid, _ in items if files.holds(cid))
    target_info = {"target": source, "target_fingerprint": weights_fingerprint(model)}
    _generate(model, tokenizer, todo, options, files, target_info, summary, on_chunk_written)
    summary.skipped_path = str(files.sidecar) if files.sidecar.exists() else None  # step 5, finalise
    summary.wall_s = time.perf_counter() - t0
    return summary


def _generate(model: Any, tokenizer: Any, todo: list[tuple[int, list[_Item]]], options: RegenerateOptions,
              files: _OutputFiles, target_info: dict[str, Any], summary: RegenerateSummary,
              on_chunk_written: Callable[[int, list[dict[str, Any]]], None] | None) -> None:
    """Step 3 and 4, generate and write: each chunk still to do, in chunk order, answered as one
    batch and appended before the next one starts.

    Invariant: a chunk is generated with all its original members, also when some of them are
    already in the output, and sampled with its own seed: its answers are those of an
    uninterrupted run, and only the missing lines are appended."""
    generation = options.generation()
    eos_ids = _eos_ids(model, tokenizer)
    t0 = time.perf_counter()
    bar = tqdm(total=sum(len(c) for _, c in todo), desc="regenerate", unit="conv",
               disable=not options.progress, dynamic_ncols=True)
    try:
        with eval_mode(model), _LeftPadding(tokenizer) as pad_id:
            gen_config = _hf_generation_config(generation, pad_id, eos_ids)
            for k, chunk in todo:
                if generation.do_sample:
                    torch.manual_seed(options.seed * 1_000_003 + k)  # per chunk: a resumed chunk samples the same
                records, failures = _answer_chunk(model, tokenizer, chunk, options, generation, gen_config,
                                                  eos_ids, summary)
                for r in records:
                    r["provenance"].update(target_info)
                new_records, new_failures = files.append(records, failures)
                summary.written += len(new_records)
                summary.failed += len(new_failures)
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{summary.new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
                if on_chunk_written is not None:
                    on_chunk_written(k, new_records)
    finally:
        bar.close()


@dataclass
class _Dialogue:
    """One conversation of a chunk, answered turn by turn."""

    id: str
    conv: Conversation
    messages: list[dict]  # the output so far: the kept system message, then user / assistant turns
    users: list[str]  # the user turns to answer, in order
    finish: list[str] = field(default_factory=list)  # per answered turn: "eos" | "length"
    new_tokens: list[int] = field(default_factory=list)  # per answered turn, the end-of-turn token included
    stop: str | None = None  # why it ended before its last user turn

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
        """The sidecar line of a conversation that produced no answer."""
        return {"id": self.id, "reason": self.stop or "no user turn", "provenance": dict(self.conv.provenance)}


def _answer_chunk(model: Any, tokenizer: Any, chunk: list[_Item], options: RegenerateOptions,
                  generation: GenerationParams, gen_config: Any, eos_ids: list[int],
                  summary: RegenerateSummary) -> tuple[list[dict], list[dict]]:
    """Answer all conversations of one chunk turn by turn: at turn t the conversations that still
    have a t-th user turn form one batch. -> (output records, failure records), in chunk order."""
    dialogues = [_Dialogue(cid, conv, *_turns(conv, options.system_prompt, options.max_turns)) for cid, conv in chunk]
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
        for d, ids, (ans, finish) in zip(active, prompts, _generate_batch(model, tokenizer, prompts, gen_config, eos_ids)):
            text = tokenizer.decode(ans, skip_special_tokens=True)
            n_new = len(ans) + (finish == "eos")
            summary.new_tokens += n_new
            summary.prompt_tokens += len(ids)
            summary.finish[finish] += 1
            if not text.strip():  # an empty answer is not a training example; stop here
                d.messages.pop()
                d.stop = f"empty answer at turn {t} ({finish} after {n_new} tokens)"
                continue
            d.messages.append({"role": "assistant", "content": text})
            d.finish.append(finish)
            d.new_tokens.append(n_new)
    records = [d.record(generation) for d in dialogues if d.finish]
    failures = [d.failure() for d in dialogues if not d.finish]
    return records, failures
