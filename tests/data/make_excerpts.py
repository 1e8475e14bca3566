"""Rebuild the excerpts in tests/data from a full copy of the public prompt sets.

    python tests/data/make_excerpts.py /path/to/shared/data

The tests never read outside the repository: they read these excerpts, a few records of each upstream
file, so that a clean clone (CI) runs every test. Which records each excerpt keeps, and why, is in
EXCERPTS below; SOURCE.md names the upstream repository, path, commit and licence of every file.

How a file is cut, by kind (so that the reader's format detection sees what it sees upstream):
- JSON Lines (``.jsonl``): the kept lines, byte for byte;
- gzipped JSON Lines (``.jsonl.gz``): the kept lines, gzipped again with no timestamp (reproducible);
- a JSON array (``.json``): the kept elements, written with the upstream file's indentation and
  ASCII escapes (json.dumps' defaults, as upstream).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SG90K = "sharegpt_prompts/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json"
# The 21 unusable records of the 2,978-prompt ShareGPT sample (each one a case the reader must
# report: an assistant turn first, a system message alone, empty or zero-width content), with five
# usable neighbours so that skipped and kept records interleave as upstream.
SG90K_BAD = [1015, 1697, 1812, 1814, 1816, 1817, 1826, 1828, 2046, 2047, 2049, 2050, 2057, 2059, 2061,
             2062, 2064, 2065, 2830, 2976, 2977]
SG90K_KEEP = sorted(SG90K_BAD + [1014, 1016, 1696, 2829, 2975])

# relative path -> the upstream record indices kept (a range: the first records)
EXCERPTS: dict[str, list[int]] = {
    "mt_bench/question.jsonl": list(range(4)),
    "mt_bench/reference_answer_gpt-4.jsonl": list(range(2)),
    "eagle_eval/mt_bench_question.jsonl": list(range(4)),
    "eagle_eval/humaneval_question.jsonl": list(range(4)),
    "eagle_eval/gsm8k_question.jsonl": list(range(4)),
    "eagle_eval/alpaca_question.jsonl": list(range(4)),
    "eagle_eval/sum_question.jsonl": list(range(2)),  # long articles: two are enough
    "eagle_eval/qa_question.jsonl": list(range(4)),
    "arena_hard/v0.1_question.jsonl": list(range(4)),
    "gsm8k/train.jsonl": list(range(96)),  # tests/support/toy.py asks for up to 96 questions
    "gsm8k/test.jsonl": list(range(4)),
    "self_instruct/seed_tasks.jsonl": list(range(4)),
    "self_instruct/user_oriented_instructions.jsonl": list(range(4)),
    "alpaca_eval/instructions.jsonl": list(range(4)),
    "humaneval/HumanEval.jsonl.gz": list(range(3)),
    "sharegpt_prompts/ShareGPT_V3_filtered_500.json": list(range(5)),
    "sharegpt_prompts/ShareGPT_V3_filtered_1000.json": list(range(5)),
    "fastchat_dummy/dummy_conversation.json": list(range(6)),  # 4, 2, 6, 4, 2, 6 messages
    SG90K: SG90K_KEEP,
}


def json_indent(text: str) -> int | None:
    """The indentation of a JSON array file: None when written on one line, else the spaces before
    its first element."""
    lines = text.splitlines()
    if len(lines) < 2:
        return None
    return len(lines[1]) - len(lines[1].lstrip(" "))


def cut(src: Path, dst: Path, keep: list[int]) -> int:
    """Write the records ``keep`` of ``src`` to ``dst``; returns how many were written."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.name.endswith(".jsonl.gz"):
        lines = gzip.decompress(src.read_bytes()).splitlines(keepends=True)
        with dst.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(b"".join(lines[i] for i in keep))
    elif src.suffix == ".jsonl":
        lines = src.read_bytes().splitlines(keepends=True)
        dst.write_bytes(b"".join(lines[i] for i in keep))
    elif src.suffix == ".json":
        text = src.read_text(encoding="utf-8")
        records = json.loads(text)
        dst.write_text(json.dumps([records[i] for i in keep], indent=json_indent(text)) + "\n", encoding="utf-8")
    else:
        raise ValueError(f"{src}: no rule to cut a {src.suffix!r} file (expected .jsonl, .jsonl.gz or .json)")
    return len(keep)


def main(source: Path) -> None:
    for rel, keep in EXCERPTS.items():
        n = cut(source / rel, HERE / rel, keep)
        print(f"{rel}: {n} records")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
