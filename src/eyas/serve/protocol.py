"""The OpenAI request bodies ``eyas serve`` accepts, their validation, and the text of a stream.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with these statuses
(the README's table):

    400 invalid_json              the body is not a JSON object
    400 invalid_type / invalid_value   a field of the wrong type or out of range (types are strict:
                                  "0.5" is not a number, 1 is not a bool); ``param`` names the field
    400 empty_messages            ``messages`` is empty (or ``prompt`` is empty)
    400 context_length_exceeded   prompt tokens + max_tokens beyond the target's context
    400 unsupported               n > 1, or a message role other than system/user/assistant
    404 model_not_found           ``model`` is not the served model
    413 body_too_large            the body is larger than --max-body-bytes
    503 shutting_down / queue_full
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP = 4


class APIError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.headers = headers  # extra response headers (Retry-After on a 503)

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, found {len(v)}")
        return v

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]


ROLES = ("system", "user", "assistant")
_TAGS = {"str", "int", "float", "bool"}


def parse(model: type[BaseModel], body: Any) -> Any:
    """``body`` (decoded JSON) as ``model``; the first problem as an :class:`APIError`."""
    if not isinstance(body, dict):
        raise APIError(400, "invalid_json", f"the request body must be a JSON object, found {type(body).__name__}")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # the field's path, without pydantic's union-member tags (``str``, ``list[TextPart]``, ...)
        param = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and (x in _TAGS or "[" in x)))
        kind = err["type"]
        code = "invalid_type" if kind.endswith("_type") or kind in ("missing", "union_tag_invalid") else "invalid_value"
        if kind == "missing":
            msg = f"{param}: required"
        else:
            msg = f"{param}: {err['msg']} (found {err.get('input')!r})"
        raise APIError(400, code, msg, param) from None
    if req.n != 1:
        raise APIError(400, "unsupported", f"n: only 1 choice per request is served, found {req.n}", "n")
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise APIError(400, "empty_messages", "messages: expected at least one message, found none", "messages")
        for i, m in enumerate(req.messages):
            if m.role not in ROLES:
                raise APIError(400, "unsupported", f"messages.{i}.role: expected one of {list(ROLES)}, found {m.role!r}",
                               f"messages.{i}.role")
    if isinstance(req, CompletionRequest):
        p = req.prompt
        if (isinstance(p, list) and len(p) != 1 and (not p or isinstance(p[0], str))) or p == "" or p == [""]:
            raise APIError(400, "empty_messages" if not p or p == [""] else "unsupported",
                           "prompt: expected one non-empty prompt (a string, a list of one string, or token ids)",
                           "prompt")
    return req


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop sequence (excluded, as OpenAI does), and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class TextStream:
    """Token ids in, text pieces out, such that the pieces add up to the final text.

    Decoding is incremental, as TGI and vLLM do it: each push decodes only the tokens since the last
    release plus the few before them (``ids[prefix:]``, against ``ids[prefix:read]``: a SentencePiece
    tokenizer drops a word's leading space at the start of a decode, so the difference of two decodes
    with the same context is the new text), so a push costs O(tokens since the last release), not
    O(tokens so far): decoding everything at every token costs ~55 us a token at 128 tokens and grows
    with the answer, on the thread that also feeds the GPU. It releases the part that can no longer
    change: nothing while the new text ends inside a UTF-8 sequence (a replacement character), and
    never the last len(longest stop) - 1 characters, which could still become the start of a stop
    sequence (the stop sequence itself is never sent). :meth:`finish` releases the rest, cut at the
    first stop sequence. Invariant: ``text`` equals the decode of ``ids[:read]`` (for tokenizers whose
    decode of a sequence is the concatenation of its parts' decodes in context, every byte-level BPE
    and SentencePiece one)."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the decode of ids[:read]
        self.prefix = self.read = 0  # ids[prefix:read]: the context the next decode starts from
        self.sent = 0
        # a fast tokenizer's own decode, without transformers' wrapper (~10 us a call against ~3), where
        # the wrapper would add nothing (no clean-up of spaces)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = backend.decode if backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True) else None

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=True)
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        before = self._decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self._decode(self.ids[self.prefix:])
        if after.endswith("\ufffd") or len(after) < len(before):
            return ""  # inside a UTF-8 sequence: wait for its last byte
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        text, stopped = cut_at_stop(self.text, self.stops)
        safe = len(text) if stopped else len(text) - self.hold
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent:safe], safe
        return out

    def final_text(self) -> str:
        return cut_at_stop(self._decode(self.ids), self.stops)[0]

    def finish(self) -> str:
        text = self.final_text()
        out = text[self.sent:]
        self.sent = len(text)
        return out
