"""Prompts without limit: the target writes user turns itself (``eyas prompts``), as in Magpie
(Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing").

Algorithm. An aligned chat model given only its template's header of a user turn (for SmolLM2's
template, its default system turn and then ``<|im_start|>user\\n``) continues with a plausible user
message and ends it with the template's end of turn. :func:`user_header` finds that header from the
template itself: it renders a user turn whose content is a sentinel and keeps the tokens before the
sentinel, so any template works, system prompt handling included (``system_prompt`` as for
training: the template's default, none, or custom text). :func:`make_prompts` asks a
:class:`~eyas.data.generation.BatchGenerator` for batches of continuations of that header, at each
temperature in turn (hotter draws are more diverse and noisier), and keeps a prompt when:

- it ended with an end-of-turn token (finish "eos": a runaway continuation is not a message);
- its text, stripped, has at least ``min_chars`` characters, a third of them letters, and no
  special token text (the model imitating the template);
- it has no repetition loop (:func:`eyas.data.loops.find_loops`);
- it is not a duplicate: exactly (case- and whitespace-folded) or nearly (:class:`NearDuplicates`:
  MinHash over word 3-grams, Jaccard similarity estimated above ``near_threshold``).

Long prompts (``documents``, :func:`read_documents`): the header followed by a long document, a
blank line and an opener (the first words of a request, :data:`REQUEST_OPENERS`, one drawn per row),
and the target completes the request (Magpie conditioned on a text, as serving reads long
contexts); the prompt is the document and the request, opener included. Why the opener: after a
document alone the target mostly goes on writing the document (SmolLM2 on 40 passages of one book:
193 of 209 continuations had no end of turn within 128 tokens, 16 were kept), and every runaway
row costs a whole batch of decoding steps.

Output: JSONL records ``{"id", "messages": [{"role": "user", "content": ...}], "source": {...}}``
that ``eyas regenerate`` reads. The file is appended to batch by batch (each line flushed), and a
rerun resumes: it reads the records already there into the duplicate index and writes only what
is still missing up to ``count``; a batch's seed is a hash of (seed, temperature, batch index), and a
rerun's batches continue after the highest index in the file's ids (``magpie-<batch>-<row>``), so
it draws new prompts rather than the same ones again.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from eyas.data.generation import BatchGenerator, BatchParams
from eyas.data.loops import find_loops
from eyas.data.regenerate_output import read_resumable_jsonl
from eyas.data.render import TEMPLATE_DEFAULT, user_header
from eyas.errors import EyasError

@dataclass
class NearDuplicates:
    """Near-duplicate detection by MinHash with locality-sensitive hashing (Broder 1997): a text's
    signature is the minimum over its word 3-gram shingles of ``bands x rows`` hash functions; two
    texts collide in a band when ``rows`` minima agree, which happens with probability J^rows for
    Jaccard similarity J. A collision is then confirmed by the signatures' agreement (an estimate
    of J) at least ``threshold``. Written here: no MinHash library is among eyas' dependencies, and
    this is 40 lines of numpy."""

    threshold: float = 0.7
    bands: int = 16
    rows: int = 4
    _buckets: dict[tuple[int, bytes], list[int]] = field(default_factory=dict)
    _signatures: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        g = np.random.default_rng(0)
        n = self.bands * self.rows
        self._a = g.integers(1, (1 << 61) - 1, n, dtype=np.uint64)
        self._b = g.integers(0, (1 << 61) - 1, n, dtype=np.uint64)

    def signature(self, text: str) -> np.ndarray:
        words = re.findall(r"\w+", text.lower())
        grams = {" ".join(words[i:i + 3]) for i in range(max(1, len(words) - 2))} or {""}
        x = np.array([int.from_bytes(hashlib.blake2b(g.encode(), digest_size=8).digest(), "little") >> 3
                      for g in grams], dtype=np.uint64)
        return (x[:, None] * self._a[None, :] + self._b[None, :]).min(axis=0)  # [bands * rows], mod 2^64

    def add(self, text: str) -> bool:
        """Index ``text``; False (and not indexed) when it nearly duplicates one indexed before."""
        sig = self.signature(text)
        keys = [(b, sig[b * self.rows:(b + 1) * self.rows].tobytes()) for b in range(self.bands)]
        for key in keys:
            for j in self._buckets.get(key, ()):
                if float((self._signatures[j] == sig).mean()) >= self.threshold:
                    return False
        for key in keys:
            self._buckets.setdefault(key, []).append(len(self._signatures))
        self._signatures.append(sig)
        return True


def fold(text: str) -> str:
    """The exact-duplicate key: lower case, whitespace runs as one space."""
    return " ".join(text.lower().split())


REJECTIONS = ("no_end_of_turn", "short", "not_text", "special_tokens", "loop", "duplicate", "near_duplicate")


@dataclass
class PromptFilter:
    """The checks a generated prompt passes (module docstring), with a count per rejection."""

    special_texts: Sequence[str]
    min_chars: int = 12
    near: NearDuplicates = field(default_factory=NearDuplicates)
    seen: set[str] = field(default_factory=set)
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTIONS, 0))

    def why_not(self, text: str, ids: Sequence[int], finish: str) -> str | None:
        """None when the prompt is kept (then indexed as seen), else the rejection's name."""
        stripped = text.strip()
        reason = None
        if finish != "eos":
            reason = "no_end_of_turn"
        elif len(stripped) < self.min_chars:
            reason = "short"
        elif sum(c.isalpha() for c in stripped) < len(stripped) / 3:
            reason = "not_text"
        elif any(s and s in stripped for s in self.special_texts):
            reason = "special_tokens"
        elif find_loops(ids):
            reason = "loop"
        elif fold(stripped) in self.seen:
            reason = "duplicate"
        elif not self.near.add(stripped):
            reason = "near_duplicate"
        if reason is not None:
            self.rejected[reason] += 1
            return reason
        self.seen.add(fold(stripped))
        return None

    def remember(self, text: str) -> None:
        """Index a prompt written before (a resumed file) without counting it."""
        self.seen.add(fold(text.strip()))
        self.near.add(text.strip())


@dataclass
class PromptsResult:
    out_path: str
    written: int  # this run
    existing: int  # already in the file
    generated: int  # continuations asked for
    rejected: dict[str, int]
    per_temperature: dict[str, int]  # written per temperature, this run
    surplus: int = 0  # answers of the last batch past the count, not looked at
    interrupted: bool = False  # stopped by SIGINT (Ctrl-C): rerun the same command to resume

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, kept_share=round(self.written / self.generated, 4) if self.generated else None)


def batch_seed(seed: int, temperature: float, index: int) -> int:
    """A batch's sampling seed: a hash of the three (module docstring, resume)."""
    h = hashlib.blake2b(f"{seed}/{temperature:g}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


@dataclass(frozen=True)
class Document:
    """A long text the target writes requests about (``eyas prompts --documents``)."""

    id: str
    text: str


# The first words of a request about a text, across what people ask of documents (summaries,
# questions, extraction, rewriting, translation, critique, teaching). No trailing space: the
# target's next token carries its own.
REQUEST_OPENERS: tuple[str, ...] = (
    "Summarize", "Can you summarize", "Write a short summary of", "TL;DR:", "What are the main points",
    "What is", "What does the author", "Why does", "How does", "Who", "When", "According to the text,",
    "Based on the passage above,", "Answer using only the text above:", "Explain", "Explain to a child",
    "List", "Extract", "Identify", "Find every", "Make a table of", "Describe", "Compare", "Rewrite",
    "Rewrite this passage", "Translate the first paragraph into", "Write a title for", "Give me three questions",
    "Create a quiz about", "Is it true that", "What can we infer", "Critique", "What is the tone of",
    "Turn this into", "Continue the story", "In one sentence,",
)


def document_prompt(doc: Document, request: str) -> str:
    """The prompt about a document: the document, a blank line, the request (what the target read
    before writing the request)."""
    return f"{doc.text}\n\n{request}"


def cut_documents(docs: Sequence[Document], tokenizer: Any, max_tokens: int) -> list[Document]:
    """Each document cut to at most ``max_tokens`` of the tokenizer's tokens, as a prefix of its
    text (``doc.text[:n]``: an id and a character count say exactly what a prompt holds), ended
    at the last line or sentence break in the final fifth when there is one. Why: the target
    prefills every document it writes a request about, and a long one costs its square in
    attention and its length in every row's cache (an H100 wrote 2.3 requests a second about
    documents of up to 10.8k tokens, 394 Magpie turns a second); serving reads long contexts, but a
    drafter learns them from 1-2k tokens as well."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens: expected >= 1, found {max_tokens}")
    out = []
    for d in docs:
        enc = tokenizer(d.text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        if len(offsets) <= max_tokens:
            out.append(d)
            continue
        end = offsets[max_tokens - 1][1]  # the character after the last token kept
        head = d.text[:end]
        brk = max(head.rfind("\n"), head.rfind(". ") + 1)
        out.append(Document(d.id, d.text[:brk] if brk > 0.8 * end else head))
    return out


def read_documents(path: str | Path) -> list[Document]:
    """``{"id", "text"}`` JSON lines (``eyas open-prompts --documents-out`` writes them)."""
    docs = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), 1):
        if line.strip():
            try:
                r = json.loads(line)
                docs.append(Document(str(r["id"]), str(r["text"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise EyasError(f"{path} line {n}: expected a JSON record with id and text, found "
                                 f"{line[:80]!r} ({type(e).__name__}: {e})") from None
    if not docs:
        raise EyasError(f"{path}: expected documents (JSON lines with id and text), found none")
    return docs


def make_prompts(generator: BatchGenerator, tokenizer: Any, out_path: str | Path, count: int,
                 temperatures: Sequence[float] = (1.0,), *, top_p: float = 1.0, max_new_tokens: int = 256,
                 batch_size: int = 64, seed: int = 0, eos_ids: Sequence[int] = (),
                 system_prompt: str = TEMPLATE_DEFAULT, source: str = "", max_batches: int | None = None,
                 filter_: PromptFilter | None = None, documents: Sequence[Document] = (),
                 openers: Sequence[str] = REQUEST_OPENERS,
                 on_batch: Callable[[int, int], None] | None = None) -> PromptsResult:
    """Write prompts to ``out_path`` until it holds ``count`` (see the module docstring): batches of
    ``batch_size`` continuations of the user header, temperatures taken in turn. ``max_batches``
    bounds the batches (None: 20 x what ``count`` needs at full yield). ``on_batch(written, asked)``
    after each batch (a progress bar). SIGINT (Ctrl-C) stops it with what it wrote so far
    (``interrupted``): a rerun resumes.

    With ``documents``, row j of batch b continues the header followed by document
    ``(b * batch_size + j) mod D``, a blank line and an opener drawn from ``openers`` by a hash of
    (seed, b, j) (none when ``openers`` is empty): the target completes a request about that
    document (a question, a summary to make, a task on it), and the prompt is the document, a blank
    line and the request (opener and completion). Exact and near duplicates are judged among one
    document's requests, and the record's ``source`` names the document, the characters of it the
    prompt holds (``document_chars``: documents may come cut, :func:`cut_documents`), the request
    alone (``request``) and its ``opener``."""
    if count < 1 or batch_size < 1 or not temperatures or any(t <= 0 for t in temperatures):
        raise ValueError(f"count, batch_size: expected >= 1, temperatures > 0; found {count}, {batch_size}, "
                         f"{list(temperatures)}")
    out = Path(out_path)
    header = user_header(tokenizer, system_prompt)
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    filt = filter_ or PromptFilter(specials)
    # One filter a document (its own duplicate index), sharing the rejection counts.
    per_doc = {d.id: PromptFilter(filt.special_texts, filt.min_chars, NearDuplicates(filt.near.threshold),
                                  rejected=filt.rejected) for d in documents}
    prefixes = [list(header) + tokenizer.encode(d.text + "\n\n", add_special_tokens=False) for d in documents]
    opener_ids = [tokenizer.encode(o, add_special_tokens=False) for o in openers] if documents else []
    existing, next_batch = 0, 0
    # Resume: a killed run leaves a torn last line (cut off here); lines end at b"\n" only, as a
    # prompt may hold U+2028 raw, which str.splitlines() takes for a line end.
    for record in read_resumable_jsonl(out):
        doc = record.get("source", {}).get("document")
        if doc is not None and doc in per_doc:
            per_doc[doc].remember(record["source"]["request"])
        elif doc is None:
            filt.remember(record["messages"][0]["content"])
        existing += 1
        m = re.fullmatch(r"magpie-(\d+)-\d+", str(record.get("id", "")))
        next_batch = max(next_batch, int(m.group(1)) + 1) if m else next_batch
    need = count - existing
    generator.reserve(max((len(p) for p in prefixes), default=len(header))
                      + max((len(o) for o in opener_ids), default=0), max_new_tokens)
    limit = max_batches if max_batches is not None else 20 * -(-max(need, 0) // batch_size)
    written, generated, surplus, per_t = 0, 0, 0, {f"{t:g}": 0 for t in temperatures}
    out.parent.mkdir(parents=True, exist_ok=True)
    interrupted = False
    with out.open("a", encoding="utf-8") as f:
        b = next_batch  # a resumed run continues the batch indices (fresh seeds)
        try:
            while written < need and b - next_batch < limit:
                t = float(temperatures[b % len(temperatures)])
                params = BatchParams(max_new_tokens, tuple(int(e) for e in eos_ids), t, top_p, batch_seed(seed, t, b))
                rows = [(b * batch_size + j) % len(documents) for j in range(batch_size)] if documents else []
                pick = [batch_seed(seed, -1.0, b * batch_size + j) % len(openers) if opener_ids else -1
                        for j in range(len(rows))]  # the row's opener (-1: none)
                prompts = ([prefixes[d] + (opener_ids[k] if k >= 0 else []) for d, k in zip(rows, pick)]
                           if documents else [list(header)] * batch_size)
                answers = generator.generate(prompts, params)
                generated += len(answers)
                for j, (ids, finish) in enumerate(answers):
                    if written >= need:  # the batch's last answers, past the count: not looked at
                        surplus += 1
                        continue
                    doc = documents[rows[j]] if documents else None
                    opener = openers[pick[j]] if doc is not None and pick[j] >= 0 else ""
                    text = opener + tokenizer.decode(ids)  # special tokens kept: the filter rejects them
                    if (per_doc[doc.id] if doc is not None else filt).why_not(text, ids, finish) is not None:
                        continue
                    about = {} if doc is None else {"document": doc.id, "document_chars": len(doc.text),
                                                     "request": text.strip(), "opener": opener}
                    content = text.strip() if doc is None else document_prompt(doc, text.strip())
                    record = {"id": f"magpie-{b}-{j}", "messages": [{"role": "user", "content": content}],
                              "source": {"generator": "magpie", "target": source, "temperature": t, "top_p": top_p,
                                         **about}}
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
                    written += 1
                    per_t[f"{t:g}"] += 1
                f.flush()
                b += 1
                if on_batch is not None:
                    on_batch(existing + written, generated)
        except KeyboardInterrupt:
            # Ctrl-C or a scheduler's SIGINT: every batch before this one is flushed, and a line
            # this one left torn is cut off by the next run's resume; report what was written.
            interrupted = True
    return PromptsResult(str(out), written, existing, generated, dict(filt.rejected), per_t, surplus, interrupted)
