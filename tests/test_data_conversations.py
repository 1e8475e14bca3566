"""eyas.data.conversations: format detection, readers, bad-record reporting, atomic writing."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from eyas.data import Conversation, DataFormatError, read_conversations, write_jsonl
from tests.support import DATA  # excerpts of the public prompt sets, shipped in tests/data

pytestmark = pytest.mark.unit


def _jsonl(path: Path, records: list) -> Path:
    """Write records one per line; a str record is written verbatim (to make bad lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def _roles(conv: Conversation) -> list[str]:
    return [m["role"] for m in conv.messages]


# ---------------------------------------------------------------------------------------------
# Each format, tiny inline files
# ---------------------------------------------------------------------------------------------

def test_sharegpt_json_array(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                      {"from": "user", "value": "More"}, {"from": "chatgpt", "value": "Sure"},
                                      {"from": "Human", "value": "Bing?"}, {"from": "bing", "value": "Yes"}]},
        {"conversations": [{"from": "system", "value": "Be nice."}, {"from": "human", "value": "Q"},
                           {"from": "assistant", "value": "A"}]},
    ]))
    res = read_conversations(path)
    assert res.formats == {str(path): "sharegpt"} and res.counts == {"records": 2, "ok": 2, "skipped": 0}
    a, b = res.conversations
    assert a.id == "a" and _roles(a) == ["user", "assistant"] * 3
    assert a.messages[1] == {"role": "assistant", "content": "Hello"}
    assert b.id is None and _roles(b) == ["system", "user", "assistant"] and b.system == "Be nice."
    assert a.provenance == {"source": str(path), "index": 0, "format": "sharegpt"}
    assert not a.is_prompt


def test_sharegpt_jsonl(tmp_path):
    path = _jsonl(tmp_path / "sg.jsonl", [
        {"id": 1, "conversations": [{"from": "human", "value": "Hi"}]},
        {"id": 2, "conversations": [{"role": "user", "content": "tolerated role/content keys"}]},
    ])
    res = read_conversations(path)
    assert [c.id for c in res] == ["1", "2"] and res.conversations[0].is_prompt
    assert res.conversations[1].provenance["line"] == 2


def test_openai_messages_jsonl(tmp_path):
    path = _jsonl(tmp_path / "oa.jsonl", [
        {"id": "x", "messages": [{"role": "developer", "content": "Sys"}, {"role": "user", "content": "Q"},
                                 {"role": "assistant", "content": [{"type": "text", "text": "A"},
                                                                   {"type": "text", "text": "B"}]}]},
    ])
    (conv,) = read_conversations(path).conversations
    assert conv.messages == [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Q"},
                             {"role": "assistant", "content": "AB"}]


def test_prompt_formats(tmp_path):
    # MT-bench / EAGLE eval: turns of strings; old Arena-Hard: turns of {content}.
    turns = _jsonl(tmp_path / "q.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["First", "Second"], "reference": ["ignored"]},
        {"question_id": 82, "category": "writing", "turns": [{"content": "Arena style"}]},
    ])
    a, b = read_conversations(turns).conversations
    assert a.id == "81" and a.messages == [{"role": "user", "content": "First"}, {"role": "user", "content": "Second"}]
    assert a.is_prompt and a.provenance["category"] == "writing" and a.provenance["format"] == "turns"
    assert b.messages == [{"role": "user", "content": "Arena style"}]

    prompt = _jsonl(tmp_path / "p.jsonl", [{"uid": "u1", "prompt": "Write a melody.", "system": "Be musical."}])
    (c,) = read_conversations(prompt).conversations
    assert c.id == "u1" and c.messages == [{"role": "system", "content": "Be musical."},
                                           {"role": "user", "content": "Write a melody."}]

    question = _jsonl(tmp_path / "gsm.jsonl", [{"question": "2+2?", "answer": "4 (ignored)"}])
    (d,) = read_conversations(question).conversations
    assert d.id is None and d.messages == [{"role": "user", "content": "2+2?"}]
    assert d.provenance == {"source": str(question), "line": 1, "format": "question"}


def test_instruction_formats(tmp_path):
    path = _jsonl(tmp_path / "inst.jsonl", [
        {"instruction": "Translate.", "input": "Bonjour", "output": "ignored"},  # Alpaca
        {"instruction": "Say hi.", "input": ""},
        {"id": "seed_1", "instruction": "Relate.", "instances": [{"input": "Night : Day", "output": "x"}]},
        {"id": "seed_2", "instruction": "Two.", "instances": [{"input": "a"}, {"input": ""}]},
    ])
    res = read_conversations(path)
    texts = [(c.id, c.messages[0]["content"]) for c in res]
    assert texts == [(None, "Translate.\n\nBonjour"), (None, "Say hi."), ("seed_1", "Relate.\n\nNight : Day"),
                     ("seed_2#0", "Two.\n\na"), ("seed_2#1", "Two.")]
    assert res.num_records == 4 and res.num_ok == 5  # a record with two instances is two prompts
    assert res.conversations[4].provenance["instance"] == 1


def test_gzip_and_several_files(tmp_path):
    gz = tmp_path / "h.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():"}) + "\n")
    other = _jsonl(tmp_path / "q.jsonl", [{"question": "Why?"}])
    res = read_conversations([gz, other])
    assert [c.id for c in res] == ["HumanEval/0", None]
    assert res.formats == {str(gz): "prompt", str(other): "question"}
    assert read_conversations(other, format="question").num_ok == 1


# ---------------------------------------------------------------------------------------------
# Bad records: reported with file and line (index for JSON arrays), skipped or fatal
# ---------------------------------------------------------------------------------------------

BAD_LINES = [
    {"id": "ok1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    '{"id": "broken", "conversations": [',                                            # 2 bad JSON
    {"id": "r", "conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "x"}]},  # 3
    {"id": "e", "conversations": [{"from": "human", "value": "  \u200b "}]},           # 4 empty content
    {"id": "m", "conversations": [{"from": "human"}]},                                 # 5 missing value
    {"id": "n", "messages": []},                                                       # 6 other format
    "[1, 2]",                                                                          # 7 not an object
    {"id": "g", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "Hi"}]},  # 8
    {"id": "s", "conversations": [{"from": "system", "value": "Only system"}]},         # 9
    {"id": "s2", "conversations": [{"from": "human", "value": "Hi"}, {"from": "system", "value": "late"}]},  # 10
    {"id": "v", "conversations": [{"from": "human", "value": ["not", "text"]}]},       # 11
    "",                                                                                # 12 blank: no record
    {"id": "ok2", "conversations": [{"from": "human", "value": "Bye"}]},               # 13
]


def test_bad_records_are_skipped_and_reported(tmp_path, caplog):
    path = _jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    with caplog.at_level(logging.WARNING, logger="eyas.data"):
        res = read_conversations(path, on_error="skip")
    assert [c.id for c in res] == ["ok1", "ok2"]
    assert res.counts == {"records": 12, "ok": 2, "skipped": 10}
    by_line = {p.line: p for p in res.problems}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert all(p.path == str(path) and p.index is None for p in res.problems)

    assert "bad JSON" in by_line[2].message
    assert (by_line[3].field, by_line[3].message, by_line[3].found) == (
        "conversations[1].from", "unknown role", "'robot'")
    assert "human" in by_line[3].expected
    assert (by_line[4].field, by_line[4].message) == ("conversations[0].content", "empty content")
    assert (by_line[5].field, by_line[5].expected) == ("conversations[0]", "field 'value'")
    assert by_line[6].field == "conversations" and "sharegpt" in by_line[6].message
    assert "not a JSON object" in by_line[7].message
    assert by_line[8].message == "conversation does not start with a user message" and by_line[8].found == "'assistant'"
    assert by_line[9].message == "no user message"
    assert by_line[10].message == "system message not first" and by_line[10].field == "conversations[1].role"
    assert by_line[11].message == "content is not a string" and by_line[11].found == "list"

    # str(problem) names file:line, field, expected and found.
    assert str(by_line[3]) == (f"{path}:3: conversations[1].from: unknown role "
                               f"(expected one of human|user|gpt|assistant|chatgpt|bing|system, found 'robot')")
    assert "skipped 10 of 12 records" in caplog.text and f"{path}:2" in caplog.text
    assert "10 skipped" in res.summary() and "bad.jsonl (sharegpt)" in res.summary()


def test_bad_record_raises_with_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: bad JSON") as err:
        read_conversations(path, on_error="raise")
    assert err.value.problem.line == 2 and err.value.problem.path == str(path)

    good_then_bad = _jsonl(tmp_path / "b2.jsonl", [BAD_LINES[0], BAD_LINES[2]])
    with pytest.raises(DataFormatError, match=r"b2\.jsonl:2: conversations\[1\]\.from: unknown role"):
        read_conversations(good_then_bad, on_error="raise")
    with pytest.raises(ValueError, match="on_error"):
        read_conversations(path, on_error="ignore")


def test_json_array_problems_use_the_index(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([{"prompt": "ok"}, {"prompt": ""}, {"question": "wrong format"}, {"prompt": 3}]))
    res = read_conversations(path)
    assert res.num_ok == 1 and [p.index for p in res.problems] == [1, 2, 3]
    assert str(res.problems[0]) == f"{path}[1]: prompt: empty content (expected non-blank text, found '')"
    assert res.problems[1].expected == "field 'prompt'" and res.problems[2].message == "not a string"
    with pytest.raises(DataFormatError, match=r"arr\.json\[1\]: prompt: empty content"):
        read_conversations(path, on_error="raise")


def test_fatal_file_errors(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"prompt": "a"},\n  {"prompt": \n]')
    with pytest.raises(DataFormatError, match=r"broken\.json:4: not valid JSON"):
        read_conversations(broken)  # a JSON array cannot be split into records: fatal even when skipping
    unknown = _jsonl(tmp_path / "answers.jsonl", ["not json", {"question_id": 1, "choices": []}])
    with pytest.raises(DataFormatError,
                       match=r"cannot detect the format.*line 2.*found keys \['choices', 'question_id'\]"):
        read_conversations(unknown)
    with pytest.raises(ValueError, match="unknown format"):
        read_conversations(unknown, format="alpaca")
    single = tmp_path / "one.json"
    single.write_text(json.dumps({"data": [{"prompt": "a"}]}, indent=2))
    with pytest.raises(DataFormatError, match=r"one\.json: the file is a single JSON object"):
        read_conversations(single)


def test_first_bad_line_does_not_decide_the_format(tmp_path):
    path = _jsonl(tmp_path / "x.jsonl", ["{oops", {"turns": ["a"]}])
    res = read_conversations(path)
    assert res.formats[str(path)] == "turns" and res.num_ok == 1 and res.problems[0].line == 1


def test_conversation_validates():
    with pytest.raises(ValueError, match=r"messages\[0\]\.role: unknown role"):
        Conversation([{"role": "human", "content": "x"}])
    with pytest.raises(ValueError, match="empty content"):
        Conversation([{"role": "user", "content": ""}])
    with pytest.raises(ValueError, match="no messages"):
        Conversation([])
    with pytest.raises(ValueError, match="must be a list of"):
        Conversation(["user: hi"])
    c = Conversation([{"role": "user", "content": "x", "extra": 1}], id=7)
    assert c.id == "7" and c.messages == [{"role": "user", "content": "x"}] and c.is_prompt


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def test_write_jsonl_roundtrip_and_atomic(tmp_path):
    src = _jsonl(tmp_path / "q.jsonl", [{"question_id": 81, "category": "writing", "turns": ["Héllo ✓", "Again"]},
                                        {"turns": ["2+2?"]}])
    convs = read_conversations(src).conversations
    convs.append(Conversation([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
                              id="answered", provenance={"source": "gen", "model": "smollm2"}))
    out = tmp_path / "sub" / "out.jsonl"
    assert write_jsonl(convs, out) == 3
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert first == {"id": "81", "messages": [{"role": "user", "content": "Héllo ✓"},
                                              {"role": "user", "content": "Again"}],
                     "provenance": {"source": str(src), "line": 1, "format": "turns", "category": "writing"}}
    back = read_conversations(out)
    assert back.formats[str(out)] == "openai"
    # Provenance survives the round trip: it still points at the original file, not at out.jsonl.
    assert [c.to_dict() for c in back] == [c.to_dict() for c in convs]

    # A failure while writing leaves the previous file intact and no temporary file behind.
    def exploding():
        yield convs[0]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_jsonl(exploding(), out)
    assert len(read_conversations(out)) == 3
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]


# ---------------------------------------------------------------------------------------------
# The real files: excerpts of the public prompt sets in tests/data (SOURCE.md there names each
# upstream file; the counts are the excerpts' record counts)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rel, fmt, n", [
    ("mt_bench/question.jsonl", "turns", 4),
    ("eagle_eval/mt_bench_question.jsonl", "turns", 4),
    ("eagle_eval/humaneval_question.jsonl", "turns", 4),
    ("eagle_eval/gsm8k_question.jsonl", "turns", 4),
    ("eagle_eval/alpaca_question.jsonl", "turns", 4),
    ("eagle_eval/sum_question.jsonl", "turns", 2),
    ("eagle_eval/qa_question.jsonl", "turns", 4),
    ("arena_hard/v0.1_question.jsonl", "prompt", 4),
    ("gsm8k/train.jsonl", "question", 96),
    ("gsm8k/test.jsonl", "question", 4),
    ("self_instruct/seed_tasks.jsonl", "instruction", 4),
    ("self_instruct/user_oriented_instructions.jsonl", "instruction", 4),
    ("alpaca_eval/instructions.jsonl", "instruction", 4),
    ("humaneval/HumanEval.jsonl.gz", "prompt", 3),
    ("sharegpt_prompts/ShareGPT_V3_filtered_500.json", "sharegpt", 5),
    ("sharegpt_prompts/ShareGPT_V3_filtered_1000.json", "sharegpt", 5),
    ("fastchat_dummy/dummy_conversation.json", "sharegpt", 6),
])
def test_real_files(rel, fmt, n):
    res = read_conversations(DATA / rel, on_error="raise")
    assert res.formats[str(DATA / rel)] == fmt
    assert res.num_records == n and res.num_ok == n and not res.problems


def test_real_file_shapes():
    mt = read_conversations(DATA / "mt_bench/question.jsonl").conversations
    assert all(_roles(c) == ["user", "user"] and c.is_prompt for c in mt)
    assert mt[0].id == "81" and mt[0].provenance["category"] == "writing"
    seed = read_conversations(DATA / "self_instruct/seed_tasks.jsonl").conversations
    assert seed[1].messages[0]["content"] == (
        "What is the relation between the given pairs?\n\nNight : Day :: Right : Left")
    dummy = read_conversations(DATA / "fastchat_dummy/dummy_conversation.json").conversations
    assert all(_roles(c) == ["user", "assistant"] * (len(c.messages) // 2) for c in dummy)
    assert {len(c.messages) for c in dummy} == {2, 4, 6}


def test_real_sharegpt_file_with_bad_records():
    """The 2,978-prompt ShareGPT sample holds 21 unusable records; each one is reported. The excerpt
    keeps all 21 and five usable neighbours (upstream index 1015 is excerpt index 1, 2976 is 24,
    2977 is 25: tests/data/SOURCE.md)."""
    path = DATA / "sharegpt_prompts/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json"
    res = read_conversations(path)
    assert res.counts == {"records": 26, "ok": 5, "skipped": 21}
    by_index = {p.index: p for p in res.problems}
    assert by_index[25].message == "empty content" and by_index[25].field == "conversations[0].content"
    assert by_index[24].found == "'\\u200b'"  # a zero-width space is empty too
    assert by_index[1].message == "conversation does not start with a user message"
    assert sum(p.message == "no user message" for p in res.problems) == 16  # "shared from TypingMind" stubs
    with pytest.raises(DataFormatError, match=r"\[1\]: conversations: conversation does not start"):
        read_conversations(path, on_error="raise")


def test_real_answer_file_is_not_a_prompt_file():
    with pytest.raises(DataFormatError, match="cannot detect the format"):
        read_conversations(DATA / "mt_bench/reference_answer_gpt-4.jsonl")
