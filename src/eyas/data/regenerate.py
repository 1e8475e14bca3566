"""Answer training prompts with the target itself (docs/data.md: train on the target's own answers).

A drafter learns to predict what the *target* would write next, so the answers it trains on must
be the target's: regenerated here, turn by turn for multi-turn prompts (MT-bench style: user turns
only; assistant turns already in a ShareGPT record are dropped and rewritten by the target).

Output: JSON Lines, one answered conversation per line, in the shape
:func:`eyas.data.conversation_files.read_conversations` reads back (``openai``)::

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
``generate``, :mod:`eyas.data.hf_generator`), or eyas' own batched Llama-family forward
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

Modules: this one holds the run (plan, the loop over units, answering a unit turn by turn);
:mod:`eyas.data.regenerate_options` the options, generation parameters, ids, seeds and summary;
:mod:`eyas.data.regenerate_output` the resumable JSONL files; :mod:`eyas.data.hf_generator` the
``hf`` engine. Their public names are importable from here too.
"""


from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from eyas import __version__
from eyas.data.conversations import Conversation, conversation_id
from eyas.data.generation import BatchGenerator, BatchParams
from eyas.data.hf_generator import HFGenerator
from eyas.data.loops import cut_at_first_loop, rows_with_loops
from eyas.data.regenerate_options import (
    CacheMode,
    GenerationParams,
    LoopPolicy,
    RegenerateError,
    RegenerateOptions,
    RegenerateSummary,
    answer_id,
    sampling_seed,
)
from eyas.data.regenerate_output import OutputFiles, read_resumable_jsonl
from eyas.data.render import TEMPLATE_DEFAULT, render_prompts, system_prompt_mode
from eyas.data.runs import eval_mode
from eyas.targets.structure import eos_token_ids

# The public names of the regeneration modules, importable from here as before the split.
__all__ = [
    "CacheMode", "GenerationParams", "HFGenerator", "LoopPolicy", "RegenerateError", "RegenerateOptions",
    "RegenerateSummary", "answer_id", "read_resumable_jsonl", "regenerate", "sampling_seed",
]


# ---------------------------------------------------------------------------------------------
# Prompts: the turns of a conversation, where an answer ends
# ---------------------------------------------------------------------------------------------


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a turn; refuses a target with none (an answer would never end)."""
    ids = eos_token_ids(model, tokenizer)
    if not ids:
        raise RegenerateError(f"{type(tokenizer).__name__} has no eos token: cannot tell where an answer ends")
    return ids


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


_LENGTH_BATCH = 1024  # prompts a tokenizer call counts


def _first_prompt_lengths(items: Sequence[tuple[str, Conversation]], tokenizer: Any,
                          options: RegenerateOptions) -> list[int]:
    """Token length of the first prompt the target would be given for each conversation (0: no
    user turn), counted in batches (:func:`render_prompts`: 256k prompts take minutes one by one,
    which once spent a whole run's regeneration budget before the first answer)."""
    firsts: list[tuple[int, list[dict]]] = []
    for k, (_, conv) in enumerate(items):
        head, users = _turns(conv, options.system_prompt, options.max_turns)
        if users:
            firsts.append((k, head + [{"role": "user", "content": users[0]}]))
    lengths = [0] * len(items)
    batches = render_prompts([m for _, m in firsts], tokenizer, options.system_prompt, batch_size=_LENGTH_BATCH)
    done = 0
    with tqdm(total=len(firsts), desc="prompt lengths", unit="prompt", disable=not options.progress,
              dynamic_ncols=True) as bar:
        for batch in batches:
            for (k, _), ids in zip(firsts[done:done + len(batch)], batch):
                lengths[k] = len(ids)
            done += len(batch)
            bar.update(len(batch))
    return lengths


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
        lengths = _first_prompt_lengths(items, tokenizer, options)
    if options.sort_by_length:
        items, lengths = _sort_by_length(items, lengths)
    summary.conversations, summary.temperatures = len(items), temperatures
    summary.total = len(items) * len(temperatures)
    files = OutputFiles.resume(options.out_path, generations)
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
              files: OutputFiles, target_info: dict[str, Any], summary: RegenerateSummary,
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
        asking = [d for d in dialogues if d.stop is None and t < len(d.users)]
        for d in asking:
            d.messages.append({"role": "user", "content": d.users[t]})
        # render_prompt's ids (the same system-prompt handling as training-time render()), in one batch
        rendered = [ids for batch in render_prompts([d.messages for d in asking], tokenizer, options.system_prompt,
                                                    batch_size=max(len(asking), 1)) for ids in batch]
        for d, ids in zip(asking, rendered):
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
