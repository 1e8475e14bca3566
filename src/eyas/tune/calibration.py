"""The calibration prompts of ``--tree auto``: shipped with eyas, drawn from training prompt sets.

``data/calibration.jsonl`` holds 50 user prompts, 10 from each of five training sets (GSM8K train,
Self-Instruct seed tasks, Arena-Hard v0.1, GPTeacher code and role-play; ``data/SOURCE.md`` gives
each source's repository, commit and licence, and how they were picked), interleaved so that every
prefix of the file draws on every set. None comes from an evaluation set: a tree tuned on them and
benchmarked on the EAGLE sets is measured on prompts it never saw.

The calibration decodes these prompts until it has measured :data:`CALIBRATION_POSITIONS` round
positions (``eyas.tune.acceptance.measure_acceptance``'s ``positions``): about 20 prompts of
:data:`~eyas.tune.acceptance.CALIBRATION_TOKENS` tokens, from all five sets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas.data.conversations import Conversation
from eyas.data.conversation_files import read_conversations

CALIBRATION_FILE = Path(__file__).parent / "data" / "calibration.jsonl"
CALIBRATION_POSITIONS = 2000  # round positions a default calibration measures, per temperature


def calibration_conversations(limit: int | None = None) -> list[Conversation]:
    """The shipped calibration prompts, in file order (interleaved across their sets), each a
    one-message conversation; the first ``limit`` when given."""
    convs = read_conversations(CALIBRATION_FILE, on_error="raise").conversations
    return convs[:limit] if limit is not None else convs


def calibration_sets(conversations: list[Conversation]) -> list[str]:
    """The training set each conversation was drawn from (``provenance["set"]``), in order, once each."""
    return list(dict.fromkeys(str(c.provenance.get("set", "?")) for c in conversations))


def calibration_prompts(tokenizer: Any, limit: int | None = None) -> list[list[int]]:
    """The shipped calibration prompts rendered with ``tokenizer``'s chat template, as ``eyas bench``
    renders its prompts: target token ids, one list per prompt."""
    from eyas.data.render import render_prompt

    return [render_prompt(c, tokenizer).tolist() for c in calibration_conversations(limit)]
