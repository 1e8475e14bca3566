"""benchmarks/drafter_mix.py, the prompt mix of a drafter run: the weighted interleaving keeps every
prefix in proportion, the mix drops duplicates across parts and keeps each record's source, a bad
line is named with its file and line, and `grow` runs `eyas prompts` (Magpie, then requests about
documents) under its deadline with the toy target."""

from __future__ import annotations

import gzip
import importlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str):
    """A benchmark script as a module under its own name (its dataclasses and its neighbours resolve)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def dm():
    return load_script("drafter_mix")


def write(path: Path, texts: list[str], source: str) -> Path:
    path.write_text("".join(json.dumps({"id": f"{source}-{i}", "messages": [{"role": "user", "content": t}],
                                        "source": {"set": source}}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.mark.unit
def test_interleave_keeps_every_prefix_in_the_weights_proportion(dm):
    groups = {"a": list(range(300)), "b": list(range(100)), "c": list(range(40))}
    out = dm.interleave(groups, {"a": 3.0, "b": 1.0, "c": 1.0})
    assert Counter(g for g, _ in out) == {"a": 300, "b": 100, "c": 40}  # everything, once
    for g in groups:  # each group's items in their own order
        assert [x for h, x in out if h == g] == groups[g]
    for n in range(1, 200):  # before c runs out (at 200 items): within one of n x share
        taken = Counter(g for g, _ in out[:n])
        for g, share in (("a", 0.6), ("b", 0.2), ("c", 0.2)):
            assert abs(taken[g] - n * share) <= 1, (n, g, taken)
    taken = Counter(g for g, _ in out[:360])  # after c ran out, a and b share its turns 3:1
    assert taken["c"] == 40 and abs(taken["a"] - 3 * taken["b"]) <= 3
    with pytest.raises(ValueError, match="weights: expected > 0"):
        dm.interleave(groups, {"a": 1.0, "b": 0.0, "c": 1.0})


@pytest.mark.unit
def test_mix_drops_duplicates_keeps_sources_adds_follow_ups_and_estimates_long_prompts(dm, tmp_path):
    shared = write(tmp_path / "shared.jsonl", [f"question {i}" for i in range(20)], "shared")
    magpie = write(tmp_path / "magpie.jsonl", [f"write a poem about {i}" for i in range(40)] + ["Question  0"], "magpie")
    docs = write(tmp_path / "docs.jsonl", [("long text " * 600) + f"summarize {i}" for i in range(10)], "documents")
    parts = [dm.MixPart("shared", shared, 1.0), dm.MixPart("magpie", magpie, 2.0, follow_ups=True),
             dm.MixPart("open", tmp_path / "missing.jsonl", 1.0), dm.MixPart("documents", docs, 1.0)]
    out = tmp_path / "mix.jsonl"
    rep = dm.mix(parts, out, seed=3, follow_up_share=0.5, count_tokens=lambda texts: [len(t.split()) for t in texts])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rep["prompts"] == len(rows) == 20 + 40 + 10  # "Question  0" is shared's "question 0" folded
    assert rep["parts"]["magpie"] == {"path": str(magpie), "read": 41, "kept": 40, "weight": 2.0,
                                      "with_follow_up": rep["parts"]["magpie"]["with_follow_up"]}
    assert rep["parts"]["open"]["read"] == 0
    assert all(r["mix_part"] == r["source"]["set"] for r in rows)  # each record keeps where it came from
    two = [r for r in rows if len(r["messages"]) == 2]
    assert two and {r["mix_part"] for r in two} == {"magpie"} and len(two) == rep["parts"]["magpie"]["with_follow_up"]
    assert all(r["messages"][1]["content"] in dm.FOLLOW_UPS for r in two)
    # documents (10 of 70) run out first, at 10 / (1/4) = 40 prompts: the prefix before is in proportion
    assert rep["balanced_prefix"] == [i for i, r in enumerate(rows) if r["mix_part"] == "documents"][-1] + 1
    n, taken = rep["balanced_prefix"], Counter(r["mix_part"] for r in rows[:rep["balanced_prefix"]])
    assert taken["documents"] == 10 and all(abs(taken[p] - n * w / 4) <= 1 for p, w in (("shared", 1), ("magpie", 2)))
    est = rep["long_share_estimate"]  # whitespace "tokens" here: only the documents exceed 1,000
    assert est["sample"] == 70 and est["over_1000_tokens"] == round(10 / 70, 4)
    assert not list(tmp_path.glob("*.tmp"))  # written to a temp file, then renamed


@pytest.mark.unit
def test_a_torn_last_line_is_skipped_and_any_other_bad_line_named(dm, tmp_path):
    f = write(tmp_path / "p.jsonl", ["one", "two\u2028lines"], "x")  # U+2028: no line end in JSON
    f.write_text(f.read_text() + '{"id": "torn", "mess')  # a writer killed mid-line
    assert [r["id"] for r in dm.read_prompts(f)] == ["x-0", "x-1"]
    f.write_text(json.dumps({"id": "y", "messages": [{"role": "user", "content": "a\u2028b"}]}, ensure_ascii=False)
                 + "\n" + f.read_text(), encoding="utf-8")
    assert [r["messages"][0]["content"] for r in dm.read_prompts(f)] == ["a\u2028b", "one", "two\u2028lines"]
    f.write_text('{"id": 1\n' + f.read_text())
    with pytest.raises(ValueError, match=r"p.jsonl:1: not JSON"):
        dm.read_prompts(f)
    f.write_text(json.dumps({"id": "a", "messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: messages: expected a list ending with a user turn"):
        dm.read_prompts(f)


@pytest.mark.integration
@pytest.mark.usefixtures("one_thread")
def test_grow_runs_eyas_prompts_for_magpie_then_documents_within_its_deadline(dm, toy_drafter, tmp_path):
    target, _ = toy_drafter
    train = load_script("train_smollm2_drafter")
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "d1", "text": "The river rose in the spring. " * 40}) + "\n")
    t0 = time.time()
    rep = dm.grow(str(target), tmp_path, time.time() + 240, train.run_cli, magpie=2, documents=docs, doc_prompts=1,
                  rows=1, device="cpu", last_json=train.last_json, max_new_tokens=8)
    assert time.time() - t0 < 240
    assert set(rep) == {"magpie", "doc_prompts"}
    assert rep["magpie"]["asked"] == {"max_new_tokens": 8, "temperatures": None}
    assert rep["doc_prompts"]["asked"] == {"max_new_tokens": 8, "temperatures": "0.7,0.9"}
    for name, r in rep.items():  # the random toy never ends a turn: every continuation asked is rejected
        assert r["exit"] == 0, r
        assert r["path"] == str(tmp_path / f"{name}.jsonl") and r["prompts"] == 0
        assert r["generated"] > 0 and r["rejected"]["no_end_of_turn"] == r["generated"]


@pytest.mark.unit
def test_prompts_about_documents_travel_without_the_documents_and_come_back_equal(dm, tmp_path):
    from eyas.data.prompts import Document, document_prompt

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Document {i}. " * 50}) + "\n" for i in range(3)))
    full = tmp_path / "doc_prompts.jsonl"
    recs = [{"id": f"magpie-0-{i}", "messages": [{"role": "user", "content": document_prompt(
        Document(f"d{i % 3}", f"Document {i % 3}. " * 50), f"Summarize it, take {i}.")}],
        "source": {"generator": "magpie", "temperature": 1.0, "document": f"d{i % 3}", "request": f"Summarize it, take {i}."}}
        for i in range(5)]
    cut = Document("d1", ("Document 1. " * 50)[:30])  # eyas prompts --max-document-tokens: a prefix, its length kept
    recs.append({"id": "magpie-1-0", "messages": [{"role": "user", "content": document_prompt(cut, "And this?")}],
                 "source": {"document": "d1", "document_chars": 30, "request": "And this?"}})
    full.write_text("".join(json.dumps(r) + "\n" for r in recs))
    small = tmp_path / "doc_requests.jsonl.gz"
    assert dm.compact_documents(full, small) == 6
    assert small.stat().st_size < full.stat().st_size / 4  # the documents stay behind
    back = tmp_path / "back.jsonl"
    assert dm.expand_documents(small, docs, back) == 6
    assert [json.loads(x) for x in back.read_text().splitlines()] == recs
    docs.write_text(json.dumps({"id": "d0", "text": "only one"}) + "\n")
    with pytest.raises(ValueError, match=r"doc_requests.jsonl.gz:2: source.document: expected an id of .*docs.jsonl, found 'd1'"):
        dm.expand_documents(small, docs, back)


@pytest.mark.integration
def test_a_staged_run_resumes_from_grown_prompts_mixes_them_and_stops_after_the_mix(dm, toy_drafter, tmp_path):
    """`run --grown DIR --stop-after mix`: an earlier stage's Magpie file and compact document
    requests start this run's files; the mix holds every part; the stage's outputs are written again."""
    from eyas.data.prompts import Document, document_prompt

    target, _ = toy_drafter
    train = load_script("train_smollm2_drafter")
    grown = tmp_path / "grown"
    grown.mkdir()
    magpie = write(tmp_path / "magpie.jsonl", [f"tell me about {i}" for i in range(6)], "magpie")
    with magpie.open("rb") as f, gzip.open(grown / "magpie.jsonl.gz", "wb") as g:
        g.write(f.read())
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "d0", "text": "A long text. " * 30}) + "\n")
    asked = tmp_path / "asked.jsonl"
    asked.write_text("".join(json.dumps({"id": f"magpie-0-{i}", "messages": [{"role": "user", "content": document_prompt(
        Document("d0", "A long text. " * 30), f"Question {i}?")}], "source": {"document": "d0", "request": f"Question {i}?"}})
        + "\n" for i in range(3)))
    dm.compact_documents(asked, grown / "doc_requests.jsonl.gz")
    shared = write(tmp_path / "shared.jsonl", [f"shared {i}" for i in range(4)], "shared")
    opened = write(tmp_path / "open.jsonl", [f"translate {i}" for i in range(5)], "open")
    work = tmp_path / "work"
    assert train.main(["run", "--target", str(target), "--prompts", str(shared), "--work", str(work), "--device", "cpu",
                       "--grown", str(grown), "--documents", str(docs), "--open-prompts", str(opened),
                       "--stop-after", "mix", "--no-copy-to-out"]) == 0
    summary = json.loads((work / "summary.json").read_text())
    assert "grow" not in summary  # nothing asked of eyas prompts: --magpie and --doc-prompts are 0
    parts = summary["mix"]["parts"]
    assert {k: v["kept"] for k, v in parts.items()} == {"shared": 4, "magpie": 6, "open": 5, "documents": 3}
    rows = [json.loads(x) for x in (work / "mix.jsonl").read_text().splitlines()]
    assert len(rows) == 18 and summary["mix"]["long_share_estimate"]["sample"] == 18
    assert sorted(r["messages"][0]["content"] for r in rows if r["mix_part"] == "documents") == \
        sorted(json.loads(x)["messages"][0]["content"] for x in asked.read_text().splitlines())
    assert not (work / "answers.jsonl").exists()  # stopped after the mix
    with gzip.open(work / "magpie.jsonl.gz", "rt") as f:
        assert f.read() == magpie.read_text()
    with gzip.open(work / "doc_requests.jsonl.gz", "rt") as f, gzip.open(grown / "doc_requests.jsonl.gz", "rt") as g:
        assert f.read() == g.read()
    code = train.main(["run", "--target", str(target), "--prompts", str(shared), "--work", str(tmp_path / "w2"),
                       "--device", "cpu", "--grown", str(grown), "--open-prompts", str(opened), "--stop-after", "mix"])
    assert code == 2  # document requests without the documents they are about


@pytest.mark.unit
def test_the_committed_grown_prompts_are_what_their_source_file_says(dm, tmp_path):
    """benchmarks/grown/: each file's sha256 and record count as SOURCE.md states them; the Magpie
    turns read as prompts; every document request names its document and holds its request."""
    import hashlib
    import re

    grown = BENCHMARKS / "grown"
    table = {m.group(1): (int(m.group(2).replace(",", "")), m.group(3)) for m in re.finditer(
        r"\| `([\w.]+\.gz)` \| ([\d,]+) \| `([0-9a-f]{64})` \|", (grown / "SOURCE.md").read_text())}
    assert set(table) == {"magpie.jsonl.gz", "doc_requests.jsonl.gz"}
    for name, (_, sha) in table.items():
        assert hashlib.sha256((grown / name).read_bytes()).hexdigest() == sha, name
    magpie = tmp_path / "magpie.jsonl"
    magpie.write_bytes(gzip.decompress((grown / "magpie.jsonl.gz").read_bytes()))
    rows = dm.read_prompts(magpie)
    assert len(rows) == table["magpie.jsonl.gz"][0] == len({r["messages"][0]["content"] for r in rows})
    requests = [json.loads(x) for x in gzip.decompress((grown / "doc_requests.jsonl.gz").read_bytes()).split(b"\n") if x]
    assert len(requests) == table["doc_requests.jsonl.gz"][0]
    assert all(r["source"]["document"] and r["source"]["request"].strip() and "messages" not in r for r in requests)


@pytest.mark.unit
def test_the_mix_counts_every_prompt_when_asked_in_chunks(dm, tmp_path):
    magpie = write(tmp_path / "m.jsonl", [f"question {i}" for i in range(5000)], "magpie")
    docs = write(tmp_path / "d.jsonl", [("word " * 1200) + f"{i}" for i in range(3)], "documents")
    calls: list[int] = []

    def count(texts):
        calls.append(len(texts))
        return [len(t.split()) for t in texts]

    rep = dm.mix([dm.MixPart("magpie", magpie, 1.0), dm.MixPart("documents", docs, 1.0)], tmp_path / "mix.jsonl",
                 count_tokens=count, sample=0)
    est = rep["long_share_estimate"]
    assert est["exact"] and est["sample"] == 5003 and est["prompts_over_1000"] == 3
    assert est["over_1000_tokens"] == round(3 / 5003, 4) and calls == [4096, 907]  # chunks of 4,096
