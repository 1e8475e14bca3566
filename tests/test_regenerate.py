"""eyas.data.regenerate: the target answers prompts turn by turn; the output JSONL survives a crash
(resume gives the same bytes as an uninterrupted run, no duplicates, no loss).

The target is the tiny offline chat target of tests/support/chat.py."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from eyas.data.conversations import Conversation
from eyas.data.conversation_files import read_conversations
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
    s = regenerate(target, tok, prompts(), opts(out, sort_by_length=False), source="tiny")
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
    # one generate call per (chunk, turn); each decodes as many steps as its longest answer
    assert s.generate_calls >= 2 and 0 < s.generate_s <= s.wall_s
    assert max(max(r["provenance"]["new_tokens"]) for r in recs) <= s.decode_steps <= 6 * s.generate_calls
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
    """Crash after the (k+1)-th unit written (units are visited in a seeded order of chunks)."""
    written = []

    def hook(chunk_index, _records):
        written.append(chunk_index)
        if len(written) == k + 1:
            raise Crash(f"simulated crash after {k + 1} units (chunks {written})")
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


def test_an_interrupt_stops_after_whole_chunks_reports_what_it_did_and_resumes(tmp_path, tok, target):
    """SIGINT (KeyboardInterrupt) mid-run: the summary says interrupted, with this run's tokens and
    counts; the file holds whole chunks only, and a rerun completes it byte-identically."""
    ref = tmp_path / "ref.jsonl"
    regenerate(target, tok, prompts(), opts(ref))

    def interrupt(chunk_index, records):
        if chunk_index == 0:
            raise KeyboardInterrupt

    out = tmp_path / "out.jsonl"
    s = regenerate(target, tok, prompts(), opts(out), on_chunk_written=interrupt)
    assert s.interrupted and s.written == 3 == len(lines(out)) and s.new_tokens > 0
    s = regenerate(target, tok, prompts(), opts(out))
    assert not s.interrupted and (s.skipped, s.written) == (3, 4)
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
                                   "max_prompt_tokens": None, "max_turns": None, "loops": "cut",
                                   "sort_by_length": True}


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


def test_text_that_str_splitlines_would_break_is_read_back_whole(tmp_path):
    """U+2028, U+2029, U+0085, a form feed and a vertical tab, raw in an answer (ensure_ascii=False
    writes them so): one record each, not a "corrupt" line, and the line numbers of errors count
    b"\n" only."""
    p = tmp_path / "x.jsonl"
    texts = ["a\u2028b", "c\u2029d", "e\x85f", "g\x0ch", "i\x0bj"]
    p.write_text("".join(json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)),
                 encoding="utf-8")
    assert [r["text"] for r in read_resumable_jsonl(p)] == texts
    p.write_text(p.read_text(encoding="utf-8") + "{not json\n", encoding="utf-8")
    with pytest.raises(RegenerateError, match=rf"{p}:6: not valid JSON"):
        read_resumable_jsonl(p)


def test_limit_duplicates_and_ids_from_provenance(tmp_path, tok, target):
    convs = prompts(5)
    convs.insert(2, Conversation([{"role": "user", "content": "dup"}], id="p0"))
    anon = Conversation([{"role": "user", "content": "no id"}], provenance={"source": "/x/train.jsonl", "line": 9})
    assert conversation_id(anon, 0) == "train.jsonl:9"
    s = regenerate(target, tok, convs + [anon], opts(tmp_path / "o.jsonl", limit=4, sort_by_length=False))
    assert s.duplicates == 1 and s.total == 4
    assert [r["id"] for r in lines(tmp_path / "o.jsonl")] == ["p0", "p1", "p2", "p3"]


def test_unusable_conversations_go_to_the_sidecar_and_are_not_retried(tmp_path, tok, target, monkeypatch):
    import eyas.data.hf_generator as hf

    real = hf._generate_batch

    def empty_for_p4(model, tokenizer, prompt_ids, gen_config, eos_ids, static=None):
        res = real(model, tokenizer, prompt_ids, gen_config, eos_ids, static)
        return [([], "eos") if "question 4" in tokenizer.decode(p) else r for p, r in zip(prompt_ids, res)]

    monkeypatch.setattr(hf, "_generate_batch", empty_for_p4)
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


# -- length-sorted chunks ---------------------------------------------------------------------------


def test_chunks_are_cut_from_conversations_sorted_by_first_prompt_length(tmp_path, tok, target, monkeypatch):
    import eyas.data.regenerate as regenerate_module

    from eyas.data.render import render_prompt

    convs = prompts(7)
    out = tmp_path / "o.jsonl"
    regenerate(target, tok, convs, opts(out, loops="keep"))
    first = [render_prompt([m for m in c.messages if m["role"] == "system"][:1] +
                           [next(m for m in c.messages if m["role"] == "user")], tok).numel() for c in convs]
    expected = [f"p{i}" for i in sorted(range(7), key=first.__getitem__)]  # stable: ties keep input order
    assert expected != [f"p{i}" for i in range(7)]
    # chunks are cut from the sorted order; they are visited (and written) in a seeded order, each
    # chunk's lines together and in sorted order
    got = [r["id"] for r in lines(out)]
    B = KW["batch_size"]
    chunks = [expected[i:i + B] for i in range(0, 7, B)]
    assert sorted(got, key=expected.index) == expected
    assert all(got[got.index(c[0]):got.index(c[0]) + len(c)] == c for c in chunks)
    assert all(r["provenance"]["generation"]["sort_by_length"] is True for r in lines(out))
    # The order is a function of the input: a shuffled copy of the same conversations gives the same
    # chunks only up to ties, so the same input gives the same file.
    again = tmp_path / "again.jsonl"
    regenerate(target, tok, prompts(7), opts(again, loops="keep"))
    assert again.read_bytes() == out.read_bytes()
    # The lengths are counted in tokenizer batches: batches of 2 (the last of 1) give the same order.
    monkeypatch.setattr(regenerate_module, "_LENGTH_BATCH", 2)
    batched = tmp_path / "batched.jsonl"
    regenerate(target, tok, prompts(7), opts(batched, loops="keep"))
    assert batched.read_bytes() == out.read_bytes()


# -- repetition loops ----------------------------------------------------------------------------


def _looping(monkeypatch, marker: str):
    """Make the answer to every prompt containing ``marker`` a text followed by a period-3 loop."""
    import eyas.data.hf_generator as hf

    real = hf._generate_batch
    tok = chat_tokenizer()
    text = tok("The answer is ")["input_ids"]
    looped = text + tok("abc")["input_ids"] * 12

    def fake(model, tokenizer, prompt_ids, gen_config, eos_ids, static=None):
        res = real(model, tokenizer, prompt_ids, gen_config, eos_ids, static)
        return [(looped, "length") if marker in tokenizer.decode(p) else r for p, r in zip(prompt_ids, res)]

    monkeypatch.setattr(hf, "_generate_batch", fake)
    return text, looped


def test_loops_cut_keeps_the_first_copy_and_ends_the_conversation(tmp_path, tok, target, monkeypatch):
    text, _ = _looping(monkeypatch, "question 0")  # p0 has two user turns: the second is not answered
    out = tmp_path / "o.jsonl"
    s = regenerate(target, tok, prompts(4), opts(out, max_new_tokens=20))  # < MIN_SPAN: only the fake loops
    recs = {r["id"]: r for r in lines(out)}
    p0 = recs["p0"]
    assert [m["role"] for m in p0["messages"]] == ["user", "assistant"]
    assert p0["messages"][1]["content"] == "The answer is abc"
    assert p0["provenance"]["finish_reasons"] == ["loop"] and p0["provenance"]["new_tokens"] == [len(text) + 3]
    assert "repetition loop" in p0["provenance"]["stopped"]
    assert (s.loops_cut, s.loops_dropped, s.finish["loop"], s.written, s.failed) == (1, 0, 1, 4, 0)
    assert s.new_tokens >= len(text) + 36  # the cut tokens were generated: they count for throughput


def test_loops_drop_sends_the_conversation_to_the_sidecar_and_keep_leaves_it(tmp_path, tok, target, monkeypatch):
    _looping(monkeypatch, "question 3")
    out = tmp_path / "drop.jsonl"
    s = regenerate(target, tok, prompts(4), opts(out, loops="drop", max_new_tokens=20))
    assert "p3" not in {r["id"] for r in lines(out)}
    side = lines(out.with_name("drop.jsonl.skipped.jsonl"))
    assert [r["id"] for r in side] == ["p3"] and "repetition loop" in side[0]["reason"]
    assert (s.loops_cut, s.loops_dropped, s.failed, s.written) == (0, 1, 1, 3)
    keep = tmp_path / "keep.jsonl"
    s = regenerate(target, tok, prompts(4), opts(keep, loops="keep", max_new_tokens=20))
    p3 = next(r for r in lines(keep) if r["id"] == "p3")
    assert p3["messages"][-1]["content"] == "The answer is " + "abc" * 12
    assert p3["provenance"]["finish_reasons"] == ["length"]
    assert (s.loops_cut, s.loops_dropped, s.finish["loop"]) == (0, 0, 0)


def test_a_file_from_before_loops_resumes_only_as_it_was_written(tmp_path, tok, target):
    """Old files have no loops / sort_by_length: they were never cut and kept input order."""
    ref = tmp_path / "ref.jsonl"
    regenerate(target, tok, prompts(), opts(ref, loops="keep", sort_by_length=False))
    old = [json.loads(x) for x in ref.read_text().splitlines()]
    for r in old:
        del r["provenance"]["generation"]["loops"], r["provenance"]["generation"]["sort_by_length"]
    out = tmp_path / "old.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in old[:4]))
    with pytest.raises(RegenerateError, match=r"old.jsonl: .*loops: file has 'keep', now 'cut'.*sort_by_length: "
                                              r"file has False, now True.*--loops keep --no-sort-by-length"):
        regenerate(target, tok, prompts(), opts(out))
    s = regenerate(target, tok, prompts(), opts(out, loops="keep", sort_by_length=False))
    assert (s.skipped, s.written) == (4, 3)
    # A sampled old file cannot be resumed: its ids and seeds follow the old rule.
    for r in old:
        r["provenance"]["generation"].update(do_sample=True, temperature=1.0, seed=0)
    out.write_text("".join(json.dumps(r) + "\n" for r in old[:2]))
    with pytest.raises(RegenerateError, match=r"sampled answer written before eyas recorded loops and sort_by_length"):
        regenerate(target, tok, prompts(), opts(out, temperature=1.0, loops="keep", sort_by_length=False))


# -- several temperatures ------------------------------------------------------------------------------


def test_each_conversation_is_answered_once_per_temperature(tmp_path, tok, target):
    out = tmp_path / "o.jsonl"
    # input order (sort_by_length=False): the check of the unit order below reads chunk 0 first
    s = regenerate(target, tok, prompts(5), opts(out, temperatures=[0, 0.8], seed=1, sort_by_length=False))
    recs = lines(out)
    ids = [r["id"] for r in recs]
    assert sorted(ids) == sorted([f"p{i}" for i in range(5)] + [f"p{i}@t0.8" for i in range(5)])
    assert (s.conversations, s.total, s.written, s.temperatures) == (5, 10, 10, [0.0, 0.8])
    for r in recs:
        g = r["provenance"]["generation"]
        assert (g["temperature"], g["do_sample"]) == ((0.8, True) if "@t" in r["id"] else (0.0, False))
    # Units run chunk by chunk, each chunk once per temperature: p-chunk greedy, then sampled.
    assert ["@t" in i for i in ids[:6]] == [False] * 3 + [True] * 3
    # The greedy answers are those of a greedy-only run.
    greedy = tmp_path / "greedy.jsonl"
    regenerate(target, tok, prompts(5), opts(greedy, sort_by_length=False))
    assert [r for r in recs if "@t" not in r["id"]] == lines(greedy)
    # Another sampling temperature samples with another seed.
    other = tmp_path / "other.jsonl"
    regenerate(target, tok, prompts(5), opts(other, temperatures=[0.8, 1.0], seed=1, sort_by_length=False))
    by_id = {r["id"]: r["messages"] for r in lines(other)}
    assert all(by_id[r["id"]] == r["messages"] for r in recs if r["id"].endswith("@t0.8"))


def test_resume_with_several_temperatures_is_byte_identical_and_checks_each_temperature(tmp_path, tok, target):
    kw = dict(temperatures=[0.0, 1.0], seed=3, sort_by_length=False)  # chunks in input order: sizes 3, 3, 1
    ref = tmp_path / "ref.jsonl"
    regenerate(target, tok, prompts(), opts(ref, **kw))
    out = tmp_path / "out.jsonl"
    calls = []

    def crash_on_third_unit(k, _records):
        calls.append(k)
        if len(calls) == 3:  # chunk 1 at temperature 0 is on disk, chunk 1 at 1.0 is not
            raise Crash("after the third unit")

    with pytest.raises(Crash):
        regenerate(target, tok, prompts(), opts(out, **kw), on_chunk_written=crash_on_third_unit)
    text = out.read_text()
    out.write_text(text[: len(text) - 20])  # torn last line
    s = regenerate(target, tok, prompts(), opts(out, **kw))
    assert (s.skipped, s.written) == (8, 6)
    assert out.read_bytes() == ref.read_bytes()
    with pytest.raises(RegenerateError, match=r"out.jsonl: .*temperature 1; expected one of this run's "
                                              r"temperatures \(0\)"):
        regenerate(target, tok, prompts(), opts(out, sort_by_length=False))
    with pytest.raises(RegenerateError, match=r"at temperature 1 \(top_p: file has 1.0, now 0.5\)"):
        regenerate(target, tok, prompts(), opts(out, **(kw | {"top_p": 0.5})))


def test_temperature_options_are_checked(tmp_path):
    o = tmp_path / "o.jsonl"
    with pytest.raises(RegenerateError, match=r"temperature, temperatures: expected one of the two"):
        RegenerateOptions(out_path=o, temperature=0.5, temperatures=[0, 0.5])
    with pytest.raises(RegenerateError, match=r"temperatures: expected distinct finite .*found \[0.8, 0.8\]"):
        RegenerateOptions(out_path=o, temperatures=[0.8, 0.8])
    with pytest.raises(RegenerateError, match=r"temperatures.0: expected greater than or equal to 0, found -1"):
        RegenerateOptions(out_path=o, temperatures=[-1])
    with pytest.raises(RegenerateError, match=r"loops: expected 'cut', 'drop' or 'keep', found 'trim'"):
        RegenerateOptions(out_path=o, loops="trim")
    assert RegenerateOptions(out_path=o, temperature=0.7).temperature_list() == [0.7]
    assert RegenerateOptions(out_path=o).temperature_list() == [0.0]


# -- static cache ------------------------------------------------------------------------------------


def _varied_prompts() -> list[Conversation]:
    """Prompts of many lengths (left padding differs per row), one with two turns."""
    out = [Conversation([{"role": "user", "content": "x" * (3 + 11 * i) + f" {i}?"}], id=f"v{i}") for i in range(7)]
    out[2] = Conversation([{"role": "user", "content": "first"}, {"role": "user", "content": "second, longer " * 7}],
                          id="v2")
    return out


@pytest.mark.parametrize("max_prompt_tokens", [None, 120])
def test_static_cache_gives_exactly_the_greedy_answers_of_the_dynamic_cache(tmp_path, tok, max_prompt_tokens,
                                                                           monkeypatch):
    """float32 on a CPU: 7 prompts in chunks of 3 (the last chunk, one prompt, is padded with two
    dummy rows), left padding, and a second turn longer than any first prompt (without
    max_prompt_tokens the cache grows once). Compared token id by token id, and as files."""
    import eyas.data.hf_generator as hf

    target = chat_target(tok, seed=4)  # a seed whose 7 answers all differ
    answers: dict[str, list] = {"dynamic": [], "static": []}
    batches: list[tuple[int, object]] = []  # (rows, the cache object: held, so ids stay distinct)
    real_generate, real_prepare = hf._generate_batch, hf._StaticKV.prepare

    def generate_spy(model, tokenizer, prompt_ids, gen_config, eos_ids, static=None):
        res = real_generate(model, tokenizer, prompt_ids, gen_config, eos_ids, static)
        answers["static" if static is not None else "dynamic"].append((prompt_ids, res))
        return res

    def prepare_spy(self, prompt_ids):
        padded, cache = real_prepare(self, prompt_ids)
        batches.append((len(padded), cache))
        return padded, cache

    monkeypatch.setattr(hf, "_generate_batch", generate_spy)
    monkeypatch.setattr(hf._StaticKV, "prepare", prepare_spy)
    kw = dict(max_new_tokens=10, loops="keep", max_prompt_tokens=max_prompt_tokens)
    dyn, sta = tmp_path / "dynamic.jsonl", tmp_path / "static.jsonl"
    s_dyn = regenerate(target, tok, _varied_prompts(), opts(dyn, cache="dynamic", **kw))
    s_sta = regenerate(target, tok, _varied_prompts(), opts(sta, cache="static", **kw))
    assert (s_dyn.cache, s_sta.cache) == ("dynamic", "static")
    assert answers["static"] == answers["dynamic"]
    assert len({tuple(a) for _, res in answers["dynamic"] for a, _ in res}) >= 5  # not one degenerate answer
    assert sta.read_bytes() == dyn.read_bytes()
    assert {n for n, _ in batches} == {3}  # every batch padded to batch_size, the one-prompt last chunk too
    assert len({id(c) for _, c in batches}) == (1 if max_prompt_tokens else 2)  # one cache, grown once without a bound
    assert (s_sta.new_tokens, s_sta.prompt_tokens) == (s_dyn.new_tokens, s_dyn.prompt_tokens)  # dummies not counted


def test_cache_auto_is_dynamic_on_cpu(tmp_path, tok, target):
    s = regenerate(target, tok, prompts(2), opts(tmp_path / "o.jsonl"))
    assert s.cache == "dynamic"
