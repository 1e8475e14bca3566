"""Open prompt sets: files from public GitHub repositories under permissive licences, pinned by
commit and sha256, turned into user prompts (``eyas open-prompts``).

Why. A drafter accepts well near its training prompts and much less elsewhere (issue 34: 0.82
first-draft acceptance on MT-bench, 0.62-0.69 on translation, summarization, RAG and hard
prompts), and serving reads long contexts. These sets add what ``../shared/data`` lacks: long
documents to summarize or answer questions about, translation pairs, math and code tasks.

Shape. :data:`OPEN_SETS` is the registry: each :class:`OpenSet` names its files
(:class:`OpenFile`: repo, commit, path, sha256, bytes), its licence, its kind and the reader that
turns its files into prompts (:data:`eyas.data.open_readers.READERS`, by name). A set of many files
(a repository's documentation and source, 94 books) is pinned in ``manifests/<name>.tsv``
(:func:`manifest_files`; ``benchmarks/pin_open_files.py`` writes one). :func:`fetch_file`
gets a file from ``raw.githubusercontent.com`` at its commit into eyas' cache
(``$EYAS_CACHE/open_sets/<sha256>``, checked before :func:`eyas.io.atomic_write` moves it in place) or takes
it from a directory of local copies (``files_dir``: ``<repo with / as __>/<path>``, for machines
without network), and refuses a file whose sha256 differs, naming the file, the expected and the
found digest. Invariant: every prompt written carries its source (set, repo, commit, path,
licence), so a dataset built from them says where each prompt came from and under what terms.
"""

from __future__ import annotations

import hashlib
import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from eyas.errors import EyasError
from eyas.io import atomic_write
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
    genre: str = ""  # a manifest's files: prose, technical or code (which requests a passage gets)
    title: str = ""  # a manifest's files: what a request calls the file ("PEP 8: Style Guide ...")

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
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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

            def download(tmp: str) -> None:  # checked before it takes its place
                try:
                    with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as out:
                        shutil.copyfileobj(r, out, 1 << 20)
                except OSError as e:
                    raise OpenSetError(f"{url}: could not download it ({e}); on a machine without network, "
                                       "download it elsewhere and pass --files DIR") from None
                found = _sha256(Path(tmp))
                if found != f.sha256:
                    raise OpenSetError(f"{url}: sha256 expected {f.sha256}, found {found} (the file changed or the "
                                       "download was cut)")

            atomic_write(path, download)
            return path
    found = _sha256(path)
    if found != f.sha256:
        raise OpenSetError(f"{path} ({f.repo}@{f.commit[:10]}:{f.path}): sha256 expected {f.sha256}, found {found}")
    return path


def _gh(repo: str, commit: str, path: str, sha256: str, size: int) -> OpenFile:
    return OpenFile(repo, commit, path, sha256, size)


MANIFESTS = Path(__file__).with_name("manifests")


def manifest_files(name: str, root: Path = MANIFESTS) -> tuple[OpenFile, ...]:
    """A set of many files, pinned in ``manifests/<name>.tsv`` (``benchmarks/pin_open_files.py``
    writes it): one line a file, tab-separated ``repo commit path sha256 bytes genre title``."""
    path = root / f"{name}.tsv"
    files = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        cols = line.split("\t")
        if len(cols) != 7 or not cols[4].isdigit():
            raise OpenSetError(f"{path} line {n}: expected 7 tab-separated fields (repo commit path sha256 bytes "
                               f"genre title), found {len(cols)}: {line[:80]!r}")
        repo, commit, file_path, sha, size, genre, title = cols
        files.append(OpenFile(repo, commit, file_path, sha, int(size), genre, title))
    return tuple(files)


# The registry (module docstring). Each file was read at its commit and its sha256 computed from
# those bytes; the licence is the repository's, as stated in the file named.
OPEN_SETS: dict[str, OpenSet] = {}


def register(s: OpenSet) -> OpenSet:
    if s.kind not in KINDS:
        raise ValueError(f"open set {s.name}: kind expected one of {list(KINDS)}, found {s.kind!r}")
    OPEN_SETS[s.name] = s
    return s


LANGUAGES = "English,German,French,Spanish,Chinese,Japanese,Russian"

register(OpenSet(
    "xquad-en", "rag_qa", "CC-BY-SA-4.0 (README.md; CC-BY-SA4.0.txt)", "squad",
    (_gh("google-deepmind/xquad", "7d30520c717524000f0d9d2f9c10a069acd9d285", "xquad.en.json",
         "e4c57d1c9143aaa1c5d265ba5987a65f4e69528d2a98f29d6e75019b10344f29", 609383),),
    (("questions_per_article", "12"),),
    "48 Wikipedia articles of SQuAD v1.1 dev (about 900 tokens each): a summary and 12 questions an article"))
register(OpenSet(
    "squality", "rag_qa", "CC-BY-4.0 questions and summaries (README.md, data/LICENSE); stories public domain "
                          "(Project Gutenberg, data/GUTENBERG_LICENSE)", "squality",
    (_gh("nyu-mll/SQuALITY", "dc08d4f574639d773bc64ef3ab3527043108fb4e", "data/v1-3/txt/dev.jsonl",
         "e9cbb1daff74b70a6cd15641ba2f602a925761759200a17c9225aca90018a42b", 1474020),
     _gh("nyu-mll/SQuALITY", "dc08d4f574639d773bc64ef3ab3527043108fb4e", "data/v1-3/txt/test.jsonl",
         "5a485f30edebd16367427997ae82fac47bcd9ada9e7755c70a7d6569c0668c9c", 3039248)),
    note="77 short stories of about 7k tokens, 5 questions each (the first: the plot)"))
register(OpenSet(
    "qmsum", "summarize", "MIT (LICENSE); the AMI, ICSI and parliamentary transcripts' own terms are not stated",
    "qmsum",
    (_gh("Yale-LILY/QMSum", "83d7768c1f2b4dfeb091385d3dc7e239b8e5bb7e", "data/ALL/jsonl/val.jsonl",
         "fc7444e241bdbe6997c01720d07f1a58b7357284acb73f909766e5a4700db49f", 2714748),
     _gh("Yale-LILY/QMSum", "83d7768c1f2b4dfeb091385d3dc7e239b8e5bb7e", "data/ALL/jsonl/test.jsonl",
         "6bcd428211260ad2efae3af76cbaf6a7f5ae4bb5e1e59c45a4b8e89539cb9208", 2746108)),
    (("max_chars", "24000"), ("span_chars", "6000")),
    "70 meetings: general queries over a transcript's start, specific ones over a widened excerpt"))
_NTREX = ("MicrosoftTranslator/NTREX", "8561f6a622db9edad1217683e5c83daefd8bb2bf")
register(OpenSet(
    "ntrex-128", "translate", "CC-BY-SA-4.0 (LICENSE.md)", "parallel_lines",
    tuple(_gh(*_NTREX, f"NTREX-128/newstest2019-{name}.txt", sha, size) for name, sha, size in (
        ("src.eng", "389e8f5796c66db4f646dfad33e1ec622d74767af5ef112b42a1f2cd814df3cc", 251739),
        ("ref.deu", "259d7406a07b63e6b5b9c4a22fb76b85e2578a3fa0a4e541a50f4f7348e5c1b2", 306436),
        ("ref.fra", "1dd80d337f6a75c6ed579a95f09ca9b85d87d6e488d0a428c5f89cca99553136", 314688),
        ("ref.spa", "0ad8129e5ce0bea86ba7e0ea0db0504d6626b8a4d2a7cf4c44b7791c70e99b84", 299333),
        ("ref.zho-CN", "8bcd6f0868d33f26c8da12f55a82f66088a7b60a5f7b0b1a99dcec51daa8054a", 241603),
        ("ref.jpn", "4debd275d04414b71c95bad5f68e7275174e32a4ed33ece1b9a43a227aea2fca", 328104),
        ("ref.rus", "a7e3601298b0368659a5c006c52809cf6792e02eb94bde9b9693333278d85732", 505414))),
    (("languages", LANGUAGES),),
    "1,997 news sentences in 7 languages (an MT test set: do not evaluate on NTREX after training on it)"))
_FLORES = ("Helsinki-NLP/OPUS-MT-testsets", "ac0f19c0be3cb4e0d9450fcb2d7a9847c4bdd180")
register(OpenSet(
    "flores-200-devtest", "translate", "CC-BY-SA-4.0 (README.md, LICENSE-CC-BY-SA)", "parallel_lines",
    tuple(_gh(*_FLORES, f"datasets/facebook/flores/flores200_dataset/devtest/{name}.devtest", sha, size)
          for name, sha, size in (
        ("eng_Latn", "612e9fbe87997617c0fa8fa8929654a4f49b728d96738112c2b86ef6a1d78d88", 133108),
        ("deu_Latn", "9a1bfa90d153fedb7ff80047f4a63d493998888eddb056e8a28e24592f26e5f2", 157370),
        ("fra_Latn", "82f5b000db419ef9254eea7857cce82943b361090942f17ed696e3dce2944f42", 165038),
        ("spa_Latn", "40fcb836b49b0a461a14c00b8bce1f03113f8d2668132af424e74b2421d18ce9", 160955),
        ("zho_Hans", "b30158b1b76f7cee08530d8127a9769f4512597c7eefe97ae1ccf630d5b6e7fd", 121818),
        ("jpn_Jpan", "36b8e392ae9404a20e8448c731d16d957ac1b94588d97fb691128ae706b63606", 168121),
        ("rus_Cyrl", "cdc706ed862d1d35d8d67cfda0b396766646885434958b18291aa760ff1bb59e", 261354))),
    (("languages", LANGUAGES),),
    "1,012 Wikipedia sentences in 7 languages (an MT test set: do not evaluate on FLORES after training on it)"))
_HARNESS = ("ZubinGou/math-evaluation-harness", "db77bc6bb2a17c90ed2d63e88ebd8c40a82858c5")
register(OpenSet(
    "math-test", "math", "MIT (LICENSE; MATH itself MIT)", "jsonl_template",
    (_gh(*_HARNESS, "data/math/test.jsonl", "3371949f33dd702d04b43fddd7d53a028de0aaca0e76abb1b875a050297b3aa4",
         4101364),),
    (("template", "{problem}"),),
    "5,000 competition problems of MATH's test split (an evaluation set: do not evaluate on MATH after training on it)"))
register(OpenSet(
    "mathqa-test", "math", "MIT (LICENSE; MathQA itself Apache-2.0)", "jsonl_template",
    (_gh(*_HARNESS, "data/mathqa/test.jsonl", "136de4608366708d01d4c38890437e722c9209e9a66ef5d119cb01f6f88dfec6",
         700852),),
    (("template", "{problem}\nOptions: {options}"),),
    "1,000 multiple-choice word problems"))
register(OpenSet(
    "mbpp-sanitized", "code", "MIT (CodeT/LICENSE; MBPP itself CC-BY-4.0)", "jsonl_template",
    (_gh("microsoft/CodeT", "35f54d60b152cc31d134b788e702878ad613d9f7",
         "CodeT/data/dataset/mbpp_sanitized_for_code_generation.jsonl",
         "c48e256d2cdd091ed2dcad85a0b6fbc7672884032cf0cf28284d66b7b4eb1552", 264580),),
    (("template", "Complete this Python function.\n\n{prompt}"),),
    "427 Python tasks as a signature and docstring"))
register(OpenSet(
    "ifeval", "writing", "Apache-2.0 (LICENSE)", "jsonl_template",
    (_gh("josejg/instruction_following_eval", "0c495b2f95155e8b10acb919ae283bfb4d5be6e2",
         "instruction_following_eval/data/input_data.jsonl",
         "67ffeee0fcb87c317c5b08a2de85557b4a7e96ada6178aa645b4954fe4b53d49", 207111),),
    (("template", "{prompt}"),),
    "541 writing tasks with verifiable constraints (length, format, keywords)"))
register(OpenSet(
    "arena-hard-v2", "writing", "Apache-2.0 (LICENSE)", "jsonl_template",
    (_gh("lmarena/arena-hard-auto", "196f6b826783b3da7310e361a805fa36f0be83f3", "data/arena-hard-v2.0/question.jsonl",
         "a75cef6623db6b27aec810497b059f0659705d7ff48dcbccc5bd5b130728ac73", 947596),),
    (("template", "{prompt}"),),
    "750 hard user prompts from Chatbot Arena: 250 creative writing, 253 coding, 247 math"))
_NQ = ("google-research-datasets/natural-questions", "fb26a3073b1fe636c97302890a27b491d6530130")
register(OpenSet(
    "nq-open-efficientqa", "rag_qa", "CC-BY-SA-3.0 (nq_open/README.md; the repository's code Apache-2.0)",
    "jsonl_template",
    (_gh(*_NQ, "nq_open/NQ-open.efficientqa.dev.1.1.jsonl",
         "0ad45e2fa9fd32d10b3cf08c63e6d22f97ba1a0ce44ea98040f4c18bce7e268d", 194998),
     _gh(*_NQ, "nq_open/NQ-open.efficientqa.test.1.1.jsonl",
         "c37b3cb2069632dfef219fa770d7910ac77ff6d12a08e8f3d5f058b388aca8a6", 595322)),
    (("template", "{question}?"),),
    "3,569 real search queries (EfficientQA's dev and test: none of them is in EAGLE's qa set, which draws "
    "on NQ-open's dev split, left out here)"))
_BOOKS = (  # GITenberg: a repository a book; (repo, commit, path, sha256, bytes, title)
    ("GITenberg/Pride-and-Prejudice_1342", "81db45c9c48c592f0b77f01fc59e677ad0a5634e", "1342-0.txt",
     "48e0522844402a86a3ea98f0947ba85ea54838db3c59022299298ed968a5a163", 724725, "Pride and Prejudice by Jane Austen"),
    ("GITenberg/Moby-Dick--Or-The-Whale_2701", "bdf1948e6cd00963730971e5624e764a35f238c3", "2701-0.txt",
     "baf9b04fcf6e0008f30eaaa6697277751448c1070b20175e0082f28cbb161fd3", 1276201, "Moby-Dick by Herman Melville"),
    ("GITenberg/Frankenstein_84", "c98a483bd1f34e7366126b81bcedd1a6faee636e", "84-0.txt",
     "c29a4f56dd91aa894a3f17d5f96b356ccb499e3e2c5a27964de911845e39efab", 450783, "Frankenstein by Mary Shelley"),
    ("GITenberg/The-Picture-of-Dorian-Gray_174", "2e7a9776d3179fac76db4370fd66231ac0f4c184", "174.txt",
     "0c9a2cbf188ca6534c60381b764ac37bf4594b16971aea5cc8263e83b9ce9a05", 462103,
     "The Picture of Dorian Gray by Oscar Wilde"),
    ("GITenberg/Narrative-of-the-Life-of-Frederick-Douglass-an-American-Slave_23",
     "2a7853fe25d271a1e10bc0e4e55982a313be9adc", "23.txt",
     "948d491964b6ac66df3966476b2a9305b5d7ea56b8ec0b78c3c56815c5d9605f", 248399,
     "the Narrative of the Life of Frederick Douglass"),
    ("GITenberg/The-History-of-Herodotus---Volume-1_2707", "1b4b3ba07fdcb11037524dbb148705a4eceb9598", "2707.txt",
     "1d6a446de1b655bb80cf7c3d0f8449f019a76d38eec8d32b3f634e41d8a9ac32", 915395, "the History of Herodotus"),
    ("GITenberg/The-Federalist-Papers_1404", "7effe9c7518aa38e80f23664419a3e28b7993127", "1404.txt",
     "64dd04d805964a7c8f946072fcc8ba11d01613c8e6faf908511a28930dcb28e1", 1186923, "The Federalist Papers"),
    ("GITenberg/Essays---First-Series_2944", "9210518e45c73c99d03083c2bdfb0a6d32fae289", "2944.txt",
     "c3aedb85a2b5c6e05cfe14c98819b9155226901310978662bd3443df4f211991", 439075, "Emerson's Essays, First Series"),
    ("GITenberg/The-Prince_1232", "2566e0bd24ead77ae0d3d4e3ec7b08cd35435c2a", "1232.txt",
     "77e227946c6cf3e040a6eb0d87714a8355da450498ebe5454dc02861a2bcd5fe", 305881, "The Prince by Machiavelli"),
    ("GITenberg/Relativity-the-Special-and-General-Theory_5001", "c058d2622e42de36d28e39bba97ce13b0b8213c7", "5001.txt",
     "f50a1e58f140ae60a61c8ab1b5a6051e144c19b154e8bc6262cdedf58777fa68", 205905,
     "Relativity: The Special and General Theory by Albert Einstein"),
)
register(OpenSet(
    "gutenberg-books", "summarize", "public domain in the USA (the Project Gutenberg licence in each file)",
    "text_chunks", tuple(_gh(repo, commit, path, sha, size) for repo, commit, path, sha, size, _ in _BOOKS),
    (("chars", "6000"), ("titles", "|".join(title for *_, title in _BOOKS))),
    "10 books (novels, history, essays, politics, science) in passages of about 1,500 tokens to summarize"))


# Long documents a user pastes and asks about (eyas.data.open_tasks: passage_tasks, squad_rag).
# Each file is read once per size of "passes", cut at other places, with another request each time.
DOC_PASSES = "3600,4400,5200,6000,6800,7600"  # technical text and code: about 3.4 characters a token
BOOK_PASSES = "4800,5200,5600,6400,7200,8000,8800"  # prose: about 4.3 characters a token


def _manifest_set(name: str, kind: str, licence: str, note: str, passes: str = DOC_PASSES) -> OpenSet:
    return register(OpenSet(name, kind, licence, "passage_tasks", manifest_files(name), (("passes", passes),), note))


_manifest_set("python-peps", "summarize", "public domain or CC0-1.0 (each PEP's Copyright section; only those)",
              "Python Enhancement Proposals: design documents with rationale, specification and code")
_manifest_set("rust-book", "summarize", "MIT or Apache-2.0 (LICENSE-MIT, LICENSE-APACHE)",
              "The Rust Programming Language: a book's chapters of prose and code")
_manifest_set("rust-reference", "summarize", "MIT or Apache-2.0 (LICENSE-MIT, LICENSE-APACHE)",
              "The Rust Reference: a language's specification")
_manifest_set("fastapi", "code", "MIT (LICENSE)", "FastAPI's English documentation and its Python source")
_manifest_set("flask", "code", "BSD-3-Clause (LICENSE.txt)", "Flask's documentation and its Python source")
_manifest_set("click", "code", "BSD-3-Clause (LICENSE.txt)", "Click's documentation and its Python source")
_manifest_set("jinja", "code", "BSD-3-Clause (LICENSE.txt)", "Jinja's documentation and its Python source")
_manifest_set("requests", "code", "Apache-2.0 (LICENSE)", "Requests' documentation and its Python source")
_manifest_set("httpx", "code", "BSD-3-Clause (LICENSE.md)", "HTTPX's documentation and its Python source")
_manifest_set("starlette", "code", "BSD-3-Clause (LICENSE.md)", "Starlette's documentation and its Python source")
_manifest_set("black", "code", "MIT (LICENSE)", "Black's documentation and its Python source")
_manifest_set("scrapy", "code", "BSD-3-Clause (LICENSE)", "Scrapy's documentation and its Python source")
_manifest_set("gutenberg", "summarize", "public domain in the USA (the Project Gutenberg licence in each file)",
              "public-domain books (science, history, philosophy, economics, law, how-to, fiction, plays): passages "
              "with a reader's requests", BOOK_PASSES)
register(OpenSet(
    "xquad-rag", "rag_qa", "CC-BY-SA-4.0 (README.md; CC-BY-SA4.0.txt)", "squad_rag",
    OPEN_SETS["xquad-en"].files, (("distractors", "4,10"), ("draws", "2")),
    "1,190 questions of xquad-en, each over its paragraph among 4-10 paragraphs of other articles, twice"))
