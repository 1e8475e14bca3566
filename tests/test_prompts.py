"""eyas.data.prompts (`eyas prompts`, Magpie): the user header comes from the chat template, the
filters reject what they name (no end of turn, short, not text, template tokens, loops, exact and
near duplicates), the file resumes with fresh draws, and the command runs end to end on a tiny
chat target."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eyas.cli.main import app
from eyas.data.generation import BatchParams
from eyas.data.prompts import NearDuplicates, PromptFilter, batch_seed, make_prompts
from eyas.data.render import user_header
from tests.support.chat import chat_target, chat_tokenizer


class Scripted:
    """A BatchGenerator that answers from a script of (text, finish), in order, and records its calls."""

    name, implementation, last_decode_steps = "scripted", "scripted", 0

    def __init__(self, tok, script: list[tuple[str, str]]) -> None:
        self.tok, self.script, self.calls = tok, list(script), []

    def reserve(self, max_prompt_tokens: int, max_new_tokens: int) -> None:
        self.reserved = (max_prompt_tokens, max_new_tokens)

    def generate(self, prompts: list[list[int]], params: BatchParams):
        self.calls.append((prompts, params))
        out = []
        for _ in prompts:
            text, finish = self.script.pop(0) if self.script else ("", "length")
            out.append((self.tok.encode(text), finish))
        return out


@pytest.mark.unit
def test_the_user_header_is_what_the_template_writes_before_a_user_message():
    tok = chat_tokenizer()
    header = user_header(tok)
    assert tok.decode(header) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    # "none" on a template that injects a default system turn: an empty one (as render does)
    assert tok.decode(user_header(tok, "none")) == "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n"
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert rendered.startswith(tok.decode(header))


@pytest.mark.unit
def test_near_duplicates_are_caught_and_different_texts_are_not():
    near = NearDuplicates(threshold=0.7)
    base = ("Write a short story about a lighthouse keeper who finds a message in a bottle and decides "
            "to sail across the ocean to find its sender before the winter storms arrive")
    assert near.add(base)
    assert not near.add(base.replace("short", "brief"))  # one word of 30 changed
    assert near.add("Explain how photosynthesis converts light into chemical energy in plant cells")
    assert near.add("Translate the following sentence into French: the weather is lovely today")


@pytest.mark.unit
def test_make_prompts_filters_deduplicates_writes_and_resumes_with_fresh_draws(tmp_path):
    tok = chat_tokenizer()
    good = ["How do I sort a list of tuples by the second element in Python?",
            "What were the main causes of the French Revolution?",
            "Summarize the plot of Hamlet in three sentences.",
            "Give me a recipe for a vegan lasagna with spinach."]
    script = [
        (good[0], "eos"),
        ("Tell me a story about a dragon who could not fly", "length"),  # no end of turn
        ("Hi?", "eos"),  # short
        ("1234 5678 9012 3456 !!!!", "eos"),  # not text
        ("What is <|im_start|>assistant doing here?", "eos"),  # template tokens
        ("Repeat after me: " + "one two three four five six seven eight " * 6, "eos"),  # a loop
        ("how do I sort a list of tuples by the second   element in python?", "eos"),  # exact, folded
        (good[1], "eos"),
        ("What were the main causes of the French Revolution ?!", "eos"),  # near duplicate
        (good[2], "eos"),
    ]
    gen = Scripted(tok, script)
    out = tmp_path / "prompts.jsonl"
    r = make_prompts(gen, tok, out, count=3, temperatures=(0.8, 1.2), batch_size=5, seed=3, eos_ids=[257],
                     source="chat", filter_=PromptFilter([t for t in tok.all_special_tokens if t]))
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["messages"][0]["content"] for x in records] == good[:3]
    assert [x["source"]["temperature"] for x in records] == [0.8, 1.2, 1.2]
    assert (r.written, r.existing, r.generated, r.surplus, r.per_temperature) == (3, 0, 10, 0, {"0.8": 1, "1.2": 2})
    assert r.rejected == {"no_end_of_turn": 1, "short": 1, "not_text": 1, "special_tokens": 1, "loop": 1,
                          "duplicate": 1, "near_duplicate": 1}
    assert gen.reserved == (len(user_header(tok)), 256)
    prompts, params = gen.calls[0]
    assert prompts == [user_header(tok)] * 5 and params.seed == batch_seed(3, 0.8, 0) and params.eos_ids == (257,)
    assert gen.calls[1][1].seed == batch_seed(3, 1.2, 1) != params.seed

    # resume: the file holds 3; asked for 4, one more batch, which repeats what is there and adds one
    gen2 = Scripted(tok, [(good[2], "eos"), (good[3], "eos")])
    r2 = make_prompts(gen2, tok, out, count=4, temperatures=(0.8, 1.2), batch_size=5, seed=3, eos_ids=[257])
    assert (r2.existing, r2.written, r2.rejected["duplicate"], r2.surplus) == (3, 1, 1, 3)
    assert gen2.calls[0][1].seed == batch_seed(3, 0.8, 2)  # after the batches 0 and 1 in the file: new draws
    assert [json.loads(x)["messages"][0]["content"] for x in out.read_text().splitlines()] == good
    with pytest.raises(ValueError, match="temperatures > 0"):
        make_prompts(gen2, tok, out, count=5, temperatures=(0.0,))


@pytest.mark.unit
def test_sigint_stops_make_prompts_with_what_it_wrote_and_a_rerun_resumes(tmp_path):
    tok = chat_tokenizer()
    good = ["What were the main causes of the French Revolution?", "Give me a recipe for a vegan lasagna.",
            "Summarize the plot of Hamlet in three sentences."]

    class Interrupted(Scripted):
        """Answers its first batch, then is stopped by Ctrl-C while generating the second."""

        def generate(self, prompts, params):
            if self.calls:
                raise KeyboardInterrupt
            return super().generate(prompts, params)

    out = tmp_path / "p.jsonl"
    r = make_prompts(Interrupted(tok, [(good[0], "eos"), (good[1], "eos")]), tok, out, count=3, batch_size=2)
    assert r.interrupted and (r.written, r.generated) == (2, 2)
    assert [json.loads(x)["messages"][0]["content"] for x in out.read_text().splitlines()] == good[:2]
    r2 = make_prompts(Scripted(tok, [(good[2], "eos")]), tok, out, count=3, batch_size=2)
    assert not r2.interrupted and (r2.existing, r2.written) == (2, 1)
    assert [json.loads(x)["messages"][0]["content"] for x in out.read_text().splitlines()] == good


@pytest.mark.integration
@pytest.mark.usefixtures("one_thread")
def test_eyas_prompts_runs_on_a_tiny_chat_target_and_reports_what_it_kept(tmp_path, monkeypatch):
    tok = chat_tokenizer()
    tdir = tmp_path / "target"
    chat_target(tok).save_pretrained(tdir)
    tok.save_pretrained(tdir)
    out = tmp_path / "p.jsonl"
    r = CliRunner().invoke(app, ["prompts", "--target", str(tdir), "--out", str(out), "--count", "2",
                                 "--temperatures", "1.0", "--max-new-tokens", "16", "--batch-size", "4",
                                 "--engine", "hf", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["command"] == "prompts" and rep["engine"] == "hf" and rep["batch_size"] == 4
    assert rep["generated"] % 4 == 0
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"id": "d1", "text": "A long report about rivers."}\n')
    out2 = tmp_path / "p2.jsonl"
    r = CliRunner().invoke(app, ["prompts", "--target", str(tdir), "--out", str(out2), "--count", "2",
                                 "--temperatures", "1.0", "--max-new-tokens", "16", "--batch-size", "4",
                                 "--engine", "hf", "--device", "cpu", "--documents", str(docs), "--json"])
    assert r.exit_code == 0, r.output
    for line in out2.read_text().splitlines() if out2.exists() else []:
        record = json.loads(line)
        assert record["source"]["document"] == "d1"
        assert record["messages"][0]["content"].startswith("A long report about rivers.\n\n")
    docs.write_text("not json\n")
    r = CliRunner().invoke(app, ["prompts", "--target", str(tdir), "--out", str(out2), "--documents", str(docs)])
    assert r.exit_code == 2 and "line 1: expected a JSON record with id and text" in " ".join(r.output.split())
    assert rep["written"] + sum(rep["rejected"].values()) + rep["surplus"] == rep["generated"]
    assert len(out.read_text().splitlines()) == rep["written"] <= 2
    bad = CliRunner().invoke(app, ["prompts", "--target", str(tdir), "--out", str(out), "--temperatures", "0"])
    assert bad.exit_code == 2 and "--temperatures: expected numbers > 0" in " ".join(bad.output.split())
    # Ctrl-C while generating: the report of what was written, a line saying how to go on, exit 130
    from eyas.data.regenerate import HFGenerator

    def interrupted(self, prompts, params):
        raise KeyboardInterrupt

    monkeypatch.setattr(HFGenerator, "generate", interrupted)
    args = ["prompts", "--target", str(tdir), "--out", str(tmp_path / "p3.jsonl"), "--count", "2",
            "--batch-size", "4", "--engine", "hf", "--device", "cpu"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 130 and "stopped early: rerun the same command to resume" in " ".join(r.output.split())
    r = CliRunner().invoke(app, args + ["--json"])
    assert r.exit_code == 130 and json.loads(r.stdout)["interrupted"] is True


@pytest.mark.unit
def test_with_documents_the_target_asks_about_each_and_duplicates_are_judged_per_document(tmp_path):
    from eyas.data.prompts import Document, read_documents
    from eyas.errors import EyasError

    tok = chat_tokenizer()
    docs = [Document("a", "The river flooded the town in May."), Document("b", "The bridge was built in 1890.")]
    ask = "What happened, according to the text?"
    script = [(ask, "eos"), (ask, "eos"),  # the same request about two documents: both kept
              (ask + " ", "eos"),  # about document a again: a duplicate
              ("Summarize the text in one sentence.", "eos")]  # about b
    gen = Scripted(tok, script)
    out = tmp_path / "p.jsonl"
    r = make_prompts(gen, tok, out, count=3, batch_size=2, seed=1, documents=docs, openers=())
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["messages"][0]["content"] for x in records] == [
        f"{docs[0].text}\n\n{ask}", f"{docs[1].text}\n\n{ask}", f"{docs[1].text}\n\nSummarize the text in one sentence."]
    assert [x["source"]["document"] for x in records] == ["a", "b", "b"] and records[0]["source"]["request"] == ask
    assert [x["source"]["document_chars"] for x in records] == [len(docs[0].text)] + [len(docs[1].text)] * 2
    assert r.rejected["duplicate"] == 1
    prompts, _ = gen.calls[0]  # row j of batch 0 continues the header, document j and a blank line
    assert prompts == [user_header(tok) + tok.encode(d.text + "\n\n", add_special_tokens=False) for d in docs]
    assert gen.reserved[0] == max(len(p) for p in prompts)
    # resume: the file's requests are indexed per document
    gen2 = Scripted(tok, [(ask, "eos"), ("Who built it?", "eos")])
    r2 = make_prompts(gen2, tok, out, count=4, batch_size=2, seed=1, documents=docs, openers=())
    assert (r2.existing, r2.written, r2.rejected["duplicate"]) == (3, 1, 1)
    (tmp_path / "d.jsonl").write_text('{"id": "x", "text": "t"}\n{"id": "y"}\n')
    with pytest.raises(EyasError, match=r"d.jsonl line 2: expected a JSON record with id and text"):
        read_documents(tmp_path / "d.jsonl")


@pytest.mark.unit
def test_a_request_about_a_document_starts_with_an_opener_the_target_completes(tmp_path):
    from eyas.data.prompts import REQUEST_OPENERS, Document

    tok = chat_tokenizer()
    docs = [Document("a", "The river flooded the town in May."), Document("b", "The bridge was built in 1890.")]
    openers = ("Summarize", "According to the text,", "List")
    completions = [" the text in one sentence.", " when did the river flood?", " the dates in the text.",
                   " it for a child.", " who built the bridge?", " every place named."]
    gen = Scripted(tok, [(c, "eos") for c in completions])
    out = tmp_path / "p.jsonl"
    make_prompts(gen, tok, out, count=6, batch_size=6, seed=3, documents=docs, openers=openers)
    prompts, _ = gen.calls[0]
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == 6
    header = user_header(tok)
    for j, (prompt, rec, completion) in enumerate(zip(prompts, records, completions)):
        doc = docs[j % 2]
        opener = rec["source"]["opener"]
        assert opener in openers
        # what the target read: header, document, blank line, opener; what it wrote completes the opener
        assert prompt == header + tok.encode(doc.text + "\n\n", add_special_tokens=False) \
            + tok.encode(opener, add_special_tokens=False)
        assert rec["source"]["request"] == (opener + completion).strip()
        assert rec["messages"][0]["content"] == f"{doc.text}\n\n{(opener + completion).strip()}"
    assert len({r["source"]["opener"] for r in records}) > 1  # drawn per row, not one for the batch
    longest_doc = max(len(header + tok.encode(d.text + "\n\n", add_special_tokens=False)) for d in docs)
    assert gen.reserved[0] == longest_doc + max(len(tok.encode(o, add_special_tokens=False)) for o in openers)
    # the same seed draws the same openers; the default list has no trailing spaces
    gen2 = Scripted(tok, [(c, "eos") for c in completions])
    make_prompts(gen2, tok, tmp_path / "q.jsonl", count=6, batch_size=6, seed=3, documents=docs, openers=openers)
    assert gen2.calls[0][0] == prompts
    assert all(o == o.strip() and o for o in REQUEST_OPENERS)


@pytest.mark.unit
def test_documents_are_cut_to_a_prefix_of_at_most_the_tokens_asked_at_a_break_when_near():
    from eyas.data.prompts import Document, cut_documents

    tok = chat_tokenizer()  # one token a byte
    short = Document("s", "A short one.")
    prose = Document("p", "One sentence here. " * 20)  # 380 bytes; a sentence ends every 19
    flat = Document("f", "x" * 300)  # no break anywhere
    cut = cut_documents([short, prose, flat], tok, 100)
    assert cut[0] == short
    assert cut[1].id == "p" and prose.text.startswith(cut[1].text) and cut[1].text.endswith("here.")
    assert 80 < len(tok.encode(cut[1].text, add_special_tokens=False)) <= 100
    assert cut[2] == Document("f", "x" * 100)
    with pytest.raises(ValueError, match="max_tokens: expected >= 1, found 0"):
        cut_documents([short], tok, 0)


@pytest.mark.unit
def test_resuming_reads_lines_at_newlines_only_and_cuts_a_torn_last_line(tmp_path):
    """A prompt may hold U+2028 raw (JSON allows it; str.splitlines() took it for a line end), and a
    killed writer leaves half a line: the resume counts the whole records and appends after them."""
    tok = chat_tokenizer()
    out = tmp_path / "prompts.jsonl"
    first = {"id": "magpie-0-0", "messages": [{"role": "user", "content": "Line one\u2028line two of one prompt?"}],
             "source": {"generator": "magpie"}}
    out.write_text(json.dumps(first, ensure_ascii=False) + '\n{"id": "magpie-0-1", "messa', encoding="utf-8")
    ask = "What were the main causes of the French Revolution?"
    r = make_prompts(Scripted(tok, [(ask, "eos")]), tok, out, count=2, batch_size=1, seed=0)
    assert (r.existing, r.written) == (1, 1)
    records = [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n") if x]
    assert [x["messages"][0]["content"] for x in records] == [first["messages"][0]["content"], ask]
    assert records[1]["id"] == "magpie-1-0"  # after the file's batch 0
