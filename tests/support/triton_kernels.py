"""What the tests of eyas' Triton kernels share: triton itself (CI installs it, so there a missing
triton fails the run instead of skipping), and the device they run on (the GPU, else Triton's
interpreter on the CPU: tests/conftest.py sets TRITON_INTERPRET=1 before triton's import)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def require_triton(what: str) -> None:
    """Skip the calling test module without triton, except on CI (.ci/run checks that it imports)."""
    if os.environ.get("CI"):
        import triton  # noqa: F401
    else:
        pytest.importorskip("triton", reason=f"{what} need triton: pip install -e '.[test]' (Linux)")
