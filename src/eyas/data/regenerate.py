"""Answer training prompts with the target itself (DESIGN.md section 9: train on the target's own answers).

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
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from eyas import __version__
from eyas.data.conversations import Conversation
from eyas.data.render import TEMPLATE_DEFAULT, render_prompt, system_prompt_mode
from eyas.errors import EyasError
from eyas.targets.structure import eos_token_ids


class RegenerateError(EyasError, ValueError):
    """The output file cannot be resumed (corrupt line, other generation parameters)."""


# ---------------------------------------------------------------------------------------------
# Ids and resumable JSONL files
# ---------------------------------------------------------------------------------------------


def conversation_id(conv: Conversation, position: int) -> str:
    """A stable id: the record's own id, else ``<file name>:<line>`` / ``<file name>[<index>]``
    from its provenance, else ``#<position in the input>``."""
    if conv.id is not None:
        return str(conv.id)
    p = conv.provenance or {}
    name = Path(str(p["source"])).name if p.get("source") else None
    if name and p.get("line") is not None:
        base = f"{name}:{p['line']}"
    elif name and p.get("index") is not None:
        base = f"{name}[{p['index']}]"
    else:
        return f"#{position}"
    return base + (f"#{p['instance']}" if p.get("instance") is not None else "")


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
# Generation
# ---------------------------------------------------------------------------------------------


@dataclass
class RegenerateSummary:
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
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        return d


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a turn; refuses a target with none (an answer would never end)."""
    ids = eos_token_ids(model, tokenizer)
    if not ids:
        raise RegenerateError(f"{type(tokenizer).__name__} has no eos token: cannot tell where an answer ends")
    return ids


def _generation_params(max_new_tokens: int, temperature: float, top_p: float, seed: int,
                       batch_size: int, system_prompt: str, max_prompt_tokens: int | None,
                       max_turns: int | None) -> dict[str, Any]:
    """What the answers depend on (recorded in provenance; a resume must use the same)."""
    sampled = temperature > 0
    return {
        "do_sample": sampled,
        "temperature": float(temperature) if sampled else 0.0,
        "top_p": float(top_p) if sampled else 1.0,
        "seed": int(seed) if sampled else None,
        "max_new_tokens": int(max_new_tokens),
        "batch_size": int(batch_size),  # batch composition changes the numerics of padded batches
        "system_prompt": system_prompt_mode(system_prompt),
        "max_prompt_tokens": max_prompt_tokens,
        "max_turns": max_turns,
    }


def _hf_generation_config(params: dict[str, Any], pad_id: int, eos_ids: list[int]) -> Any:
    from transformers import GenerationConfig

    # Every knob set explicitly: generate() fills unset (None) fields from the model's own
    # generation_config, which may carry top_k / repetition_penalty defaults we do not want.
    kw: dict[str, Any] = dict(max_new_tokens=params["max_new_tokens"], pad_token_id=pad_id,
                              eos_token_id=eos_ids, repetition_penalty=1.0, num_beams=1)
    if params["do_sample"]:
        kw.update(do_sample=True, temperature=params["temperature"], top_p=params["top_p"], top_k=0)
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


def regenerate(
    model: Any,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    out_path: str | os.PathLike,
    *,
    max_new_tokens: int = 1024,
    batch_size: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    limit: int | None = None,
    system_prompt: str = TEMPLATE_DEFAULT,
    max_prompt_tokens: int | None = None,
    max_turns: int | None = None,
    source: str | None = None,
    progress: bool = True,
    on_chunk_written: Callable[[int, list[dict[str, Any]]], None] | None = None,
) -> RegenerateSummary:
    """Answer every user turn of ``conversations`` with ``model`` and append them to ``out_path``.

    Args:
        conversations: prompts (user turns, optional system message); assistant turns are ignored.
        max_new_tokens: per answer; an answer cut there has finish reason ``"length"``.
        batch_size: conversations generated together (left-padded batch); also the resume unit.
            Large batches are nearly free on a GPU: a decode step of a small target is dominated
            by per-step overhead (SmolLM2-sized on an H200: ~600 tok/s at 64, ~3200 at 256).
        temperature: 0 = greedy; > 0 = sampled with ``top_p``, seeded per chunk from ``seed``.
        limit: only the first ``limit`` conversations of the input (after de-duplication by id).
        system_prompt: as in :func:`eyas.data.render.render`; recorded in provenance, and a custom
            prompt is written into the conversation.
        max_prompt_tokens: a turn whose prompt is longer ends the conversation before it.
        max_turns: answer at most this many user turns per conversation.
        source: the target's name for provenance (e.g. ``str(TargetSource)``).
        on_chunk_written: called as ``f(chunk_index, records)`` after each chunk is on disk.

    Returns: a :class:`RegenerateSummary`.
    """
    from eyas.contract import weights_fingerprint

    t0 = time.perf_counter()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    side = out.with_name(out.name + ".skipped.jsonl")
    summary = RegenerateSummary(out_path=str(out))
    params = _generation_params(max_new_tokens, temperature, top_p, seed, batch_size, system_prompt,
                                max_prompt_tokens, max_turns)

    # Input: de-duplicate by id (first wins), then limit. Chunks are fixed by position in this list.
    items: list[tuple[str, Conversation]] = []
    seen: set[str] = set()
    for i, conv in enumerate(conversations):
        cid = conversation_id(conv, i)
        if cid in seen:
            summary.duplicates += 1
            continue
        seen.add(cid)
        items.append((cid, conv))
    if limit is not None:
        items = items[:limit]
    summary.total = len(items)

    # Resume state.
    existing = read_resumable_jsonl(out)
    for rec in existing[:1]:
        theirs = (rec.get("provenance") or {}).get("generation")
        if theirs is not None and theirs != params:
            diff = {k: (theirs.get(k), v) for k, v in params.items() if theirs.get(k) != v}
            raise RegenerateError(
                f"{out}: written with other generation parameters ({', '.join(f'{k}: file has {a!r}, now {b!r}' for k, (a, b) in diff.items())}); "
                f"resume with the same parameters or write to a new file")
    written_ids = {r["id"] for r in existing}
    failed_ids = {r["id"] for r in read_resumable_jsonl(side)}
    done = written_ids | failed_ids

    chunks = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
    todo = [(k, c) for k, c in enumerate(chunks) if any(cid not in done for cid, _ in c)]
    summary.skipped = sum(1 for cid, _ in items if cid in done)

    target_info = {"target": source, "target_fingerprint": weights_fingerprint(model)}
    eos_ids = _eos_ids(model, tokenizer)
    bar = tqdm(total=sum(len(c) for _, c in todo), desc="regenerate", unit="conv",
               disable=not progress, dynamic_ncols=True)
    was_training = model.training
    model.eval()
    try:
        with _LeftPadding(tokenizer) as pad_id:
            gen_config = _hf_generation_config(params, pad_id, eos_ids)
            for k, chunk in todo:
                if params["do_sample"]:
                    torch.manual_seed(seed * 1_000_003 + k)  # per chunk: a resumed chunk samples the same
                recs, fails = _answer_chunk(model, tokenizer, chunk, params, gen_config, eos_ids,
                                            system_prompt, summary)
                new_recs = [r for r in recs if r["id"] not in written_ids]
                new_fails = [r for r in fails if r["id"] not in failed_ids]
                for r in new_recs:
                    r["provenance"].update(target_info)
                _append_lines(side, new_fails)  # sidecar first: a crash before the output line
                _append_lines(out, new_recs)  # leaves the chunk incomplete, so it is redone
                written_ids.update(r["id"] for r in new_recs)
                failed_ids.update(r["id"] for r in new_fails)
                summary.written += len(new_recs)
                summary.failed += len(new_fails)
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{summary.new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
                if on_chunk_written is not None:
                    on_chunk_written(k, new_recs)
    finally:
        bar.close()
        model.train(was_training)
    summary.skipped_path = str(side) if side.exists() else None
    summary.wall_s = time.perf_counter() - t0
    return summary


def _answer_chunk(model: Any, tokenizer: Any, chunk: list[tuple[str, Conversation]], params: dict[str, Any],
                  gen_config: Any, eos_ids: list[int], system_prompt: str,
                  summary: RegenerateSummary) -> tuple[list[dict], list[dict]]:
    """Answer all conversations of one chunk turn by turn: at turn t the conversations that still
    have a t-th user turn form one batch. -> (output records, failure records), in chunk order."""
    state = []
    for cid, conv in chunk:
        head, users = _turns(conv, system_prompt, params["max_turns"])
        state.append({"id": cid, "conv": conv, "messages": head, "users": users, "finish": [],
                      "new_tokens": [], "stop": None})
    for t in range(max(len(s["users"]) for s in state)):
        active, prompts = [], []
        for s in state:
            if s["stop"] is not None or t >= len(s["users"]):
                continue
            s["messages"].append({"role": "user", "content": s["users"][t]})
            # render_prompt applies the same system-prompt handling as training-time render().
            ids = render_prompt(s["messages"], tokenizer, system_prompt=system_prompt).tolist()
            if params["max_prompt_tokens"] is not None and len(ids) > params["max_prompt_tokens"]:
                s["messages"].pop()
                s["stop"] = f"prompt of turn {t} has {len(ids)} tokens > max_prompt_tokens {params['max_prompt_tokens']}"
                continue
            active.append(s)
            prompts.append(ids)
        if not active:
            break
        for s, ids, (ans, finish) in zip(active, prompts, _generate_batch(model, tokenizer, prompts, gen_config, eos_ids)):
            text = tokenizer.decode(ans, skip_special_tokens=True)
            n_new = len(ans) + (finish == "eos")
            summary.new_tokens += n_new
            summary.prompt_tokens += len(ids)
            summary.finish[finish] += 1
            if not text.strip():  # an empty answer is not a training example; stop here
                s["messages"].pop()
                s["stop"] = f"empty answer at turn {t} ({finish} after {n_new} tokens)"
                continue
            s["messages"].append({"role": "assistant", "content": text})
            s["finish"].append(finish)
            s["new_tokens"].append(n_new)
    recs, fails = [], []
    for s in state:
        if not s["finish"]:
            fails.append({"id": s["id"], "reason": s["stop"] or "no user turn",
                          "provenance": dict(s["conv"].provenance)})
            continue
        prov = {k: v for k, v in s["conv"].provenance.items()
                if k not in ("target", "target_fingerprint", "generation", "finish_reasons", "new_tokens")}
        prov.update(generation=params, finish_reasons=s["finish"], new_tokens=s["new_tokens"],
                    eyas_version=__version__)
        if s["stop"]:
            prov["stopped"] = s["stop"]
        recs.append({"id": s["id"], "messages": s["messages"], "provenance": prov})
    return recs, fails
