"""Where a target runs and in which precision: ``--device`` and ``--target-dtype`` resolved once.

Rules (every command follows them):
- device ``"auto"`` is the GPU when CUDA is available, else the CPU; a CUDA device without an index
  (``"auto"`` or ``"cuda"``) is ``cuda:LOCAL_RANK``, so that under torchrun every process takes its
  own GPU (LOCAL_RANK is 0 outside torchrun, i.e. the current ``"cuda"``). An indexed device
  (``"cuda:1"``) and ``"cpu"`` are taken as given.
- dtype ``"auto"`` is bfloat16 on a GPU (as engines serve it) and float32 on the CPU (bf16 matmuls
  are slow there, and greedy equality with a plain decoder is exact in float32).
"""

from __future__ import annotations

import os

import torch

from eyas.errors import EyasError

AUTO = "auto"
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class PlacementError(EyasError, ValueError):
    """A device or dtype name that is not one of the accepted ones."""


def local_rank() -> int:
    """This process's GPU index under torchrun (``LOCAL_RANK``); 0 outside it."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(device: str | torch.device = AUTO) -> torch.device:
    """``"auto"`` | ``"cpu"`` | ``"cuda"`` | ``"cuda:N"`` (or a torch.device) -> a torch.device.

    ``"auto"`` and a bare ``"cuda"`` become ``cuda:LOCAL_RANK`` (``"auto"`` only when CUDA is
    available, else ``cpu``); anything else is passed to :class:`torch.device` as given.
    """
    if isinstance(device, torch.device):
        return device
    name = device.strip().lower()
    if name == AUTO:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", local_rank())
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise PlacementError(f"device: expected {AUTO}|cpu|cuda|cuda:N, found {device!r} ({e})") from None


def resolve_draft_dtype(dtype: str | torch.dtype, target_dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The drafter's dtype when serving: ``"auto"`` is bfloat16 on a CPU with native bf16 dot
    products (AVX512-BF16: the drafter's weight reads halve, its steps run about twice as fast),
    else the target's dtype; or an explicit ``"bfloat16"`` | ``"float16"`` | ``"float32"``.

    Lossless whatever it is: the drafter only proposes tokens, and the target verifies them in its
    own dtype, so greedy output is the target's (float32 on a CPU) token for token. Acceptance can
    move a little with the drafter's rounding (the drafter was trained under bf16 autocast)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.strip().lower()
    if name == AUTO:
        cpu_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        return torch.bfloat16 if resolve_device(device).type == "cpu" and cpu_bf16 else target_dtype
    if name not in DTYPES:
        raise PlacementError(f"--draft-dtype: expected {AUTO}|{'|'.join(DTYPES)}, found {dtype!r}")
    return DTYPES[name]


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """``"auto"`` | ``"bfloat16"`` | ``"float16"`` | ``"float32"`` (or a torch.dtype) -> a torch.dtype;
    ``"auto"`` is bfloat16 when ``device`` is a GPU, float32 otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.strip().lower()
    if name == AUTO:
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise PlacementError(f"target dtype: expected {AUTO}|{'|'.join(DTYPES)}, found {dtype!r}")
    return DTYPES[name]
