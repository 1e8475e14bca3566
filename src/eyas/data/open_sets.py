"""Open prompt sets: files from public GitHub repositories under permissive licences, pinned by
commit and sha256, turned into user prompts (``eyas open-prompts``).

Why. A drafter accepts well near its training prompts and much less elsewhere (issue 34: 0.82
first-draft acceptance on MT-bench, 0.62-0.69 on translation, summarization, RAG and hard
prompts), and serving reads long contexts. These sets add what ``../shared/data`` lacks: long
documents to summarize or answer questions about, translation pairs, math and code tasks.

Shape. :data:`OPEN_SETS` is the registry: each :class:`OpenSet` names its files
(:class:`OpenFile`: repo, commit, path, sha256, bytes), its licence, its kind and the reader that
turns its files into prompts (:data:`eyas.data.open_readers.READERS`, by name). :func:`fetch_file`
gets a file from ``raw.githubusercontent.com`` at its commit into eyas' cache
(``$EYAS_CACHE/open_sets/<sha256>``, written to a temporary name, checked, then renamed) or takes
it from a directory of local copies (``files_dir``: ``<repo with / as __>/<path>``, for machines
without network), and refuses a file whose sha256 differs, naming the file, the expected and the
found digest. Invariant: every prompt written carries its source (set, repo, commit, path,
licence), so a dataset built from them says where each prompt came from and under what terms.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError
from eyas.targets.loading import cache_root

KINDS = ("rag_qa", "summarize", "translate", "math", "code", "writing")
RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"


@dataclass(frozen=True)
class OpenFile:
    repo: str  # owner/name on GitHub
    commit: str  # 40 hex digits: the file as it was at this commit
    path: str  # in the repository
    sha256: str  # of the file's bytes
    bytes: int

    def local_name(self) -> str:
        """Where a directory of local copies holds it (``files_dir``)."""
        return f"{self.repo.replace('/', '__')}/{self.path}"


@dataclass(frozen=True)
class OpenSet:
    name: str
    kind: str  # one of KINDS: what its prompts ask
    licence: str  # SPDX id (and where the repository states it)
    reader: str  # a name in eyas.data.open_readers.READERS
    files: tuple[OpenFile, ...]
    options: tuple[tuple[str, str], ...] = ()  # the reader's settings (languages, templates, ...)
    note: str = ""

    def option(self, key: str, default: str = "") -> str:
        return dict(self.options).get(key, default)


class OpenSetError(EyasError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_file(f: OpenFile, files_dir: Path | None = None, cache: Path | None = None, timeout: float = 60.0) -> Path:
    """The file's bytes on disk, checked against its sha256 (module docstring)."""
    if files_dir is not None:
        path = Path(files_dir) / f.local_name()
        if not path.is_file():
            raise OpenSetError(f"{path}: no such file (--files {files_dir} holds local copies as "
                               f"<owner>__<name>/<path>; this one is {f.repo}@{f.commit[:10]}:{f.path})")
    else:
        path = (cache or cache_root() / "open_sets") / f.sha256
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            url = RAW_URL.format(repo=f.repo, commit=f.commit, path=f.path)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as out:
                    while block := r.read(1 << 20):
                        out.write(block)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise OpenSetError(f"{url}: could not download it ({e}); on a machine without network, "
                                   "download it elsewhere and pass --files DIR") from None
            found = _sha256(tmp)
            if found != f.sha256:
                tmp.unlink(missing_ok=True)
                raise OpenSetError(f"{url}: sha256 expected {f.sha256}, found {found} (the file changed or the "
                                   "download was cut)")
            os.replace(tmp, path)
            return path
    found = _sha256(path)
    if found != f.sha256:
        raise OpenSetError(f"{path} ({f.repo}@{f.commit[:10]}:{f.path}): sha256 expected {f.sha256}, found {found}")
    return path


def _gh(repo: str, commit: str, path: str, sha256: str, size: int) -> OpenFile:
    return OpenFile(repo, commit, path, sha256, size)


# The registry (module docstring). Each file was read at its commit and its sha256 computed from
# those bytes; the licence is the repository's, as stated in the file named.
OPEN_SETS: dict[str, OpenSet] = {}


def register(s: OpenSet) -> OpenSet:
    if s.kind not in KINDS:
        raise ValueError(f"open set {s.name}: kind expected one of {list(KINDS)}, found {s.kind!r}")
    OPEN_SETS[s.name] = s
    return s
