"""Fixtures shared by the test modules: one torch thread, a tiny Llama with a drafter that is
partially right (tests/tiny.py), and a toy target with the SmolLM2 tokenizer and an untrained
drafter made by `eyas new` (tests/toy.py)."""

from __future__ import annotations

import pytest
import torch

from tiny import SPEC4, self_trained_drafter, sharpened, tiny_model
from toy import make_toy_target


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
