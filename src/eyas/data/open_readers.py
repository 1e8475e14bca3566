"""Readers of open prompt sets (:mod:`eyas.data.open_sets`): each turns a set's files into user
prompts, and :func:`eyas.data.open_writer.write_open_prompts` writes them as ``eyas regenerate``
reads them. The readers of long documents (``passage_tasks``, ``squad_rag``) are in
:mod:`eyas.data.open_tasks`.

Readers (by name, :data:`READERS`; a set's ``options`` configure them):

- ``squad``: SQuAD-format JSON (``data[].paragraphs[].context`` and ``.qas[].question``). An
  article's paragraphs, joined, are one long document: it gives one summarization prompt and up to
  ``questions_per_article`` question-answering prompts spread over the article (the whole article
  as the context, RAG-style), so that a context is not repeated hundreds of times.
- ``jsonl_template``: a JSON-lines file (or a JSON array) of records; each prompt is ``template``
  formatted with the record's fields (``{problem}``, ``{text}``, ``{test_list[0]}``).
- ``parallel_lines``: line-aligned files, one per language of ``languages``; line i of the first
  (the pivot) and of another language make a pair, asked one way on even lines and the other way
  on odd ones, so each pair gives one prompt and both directions are covered.
- ``text_chunks``: a long plain text (a public-domain book) cut at blank lines into passages of
  about ``chars`` characters, each to be summarized (a passage under half that is dropped).
- ``squality``: SQuALITY's stories (about 7k tokens each), each of its five questions over the
  whole story; ``qmsum``: QMSum's meeting transcripts, general queries over the transcript's start
  and specific queries over their span widened to a RAG-sized excerpt.

Invariants: a reader yields prompts in file order with stable ids (``<set>/<place in its
file>``), so a rerun writes the same file; the writer drops exact duplicates (case- and
whitespace-folded, :func:`eyas.data.prompts.fold`) and writes ``out`` atomically.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from eyas.data.open_sets import OpenSet, OpenSetError

RAG = ("Answer the question using the document below.\n\n{document}\n\nQuestion: {question}")
SUMMARIZE = "Summarize the following article{title}.\n\n{document}"
SUMMARIZE_PASSAGE = "Summarize this passage from {title}.\n\n{document}"
TRANSLATE = "Translate the following text from {source} into {target}.\n\n{text}"


@dataclass(frozen=True)
class OpenPrompt:
    id: str
    text: str
    kind: str  # what it asks (open_sets.KINDS)
    file: int = 0  # which of the set's files it came from
    document_id: str = ""  # the long document it is about, if any (written by --documents-out)
    document: str = ""


Reader = Callable[[OpenSet, Sequence[Path]], Iterator[OpenPrompt]]
READERS: dict[str, Reader] = {}


def reader(name: str) -> Callable[[Reader], Reader]:
    def add(fn: Reader) -> Reader:
        READERS[name] = fn
        return fn
    return add


def _records(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    records = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 inside a string is no line break
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise OpenSetError(f"{path} line {n}: expected a JSON record, found {line[:80]!r} ({e.msg})") from None
    return records


@reader("squad")
def squad(s: OpenSet, paths: Sequence[Path]) -> Iterator[OpenPrompt]:
    per_article = int(s.option("questions_per_article", "8"))
    for k, path in enumerate(paths):
        for a, article in enumerate(json.loads(path.read_text(encoding="utf-8"))["data"]):
            document = "\n\n".join(p["context"].strip() for p in article["paragraphs"])
            title = str(article.get("title", "")).replace("_", " ")
            doc = f"{s.name}/{k}/{a}"
            yield OpenPrompt(f"{doc}/summary", SUMMARIZE.format(title=f" about {title}" if title else "",
                                                              document=document), "summarize", k, doc, document)
            questions = [q for p in article["paragraphs"] for q in p["qas"]]
            step = max(1, len(questions) // max(per_article, 1))
            for q in questions[::step][:per_article]:
                yield OpenPrompt(f"{doc}/{q.get('id', '')}", RAG.format(document=document, question=q["question"].strip()),
                                 "rag_qa", k, doc, document)


@reader("jsonl_template")
def jsonl_template(s: OpenSet, paths: Sequence[Path]) -> Iterator[OpenPrompt]:
    template = s.option("template")
    if not template:
        raise OpenSetError(f"open set {s.name}: option template: expected a format string, found none")
    for k, path in enumerate(paths):
        for i, record in enumerate(_records(path)):
            try:
                text = template.format_map(record)
            except (KeyError, IndexError, TypeError) as e:
                raise OpenSetError(f"{path} record {i}: template {template!r} needs {e}, the record has "
                                   f"{sorted(record) if isinstance(record, dict) else type(record).__name__}") from None
            yield OpenPrompt(f"{s.name}/{k}/{i}", text.strip(), s.kind, k)


@reader("parallel_lines")
def parallel_lines(s: OpenSet, paths: Sequence[Path]) -> Iterator[OpenPrompt]:
    languages = [x.strip() for x in s.option("languages").split(",") if x.strip()]
    if len(languages) != len(paths) or len(paths) < 2:
        raise OpenSetError(f"open set {s.name}: option languages: expected one per file ({len(paths)}), "
                           f"found {languages}")
    lines = [p.read_text(encoding="utf-8").splitlines() for p in paths]
    for p, ls in zip(paths[1:], lines[1:]):
        if len(ls) != len(lines[0]):
            raise OpenSetError(f"{p}: expected {len(lines[0])} lines, aligned with {paths[0]}, found {len(ls)}")
    for j in range(1, len(paths)):
        for i, (pivot, other) in enumerate(zip(lines[0], lines[j])):
            if not pivot.strip() or not other.strip():
                continue
            src, tgt, text, k = ((languages[0], languages[j], pivot, 0) if i % 2 == 0
                                 else (languages[j], languages[0], other, j))
            yield OpenPrompt(f"{s.name}/{languages[j]}/{i}", TRANSLATE.format(source=src, target=tgt, text=text.strip()),
                             "translate", k)


GUTENBERG = re.compile(r"^\*\*\* ?(START|END) OF (THE|THIS) PROJECT GUTENBERG EBOOK.*$", re.MULTILINE | re.IGNORECASE)


def book_text(path: Path) -> str:
    """A plain text as read for passages: UTF-8 (a byte-order mark dropped), line ends as ``\n``,
    and, where a Project Gutenberg header and footer mark the book, only what lies between them."""
    text = path.read_text(encoding="utf-8-sig", errors="replace").replace("\r\n", "\n")
    marks = {m.group(1).upper(): m for m in GUTENBERG.finditer(text)}
    if "START" in marks and "END" in marks and marks["START"].end() < marks["END"].start():
        text = text[marks["START"].end():marks["END"].start()]
    return text


@reader("text_chunks")
def text_chunks(s: OpenSet, paths: Sequence[Path]) -> Iterator[OpenPrompt]:
    """Passages of a long text (module docstring); a paragraph's hard-wrapped lines joined;
    ``titles``: one per file, separated by ``|``."""
    size = int(s.option("chars", "6000"))
    titles = s.option("titles", "").split("|")
    for k, path in enumerate(paths):
        title = titles[k].strip() if k < len(titles) and titles[k].strip() else s.option("title", "a book")
        blocks = [" ".join(x.strip() for x in b.strip().split("\n")) for b in book_text(path).split("\n\n")
                  if b.strip()]
        chunk: list[str] = []
        n = 0
        for b in blocks + [""]:
            if b and sum(len(x) for x in chunk) + len(b) <= size:
                chunk.append(b)
                continue
            if chunk and sum(len(x) for x in chunk) >= size // 2:
                passage = "\n\n".join(chunk)
                yield OpenPrompt(f"{s.name}/{k}/{n}", SUMMARIZE_PASSAGE.format(title=title, document=passage),
                                 "summarize", k, f"{s.name}/{k}/{n}", passage)
                n += 1
            chunk = [b] if b else []


MARKUP = re.compile(r"\s*\{(?:disfmarker|vocalsound|gap|nonvocalsound|pause|comment)\}")  # QMSum's annotations


def _paragraphs(text: str) -> str:
    """Line breaks with stray spaces around them (SQuALITY's " \n \n ") as plain ones; paragraphs
    separated by one blank line."""
    text = re.sub(r"[ \t]*\n[ \t]*", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


STORY = "Read the story and answer the question.\n\n{document}\n\nQuestion: {question}"
MEETING = "Here is a meeting transcript.\n\n{transcript}\n\n{query}"


@reader("squality")
def squality(s: OpenSet, paths: Sequence[Path]) -> Iterator[OpenPrompt]:
    """SQuALITY (JSON lines: ``document``, a public-domain story, and ``questions[].question_text``;
    question 1 asks for the plot): each question over the whole story."""
    for k, path in enumerate(paths):
        for i, record in enumerate(_records(path)):
            document = _paragraphs(str(record["document"]))
            for q in record["questions"]:
                kind = "summarize" if q.get("question_number") == 1 else "rag_qa"
                yield OpenPrompt(f"{s.name}/{k}/{i}/{q.get('question_number', '')}",
                                 STORY.format(document=document, question=q["question_text"].strip()), kind, k,
                                 f"{s.name}/{k}/{i}", document)


@reader("qmsum")
def qmsum(s: OpenSet, paths: Sequence[Path]) -> Iterator[OpenPrompt]:
    """QMSum (JSON lines: ``meeting_transcripts[]`` of speaker turns, ``general_query_list`` and
    ``specific_query_list`` with ``relevant_text_span`` turn ranges): a general query over the
    transcript cut to ``max_chars`` (its start), and each specific query over its span widened
    with the turns around it to about ``span_chars`` characters (RAG-sized: a retrieved excerpt)."""
    max_chars, span_chars = int(s.option("max_chars", "24000")), int(s.option("span_chars", "6000"))
    for k, path in enumerate(paths):
        for i, record in enumerate(_records(path)):
            turns = [f"{t['speaker']}: {MARKUP.sub('', t['content']).strip()}" for t in record["meeting_transcripts"]]

            def excerpt(lo: int, hi: int, budget: int) -> str:
                lo, hi = max(0, lo), min(len(turns) - 1, hi)
                size = sum(len(t) + 1 for t in turns[lo:hi + 1])
                while size < budget and (lo > 0 or hi < len(turns) - 1):  # widen on both sides in turn
                    if lo > 0:
                        lo -= 1
                        size += len(turns[lo]) + 1
                    if hi < len(turns) - 1 and size < budget:
                        hi += 1
                        size += len(turns[hi]) + 1
                return "\n".join(turns[lo:hi + 1])[:max_chars]

            start = excerpt(0, 0, max_chars)
            for j, q in enumerate(record["general_query_list"]):
                yield OpenPrompt(f"{s.name}/{k}/{i}/g{j}", MEETING.format(transcript=start, query=q["query"].strip()),
                                 "summarize", k, f"{s.name}/{k}/{i}/start", start)
            for j, q in enumerate(record["specific_query_list"]):
                spans = [(int(a), int(b)) for a, b in q["relevant_text_span"]]
                lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
                part = excerpt(lo, hi, span_chars)
                yield OpenPrompt(f"{s.name}/{k}/{i}/s{j}", MEETING.format(transcript=part, query=q["query"].strip()),
                                 "rag_qa", k, f"{s.name}/{k}/{i}/{lo}-{hi}", part)
