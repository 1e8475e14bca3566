"""``eyas open-prompts``' writer: every set's reader run over its checked files, exact duplicates
dropped, each prompt written with its source and licence, the documents the prompts are about
written once each.

Invariants: ``out`` is written atomically (a changed file or no network leaves it as it was);
prompts keep their readers' order; a document is kept even when its prompt is a duplicate
(requests grown earlier refer to it by id); lengths are in the tokenizer's tokens when one is given,
counted in batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import eyas.data.open_tasks  # noqa: F401  registers the long-document readers (passage_tasks, squad_rag)
from eyas.data.open_readers import READERS
from eyas.data.open_sets import OPEN_SETS, OpenSetError, fetch_file
from eyas.data.prompts import fold
from eyas.io import atomic_write, atomic_write_text


@dataclass
class OpenPromptsResult:
    out_path: Path
    per_set: dict[str, int] = field(default_factory=dict)
    per_kind: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    lengths: list[int] = field(default_factory=list)  # tokens (with a tokenizer) or characters, per prompt
    unit: str = "chars"
    documents: int = 0  # written to documents_out

    @property
    def written(self) -> int:
        return sum(self.per_set.values())

    def share_over(self, n: int) -> float:
        return sum(x > n for x in self.lengths) / len(self.lengths) if self.lengths else 0.0

    def to_dict(self) -> dict[str, Any]:
        s = sorted(self.lengths)
        pick = (lambda q: s[min(len(s) - 1, int(q * len(s)))] if s else 0)
        return {"out": str(self.out_path), "written": self.written, "per_set": self.per_set, "per_kind": self.per_kind,
                "duplicates_dropped": self.duplicates, "documents": self.documents, "length_unit": self.unit,
                "length_p50": pick(0.5), "length_p90": pick(0.9),
                "share_over_1000": round(self.share_over(1000), 4) if self.unit == "tokens" else None}


def write_open_prompts(names: Sequence[str], out: Path, *, files_dir: Path | None = None, max_per_set: int | None = None,
                       tokenizer: Any = None, documents_out: Path | None = None,
                       on_set: Callable[[str, int], None] | None = None) -> OpenPromptsResult:
    """The prompts of the sets ``names`` (all of :data:`OPEN_SETS` if empty) into ``out`` (module
    docstring); lengths in the tokenizer's tokens when one is given. ``documents_out``: the long
    documents the prompts are about, once each (``{"id", "text", "source"}`` lines), for
    ``eyas prompts --documents`` (the target writes more requests about each)."""
    unknown = [n for n in names if n not in OPEN_SETS]
    if unknown:
        raise OpenSetError(f"--sets: unknown {unknown}; the sets are {sorted(OPEN_SETS)}")
    result = OpenPromptsResult(Path(out), unit="tokens" if tokenizer is not None else "chars")
    documents: dict[str, dict[str, Any]] = {}
    pending: list[str] = []  # texts whose tokens are not counted yet

    def count_pending() -> None:
        if pending:
            result.lengths.extend(len(ids) for ids in tokenizer(pending, add_special_tokens=False)["input_ids"])
            pending.clear()

    def write(tmp: str) -> None:
        seen: set[str] = set()
        with open(tmp, "w", encoding="utf-8") as f:
            for name in names or sorted(OPEN_SETS):
                s = OPEN_SETS[name]
                paths = [fetch_file(x, files_dir) for x in s.files]
                n = 0
                for p in READERS[s.reader](s, paths):
                    if max_per_set is not None and n >= max_per_set:
                        break
                    src = s.files[p.file]
                    source = {"set": s.name, "kind": p.kind, "repo": src.repo, "commit": src.commit, "path": src.path,
                              "licence": s.licence}
                    if p.document_id and p.document_id not in documents:  # even under a duplicate prompt: requests
                        # grown earlier refer to it by id
                        documents[p.document_id] = {"id": p.document_id, "text": p.document,
                                                    "source": {k: v for k, v in source.items() if k != "kind"}}
                    key = fold(p.text)
                    if key in seen:
                        result.duplicates += 1
                        continue
                    seen.add(key)
                    f.write(json.dumps({"id": p.id, "messages": [{"role": "user", "content": p.text}],
                                        "source": source}, ensure_ascii=False) + "\n")
                    n += 1
                    result.per_kind[p.kind] = result.per_kind.get(p.kind, 0) + 1
                    if tokenizer is None:
                        result.lengths.append(len(p.text))
                    else:  # counted in batches: a fast tokenizer encodes a batch on every core
                        pending.append(p.text)
                        if len(pending) == 1024:
                            count_pending()
                count_pending()
                result.per_set[name] = n
                if on_set is not None:
                    on_set(name, n)

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, write)  # a failure (a changed file, no network) leaves ``out`` as it was
    if documents_out is not None:
        atomic_write_text(documents_out, "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in documents.values()))
    result.documents = len(documents)
    return result

