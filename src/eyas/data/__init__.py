"""Data pipeline, part 1: conversations in, rendered with the target's chat template, with an
assistant-only loss mask at token level.

    from eyas.data import read_conversations, render, shift_for_training
    result = read_conversations("prompts.jsonl")          # ReadResult: conversations + problems
    sample = render(result.conversations[0], tokenizer)   # input_ids [T], loss_mask [T]
    train = shift_for_training(sample)                    # target_ids[t] = input_ids[t+1], mask too
"""

from .conversations import (
    FORMATS,
    Conversation,
    DataFormatError,
    MessageIssue,
    Problem,
    ReadResult,
    check_messages,
)
from .conversation_files import read_conversations, write_jsonl
from .render import (
    NO_SYSTEM_PROMPT,
    TEMPLATE_DEFAULT,
    RenderedSample,
    TemplateAlignmentError,
    TrainingSample,
    render,
    render_prompt,
    render_prompts,
    shift_for_training,
    shift_targets,
    system_prompt_mode,
    template_default_system_prompt,
)
from .render_pool import render_many

__all__ = [
    "FORMATS", "Conversation", "DataFormatError", "MessageIssue", "Problem", "ReadResult", "check_messages",
    "read_conversations", "write_jsonl",
    "NO_SYSTEM_PROMPT", "TEMPLATE_DEFAULT", "RenderedSample", "TemplateAlignmentError", "TrainingSample",
    "render", "render_many", "render_prompt", "render_prompts", "shift_for_training", "shift_targets", "system_prompt_mode",
    "template_default_system_prompt",
]
