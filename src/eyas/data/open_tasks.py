"""Long prompts from open documents: passages of books, technical documents and source files, each
with a request a user would make of it, and multi-passage RAG questions (``eyas open-prompts``).

Why. Serving reads long contexts (issue 34 asks that 30% of the prompts be over 1,000 tokens), and
a drafter that only saw short chat turns accepts less after a long document. A user pastes a
chapter, a design document or a source file and asks for a summary, a review, tests, a FAQ or an
answer; these readers make such prompts from permissively licensed files, many per file.

Readers (registered in :data:`eyas.data.open_readers.READERS`):

- ``passage_tasks``: each file (its :class:`OpenFile`'s ``genre``: ``prose``, the default,
  ``technical`` or ``code``; its ``title``, else its path) is cut at blank lines into passages of
  about ``size`` characters, once per size of ``passes`` (``"4500,8500"``: a file is read twice, at two cuts, so a passage
  boundary of one pass falls inside a passage of the other). Each passage gets one request of its
  genre (:data:`TASKS`) and one layout (:data:`LAYOUTS`: the request before or after the
  document, fenced for code), both drawn by a hash of (set, file, pass, passage), so a rerun writes
  the same prompts. Prose has its hard-wrapped lines joined; technical text and code keep their
  lines. A block longer than ``size`` is cut at line ends; a file's last passage under half the
  size is dropped unless it is the file's only one and at least :data:`MIN_CHARS` long.
- ``squad_rag``: SQuAD-format questions, each over its own paragraph hidden among ``k`` paragraphs
  of other articles (``k`` from ``distractors``, ``"4,10"``, drawn per question), numbered
  ``[1]..[k+1]`` as a retriever hands them to a model; ``draws`` times per question with other
  distractors and places.

Invariant: only the first pass's passages are written as documents (``--documents-out``), so the
documents file holds each stretch of text about once.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Iterator, Sequence

from eyas.data.open_readers import OpenPrompt, book_text, reader
from eyas.data.open_sets import OpenSet, OpenSetError

MIN_CHARS = 1200

# (kind, request): what a user asks of a passage of each genre. {title} is the file's title.
TASKS: dict[str, tuple[tuple[str, str], ...]] = {
    "prose": (
        ("summarize", "Summarize this passage from {title}."),
        ("summarize", "Summarize the passage below in three or four sentences."),
        ("summarize", "List the main events of this passage as bullet points."),
        ("rag_qa", "Who are the people mentioned in this passage, and what do we learn about each of them?"),
        ("writing", "Explain this passage from {title} in plain modern English, as you would to a high-school "
                    "student."),
        ("rag_qa", "What is the author arguing or describing in this passage? Quote one sentence that shows it."),
        ("writing", "Write five questions a teacher could ask about this passage, each with its answer."),
        ("writing", "Describe the tone and the style of this passage, with examples from the text."),
        ("summarize", "Give this passage a short title and a one-paragraph summary."),
        ("writing", "Rewrite the first paragraph of this passage in simpler words."),
        ("translate", "Translate the first paragraph of this passage into {language}."),
        ("writing", "What happens in this passage? Then say what you think happens next, and why."),
        ("writing", "Write a short review of this passage from {title}: what works and what does not."),
        ("rag_qa", "Extract every place, date and number mentioned in this passage, as a table."),
        ("rag_qa", "Which idea in this passage would a modern reader find most surprising, and why?"),
    ),
    "technical": (
        ("summarize", "Summarize this document ({title}) for a busy engineer in five bullet points."),
        ("summarize", "Explain the main idea of this document to someone new to the topic."),
        ("rag_qa", "What problem does this document address, and what solution does it propose?"),
        ("writing", "Write a FAQ of five questions and answers based on this document."),
        ("rag_qa", "List the rules, requirements or steps this document states, as a checklist."),
        ("code", "Write a short code example that illustrates what this document describes, and explain it."),
        ("rag_qa", "What trade-offs or alternatives does this document discuss? Summarize them in a table."),
        ("summarize", "Write a TL;DR of this text in two sentences, then its three most important details."),
        ("writing", "Quiz me: write four multiple-choice questions about this document, with the answers at the "
                    "end."),
        ("writing", "Which parts of this document are unclear or could be misread? Suggest better wording."),
        ("rag_qa", "Based only on this text, what would you tell a colleague who asks what {title} is about?"),
        ("writing", "Turn this document into a short blog post that introduces it to developers."),
    ),
    "code": (
        ("code", "Explain what this code does, function by function."),
        ("code", "Review this code: point out bugs, risky patterns and anything you would change, most "
                 "important first."),
        ("code", "Add docstrings and type hints to the functions in this code. Show only the changed functions."),
        ("code", "Write pytest unit tests for the main functions in this code."),
        ("code", "Summarize the public API of this module in a Markdown table: name, purpose, arguments."),
        ("code", "How would you refactor this code to make it easier to read and to test? Show an example."),
        ("code", "Are there security or error-handling problems in this code? Explain each one."),
        ("code", "Write a short tutorial that shows how to use this module, with an example."),
        ("code", "Which edge cases does this code not handle? Give inputs that would break it."),
        ("code", "Describe the control flow of this code in plain English, as a numbered list of steps."),
    ),
}
LANGUAGES = ("French", "German", "Spanish", "Chinese", "Japanese", "Russian", "Italian", "Portuguese")
# How the request and the document sit in the prompt; {fence} is a code fence's language or "".
LAYOUTS: dict[str, tuple[str, ...]] = {
    "prose": ("{request}\n\n{document}", "{document}\n\n{request}",
              "Here is a passage from {title}:\n\n{document}\n\n{request}"),
    "technical": ("{request}\n\n{document}", "{document}\n\n{request}",
                  "I am reading {title}.\n\n{document}\n\n{request}"),
    "code": ("{request}\n\n```{fence}\n{document}\n```", "```{fence}\n{document}\n```\n\n{request}",
             "This is {title}:\n\n```{fence}\n{document}\n```\n\n{request}"),
}
FENCES = {".py": "python", ".rs": "rust", ".js": "javascript", ".ts": "typescript", ".go": "go", ".c": "c"}


def draw(*key: object) -> int:
    """A stable draw (Python's ``hash`` changes per process): the first 8 bytes of a BLAKE2b."""
    return int.from_bytes(hashlib.blake2b("\x1f".join(map(str, key)).encode(), digest_size=8).digest(), "big")


def _blocks(text: str, genre: str, size: int) -> list[str]:
    """Blank-line-separated blocks; prose's hard-wrapped lines joined; a block over ``size`` cut at
    line ends (a long code block or table) so that no passage is far over the size asked."""
    out = []
    for b in text.split("\n\n"):
        if not b.strip():
            continue
        if genre == "prose":
            out.append(" ".join(x.strip() for x in b.strip().split("\n")))
            continue
        b = b.strip("\n")
        while len(b) > size:
            cut = b.rfind("\n", 0, size)
            cut = cut if cut > 0 else size
            out.append(b[:cut])
            b = b[cut:].lstrip("\n")
        if b.strip():
            out.append(b)
    return out


def passages(text: str, genre: str, size: int) -> list[str]:
    """The text cut into passages of about ``size`` characters (module docstring)."""
    result: list[str] = []
    chunk = ""
    for b in _blocks(text, genre, size) + [""]:
        if b and (not chunk or len(chunk) + 2 + len(b) <= size):
            chunk = f"{chunk}\n\n{b}" if chunk else b
            continue
        if chunk and (len(chunk) >= size // 2 or (not result and not b and len(chunk) >= MIN_CHARS)):
            result.append(chunk)
        chunk = b
    return result


@reader("passage_tasks")
def passage_tasks(s: OpenSet, paths: Sequence[Path]) -> Iterator[OpenPrompt]:
    sizes = [int(x) for x in s.option("passes", "4500,8500").split(",") if x.strip()]
    for k, (f, path) in enumerate(zip(s.files, paths)):
        genre, title = f.genre or "prose", f.title or f.path
        if genre not in TASKS:
            raise OpenSetError(f"open set {s.name} file {k} ({path}): genre expected one of {sorted(TASKS)}, "
                               f"found {genre!r}")
        text = book_text(path) if genre == "prose" else path.read_text(encoding="utf-8-sig", errors="replace")
        text = text.replace("\r\n", "\n")
        for p, size in enumerate(sizes):
            for n, passage in enumerate(passages(text, genre, size)):
                kind, request = TASKS[genre][draw(s.name, k, p, n, "task") % len(TASKS[genre])]
                layout = LAYOUTS[genre][draw(s.name, k, p, n, "layout") % len(LAYOUTS[genre])]
                request = request.format(title=title, language=LANGUAGES[draw(s.name, k, p, n) % len(LANGUAGES)])
                prompt = layout.format(request=request, document=passage, title=title,
                                       fence=FENCES.get(Path(f.path).suffix, ""))
                pid = f"{s.name}/{k}/{p}/{n}"
                yield OpenPrompt(pid, prompt, kind, k, pid if p == 0 else "", passage if p == 0 else "")


RAG_PASSAGES = ("Answer the question using the passages below, and say which passage the answer comes from.\n\n"
                "{passages}\n\nQuestion: {question}")
RAG_QUESTION_FIRST = "Question: {question}\n\nUse these search results to answer it.\n\n{passages}"


@reader("squad_rag")
def squad_rag(s: OpenSet, paths: Sequence[Path]) -> Iterator[OpenPrompt]:
    lo, hi = (int(x) for x in s.option("distractors", "4,10").split(","))
    draws = int(s.option("draws", "2"))
    for k, path in enumerate(paths):
        articles = json.loads(path.read_text(encoding="utf-8"))["data"]
        paragraphs = [(a, p["context"].strip(), p["qas"]) for a, art in enumerate(articles) for p in art["paragraphs"]]
        for i, (a, context, questions) in enumerate(paragraphs):
            others = [j for j, (b, _, _) in enumerate(paragraphs) if b != a]
            if not others:
                raise OpenSetError(f"{path}: squad_rag needs paragraphs of at least two articles, found one")
            for q in questions:
                for d in range(draws):
                    rng = random.Random(draw(s.name, k, q.get("id", i), d))
                    picked = [paragraphs[j][1] for j in rng.sample(others, min(len(others), rng.randint(lo, hi)))]
                    picked.insert(rng.randint(0, len(picked)), context)
                    text = "\n\n".join(f"[{n}] {c}" for n, c in enumerate(picked, 1))
                    template = RAG_PASSAGES if d % 2 == 0 else RAG_QUESTION_FIRST
                    yield OpenPrompt(f"{s.name}/{k}/{q.get('id', i)}/{d}",
                                     template.format(passages=text, question=q["question"].strip()), "rag_qa", k)
