"""eyas.serve.protocol on its own: request validation (status, code, the field named) and the
streamed text (pieces that add up to the final text, stop sequences never sent, no half characters)."""

from __future__ import annotations

import pytest

from eyas.serve.protocol import APIError, ChatRequest, CompletionRequest, TextStream, cut_at_stop, parse

pytestmark = pytest.mark.unit


class Pieces:
    """A tokenizer whose token i decodes to PIECES[i] (bytes joined, invalid UTF-8 replaced)."""

    PIECES = [b"Hel", b"lo", b" wo", b"rld", b"\xe2\x82", b"\xac", b"!", b"<eos>"]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        data = b"".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 7))
        return data.decode("utf-8", errors="replace")


def stream(ids: list[int], stops: list[str]) -> tuple[list[str], str]:
    s = TextStream(Pieces(), stops)
    pieces = [s.push([i]) for i in ids]
    pieces.append(s.finish())
    return pieces, s.final_text()


def test_pieces_add_up_to_the_final_text_and_never_split_a_character():
    pieces, final = stream([0, 1, 2, 3, 4, 5, 6, 7], [])
    assert "".join(pieces) == final == "Hello world€!"
    assert pieces[4] == "" and pieces[5] == "€"  # the euro sign waits for its last byte


class Words(Pieces):
    """A SentencePiece-like tokenizer: token i is a word with its leading space, which a decode drops
    at its start; it counts the tokens it decodes."""

    PIECES = [b" the", b" rain", b" in", b" Spain", b" \xe2\x82", b"\xac", b"."]

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens).removeprefix(" ")


def test_incremental_decoding_keeps_spaces_and_decodes_a_bounded_window():
    tok = Words()
    ids = [0, 1, 2, 3, 4, 5, 6] * 30
    s = TextStream(tok, [])
    pieces = [s.push([i]) for i in ids]
    # each push decodes the tokens since the last release and the ones before them (at most 3 here,
    # twice), never all so far (~n^2 / 2 = 22,000 tokens)
    assert tok.decoded <= 6 * len(ids)
    pieces.append(s.finish())
    assert "".join(pieces) == s.final_text() == tok.decode(ids)
    assert pieces[1] == " rain"  # the space a decode of "rain" alone would drop


def test_a_stop_sequence_is_cut_and_never_sent_even_across_tokens():
    pieces, final = stream([0, 1, 2, 3, 6], ["lo w"])
    assert final == "Hel" and "".join(pieces) == "Hel"
    assert all("lo" not in p for p in pieces)
    assert cut_at_stop("abcabc", ["c", "b"]) == ("a", True) and cut_at_stop("abc", ["x"]) == ("abc", False)


def test_validation_names_the_field_and_the_code():
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = parse(ChatRequest, ok)
    assert req.temperature == 1.0 and req.stops() == [] and req.max_tokens is None
    assert parse(ChatRequest, {**ok, "stop": "x", "temperature": 0}).stops() == ["x"]  # an int is a number
    cases = [
        ({**ok, "temperature": "0.5"}, "invalid_type", "temperature"),
        ({**ok, "temperature": 3}, "invalid_value", "temperature"),
        ({**ok, "stop": ["a"] * 5}, "invalid_value", "stop"),
        ({**ok, "messages": []}, "empty_messages", "messages"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]}, "invalid_type",
         "messages.0.content"),
        ({**ok, "n": 3}, "unsupported", "n"),
    ]
    for body, code, param in cases:
        with pytest.raises(APIError) as e:
            parse(ChatRequest, body)
        assert (e.value.status, e.value.code, e.value.param) == (400, code, param), (body, e.value.body())
    with pytest.raises(APIError, match="JSON object"):
        parse(ChatRequest, [ok])
    parts = parse(ChatRequest, {**ok, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}]})
    assert parts.messages[0].text() == "ab"
    assert parse(CompletionRequest, {"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"]})
    assert e.value.code == "unsupported"
