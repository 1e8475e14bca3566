"""Fixtures shared by the test modules, and the rule that every test carries exactly one tier.

Fixtures: one torch thread, a tiny Llama with a drafter that is partially right
(tests/support/tiny.py), and a toy target with the SmolLM2 tokenizer and an untrained drafter made by
`eyas new` (tests/support/toy.py).

How the helpers import. ``tests`` is a package (tests/__init__.py) and the helpers live in one
subpackage, ``tests.support``. Under pytest's default import mode ("prepend"), a test module inside a
package is imported by its dotted name after the directory above the package's top (the repository
root) is put first on sys.path; so ``from tests.support.tiny import ...`` works in every test module
and here, with no sys.path edit in any file and no ini option. Chosen over pytest's ``pythonpath``
option because the import names say where a helper lives (``tests.support.x``, not a bare ``x`` that
could shadow an installed module), test modules get unique dotted names, and every import of a
helper names its one home (no test module imports another). A subprocess that a test starts gets
what it needs through its environment (PYTHONPATH), as test_training.py's torchrun ranks do.

Tiers (markers registered in pyproject.toml; ``make test-fast`` runs ``pytest -m unit``):
- ``unit``: one module on tiny inputs, no CLI runs, no SmolLM2, well under a second each;
- ``integration``: several packages together, the CLI, toy targets, trained tiny drafters;
- ``slow``: the embedded SmolLM2 target, torchrun and other multi-process runs, training to a
  quality bar, anything over about 5 s.
A module of one tier says so in ``pytestmark``; a mixed module marks each test. Collection fails
when a test has no tier or more than one (``pytest_collection_modifyitems`` below).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the split-KV Triton kernels run in Triton's interpreter. Triton reads this when
    # its own library's functions are decorated, at its import: so here, before anything imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.tiny import SPEC4, self_trained_drafter, sharpened, tiny_model  # noqa: E402
from tests.support.toy import make_toy_target  # noqa: E402

TIERS = ("unit", "integration", "slow")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse the run when a test carries no tier or more than one (module and function marks
    together; the same tier twice counts once)."""
    wrong = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) need exactly one tier marker of {', '.join(TIERS)} (see tests/conftest.py); "
            "found:\n" + "\n".join(wrong))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are dominated by per-op overhead; on a shared 2-core machine a second OpenMP
    thread only adds contention (2 threads made TTT training 7x slower than 1). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama():
    """A 4-block tiny Llama (vocab 128) with peaked distributions."""
    return sharpened(tiny_model("llama", 4), 8.0)


@pytest.fixture(scope="module")
def trained_drafter(llama):
    """A drafter for ``llama`` on SPEC4, trained a few seconds on its own continuations."""
    return self_trained_drafter(llama, SPEC4)


@pytest.fixture(scope="module")
def toy_drafter(tmp_path_factory):
    """(toy target directory, untrained drafter directory), saved the way the CLI saves them."""
    from typer.testing import CliRunner

    from eyas.cli.main import app

    root = tmp_path_factory.mktemp("toy")
    target = make_toy_target(root / "target", num_blocks=8, hidden=32)
    r = CliRunner().invoke(app, ["new", "--target", str(target), "--out", str(root / "d"), "--draft-vocab", "512"])
    assert r.exit_code == 0, r.output
    return target, root / "d"
