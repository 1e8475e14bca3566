"""Prompt sets for benchmarks: the EAGLE papers' six evaluation sets by name, or any file."""

from __future__ import annotations

from pathlib import Path

from eyas.data.conversations import Conversation
from eyas.data.conversation_files import read_conversations

DATA = Path(__file__).parent / "data"
# The six sets of the EAGLE papers (80 prompts each), shipped with eyas; see data/SOURCE.md.
NAMED_SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")


def set_path(name_or_file: str) -> Path:
    if name_or_file in NAMED_SETS:
        return DATA / f"{name_or_file}.jsonl"
    p = Path(name_or_file)
    if not p.exists():
        raise FileNotFoundError(
            f"--prompts {name_or_file!r}: expected one of {', '.join(NAMED_SETS)} or a prompt file; no such file"
        )
    return p


def load_prompts(name_or_file: str, limit: int | None = None) -> list[Conversation]:
    """The first user turn of each record, as a one-message conversation.

    Multi-turn sets (MT-bench) are benchmarked on their first turn: the second turn would depend on
    each method's own first answer, which differs under sampling.
    """
    convs = read_conversations(set_path(name_or_file), on_error="raise").conversations
    out = []
    for c in convs:
        first = next(m for m in c.messages if m["role"] == "user")
        system = [m for m in c.messages[:1] if m["role"] == "system"]
        out.append(Conversation(system + [first], id=c.id))
        if limit is not None and len(out) >= limit:
            break
    return out
