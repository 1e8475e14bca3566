"""Render a conversation with the target's own chat template and mark the assistant tokens.

The sequence a drafter trains on must be the sequence the target sees at serving time, so the text
always comes from ``tokenizer.apply_chat_template`` (never from hand-written template strings) and
the ids from tokenising that text without extra special tokens (exactly what
``apply_chat_template(tokenize=True)`` and the serving engines do).

How the assistant mask is found (generic, no template strings):

1. ``full = render(messages)``.
2. For each assistant message i:
   - ``prompt_i = render(messages[:i], add_generation_prompt=True)``: the text the target is given
     when it writes turn i. It must be a prefix of ``full``; the turn starts at ``len(prompt_i)``.
     So the role header (``<|im_start|>assistant\\n``, ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``)
     is never in the mask: the target does not generate it.
   - ``turn_i = render(messages[:i+1])``: if it is a prefix of ``full``, the turn ends at
     ``len(turn_i.rstrip())``. The turn is therefore content + end-of-turn token(s)
     (``<|im_end|>``, ``<|eot_id|>``): exactly what the target generates before it stops.
     **Trailing whitespace the template puts after the end-of-turn token (the ``\\n`` after
     ``<|im_end|>`` in ChatML) is NOT part of the turn (mask 0)**: the target never generates it, the
     server appends it when it re-renders the history (same choice as SpecForge).
   - Some templates render the *last* message differently from history (Qwen3 adds an empty
     ``<think>`` block to the last assistant turn), so ``turn_i`` is not a prefix of ``full``. Then
     the turn's closing text is learned from ``turn_i`` (whatever follows the content there, e.g.
     ``<|im_end|>``) and ``content + closing`` is located in ``full`` after ``len(prompt_i)``; it
     must end before the next message's text, or the template rewrote the history (refused).
   Anything else (a prompt that is not a prefix, overlapping turns, empty turns) raises
   :class:`TemplateAlignmentError`, naming the turn and showing where the texts diverge.
3. ``full`` is cut at the turn boundaries into pieces, each piece is tokenised separately and the
   concatenation must equal the tokenisation of ``full``: then every boundary is a token boundary
   and the mask is exact. If it is not equal (SentencePiece tokenisers that prepend a space to
   every call), a fast tokeniser's character offsets of the full tokenisation are used instead, and
   a token that straddles a turn boundary raises. The ids are always those of ``full``.

System prompt modes (``system_prompt=``):

- ``"template_default"``: the conversation's own system message if it has one, otherwise whatever
  the template does without one (SmolLM2 and Qwen2.5 insert their default system prompt, Llama-3
  inserts nothing, Llama-3.1 inserts its date header).
- ``"none"``: no system prompt. The conversation's system message is dropped. If the template
  injects a default system prompt when none is given (detected by probing, see
  :func:`template_default_system_prompt`), an *empty* system message is passed, which for ChatML
  renders ``<|im_start|>system\\n<|im_end|>\\n``: there is no way to render SmolLM2's template with
  no system block at all. Fixed template text (Llama-3.1's date header) stays.
- any other string: used as the system message, replacing the conversation's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch

from .conversations import Conversation
from eyas.errors import EyasError

TEMPLATE_DEFAULT = "template_default"
NO_SYSTEM_PROMPT = "none"


class TemplateAlignmentError(EyasError, ValueError):
    """The chat template's renderings of prefixes do not line up with the full rendering, so the
    assistant mask cannot be computed safely."""


@dataclass
class RenderedSample:
    """One tokenised conversation.

    input_ids:  LongTensor[T], the tokenisation of the chat-template text (truncated to max_length).
    loss_mask:  LongTensor[T], 1 where the token belongs to an assistant turn (content and
                end-of-turn token), 0 elsewhere (system/user turns, role headers, separators).
    assistant_spans: token ranges [start, end) of the assistant turns, after truncation.
    truncated:  True when max_length cut the sequence.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    assistant_spans: list[tuple[int, int]] = field(default_factory=list)
    truncated: bool = False
    id: str | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])

    @property
    def num_assistant_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class TrainingSample:
    """Inputs and targets aligned for next-token training (see :func:`shift_for_training`).

    input_ids:  LongTensor[..., T]  token t, unchanged.
    target_ids: LongTensor[..., T]  target_ids[..., t] = input_ids[..., t + offset]; pad_id in the
                                    last `offset` positions.
    loss_mask:  LongTensor[..., T]  loss_mask[..., t] = rendered loss_mask[..., t + offset]; 0 in the
                                    last `offset` positions.
    """

    input_ids: torch.Tensor
    target_ids: torch.Tensor
    loss_mask: torch.Tensor


def system_prompt_mode(system_prompt: str) -> str:
    """The contract's name for a ``system_prompt`` argument: template_default | none | custom."""
    if system_prompt in (TEMPLATE_DEFAULT, NO_SYSTEM_PROMPT):
        return system_prompt
    return "custom"


# ---------------------------------------------------------------------------------------------
# Template rendering
# ---------------------------------------------------------------------------------------------

class _Renderer:
    """apply_chat_template to text, with one template and one set of template kwargs."""

    def __init__(self, tokenizer: Any, chat_template: str | None, template_kwargs: Mapping[str, Any] | None):
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat_template; pass chat_template= "
                             "(eyas renders with the target's own template and never guesses one)")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.kwargs = dict(template_kwargs or {})

    def __call__(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template, **self.kwargs)
        if not isinstance(text, str):  # some versions wrap a single rendering in a list
            text = text[0]
        return text


_PROBE_USER = "eyasProbeUserTurn7f3a"
_PROBE_SYSTEM = "eyasProbeSystemTurn7f3a"


def _default_system_prompt(render: _Renderer) -> str | None:
    """Probe a template for the system prompt it injects when the conversation has none.

    Render [user P] and [system S, user P] with sentinels. Around S, the second rendering is
    ``A + S + B + ...P``; if the first rendering's text before P has the form ``A + X + B`` with a
    non-empty X, the template injects X by default. A template that renders no system block
    without a system message (Llama-3) or a fixed block (Llama-3.1's dates, X empty) injects nothing.
    A template that rejects system messages (Gemma) injects nothing.
    """
    try:
        bare = render([{"role": "user", "content": _PROBE_USER}])
        with_sys = render([{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": _PROBE_USER}])
    except Exception:  # noqa: BLE001 - jinja raise_exception() in templates without a system role
        return None
    pre0, pre1 = bare.split(_PROBE_USER)[0], with_sys.split(_PROBE_USER)[0]
    if _PROBE_SYSTEM not in pre1:
        return None
    a, b = pre1.split(_PROBE_SYSTEM, 1)
    if len(pre0) > len(a) + len(b) and pre0.startswith(a) and pre0.endswith(b):
        return pre0[len(a): len(pre0) - len(b)]
    return None


def template_default_system_prompt(tokenizer: Any, chat_template: str | None = None,
                                   template_kwargs: Mapping[str, Any] | None = None) -> str | None:
    """The system prompt the chat template inserts when a conversation has none (SmolLM2: "You are
    a helpful AI assistant named SmolLM, trained by Hugging Face"), or None if it inserts none."""
    return _default_system_prompt(_Renderer(tokenizer, chat_template, template_kwargs))


def _with_system_prompt(messages: list[dict[str, str]], system_prompt: str, render: _Renderer) -> list[dict[str, str]]:
    if not isinstance(system_prompt, str):
        raise TypeError(f"system_prompt must be a string ('{TEMPLATE_DEFAULT}', '{NO_SYSTEM_PROMPT}' or the "
                        f"prompt text), found {type(system_prompt).__name__}")
    if system_prompt == TEMPLATE_DEFAULT:
        return messages
    rest = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if system_prompt == NO_SYSTEM_PROMPT:
        if _default_system_prompt(render):
            # The only way to keep such a template from injecting its default.
            return [{"role": "system", "content": ""}] + rest
        return rest
    return [{"role": "system", "content": system_prompt}] + rest


def _as_messages(conversation: Conversation | Sequence[Mapping[str, str]]) -> tuple[list[dict[str, str]], str | None]:
    if not isinstance(conversation, Conversation):
        conversation = Conversation(list(conversation))  # validates roles/content
    return [dict(m) for m in conversation.messages], conversation.id


# ---------------------------------------------------------------------------------------------
# Character spans of assistant turns
# ---------------------------------------------------------------------------------------------

def _divergence(expected_prefix: str, full: str, context: int = 40) -> str:
    """Where two renderings first differ, with a little context from each."""
    k = next((j for j, (x, y) in enumerate(zip(expected_prefix, full)) if x != y),
             min(len(expected_prefix), len(full)))
    lo = max(0, k - context)
    return (f"first difference at character {k}: prefix rendering has "
            f"{expected_prefix[lo:k + context]!r}, full rendering has {full[lo:k + context]!r}")


def _assistant_char_spans(messages: list[dict[str, str]], render: _Renderer) -> tuple[str, list[tuple[int, int]]]:
    """(full text, [(start, end) character span of each assistant turn]), see the module docstring."""
    full = render(messages)
    spans: list[tuple[int, int]] = []
    prev_end = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:i], add_generation_prompt=True)
        if not full.startswith(prompt):
            raise TemplateAlignmentError(
                f"assistant turn at message {i}: the generation prompt rendered for messages[:{i}] is not "
                f"a prefix of the full rendering, so the text the target sees when it writes this turn is "
                f"not the text it is trained on; {_divergence(prompt, full)}")
        start = len(prompt)
        if start < prev_end:
            raise TemplateAlignmentError(f"assistant turn at message {i} starts at character {start}, "
                                         f"inside the previous assistant turn (ends at {prev_end})")
        turn = render(messages[: i + 1])
        if full.startswith(turn):
            end = len(turn.rstrip())
        else:
            end = _locate_turn_end(full, turn, start, m["content"], i)
            # The search must not have run into a later message: the next message's text must
            # still come after the end found (guards against content the template dropped or
            # rewrote in the history being "found" in a later turn).
            if i + 1 < len(messages):
                nxt = messages[i + 1]["content"].strip()
                if full.find(nxt, start) < end:
                    raise TemplateAlignmentError(
                        f"assistant turn at message {i}: its content + end-of-turn text was found at "
                        f"characters {start}..{end}, past the start of message {i + 1}; the template "
                        f"renders this turn differently in the history than as the last message")
        if end <= start:
            raise TemplateAlignmentError(f"assistant turn at message {i} renders no text "
                                         f"(characters {start}..{end}); does the template drop assistant content?")
        spans.append((start, end))
        prev_end = end
    return full, spans


def _locate_turn_end(full: str, turn: str, start: int, content: str, i: int) -> int:
    """End of an assistant turn whose as-last rendering differs from its in-history rendering.

    The closing text (end-of-turn token) is what follows the content in the as-last rendering;
    ``content + closing`` is then searched in the full rendering from the turn's start. Templates
    may trim content, so the stripped content is tried too.
    """
    tail = turn.rstrip()
    for cand in dict.fromkeys((content, content.strip())):
        k = tail.rfind(cand)
        if k < 0:
            continue
        closing = tail[k + len(cand):]
        pos = full.find(cand + closing, start)
        if pos >= 0:
            return pos + len(cand) + len(closing)
    raise TemplateAlignmentError(
        f"assistant turn at message {i}: messages[:{i + 1}] rendered on their own are not a prefix of the "
        f"full rendering and the turn's content + end-of-turn text could not be found in it; "
        f"{_divergence(turn, full)}")


# ---------------------------------------------------------------------------------------------
# Token level
# ---------------------------------------------------------------------------------------------

def _encode(tokenizer: Any, text: str) -> list[int]:
    # No BOS/EOS added: the template writes the special tokens it wants into the text.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _token_labels(tokenizer: Any, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(input_ids of ``full``, per-token 0/1 label) given assistant character spans."""
    full_ids = _encode(tokenizer, full)
    cuts = sorted({0, len(full), *(s for s, _ in spans), *(e for _, e in spans)})
    # Spans never overlap and no cut falls inside one, so each assistant span is exactly one piece.
    span_set = set(spans)

    # Piecewise: tokenise each piece on its own; valid iff the pieces add up to the full ids.
    ids: list[int] = []
    labels: list[int] = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        piece = _encode(tokenizer, full[a:b])
        ids += piece
        labels += [1 if (a, b) in span_set else 0] * len(piece)
    if ids == full_ids:
        return full_ids, labels

    k = next((j for j, (x, y) in enumerate(zip(ids, full_ids)) if x != y), min(len(ids), len(full_ids)))
    mismatch = (f"tokenising the turn pieces separately gives {len(ids)} ids, the full text {len(full_ids)}; "
                f"first difference at token {k}: pieces {tokenizer.convert_ids_to_tokens(ids[k:k + 3])} vs "
                f"full {tokenizer.convert_ids_to_tokens(full_ids[k:k + 3])}")
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateAlignmentError(mismatch + "; a slow tokenizer has no offsets to fall back on")

    # Offsets of the full tokenisation: each token must lie entirely inside or outside every span.
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for j, (a, b) in enumerate(enc["offset_mapping"]):
        for cut in cuts:
            if a < cut < b:
                raise TemplateAlignmentError(
                    f"{mismatch}; and token {j} {tokenizer.convert_ids_to_tokens([full_ids[j]])} spans "
                    f"characters {a}..{b} across a turn boundary at {cut} ({full[max(0, cut - 20):cut]!r} | "
                    f"{full[cut:cut + 20]!r}), so it is neither assistant nor prompt")
        labels.append(1 if any(s <= a and (b <= e if b > a else a < e) for s, e in spans) else 0)
    return full_ids, labels


def _spans_from_labels(labels: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for j, x in enumerate(labels + [0]):
        if x and start is None:
            start = j
        elif not x and start is not None:
            spans.append((start, j))
            start = None
    return spans


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def render(
    conversation: Conversation | Sequence[Mapping[str, str]],
    tokenizer: Any,
    max_length: int | None = None,
    system_prompt: str = TEMPLATE_DEFAULT,
    *,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> RenderedSample:
    """Tokenise a conversation with the tokenizer's chat template and mark the assistant tokens.

    Args:
        conversation: a :class:`Conversation` or a list of ``{"role", "content"}`` messages.
        tokenizer: a Hugging Face tokenizer with a chat template.
        max_length: keep the first ``max_length`` tokens (mask truncated with them).
        system_prompt: ``"template_default"``, ``"none"`` or the system prompt text (module docstring).
        chat_template: use this template text instead of ``tokenizer.chat_template``.
        template_kwargs: extra variables for the template (e.g. ``enable_thinking``).

    Returns:
        RenderedSample with input_ids LongTensor[T] and loss_mask LongTensor[T] (1 = assistant
        content and end-of-turn token). A prompt-only conversation has an all-zero mask.

    Raises:
        TemplateAlignmentError: the template's prefix renderings or the tokenisation do not line up.
    """
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, found {max_length}")
    render_text = _Renderer(tokenizer, chat_template, template_kwargs)
    messages, cid = _as_messages(conversation)
    messages = _with_system_prompt(messages, system_prompt, render_text)
    full, char_spans = _assistant_char_spans(messages, render_text)
    ids, labels = _token_labels(tokenizer, full, char_spans)

    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, labels = ids[:max_length], labels[:max_length]
    return RenderedSample(
        input_ids=torch.tensor(ids, dtype=torch.long),
        loss_mask=torch.tensor(labels, dtype=torch.long),
        assistant_spans=_spans_from_labels(labels),
        truncated=truncated,
        id=cid,
    )


def render_prompt(
    conversation: Conversation | Sequence[Mapping[str, str]],
    tokenizer: Any,
    system_prompt: str = TEMPLATE_DEFAULT,
    *,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Token ids (LongTensor[T]) of the conversation plus the generation prompt: what the target is
    given to write the next assistant turn. Same system-prompt handling as :func:`render`, so
    regenerated answers and training samples agree on the prefix."""
    render_text = _Renderer(tokenizer, chat_template, template_kwargs)
    return torch.tensor(_encode(tokenizer, _prompt_text(conversation, system_prompt, render_text)), dtype=torch.long)


def _prompt_text(conversation: Conversation | Sequence[Mapping[str, str]], system_prompt: str,
                 render_text: _Renderer) -> str:
    """The text the target is given to write the next assistant turn (render_prompt's, before tokens)."""
    messages, _ = _as_messages(conversation)
    return render_text(_with_system_prompt(messages, system_prompt, render_text), add_generation_prompt=True)


def render_prompts(
    conversations: Sequence[Conversation | Sequence[Mapping[str, str]]],
    tokenizer: Any,
    system_prompt: str = TEMPLATE_DEFAULT,
    *,
    batch_size: int = 1024,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Iterator[list[list[int]]]:
    """:func:`render_prompt` of every conversation, in order, yielded as lists of token ids in
    batches of ``batch_size`` (the last may be shorter): the same ids, ``render_prompt(c).tolist()``.

    Why batches: the chat template is cheap (~30 us a prompt) but tokenising one long prompt at a
    time is not (~1.7 ms for a 750-token prompt on 2 cores); the tokenizer's batch call encodes on
    every core. A fast tokenizer encodes each text of a batch on its own (no padding, no special
    tokens added), so a batch gives each text the ids it gets alone (``tests/test_data_render.py``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, found {batch_size}")
    render_text = _Renderer(tokenizer, chat_template, template_kwargs)
    for start in range(0, len(conversations), batch_size):
        texts = [_prompt_text(c, system_prompt, render_text) for c in conversations[start:start + batch_size]]
        yield [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


SENTINEL = "\u2063EYAS-USER-CONTENT\u2063"  # invisible separators: no template touches them


def user_header(tokenizer: Any, system_prompt: str = TEMPLATE_DEFAULT) -> list[int]:
    """The token ids a chat template writes before a user message's content: a user turn whose
    content is a sentinel, rendered with the system prompt handling of :func:`render`, cut before
    the sentinel (``eyas prompts`` continues it: :mod:`eyas.data.prompts`). Raises ValueError when
    the template does not echo the content."""
    render = _Renderer(tokenizer, None, None)
    messages = _with_system_prompt([{"role": "user", "content": SENTINEL}], system_prompt, render)
    text = render(messages, add_generation_prompt=False)
    if SENTINEL not in text:
        raise ValueError("chat template: rendering a user turn does not contain its content; "
                         "expected a template that writes the user's text")
    return _encode(tokenizer, text[:text.index(SENTINEL)])


def shift_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, offset: int = 1,
                  pad_id: int = 0) -> TrainingSample:
    """Align targets and loss mask with the positions that predict them, along the last dim.

    Shapes: input_ids, loss_mask LongTensor[..., T] -> TrainingSample of three LongTensor[..., T].

    The drafter at position t has seen tokens <= t and predicts token t + offset, so
    ``target_ids[t] = input_ids[t + offset]`` and ``loss_mask[t] = loss_mask_in[t + offset]``:
    position t is trained iff the token it predicts is an assistant token. The mask moves WITH the
    targets (SpecForge#885: shifting the tokens but not the mask drops the position before the
    first assistant token, which predicts it, and trains the end-of-turn position on whatever follows
    the turn). The last ``offset`` positions have no target: pad_id, mask 0.

    offset=1 is step 0 of training-time test; TTT step k predicts token t + 1 + k: offset = k + 1.
    """
    if offset < 1:
        raise ValueError(f"offset must be >= 1, found {offset}")
    if input_ids.shape != loss_mask.shape:
        raise ValueError(f"input_ids and loss_mask must have the same shape, found "
                         f"{tuple(input_ids.shape)} and {tuple(loss_mask.shape)}")
    target_ids = torch.full_like(input_ids, pad_id)
    shifted_mask = torch.zeros_like(loss_mask)
    if input_ids.shape[-1] > offset:
        target_ids[..., :-offset] = input_ids[..., offset:]
        shifted_mask[..., :-offset] = loss_mask[..., offset:]
    return TrainingSample(input_ids=input_ids, target_ids=target_ids, loss_mask=shifted_mask)


def shift_for_training(sample: RenderedSample, offset: int = 1, pad_id: int = 0) -> TrainingSample:
    """:func:`shift_targets` for a :class:`RenderedSample`: input_ids [T] -> targets/mask [T] where
    position t is supervised with token t+offset iff that token is an assistant token."""
    return shift_targets(sample.input_ids, sample.loss_mask, offset=offset, pad_id=pad_id)
