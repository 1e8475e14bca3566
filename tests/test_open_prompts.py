"""Open prompt sets (eyas.data.open_sets, open_readers, `eyas open-prompts`) on small local files in
each reader's format: the prompts each reader makes, their sources and licence in every record,
exact duplicates dropped, a file whose sha256 differs refused with both digests, misaligned
translation files refused with their line counts, and the CLI's JSON."""

from __future__ import annotations

import hashlib
import json

import pytest
from typer.testing import CliRunner

from eyas.cli.main import app
from eyas.data import open_sets
from eyas.data.open_readers import READERS
from eyas.data.open_writer import write_open_prompts
from eyas.data.open_sets import OpenFile, OpenSet, OpenSetError, fetch_file

pytestmark = pytest.mark.unit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SQUAD = {"version": "v2.0", "data": [
    {"title": "Norman_Conquest", "paragraphs": [
        {"context": "The Normans came from Normandy. " * 20,
         "qas": [{"id": "q1", "question": "Where did the Normans come from?"},
                 {"id": "q2", "question": "When did they come?"}]},
        {"context": "They conquered England in 1066. " * 20,
         "qas": [{"id": "q3", "question": "What did they conquer?"}]}]}]}


def put(root, repo: str, path: str, data: bytes) -> OpenFile:
    f = root / repo.replace("/", "__") / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(data)
    return OpenFile(repo, COMMIT, path, hashlib.sha256(data).hexdigest(), len(data))


@pytest.fixture
def sets(tmp_path, monkeypatch):
    files = tmp_path / "files"
    squad = put(files, "org/squad", "dev.json", json.dumps(SQUAD).encode())
    math = put(files, "org/math", "test.jsonl", b'{"problem": "What is 2+2?"}\n{"problem": "What is 3+3?"}\n'
                                                b'{"problem": "what is  2+2?"}\n')
    en = put(files, "org/mt", "en.txt", b"Good morning.\nThe cat sleeps.\n")
    de = put(files, "org/mt", "de.txt", "Guten Morgen.\nDie Katze schläft.\n".encode())
    registry = {
        "squad-t": OpenSet("squad-t", "rag_qa", "CC-BY-SA-4.0", "squad", (squad,), (("questions_per_article", "2"),)),
        "math-t": OpenSet("math-t", "math", "MIT", "jsonl_template", (math,), (("template", "{problem}"),)),
        "mt-t": OpenSet("mt-t", "translate", "CC-BY-SA-4.0", "parallel_lines", (en, de),
                        (("languages", "English,German"),)),
    }
    monkeypatch.setattr(open_sets, "OPEN_SETS", registry)
    monkeypatch.setattr("eyas.data.open_writer.OPEN_SETS", registry)
    return files, registry


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_reader_makes_its_prompts_with_their_source_and_duplicates_are_dropped(sets, tmp_path):
    files, registry = sets
    out = tmp_path / "open.jsonl"
    result = write_open_prompts([], out, files_dir=files)
    records = read(out)
    texts = [r["messages"][0]["content"] for r in records]
    # squad: the article (both paragraphs) once to summarize, and two questions over the whole article
    summary = next(t for t, r in zip(texts, records) if r["source"]["kind"] == "summarize")
    assert summary.startswith("Summarize the following article about Norman Conquest.")
    assert "Normandy" in summary and "1066" in summary
    rag = [t for t, r in zip(texts, records) if r["source"]["kind"] == "rag_qa"]
    assert len(rag) == 2 and all("1066" in t and "Normandy" in t for t in rag)
    assert rag[0].endswith("Question: Where did the Normans come from?")
    # math: the third problem is the first one again, case and spaces aside
    assert [t for t, r in zip(texts, records) if r["source"]["set"] == "math-t"] == ["What is 2+2?", "What is 3+3?"]
    assert result.duplicates == 1 and result.per_set == {"math-t": 2, "mt-t": 2, "squad-t": 3}
    # translation: one prompt a pair, the direction alternating
    mt = [t for t, r in zip(texts, records) if r["source"]["set"] == "mt-t"]
    assert mt == ["Translate the following text from English into German.\n\nGood morning.",
                  "Translate the following text from German into English.\n\nDie Katze schläft."]
    de_record = next(r for r in records if r["source"]["set"] == "mt-t" and "Katze" in r["messages"][0]["content"])
    assert de_record["source"] == {"set": "mt-t", "kind": "translate", "repo": "org/mt", "commit": COMMIT,
                                   "path": "de.txt", "licence": "CC-BY-SA-4.0"}
    assert len({r["id"] for r in records}) == len(records)
    docs = tmp_path / "docs.jsonl"
    again = write_open_prompts([], tmp_path / "again.jsonl", files_dir=files, documents_out=docs)
    assert again.per_set == result.per_set and again.documents == 1
    (doc,) = read(docs)  # the article, once, for `eyas prompts --documents`
    assert doc["id"] == "squad-t/0/0" and doc["text"].startswith("The Normans came from Normandy.")
    assert doc["source"]["repo"] == "org/squad" and "1066" in doc["text"]
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()  # a rerun writes the same file


def test_a_changed_file_is_refused_with_both_digests_and_the_output_is_not_touched(sets, tmp_path):
    files, registry = sets
    out = tmp_path / "open.jsonl"
    out.write_text("kept\n")
    (files / "org__math" / "test.jsonl").write_bytes(b'{"problem": "changed"}\n')
    with pytest.raises(OpenSetError, match=r"test.jsonl \(org/math@0123456789:test.jsonl\): sha256 expected "
                                           r"[0-9a-f]{64}, found [0-9a-f]{64}"):
        write_open_prompts(["math-t"], out, files_dir=files)
    assert out.read_text() == "kept\n"
    with pytest.raises(OpenSetError, match=r"no such file \(--files .* holds local copies as <owner>__<name>/<path>"):
        fetch_file(OpenFile("org/none", COMMIT, "x.json", "0" * 64, 1), files)


def test_misaligned_translation_files_and_templates_name_the_file_and_what_was_found(sets, tmp_path):
    files, registry = sets
    (files / "org__mt" / "de.txt").write_text("Guten Morgen.\n")
    de = registry["mt-t"].files[1]
    paths = [files / "org__mt" / "en.txt", files / "org__mt" / "de.txt"]
    with pytest.raises(OpenSetError, match=r"de.txt: expected 2 lines, aligned with .*en.txt, found 1"):
        list(READERS["parallel_lines"](registry["mt-t"], paths))
    assert de.path == "de.txt"
    bad = OpenSet("bad", "math", "MIT", "jsonl_template", registry["math-t"].files, (("template", "{question}"),))
    with pytest.raises(OpenSetError, match=r"record 0: template '\{question\}' needs 'question', the record has "
                                           r"\['problem'\]"):
        list(READERS["jsonl_template"](bad, [files / "org__math" / "test.jsonl"]))


def test_the_cli_writes_the_prompts_and_reports_them_as_json(sets, tmp_path):
    files, _ = sets
    out = tmp_path / "open.jsonl"
    r = CliRunner().invoke(app, ["open-prompts", "--out", str(out), "--files", str(files), "--sets", "math-t,squad-t",
                                 "--max-per-set", "2", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["written"] == 4 and report["per_set"] == {"math-t": 2, "squad-t": 2} and len(read(out)) == 4
    assert report["length_unit"] == "chars" and report["share_over_1000"] is None
    r = CliRunner().invoke(app, ["open-prompts", "--out", str(out), "--sets", "nope", "--files", str(files)])
    assert r.exit_code == 2 and "--sets: unknown ['nope']" in " ".join(r.output.split())
    listed = CliRunner().invoke(app, ["open-prompts", "--list", "--json"])
    assert listed.exit_code == 0 and {s["name"] for s in json.loads(listed.stdout)} == {"squad-t", "math-t", "mt-t"}


def test_long_document_readers_keep_the_whole_story_and_a_widened_meeting_excerpt(tmp_path):
    story = {"document": "Title\n \n\n By A. WRITER\n \n \n First paragraph.\n \n Second paragraph.",
             "questions": [{"question_number": 1, "question_text": "What is the plot of the story?"},
                           {"question_number": 2, "question_text": "Who is the writer?"}]}
    meeting = {"meeting_transcripts": [{"speaker": f"S{i}", "content": f"turn {i} {{vocalsound}} ok ."}
                                       for i in range(10)],
               "general_query_list": [{"query": "Summarize the whole meeting.", "answer": "-"}],
               "specific_query_list": [{"query": "What about turn 5?", "answer": "-",
                                        "relevant_text_span": [["5", "5"]]}]}
    (tmp_path / "s.jsonl").write_text(json.dumps(story) + "\n")
    (tmp_path / "m.jsonl").write_text(json.dumps(meeting) + "\n")
    f = OpenFile("o/r", COMMIT, "x", "0" * 64, 1)
    plot, who = READERS["squality"](OpenSet("sq", "rag_qa", "CC-BY-4.0", "squality", (f,)), [tmp_path / "s.jsonl"])
    assert plot.kind == "summarize" and who.kind == "rag_qa"
    assert plot.text == ("Read the story and answer the question.\n\nTitle\n\nBy A. WRITER\n\nFirst paragraph.\n\n"
                         "Second paragraph.\n\nQuestion: What is the plot of the story?")
    qm = OpenSet("qm", "summarize", "MIT", "qmsum", (f,), (("max_chars", "1000"), ("span_chars", "40")))
    general, specific = READERS["qmsum"](qm, [tmp_path / "m.jsonl"])
    assert general.kind == "summarize" and "S0: turn 0 ok ." in general.text and "S9: turn 9 ok ." in general.text
    assert "{vocalsound}" not in general.text and general.text.endswith("\n\nSummarize the whole meeting.")
    # turn 5 widened on both sides until about 40 characters: turns 4 to 6
    assert specific.text == ("Here is a meeting transcript.\n\nS4: turn 4 ok .\nS5: turn 5 ok .\nS6: turn 6 ok .\n\n"
                             "What about turn 5?")
    (tmp_path / "bad.jsonl").write_text('{"problem": "a\u2028b"}\n{"problem": \n')
    t = OpenSet("t", "math", "MIT", "jsonl_template", (f,), (("template", "{problem}"),))
    with pytest.raises(OpenSetError, match=r"bad.jsonl line 2: expected a JSON record, found '\{\"problem\": '"):
        list(READERS["jsonl_template"](t, [tmp_path / "bad.jsonl"]))


def test_every_registered_set_is_pinned_licensed_and_readable_by_its_reader():
    import re

    assert len(open_sets.OPEN_SETS) >= 10
    for s in open_sets.OPEN_SETS.values():
        assert s.reader in READERS and s.kind in open_sets.KINDS and s.licence, s.name
        for f in s.files:
            assert re.fullmatch(r"[0-9a-f]{40}", f.commit) and re.fullmatch(r"[0-9a-f]{64}", f.sha256), (s.name, f)
            assert "/" in f.repo and f.bytes > 0
        if s.reader == "parallel_lines":
            assert len(s.option("languages").split(",")) == len(s.files), s.name
        if s.reader == "jsonl_template":
            assert s.option("template"), s.name


def test_a_long_text_is_cut_at_blank_lines_into_passages_of_about_the_size_asked(tmp_path):
    paragraphs = [f"Paragraph {i}. " + "word " * 30 for i in range(10)]  # 10 x ~165 characters
    (tmp_path / "book.txt").write_text("\n\n".join(paragraphs))
    s = OpenSet("book", "summarize", "public domain", "text_chunks", (OpenFile("o/b", COMMIT, "book.txt", "0" * 64, 1),),
                (("chars", "500"), ("title", "a test book")))
    passages = list(READERS["text_chunks"](s, [tmp_path / "book.txt"]))
    assert len(passages) == 3  # 3 + 3 + 3 paragraphs; the last one alone is under half the size: dropped
    assert all(p.text.startswith("Summarize this passage from a test book.\n\n") for p in passages)
    assert passages[0].document == "\n\n".join(x.strip() for x in paragraphs[:3])
    assert passages[-1].document == "\n\n".join(x.strip() for x in paragraphs[6:9])
    assert passages[-1].document_id == "book/0/2"


def test_a_gutenberg_book_is_read_between_its_markers_without_bom_or_crlf(tmp_path):
    from eyas.data.open_readers import book_text

    raw = ("\ufeffThe Project Gutenberg eBook of A Test\r\n\r\n*** START OF THIS PROJECT GUTENBERG EBOOK A TEST ***\r\n"
           "\r\nChapter 1\r\n\r\nIt was a dark\r\nand stormy night.\r\n\r\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK A TEST ***\r\n\r\nLicence text.\r\n")
    (tmp_path / "b.txt").write_bytes(raw.encode("utf-8"))
    assert book_text(tmp_path / "b.txt").strip() == "Chapter 1\n\nIt was a dark\nand stormy night."
    s = OpenSet("b", "summarize", "public domain", "text_chunks", (OpenFile("o/b", COMMIT, "b.txt", "0" * 64, 1),),
                (("chars", "35"), ("titles", "A Test")))
    (passage,) = READERS["text_chunks"](s, [tmp_path / "b.txt"])  # the chapter title alone is under half the size
    assert passage.text == "Summarize this passage from A Test.\n\nIt was a dark and stormy night."


def test_a_file_is_downloaded_at_its_commit_checked_and_only_then_kept(tmp_path, monkeypatch):
    files = tmp_path / "files"
    good = put(files, "org/math", "test.jsonl", b'{"problem": "What is 2+2?"}\n')
    # the raw URL, as a file:// URL into the local copies: urllib fetches it as it fetches https
    monkeypatch.setattr(open_sets, "RAW_URL", f"file://{files}/{{repo}}/{{path}}")
    monkeypatch.setattr(OpenFile, "local_name", lambda self: self.path)
    (files / "org" / "math").mkdir(parents=True)
    (files / "org" / "math" / "test.jsonl").write_bytes(b'{"problem": "What is 2+2?"}\n')
    cache = tmp_path / "cache"
    path = fetch_file(good, cache=cache)
    assert path == cache / good.sha256 and path.read_bytes() == b'{"problem": "What is 2+2?"}\n'
    assert fetch_file(good, cache=cache) == path  # from the cache now
    bad = OpenFile("org/math", COMMIT, "test.jsonl", "f" * 64, 1)
    with pytest.raises(OpenSetError, match=r"test.jsonl: sha256 expected f{64}, found [0-9a-f]{64} \(the file changed"):
        fetch_file(bad, cache=cache)
    assert sorted(p.name for p in cache.iterdir()) == [good.sha256]  # nothing kept of the bad one
    missing = OpenFile("org/none", COMMIT, "x.json", "0" * 64, 1)
    with pytest.raises(OpenSetError, match=r"x.json: could not download it .*pass --files DIR"):
        fetch_file(missing, cache=cache)


def test_lengths_are_counted_in_the_tokenizer_s_tokens_in_batches(sets, tmp_path):
    files, _ = sets
    batches: list[int] = []

    class WordTokenizer:  # one token a word; called on a batch, as a fast tokenizer is
        def __call__(self, texts, add_special_tokens=True):
            assert add_special_tokens is False
            batches.append(len(texts))
            return {"input_ids": [t.split() for t in texts]}

    result = write_open_prompts(["squad-t", "math-t"], tmp_path / "o.jsonl", files_dir=files, tokenizer=WordTokenizer())
    texts = [r["messages"][0]["content"] for r in read(tmp_path / "o.jsonl")]
    assert result.unit == "tokens" and result.lengths == [len(t.split()) for t in texts]
    assert batches == [result.per_set["squad-t"], result.per_set["math-t"]]  # a batch a set here (under 1,024)


def test_a_document_is_written_even_when_its_prompt_is_another_set_s_duplicate(tmp_path, monkeypatch):
    """Requests grown earlier (benchmarks/grown/doc_requests.jsonl.gz) name their document by id: a
    set whose prompts all repeat another set's must still write its documents."""
    text = "\n\n".join(f"Paragraph {i}. " + "word " * 30 for i in range(6))
    book = put(tmp_path / "files", "o/b", "book.txt", text.encode())
    options = (("chars", "500"), ("title", "a book"))
    registry = {"a-t": OpenSet("a-t", "summarize", "public domain", "text_chunks", (book,), options),
                "b-t": OpenSet("b-t", "summarize", "public domain", "text_chunks", (book,), options)}
    monkeypatch.setattr("eyas.data.open_writer.OPEN_SETS", registry)
    docs = tmp_path / "docs.jsonl"
    result = write_open_prompts([], tmp_path / "o.jsonl", files_dir=tmp_path / "files", documents_out=docs)
    assert result.per_set == {"a-t": 2, "b-t": 0} and result.duplicates == 2
    assert [d["id"] for d in read(docs)] == ["a-t/0/0", "a-t/0/1", "b-t/0/0", "b-t/0/1"]
