"""Long prompts from open documents (eyas.data.open_tasks, open_sets.manifest_files,
benchmarks/pin_open_files.py): passages cut at blank lines to the size asked, one request and layout
a passage drawn the same way on every run, code fenced, documents written for the first pass only,
multi-passage RAG questions with their own paragraph among other articles', manifests read back as
pinned and refused with the line that is wrong."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess

import pytest

from eyas.data import open_sets
from eyas.data.open_readers import READERS
from eyas.data.open_sets import OpenFile, OpenSet, OpenSetError, manifest_files
from eyas.data.open_tasks import LANGUAGES, LAYOUTS, MIN_CHARS, TASKS, passages

pytestmark = pytest.mark.unit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_passages_are_cut_at_blank_lines_prose_joined_and_long_blocks_cut_at_line_ends():
    paragraphs = [f"Paragraph {i} begins\nand goes on " + "word " * 40 for i in range(12)]  # ~235 characters each
    got = passages("\n\n".join(paragraphs), "prose", 1000)
    assert len(got) == 3  # 4 paragraphs (4 x 237 <= 1000) a passage
    assert got[0] == "\n\n".join(" ".join(x.strip() for x in p.split("\n")) for p in paragraphs[:4])
    assert "\n" not in got[0].replace("\n\n", "")  # prose: hard-wrapped lines joined
    code = "\n".join(f"    x{i} = compute({i})" for i in range(200))  # one block of 200 lines, ~5,000 characters
    cut = passages("def f():\n" + code, "code", 2000)
    assert all(len(p) <= 2000 for p in cut) and len(cut) == 2  # the last ~1,000 characters: under half, dropped
    assert "\n".join(cut) == ("def f():\n" + code)[:len("\n".join(cut))]  # whole lines, in order


def test_a_short_tail_is_dropped_unless_it_is_the_whole_file_and_long_enough():
    assert passages("a" * 900 + "\n\n" + "b" * 200, "technical", 1000) == ["a" * 900]
    whole = "c" * MIN_CHARS
    assert passages(whole, "technical", 4 * MIN_CHARS) == [whole]  # under half the size, but the only passage
    assert passages("d" * (MIN_CHARS - 1), "technical", 4 * MIN_CHARS) == []


def task_set(tmp_path, genres: str, files: dict[str, str], passes: str = "900,1400") -> tuple[OpenSet, list]:
    paths, pinned = [], []
    for (name, text), genre in zip(files.items(), genres.split("|")):
        (tmp_path / name).write_text(text)
        paths.append(tmp_path / name)
        pinned.append(OpenFile("org/docs", COMMIT, name, "0" * 64, len(text), genre, f"Title of {name}"))
    return OpenSet("docs-t", "summarize", "MIT", "passage_tasks", tuple(pinned), (("passes", passes),)), paths


def test_each_passage_gets_a_request_of_its_genre_and_a_layout_the_same_on_every_run(tmp_path):
    prose = "\n\n".join(f"Chapter {i}. " + "The river ran past the mill. " * 8 for i in range(20))
    code = "\n\n".join(f"def f{i}(x):\n    return x + {i}\n" + "# note\n" * 20 for i in range(20))
    s, paths = task_set(tmp_path, "prose|code", {"book.txt": prose, "mod.py": code})
    first = list(READERS["passage_tasks"](s, paths))
    assert [(p.id, p.text) for p in first] == [(p.id, p.text) for p in READERS["passage_tasks"](s, paths)]
    assert {(p.file, p.id.split("/")[2]) for p in first} == {(0, "0"), (0, "1"), (1, "0"), (1, "1")}  # a pass each
    for p in first:
        genre, title, fence = (("prose", "Title of book.txt", ""), ("code", "Title of mod.py", "python"))[p.file]
        pass_ = int(p.id.split("/")[2])
        assert (p.document_id == p.id) == (pass_ == 0)  # documents: the first pass only
        if pass_ > 0:
            continue
        assert len(p.document) <= (900, 1400)[pass_] + 60
        made = {layout.format(request=request.format(title=title, language=language), document=p.document,
                              title=title, fence=fence): kind
                for kind, request in TASKS[genre] for layout in LAYOUTS[genre] for language in LANGUAGES}
        assert made.get(p.text) == p.kind  # one request of its genre in one of its layouts, nothing else
        if genre == "code":
            assert "```python\n" + p.document + "\n```" in p.text
    assert len({p.text.split("\n")[0] for p in first}) > 2  # the draws differ between passages


def test_a_wrong_genre_is_refused_and_a_file_without_one_is_prose_named_by_its_path(tmp_path):
    s, paths = task_set(tmp_path, "poetry", {"a.txt": "x" * 2000})
    with pytest.raises(OpenSetError, match=r"open set docs-t file 0 .*a.txt\): genre expected one of "
                                           r"\['code', 'prose', 'technical'\], found 'poetry'"):
        list(READERS["passage_tasks"](s, paths))
    (tmp_path / "b.txt").write_text("A sentence. " * 150)
    bare = OpenSet("b-t", "summarize", "MIT", "passage_tasks", (OpenFile("o/b", COMMIT, "b.txt", "0" * 64, 1),),
                   (("passes", "3000"),))
    (p,) = READERS["passage_tasks"](bare, [tmp_path / "b.txt"])
    made = {lay.format(request=r.format(title="b.txt", language=lang), document=p.document, title="b.txt", fence="")
            for _, r in TASKS["prose"] for lay in LAYOUTS["prose"] for lang in LANGUAGES}
    assert p.text in made


SQUAD = {"data": [{"title": f"Article {a}", "paragraphs": [
    {"context": f"Article {a} paragraph {p}. " + "text " * 30, "qas": [{"id": f"q{a}-{p}", "question": f"Q {a} {p}?"}]}
    for p in range(3)]} for a in range(6)]}


def test_a_rag_question_reads_its_own_paragraph_among_other_articles_paragraphs(tmp_path):
    (tmp_path / "dev.json").write_text(json.dumps(SQUAD))
    s = OpenSet("rag-t", "rag_qa", "CC-BY-SA-4.0", "squad_rag", (OpenFile("o/s", COMMIT, "dev.json", "0" * 64, 1),),
                (("distractors", "2,4"), ("draws", "2")))
    got = list(READERS["squad_rag"](s, [tmp_path / "dev.json"]))
    assert len(got) == 6 * 3 * 2 and len({p.text for p in got}) == len(got)
    for p in got:
        a, q = re.search(r"q(\d)-(\d)/\d$", p.id).groups()
        numbered = re.findall(r"^\[(\d+)\] Article (\d) paragraph (\d)\.", p.text, re.M)
        assert [int(n) for n, _, _ in numbered] == list(range(1, len(numbered) + 1))
        assert 3 <= len(numbered) <= 5  # its own and 2-4 others
        own = [(x, y) for _, x, y in numbered if x == a]
        assert own == [(a, q)]  # its own paragraph once, no other paragraph of its article
        assert f"Question: Q {a} {q}?" in p.text
    one = {"data": SQUAD["data"][:1]}
    (tmp_path / "one.json").write_text(json.dumps(one))
    with pytest.raises(OpenSetError, match=r"one.json: squad_rag needs paragraphs of at least two articles"):
        list(READERS["squad_rag"](s, [tmp_path / "one.json"]))


def test_a_manifest_is_read_as_pinned_and_a_bad_line_is_named(tmp_path):
    sha = "a" * 64
    (tmp_path / "m.tsv").write_text(f"o/r\t{COMMIT}\tdocs/a.md\t{sha}\t1500\ttechnical\tA | B\n\n"
                                    f"o/r\t{COMMIT}\tsrc/b.py\t{sha}\t2500\tcode\tsrc/b.py\n")
    assert manifest_files("m", root=tmp_path) == (OpenFile("o/r", COMMIT, "docs/a.md", sha, 1500, "technical", "A | B"),
                                                  OpenFile("o/r", COMMIT, "src/b.py", sha, 2500, "code", "src/b.py"))
    (tmp_path / "bad.tsv").write_text(f"o/r\t{COMMIT}\tdocs/a.md\t{sha}\t1500\n")
    with pytest.raises(OpenSetError, match=r"bad.tsv line 1: expected 7 tab-separated fields .* found 5"):
        manifest_files("bad", root=tmp_path)


def test_every_manifest_set_gives_each_file_a_known_genre_and_a_title():
    sets = [s for s in open_sets.OPEN_SETS.values() if s.reader == "passage_tasks"]
    assert len(sets) >= 10
    for s in sets:
        assert len(s.files) > 0
        assert all(f.genre in TASKS and f.title for f in s.files), s.name
        assert all(int(x) > 2 * MIN_CHARS for x in s.option("passes").split(",")), s.name


def test_pin_open_files_pins_a_repository_s_files_as_a_manifest_read_back(tmp_path):
    from tests.test_bench_scripts import load_script

    pin = load_script("pin_open_files")
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "guide.md").write_text("# The Guide { #guide }\n\n" + "Some text. " * 200)
    (repo / "docs" / "tiny.md").write_text("# Tiny\n")
    (repo / "pep.rst").write_text("PEP: 8\nTitle: Style Guide\n\n" + "words " * 400 + "\nplaced in the public domain\n")
    (repo / "other.rst").write_text("Title\n=====\n\n" + "words " * 400)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "x"], check=True)
    files = tmp_path / "files"
    rows = pin.pin(repo, "org/docs", ["docs/*.md"], None, "technical", files)
    assert [r.split("\t")[2] for r in rows] == ["docs/guide.md"]  # tiny.md: too small for a long prompt
    rows += pin.pin(repo, "org/docs", ["*.rst"], "public domain", "technical", files)
    assert [r.split("\t")[2] for r in rows] == ["docs/guide.md", "pep.rst"]  # other.rst: states no terms
    (tmp_path / "m.tsv").write_text("\n".join(rows) + "\n")
    pinned = manifest_files("m", root=tmp_path)
    assert [f.title for f in pinned] == ["The Guide", "PEP 8: Style Guide"]
    for f in pinned:
        data = (files / "org__docs" / f.path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f.sha256 and len(data) == f.bytes
        assert open_sets.fetch_file(f, files) == files / "org__docs" / f.path  # eyas open-prompts --files takes it


def test_the_list_counts_a_manifest_s_files_per_repository(monkeypatch):
    from typer.testing import CliRunner

    from eyas.cli.main import app

    many = tuple(OpenFile("org/docs", COMMIT, f"docs/{i}.md", "0" * 64, 2000) for i in range(12))
    books = tuple(OpenFile(f"GITenberg/Book_{i}", COMMIT, f"{i}.txt", "0" * 64, 2000) for i in range(9))
    registry = {"docs-t": OpenSet("docs-t", "summarize", "MIT", "passage_tasks", many),
                "books-t": OpenSet("books-t", "summarize", "public domain", "passage_tasks", books)}
    monkeypatch.setattr(open_sets, "OPEN_SETS", registry)
    r = CliRunner().invoke(app, ["open-prompts", "--list"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "docs-t (summarize, MIT): 12 files of org/docs" in text and "docs/3.md" not in text
    assert "books-t (summarize, public domain): 9 files of 9 repositories of GITenberg" in text
