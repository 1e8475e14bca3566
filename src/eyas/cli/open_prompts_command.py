"""`eyas open-prompts`: user prompts from open sets on GitHub (pinned by commit and sha256, each
prompt with its source and licence), as `eyas regenerate` reads them.

    eyas open-prompts --out open.jsonl [--sets xquad-en,...] [--files DIR] [--max-per-set N]
                      [--target smollm2] [--documents-out docs.jsonl] [--list] [--json]

Exit code 2 for unusable input (an unknown set, a file whose sha256 differs, no network and no --files).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import typer

from eyas.cli.common import console, fail
from eyas.cli.common import print_json as _print_json
from eyas.cli.common import run as _run


def _files_line(files: list[str]) -> str:
    """A set's files (``owner/name@commit:path``) for a person: each one when they are few, else
    counted (a manifest pins hundreds), per repository or, over three, per owner."""
    if len(files) <= 8:
        return ", ".join(files)
    repos = Counter(f.split("@")[0] for f in files)
    if len(repos) <= 3:
        return ", ".join(f"{n} files of {repo}" for repo, n in repos.items())
    return f"{len(files)} files of {len(repos)} repositories of {', '.join(sorted({r.split('/')[0] for r in repos}))}"


def open_prompts_cmd(
    out: Optional[Path] = typer.Option(None, help="JSONL of user prompts to write (replaced at the end)"),
    sets: str = typer.Option("", help="comma-separated set names (default: all; --list names them)"),
    files: Optional[Path] = typer.Option(None, help="local copies of the files as <owner>__<name>/<path> "
                                                    "(default: downloaded at their commit into eyas' cache)"),
    max_per_set: Optional[int] = typer.Option(None, min=1, help="at most this many prompts a set"),
    target: Optional[str] = typer.Option(None, help="count lengths in this target's tokens (the share over 1,000)"),
    documents_out: Optional[Path] = typer.Option(None, help="also write the long documents, once each, for "
                                                            "`eyas prompts --documents` (the target asks about them)"),
    list_sets: bool = typer.Option(False, "--list", help="print the sets (source, licence, kind) and exit"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Write user prompts from open prompt sets: long documents to summarize or answer questions
    about, translation pairs, math and code tasks."""
    from eyas.data.open_writer import write_open_prompts
    from eyas.data.open_sets import OPEN_SETS

    if list_sets:
        rows = [{"name": s.name, "kind": s.kind, "licence": s.licence,
                 "files": [f"{f.repo}@{f.commit[:10]}:{f.path}" for f in s.files], "note": s.note}
                for s in OPEN_SETS.values()]
        if json_out:
            _print_json(rows)
        else:
            for r in rows:
                console.print(f"{r['name']} ({r['kind']}, {r['licence']}): {_files_line(r['files'])}",
                              highlight=False, soft_wrap=True)
        return
    if out is None:
        fail("--out: expected the JSONL file to write, found none")
    tokenizer = None
    if target is not None:
        from eyas.targets.loading import load_tokenizer

        tokenizer = _run(load_tokenizer, target)
    names = [x.strip() for x in sets.split(",") if x.strip()]
    def on_set(name: str, n: int) -> None:
        if not json_out:
            console.print(f"{name}: {n} prompts", highlight=False)

    result = _run(write_open_prompts, names, out, files_dir=files, max_per_set=max_per_set, tokenizer=tokenizer,
                  documents_out=documents_out, on_set=on_set)
    report = {"command": "open-prompts", **result.to_dict()}
    if json_out:
        _print_json(report)
        return
    share = report["share_over_1000"]
    console.print(f"open-prompts -> {result.out_path}: {result.written} prompts "
                  f"({', '.join(f'{k} {v}' for k, v in sorted(result.per_kind.items()))}); "
                  f"{result.duplicates} duplicates dropped; median {report['length_p50']} {result.unit}"
                  + (f", {share:.0%} over 1,000 tokens" if share is not None else ""), highlight=False)


def register(app: typer.Typer) -> None:
    app.command("open-prompts")(open_prompts_cmd)
