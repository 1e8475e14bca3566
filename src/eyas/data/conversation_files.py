"""Conversation files: :func:`read_conversations` reads any chat or prompt file eyas accepts into
:class:`~eyas.data.conversations.Conversation` objects (the formats, their detection and the rules
each record obeys: :mod:`eyas.data.conversations`), and :func:`write_jsonl` writes them back as
OpenAI-style JSON Lines, atomically.

A file is a JSON array or JSON Lines, told apart by its first character (not its extension),
optionally gzipped (``.gz``). Bad records are never dropped silently: each becomes a
:class:`~eyas.data.conversations.Problem` (file, line or index, field, expected, found), skipped and
collected with ``on_error="skip"``, raised as :class:`~eyas.data.conversations.DataFormatError`
with ``on_error="raise"``.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from eyas.data.conversations import (
    FORMAT_KEYS,
    FORMATS,
    META_KEYS,
    Conversation,
    DataFormatError,
    MessageIssue,
    Problem,
    ReadResult,
    detect_format,
    parse_chat,
    parse_prompts,
    record_id,
)
from eyas.io import atomic_write_text

logger = logging.getLogger("eyas.data")

# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------

def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _iter_records(path: Path) -> Iterator[tuple[dict[str, int], Any, str | None]]:
    """Yield ``(location, record, json_error)`` for each record of a JSON array or JSONL file.

    ``location`` is ``{"line": n}`` (JSONL, 1-based) or ``{"index": i}`` (JSON array). A JSONL line
    that does not parse yields ``record=None`` and the decoder's message. A JSON array that does not
    parse as a whole cannot be split into records: that is fatal (DataFormatError), and so is a file
    holding one (pretty-printed) JSON object. JSONL is streamed, so large files are fine.
    """
    with _open_text(path) as f:
        first = f.read(1)
        while first and first.isspace():
            first = f.read(1)
        f.seek(0)
        if first == "[":
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DataFormatError(Problem(str(path), f"not valid JSON: {e.msg} (column {e.colno})",
                                              line=e.lineno, expected="a JSON array of records or JSON Lines"))
            for i, record in enumerate(data):
                yield {"index": i}, record, None
            return
        seen_record = False
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines are not records
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if not seen_record:
                    _refuse_single_object(path)
                yield {"line": n}, None, f"{e.msg} at column {e.colno}"
            else:
                yield {"line": n}, record, None
            seen_record = True


def _refuse_single_object(path: Path) -> None:
    """The first line is not JSON: if the whole file is one JSON object, say so instead of
    reporting every line of it as a bad record."""
    try:
        with _open_text(path) as f:
            whole = json.load(f)
    except json.JSONDecodeError:
        return
    if isinstance(whole, dict):
        raise DataFormatError(Problem(str(path), "the file is a single JSON object",
                                      expected="a JSON array of records or JSON Lines",
                                      found=f"an object with keys {sorted(whole)[:8]}"))


def _read_one(path: Path, fmt: str, on_error: str, result: ReadResult) -> None:
    detected: str | None = None if fmt == "auto" else fmt
    if detected is not None and detected not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected 'auto' or one of {', '.join(FORMATS)}")

    def report(loc: dict[str, int], issue: MessageIssue) -> None:
        problem = Problem(str(path), issue.message, field=issue.field, expected=issue.expected,
                          found=issue.found, **loc)
        if on_error == "raise":
            raise DataFormatError(problem)
        result.problems.append(problem)

    for loc, record, json_error in _iter_records(path):
        result.num_records += 1
        if json_error is not None:
            report(loc, MessageIssue(None, f"bad JSON: {json_error}", "one JSON object per line"))
            continue
        if not isinstance(record, dict):
            report(loc, MessageIssue(None, "record is not a JSON object", "object", type(record).__name__))
            continue
        if detected is None:
            detected = detect_format(record)
            if detected is None:
                # The first well-formed record decides; if it matches nothing the file is the wrong
                # kind of file altogether (e.g. model answers), which is fatal, not a skip.
                where = f"line {loc['line']}" if "line" in loc else f"index {loc['index']}"
                raise DataFormatError(Problem(
                    str(path), f"cannot detect the format from the first record ({where})",
                    expected="a record with one of the keys " + ", ".join(FORMAT_KEYS.values()),
                    found=f"keys {sorted(record)}", **loc))
            result.formats[str(path)] = detected
        key = FORMAT_KEYS[detected]
        if key not in record:
            report(loc, MessageIssue(key, f"missing field (file format is {detected!r})", f"field {key!r}",
                               f"keys {sorted(record)}"))
            continue

        rid = record_id(record)
        provenance: dict[str, Any] = {"source": str(path), **loc, "format": detected}
        provenance.update({k: record[k] for k in META_KEYS if k in record})
        if detected in ("sharegpt", "openai"):
            messages, issue = parse_chat(record, detected)
            if issue:
                report(loc, issue)
                continue
            if detected == "openai" and "provenance" in record:
                # Our own output: keep the original provenance (where the data came from).
                if not isinstance(record["provenance"], dict):
                    report(loc, MessageIssue("provenance", "not an object", "object",
                                       type(record["provenance"]).__name__))
                    continue
                provenance = dict(record["provenance"])
            result.conversations.append(Conversation(messages, id=rid, provenance=provenance))
        else:
            prompts, issue = parse_prompts(record, detected)
            if issue:
                report(loc, issue)
                continue
            for k, messages in enumerate(prompts):
                cid = rid if len(prompts) == 1 or rid is None else f"{rid}#{k}"
                prov = provenance if len(prompts) == 1 else {**provenance, "instance": k}
                result.conversations.append(Conversation(messages, id=cid, provenance=prov))

    if detected is not None:
        result.formats[str(path)] = detected


def read_conversations(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    format: str = "auto",
    on_error: Literal["skip", "raise"] = "skip",
) -> ReadResult:
    """Read conversations from one file or several (results concatenated, in order).

    Args:
        paths: a ``.json`` / ``.jsonl`` file (optionally ``.gz``), or a list of them.
        format: ``"auto"`` (detect per file from the first well-formed record) or one of
            :data:`FORMATS` to force it.
        on_error: ``"skip"``: a bad record is skipped and reported in ``ReadResult.problems`` (and
            a warning per file is logged); ``"raise"``: the first bad record raises
            :class:`DataFormatError`.

    Raises:
        DataFormatError: always for a file whose format cannot be detected or a JSON array that
            does not parse; for any bad record when ``on_error="raise"``.
    """
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', found {on_error!r}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    result = ReadResult(conversations=[], problems=[], num_records=0, formats={})
    for p in paths:
        path = Path(p)
        before_records, before_problems = result.num_records, len(result.problems)
        _read_one(path, format, on_error, result)
        skipped = result.problems[before_problems:]
        if skipped:
            logger.warning("%s: skipped %d of %d records; first: %s", path, len(skipped),
                           result.num_records - before_records, skipped[0])
        if result.num_records == before_records:
            logger.warning("%s: no records", path)
    return result


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def write_jsonl(conversations: Iterable[Conversation], path: str | os.PathLike) -> int:
    """Write conversations as OpenAI-style JSONL (``{"id", "messages", "provenance"}`` per line).

    Atomic: written to a temporary file in the same directory, fsynced, then ``os.replace``d, so a
    reader never sees a half-written file and a crash leaves any previous file intact.
    Returns the number of conversations written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(conv.to_dict(), ensure_ascii=False) + "\n" for conv in conversations]
    atomic_write_text(path, "".join(lines))
    n = len(lines)
    return n
