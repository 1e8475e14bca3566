"""eyas.data.regenerate: the target answers prompts turn by turn; the output JSONL survives a crash
(resume gives the same bytes as an uninterrupted run, no duplicates, no loss).

The target is the tiny offline chat target of tests/support/chat.py."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from eyas.data.conversations import Conversation, read_conversations
from eyas.data.regenerate import (
    RegenerateError,
    RegenerateOptions,
    conversation_id,
    read_resumable_jsonl,
    regenerate,
)
from tests.support.chat import chat_target, chat_tokenizer

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.unit]


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def target(tok):
    return chat_target(tok)


def prompts(n: int = 7) -> list[Conversation]:
    """n prompts: conversation 0 has two user turns (MT-bench style), 1 carries assistant turns
    from elsewhere (ShareGPT style: they are dropped and rewritten), 2 has a system message."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"question {i}: " + "why " * (i % 4)}]
        if i == 0:
            msgs.append({"role": "user", "content": "and then?"})
        if i == 1:
            msgs += [{"role": "assistant", "content": "someone else's answer"},
                     {"role": "user", "content": "more"}]
        if i == 2:
            msgs.insert(0, {"role": "system", "content": "You are terse."})
        out.append(Conversation(msgs, id=f"p{i}", provenance={"source": "prompts.jsonl", "line": i + 1}))
    return out


KW = dict(max_new_tokens=6, batch_size=3, progress=False)


def opts(out, **kw) -> RegenerateOptions:
    """The tests' options: KW, then ``kw``."""
    return RegenerateOptions(out_path=out, **(KW | kw))


def lines(path) -> list[dict]:
    return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines()]


def test_regenerate_writes_every_conversation_turn_by_turn(tmp_path, tok, target):
    out = tmp_path / "answers.jsonl"
    s = regenerate(target, tok, prompts(), opts(out), source="tiny")
    recs = lines(out)
    assert [r["id"] for r in recs] == [f"p{i}" for i in range(7)]
    assert (s.total, s.written, s.skipped, s.failed) == (7, 7, 0, 0)
    roles = [[m["role"] for m in r["messages"]] for r in recs]
    assert roles[0] == ["user", "assistant", "user", "assistant"]  # both MT-bench turns answered
    assert roles[1] == ["user", "assistant", "user", "assistant"]
    assert recs[1]["messages"][1]["content"] != "someone else's answer"  # the target's own answer
    assert roles[2] == ["system", "user", "assistant"] and recs[2]["messages"][0]["content"] == "You are terse."
    assert all(r == ["user", "assistant"] for r in roles[3:])
    for r in recs:
        p = r["provenance"]
        assert p["source"] == "prompts.jsonl" and p["line"] == int(r["id"][1:]) + 1
        assert p["target"] == "tiny" and len(p["target_fingerprint"]) == 16
        assert p["generation"]["do_sample"] is False and p["generation"]["max_new_tokens"] == 6
        assert len(p["finish_reasons"]) == len(p["new_tokens"]) == roles[recs.index(r)].count("assistant")
        assert set(p["finish_reasons"]) <= {"eos", "length"}
        assert all(1 <= n <= 6 for n in p["new_tokens"])
    assert s.new_tokens == sum(sum(r["provenance"]["new_tokens"]) for r in recs)
    assert sum(s.finish.values()) == 9
    # The output reads back as conversations (openai format) with their provenance.
    back = read_conversations(out, on_error="raise")
    assert len(back) == 7 and back.conversations[0].provenance["target"] == "tiny"


def test_greedy_is_the_targets_own_argmax(tmp_path, tok, target):
    """The answer to a single prompt equals a plain greedy loop over the target's logits."""
    from eyas.data.render import render_prompt

    conv = prompts(4)[3]
    regenerate(target, tok, [conv], RegenerateOptions(out_path=tmp_path / "a.jsonl", max_new_tokens=5, batch_size=1,
                                                      progress=False))
    rec = lines(tmp_path / "a.jsonl")[0]
    ids = render_prompt(conv, tok)[None]
    new = []
    with torch.no_grad():
        for _ in range(rec["provenance"]["new_tokens"][0]):
            nxt = int(target(ids).logits[0, -1].argmax())
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    if rec["provenance"]["finish_reasons"][0] == "eos":
        assert new[-1] == tok.eos_token_id
        new = new[:-1]
    assert rec["messages"][-1]["content"] == tok.decode(new, skip_special_tokens=True)


class Crash(RuntimeError):
    pass


def _crash_after(k: int):
    def hook(chunk_index, _records):
        if chunk_index == k:
            raise Crash(f"simulated crash after chunk {k}")
    return hook


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resume_after_crash_is_byte_identical(tmp_path, tok, target, temperature):
    kw = dict(temperature=temperature, seed=3)
    ref = tmp_path / "ref.jsonl"
    regenerate(target, tok, prompts(), opts(ref, **kw))

    out = tmp_path / "out.jsonl"
    with pytest.raises(Crash):
        regenerate(target, tok, prompts(), opts(out, **kw), on_chunk_written=_crash_after(0))
    assert len(lines(out)) == 3
    with out.open("a") as f:  # the crash also tore the first line of the next chunk
        f.write('{"id": "p3", "messages": [{"role": "us')
    s = regenerate(target, tok, prompts(), opts(out, **kw))
    assert (s.skipped, s.written) == (3, 4)
    assert out.read_bytes() == ref.read_bytes()

    # A second rerun has nothing left to do.
    s = regenerate(target, tok, prompts(), opts(out, **kw))
    assert (s.skipped, s.written, s.new_tokens) == (7, 0, 0)
    assert out.read_bytes() == ref.read_bytes()


def test_resume_of_a_partly_written_chunk_keeps_order_and_adds_no_duplicates(tmp_path, tok, target):
    ref = tmp_path / "ref.jsonl"
    regenerate(target, tok, prompts(), opts(ref))
    out = tmp_path / "out.jsonl"
    text = ref.read_text().splitlines(keepends=True)
    # Chunk 1 = p3, p4, p5: only p3 made it to disk, p4 is torn.
    out.write_text("".join(text[:4]) + text[4][: len(text[4]) // 2])
    s = regenerate(target, tok, prompts(), opts(out))
    assert s.written == 3 and s.skipped == 4
    assert out.read_bytes() == ref.read_bytes()
    ids = [r["id"] for r in lines(out)]
    assert len(ids) == len(set(ids)) == 7


def test_sampling_depends_on_the_seed(tmp_path, tok, target):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    regenerate(target, tok, prompts(3), opts(a, temperature=1.0, seed=1))
    regenerate(target, tok, prompts(3), opts(b, temperature=1.0, seed=2))
    ca = [r["messages"][-1]["content"] for r in lines(a)]
    cb = [r["messages"][-1]["content"] for r in lines(b)]
    assert ca != cb


def test_resume_with_other_parameters_is_refused(tmp_path, tok, target):
    out = tmp_path / "out.jsonl"
    regenerate(target, tok, prompts(3), opts(out))
    with pytest.raises(RegenerateError, match=r"max_new_tokens: file has 6, now 9"):
        regenerate(target, tok, prompts(3), opts(out, max_new_tokens=9))


def test_options_name_field_expected_and_found_and_greedy_ignores_sampling_knobs(tmp_path):
    with pytest.raises(RegenerateError, match=r"batch_size: expected greater than 0, found 0"):
        RegenerateOptions(out_path=tmp_path / "o.jsonl", batch_size=0)
    with pytest.raises(RegenerateError, match=r"max_new_tokens: expected a valid integer.*, found 'many'"):
        RegenerateOptions(out_path=tmp_path / "o.jsonl", max_new_tokens="many")
    greedy = RegenerateOptions(out_path=tmp_path / "o.jsonl", top_p=0.5, seed=4).generation()
    assert greedy.model_dump() == {"do_sample": False, "temperature": 0.0, "top_p": 1.0, "seed": None,
                                   "max_new_tokens": 1024, "batch_size": 64, "system_prompt": "template_default",
                                   "max_prompt_tokens": None, "max_turns": None}


def test_corrupt_line_inside_the_file_names_file_and_line(tmp_path, tok, target):
    out = tmp_path / "out.jsonl"
    regenerate(target, tok, prompts(3), opts(out))
    text = out.read_text().splitlines(keepends=True)
    out.write_text(text[0] + "{not json\n" + "".join(text[1:]))
    with pytest.raises(RegenerateError, match=rf"{out}:2: not valid JSON"):
        regenerate(target, tok, prompts(3), opts(out))


def test_torn_tail_is_truncated_on_read(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "mess')
    assert [r["id"] for r in read_resumable_jsonl(p)] == ["a", "b"]
    assert p.read_text() == '{"id": "a"}\n{"id": "b"}\n'


def test_limit_duplicates_and_ids_from_provenance(tmp_path, tok, target):
    convs = prompts(5)
    convs.insert(2, Conversation([{"role": "user", "content": "dup"}], id="p0"))
    anon = Conversation([{"role": "user", "content": "no id"}], provenance={"source": "/x/train.jsonl", "line": 9})
    assert conversation_id(anon, 0) == "train.jsonl:9"
    s = regenerate(target, tok, convs + [anon], opts(tmp_path / "o.jsonl", limit=4))
    assert s.duplicates == 1 and s.total == 4
    assert [r["id"] for r in lines(tmp_path / "o.jsonl")] == ["p0", "p1", "p2", "p3"]


def test_unusable_conversations_go_to_the_sidecar_and_are_not_retried(tmp_path, tok, target, monkeypatch):
    import eyas.data.regenerate as rg

    real = rg._generate_batch

    def empty_for_p4(model, tokenizer, prompt_ids, gen_config, eos_ids):
        res = real(model, tokenizer, prompt_ids, gen_config, eos_ids)
        return [([], "eos") if "question 4" in tokenizer.decode(p) else r for p, r in zip(prompt_ids, res)]

    monkeypatch.setattr(rg, "_generate_batch", empty_for_p4)
    convs = prompts(6)
    convs.append(Conversation([{"role": "user", "content": "x" * 400}], id="long"))
    out = tmp_path / "o.jsonl"
    s = regenerate(target, tok, convs, opts(out, max_prompt_tokens=200))
    assert (s.written, s.failed) == (5, 2)
    side = lines(out.with_name("o.jsonl.skipped.jsonl"))
    assert {r["id"] for r in side} == {"p4", "long"}
    assert any("empty answer" in r["reason"] for r in side) and any("max_prompt_tokens" in r["reason"] for r in side)
    before = out.read_bytes()
    s = regenerate(target, tok, convs, opts(out, max_prompt_tokens=200))
    assert (s.written, s.failed, s.skipped) == (0, 0, 7)
    assert out.read_bytes() == before
