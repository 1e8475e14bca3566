"""Conversations in: one in-memory shape for every chat/prompt file eyas reads.

A :class:`Conversation` is a list of ``{"role", "content"}`` messages (roles ``system``, ``user``,
``assistant``), an optional ``id`` and a ``provenance`` dict (source file, line or index, format).

:func:`eyas.data.conversation_files.read_conversations` auto-detects the format of a file from its first usable record:

- ``sharegpt``: ``{"id"?, "conversations": [{"from", "value"}]}`` (ShareGPT, FastChat);
  ``from`` in human/user/gpt/assistant/chatgpt/bing/system, any case;
- ``openai``: ``{"id"?, "messages": [{"role", "content"}], "provenance"?}`` (eyas' own output,
  see :func:`write_jsonl`); content may be a list of text parts;
- ``turns``: ``{"question_id", "turns": [str | {"content": str}]}`` (MT-bench, EAGLE eval sets,
  older Arena-Hard);
- ``prompt``: ``{"uid"|"task_id"?, "prompt": str}`` (Arena-Hard v0.1, HumanEval);
- ``instruction``: ``{"instruction", "input"?}`` (Alpaca) or ``{"instruction", "instances":
  [{"input"}]}`` (Self-Instruct); a non-empty input follows the instruction after a blank line;
- ``question``: ``{"question": str}`` (GSM8K).

Every record of a file must have the detected format's key (a mixed file reports the odd records).

A file is a JSON array or JSON Lines, told apart by its first character (not its extension),
optionally gzipped (``.gz``). Conversations obey :func:`check_messages` (known roles, non-blank
content, a system message only first, a user message before any assistant message).
Prompt formats (every format but sharegpt/openai) become conversations of *user turns only*: the
target answers them later; reference answers in those files are deliberately not read (we train on
the target's own answers, docs/data.md).

Bad records are never dropped silently. Each one becomes a :class:`Problem` naming the file, the
line (JSONL) or array index (JSON), the field, what was expected and what was found. With
``on_error="skip"`` the record is skipped and the problem collected into :class:`ReadResult`
(and one warning per file is logged); with ``on_error="raise"`` the first one raises
:class:`DataFormatError`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from eyas.errors import EyasError

ROLES: tuple[str, ...] = ("system", "user", "assistant")

# ShareGPT speaker names -> roles. Lower-cased before lookup. Anything else is reported, not guessed.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "system": "system",
}
# OpenAI roles. "developer" is OpenAI's newer name for the system message.
OPENAI_ROLES: dict[str, str] = {"system": "system", "developer": "system", "user": "user",
                                "assistant": "assistant"}

FORMATS: tuple[str, ...] = ("sharegpt", "openai", "turns", "prompt", "instruction", "question")
# Format -> the key that identifies it, in detection priority order (a record with both
# "messages" and "prompt" is an openai record).
FORMAT_KEYS: dict[str, str] = {
    "sharegpt": "conversations",
    "openai": "messages",
    "turns": "turns",
    "prompt": "prompt",
    "instruction": "instruction",
    "question": "question",
}
# Fields used as the conversation id, first present wins (question_id: MT-bench/EAGLE eval,
# uid: Arena-Hard, task_id: HumanEval).
_ID_KEYS = ("id", "question_id", "uid", "task_id")
# Record fields copied into provenance (useful for per-category evaluation).
META_KEYS = ("category",)

# Characters that do not make content non-empty: ``str.strip()`` keeps zero-width spaces and the
# BOM, and ShareGPT has messages that consist of nothing else.
_INVISIBLE = "\u200b\u200c\u200d\u2060\ufeff"


def _is_blank(text: str) -> bool:
    return not text.strip().strip(_INVISIBLE).strip()


def _show(value: Any, limit: int = 60) -> str:
    """A short, unambiguous rendering of a found value for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class DataFormatError(EyasError, ValueError):
    """A record or a file that cannot be read as conversations. ``problem`` says where and why."""

    def __init__(self, problem: "Problem | str"):
        self.problem = problem if isinstance(problem, Problem) else None
        super().__init__(str(problem))


@dataclass(frozen=True)
class Problem:
    """One bad record: where it is, which field, what was expected and what was found."""

    path: str
    message: str
    line: int | None = None  # 1-based line in a JSONL file
    index: int | None = None  # 0-based index in a JSON array
    field: str | None = None  # e.g. "conversations[2].from"
    expected: str | None = None
    found: str | None = None

    @property
    def location(self) -> str:
        if self.line is not None:
            return f"line {self.line}"
        if self.index is not None:
            return f"index {self.index}"
        return "file"

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else (
            f"{self.path}[{self.index}]" if self.index is not None else self.path)
        text = f"{where}: {self.field + ': ' if self.field else ''}{self.message}"
        details = [f"expected {self.expected}" if self.expected is not None else None,
                   f"found {self.found}" if self.found is not None else None]
        details = [d for d in details if d]
        return text + (f" ({', '.join(details)})" if details else "")


@dataclass(frozen=True)
class MessageIssue:
    """A problem inside a record, before it is placed in a file (field/expected/found)."""

    field: str | None
    message: str
    expected: str | None = None
    found: str | None = None

    def __str__(self) -> str:
        return str(Problem("", self.message, field=self.field, expected=self.expected,
                           found=self.found)).removeprefix(": ")


def check_messages(messages: Sequence[Mapping[str, Any]], field_name: str = "messages") -> list[MessageIssue]:
    """Structural rules every conversation obeys (normalised roles expected).

    - at least one message; roles in ``system|user|assistant``; content a non-blank string;
    - a system message only first (mid-conversation system messages break many chat templates);
    - the first non-system message is a user message (a conversation that opens with the
      assistant, or has no user message at all, is not a usable prompt; FastChat silently drops
      such leading turns, we report them).
    """
    issues: list[MessageIssue] = []
    if not messages:
        return [MessageIssue(field_name, "no messages", "at least one message", "[]")]
    for i, m in enumerate(messages):
        where = f"{field_name}[{i}]"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            issues.append(MessageIssue(f"{where}.role", "unknown role", "|".join(ROLES), _show(role)))
        if not isinstance(content, str):
            issues.append(MessageIssue(f"{where}.content", "content is not a string", "str",
                                 type(content).__name__))
        elif _is_blank(content):
            issues.append(MessageIssue(f"{where}.content", "empty content", "non-blank text", _show(content)))
        if role == "system" and i > 0:
            issues.append(MessageIssue(f"{where}.role", "system message not first", "system only at index 0",
                                 f"system at index {i}"))
    if issues:
        return issues
    first = next((m for m in messages if m["role"] != "system"), None)
    if first is None:
        issues.append(MessageIssue(field_name, "no user message", "a user message after the system message",
                             "only a system message"))
    elif first["role"] != "user":
        issues.append(MessageIssue(field_name, "conversation does not start with a user message",
                             "first non-system role 'user'", _show(first["role"])))
    return issues


@dataclass
class Conversation:
    """Messages ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` plus id and provenance.

    ``messages`` is stored as plain dicts so it can go straight into ``apply_chat_template``.
    Construction validates (see :func:`check_messages`) and raises ``ValueError`` on bad input.
    """

    messages: list[dict[str, str]]
    id: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in self.messages):
            raise ValueError(f"invalid conversation: messages must be a list of {{role, content}} objects, "
                             f"found {_show(self.messages)}")
        self.messages = [{"role": m.get("role"), "content": m.get("content")} for m in self.messages]
        if self.id is not None:
            self.id = str(self.id)
        issues = check_messages(self.messages)
        if issues:
            raise ValueError("invalid conversation" + (f" {self.id!r}" if self.id else "") + ": "
                             + "; ".join(str(i) for i in issues))

    @property
    def is_prompt(self) -> bool:
        """True when there is no assistant message yet (a prompt waiting for the target's answer)."""
        return not any(m["role"] == "assistant" for m in self.messages)

    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages[0]["role"] == "system" else None

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI ``messages`` shape eyas writes: ``{"id", "messages", "provenance"}``."""
        return {"id": self.id, "messages": [dict(m) for m in self.messages],
                "provenance": dict(self.provenance)}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> "Conversation":
        return cls(messages=list(record["messages"]), id=record.get("id"),
                   provenance=dict(record.get("provenance") or {}))


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


@dataclass
class ReadResult:
    """What a read produced: the good conversations, one :class:`Problem` per skipped record, counts."""

    conversations: list[Conversation]
    problems: list[Problem]
    num_records: int
    formats: dict[str, str]  # path -> detected (or given) format

    @property
    def num_ok(self) -> int:
        return len(self.conversations)

    @property
    def num_skipped(self) -> int:
        return len(self.problems)

    @property
    def counts(self) -> dict[str, int]:
        return {"records": self.num_records, "ok": self.num_ok, "skipped": self.num_skipped}

    def summary(self, max_kinds: int = 5) -> str:
        """One line of counts plus the most frequent kinds of problem."""
        files = ", ".join(f"{Path(p).name} ({f})" for p, f in self.formats.items())
        text = f"{self.num_records} records from {files}: {self.num_ok} conversations, {self.num_skipped} skipped"
        if self.problems:
            kinds = Counter(f"{p.field.split('[')[0] + ': ' if p.field else ''}{p.message}"
                            for p in self.problems)
            text += " (" + "; ".join(f"{n} x {k}" for k, n in kinds.most_common(max_kinds)) + ")"
        return text

    def __len__(self) -> int:
        return len(self.conversations)

    def __iter__(self) -> Iterator[Conversation]:
        return iter(self.conversations)


# ---------------------------------------------------------------------------------------------
# Parsing one record of each format (the files: eyas.data.conversation_files)
# ---------------------------------------------------------------------------------------------

def detect_format(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    for fmt, key in FORMAT_KEYS.items():
        if key in record:
            return fmt
    return None


def record_id(record: Mapping[str, Any]) -> str | None:
    for key in _ID_KEYS:
        if record.get(key) is not None:
            return str(record[key])
    return None


def _text_field(record: Mapping[str, Any], key: str) -> tuple[str | None, MessageIssue | None]:
    """A required non-blank string field."""
    if key not in record:
        return None, MessageIssue(key, "missing field", f"field {key!r}", f"keys {sorted(record)}")
    value = record[key]
    if not isinstance(value, str):
        return None, MessageIssue(key, "not a string", "str", type(value).__name__)
    if _is_blank(value):
        return None, MessageIssue(key, "empty content", "non-blank text", _show(value))
    return value, None


def _content_text(content: Any) -> Any:
    """OpenAI content may be a list of parts; text parts are concatenated, anything else is left
    as is (and then reported as 'not a string' by check_messages)."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return content


def parse_chat(record: Mapping[str, Any], fmt: str) -> tuple[list[dict] | None, MessageIssue | None]:
    """sharegpt / openai records -> normalised messages."""
    key = FORMAT_KEYS[fmt]
    turns = record.get(key)
    if not isinstance(turns, list):
        return None, MessageIssue(key, "not a list of messages", "list", type(turns).__name__)
    role_map = SHAREGPT_ROLES if fmt == "sharegpt" else OPENAI_ROLES
    # ShareGPT uses from/value; tolerate role/content inside "conversations" (some exports do).
    role_keys, content_keys = (("from", "role"), ("value", "content")) if fmt == "sharegpt" else (
        ("role",), ("content",))
    messages = []
    for i, m in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            return None, MessageIssue(where, "message is not an object",
                                      f"{{{role_keys[0]}, {content_keys[0]}}}", type(m).__name__)
        rk = next((k for k in role_keys if k in m), None)
        ck = next((k for k in content_keys if k in m), None)
        if rk is None:
            return None, MessageIssue(where, "missing field", f"field {role_keys[0]!r}", f"keys {sorted(m)}")
        if ck is None:
            return None, MessageIssue(where, "missing field", f"field {content_keys[0]!r}", f"keys {sorted(m)}")
        raw_role = m[rk]
        role = role_map.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            return None, MessageIssue(f"{where}.{rk}", "unknown role", "one of " + "|".join(role_map),
                                _show(raw_role))
        messages.append({"role": role, "content": _content_text(m[ck])})
    issues = check_messages(messages, field_name=key)
    return (None, issues[0]) if issues else (messages, None)


def parse_prompts(record: Mapping[str, Any], fmt: str) -> tuple[list[list[dict]] | None, MessageIssue | None]:
    """Prompt records -> one or more lists of user-only messages.

    Returns a list of message lists because a Self-Instruct record with several ``instances`` is
    several prompts (all records in the bundled files have exactly one).
    """
    system: list[dict] = []
    if isinstance(record.get("system"), str) and not _is_blank(record["system"]):
        system = [{"role": "system", "content": record["system"]}]
    if fmt == "turns":
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            return None, MessageIssue("turns", "not a non-empty list", "list of str or {content}", _show(turns))
        texts = []
        for i, t in enumerate(turns):
            text = t.get("content") if isinstance(t, dict) else t  # Arena-Hard: [{"content": ...}]
            if not isinstance(text, str):
                return None, MessageIssue(f"turns[{i}]", "turn is not text", "str or {\"content\": str}", _show(t))
            if _is_blank(text):
                return None, MessageIssue(f"turns[{i}]", "empty content", "non-blank text", _show(text))
            texts.append(text)
        return [system + [{"role": "user", "content": t} for t in texts]], None
    if fmt in ("prompt", "question"):
        text, issue = _text_field(record, FORMAT_KEYS[fmt])
        return (None, issue) if issue else ([system + [{"role": "user", "content": text}]], None)
    # instruction: Alpaca puts "input" next to "instruction", Self-Instruct inside "instances".
    instruction, issue = _text_field(record, "instruction")
    if issue:
        return None, issue
    if "instances" in record:
        instances = record["instances"]
        if not isinstance(instances, list) or not instances or not all(isinstance(x, dict) for x in instances):
            return None, MessageIssue("instances", "not a non-empty list of objects", "[{\"input\": str}]",
                                _show(instances))
        inputs = [x.get("input", "") for x in instances]
    else:
        inputs = [record.get("input", "")]
    prompts = []
    for i, inp in enumerate(inputs):
        if inp is None:
            inp = ""
        if not isinstance(inp, str):
            where = f"instances[{i}].input" if "instances" in record else "input"
            return None, MessageIssue(where, "not a string", "str", type(inp).__name__)
        # Alpaca's own prompt puts the input after the instruction, separated by a blank line.
        text = instruction if _is_blank(inp) else f"{instruction}\n\n{inp}"
        prompts.append(system + [{"role": "user", "content": text}])
    return prompts, None
