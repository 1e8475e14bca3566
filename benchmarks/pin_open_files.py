"""Pin the files of a local git snapshot as an open set's manifest (``src/eyas/data/manifests``).

A manifest is what :func:`eyas.data.open_sets.manifest_files` reads: one line a file, tab-separated
``repo commit path sha256 bytes genre title``. The sha256 is of the file's bytes at ``commit`` (read
with ``git show``, never from a work tree, so line-ending filters cannot change them), and the
bytes are copied to ``--files DIR`` as ``<owner>__<name>/<path>``, the layout of ``eyas
open-prompts --files``, so the device machine (no network) builds the same prompts.

    python benchmarks/pin_open_files.py --git /path/to/repo.git --repo python/peps \
        --include 'peps/pep-*.rst' --require 'public domain|CC0' --genre technical \
        --files .device/open/files --out src/eyas/data/manifests/python-peps.tsv

Titles: a PEP's ``Title:`` header, a Markdown file's first ``#`` heading, an RST file's first
underlined line, or the path (code). ``--require`` keeps only files whose text matches (a PEP's
copyright section states its terms; a few early ones are under other terms). ``--books TSV`` turns
a list of pinned books (``repo commit path sha256 bytes title category``) into a manifest instead.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import re
import subprocess
from pathlib import Path

MIN_BYTES = 1200  # a file smaller than this makes no long prompt


def title_of(path: str, text: str) -> str:
    m = re.search(r"^PEP:\s*(\d+)\s*$", text, re.M)
    t = re.search(r"^Title:\s*(.+)$", text, re.M)
    if m and t:
        return f"PEP {int(m.group(1))}: {t.group(1).strip()}"
    if path.endswith(".md"):
        h = re.search(r"^#\s+(.+?)(?:\s*\{\s*#[^}]*\})?\s*$", text, re.M)
        if h:
            return h.group(1).strip()
    if path.endswith(".rst"):
        h = re.search(r"^([^\s.][^\n]{2,})\n([=\-~^*#])\2{2,}\s*$", text, re.M)
        if h:
            return h.group(1).strip()
    return path


def pin(git: Path, repo: str, includes: list[str], require: str | None, genre: str, files: Path,
        min_bytes: int = MIN_BYTES) -> list[str]:
    commit = subprocess.check_output(["git", "-C", str(git), "rev-parse", "HEAD"], text=True).strip()
    listing = subprocess.check_output(["git", "-C", str(git), "ls-tree", "-r", "--name-only", commit], text=True)
    rows = []
    for path in sorted(listing.splitlines()):
        if not any(fnmatch.fnmatch(path, pat) for pat in includes):
            continue
        data = subprocess.check_output(["git", "-C", str(git), "show", f"{commit}:{path}"])
        text = data.decode("utf-8", errors="replace")
        if len(data) < min_bytes or (require and not re.search(require, text, re.I)):
            continue
        dest = files / repo.replace("/", "__") / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        title = " ".join(title_of(path, text).split()).replace("\t", " ")
        rows.append("\t".join([repo, commit, path, hashlib.sha256(data).hexdigest(), str(len(data)), genre, title]))
    return rows


def books(tsv: Path) -> list[str]:
    rows = []
    for line in tsv.read_text(encoding="utf-8").splitlines():
        if line.strip():
            repo, commit, path, sha, size, title, *_ = line.split("\t")
            rows.append("\t".join([repo, commit, path, sha, size, "prose", title]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--git", type=Path, help="a git directory (bare or not) of the repository")
    ap.add_argument("--repo", help="owner/name on GitHub")
    ap.add_argument("--include", action="append", default=[], help="a glob of paths to pin (repeatable)")
    ap.add_argument("--require", default=None, help="keep only files whose text matches this regular expression")
    ap.add_argument("--genre", default="technical", choices=["prose", "technical", "code"])
    ap.add_argument("--min-bytes", type=int, default=MIN_BYTES)
    ap.add_argument("--files", type=Path, default=Path(".device/open/files"))
    ap.add_argument("--books", type=Path, default=None, help="a TSV of pinned books instead of --git")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--append", action="store_true", help="add to --out rather than replace it")
    a = ap.parse_args()
    rows = books(a.books) if a.books else pin(a.git, a.repo, a.include, a.require, a.genre, a.files, a.min_bytes)
    old = a.out.read_text(encoding="utf-8").splitlines() if a.append and a.out.exists() else []
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(old + rows) + "\n", encoding="utf-8")
    print(f"{a.out}: {len(rows)} files pinned, {sum(int(r.split(chr(9))[4]) for r in rows):,} bytes")


if __name__ == "__main__":
    main()
