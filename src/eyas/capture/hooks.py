"""Capture residual-stream boundaries from any Hugging Face causal LM with forward hooks.

This is the one capture code path of eyas: training data, online training, serving, doctor and
trace all call :class:`BoundaryCapture`. It never uses ``output_hidden_states`` (whose last entry is
post-norm, and which materialises every layer).

    boundary 0     <- forward pre-hook on block 0 (its input: embeddings after any scaling)
    boundary b>=1  <- forward hook on block b-1 (its output = hidden_states + residual)
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from eyas.convention.boundaries import CaptureSpec
from eyas.targets.structure import ArchitectureError, find_decoder_blocks


def _first_tensor(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], Tensor):
        return x[0]
    if hasattr(x, "hidden_states") and isinstance(x.hidden_states, Tensor):  # ModelOutput-like
        return x.hidden_states
    raise ArchitectureError(f"decoder block returned {type(x).__name__}; cannot find its hidden states")


class BoundaryCapture(AbstractContextManager):
    """Context manager that records the spec's boundaries during any forward pass of ``model``.

    >>> with BoundaryCapture(model, spec) as cap:
    ...     logits = model(input_ids).logits
    >>> cap.features()          # [B, T, num_slots * H], slots in spec order
    >>> cap.slots()             # list of num_slots tensors [B, T, H]

    ``detach`` (default True) stores detached tensors; ``include_last`` additionally records
    boundary L (last block output, pre-norm), read with ``cap.last_hidden()``, for training targets and tracing.

    Every boundary is stored on ``device``: by default the device of the model's first parameter
    (the embedding's). On one device that is where the blocks run (no copy); a target split across
    devices (:mod:`eyas.targets.split`) has its later boundaries copied there, so the captures and
    everything built from them live on one device whatever the split.
    """

    def __init__(self, model: nn.Module, spec: CaptureSpec, include_last: bool = False,
                 detach: bool = True, device: torch.device | None = None) -> None:
        blocks = find_decoder_blocks(model)
        if len(blocks) != spec.num_blocks:
            raise ArchitectureError(
                f"capture spec is for a target with {spec.num_blocks} decoder blocks; "
                f"{type(model).__name__} has {len(blocks)}"
            )
        self.model, self.spec, self.blocks = model, spec, blocks
        self.include_last, self.detach = include_last, detach
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._store: dict[int, Tensor] = {}
        self.device = device if device is not None else next(model.parameters()).device

    def _keep(self, boundary: int, t: Tensor) -> None:
        t = t.detach() if self.detach else t
        self._store[boundary] = t if t.device == self.device else t.to(self.device)

    def __enter__(self) -> "BoundaryCapture":
        wanted = set(self.spec.boundaries) | ({self.spec.num_blocks} if self.include_last else set())
        if 0 in wanted:
            def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
                x = args[0] if args else kwargs.get("hidden_states")
                self._keep(0, _first_tensor(x))

            self._handles.append(self.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        for b in sorted(wanted - {0}):
            def hook(_mod: nn.Module, _args: tuple, out: Any, b: int = b) -> None:
                self._keep(b, _first_tensor(out))

            self._handles.append(self.blocks[b - 1].register_forward_hook(hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def clear(self) -> None:
        self._store.clear()

    def boundary(self, b: int) -> Tensor:
        if b not in self._store:
            raise KeyError(f"boundary {b} was not captured (captured: {sorted(self._store)})")
        return self._store[b]

    def slots(self) -> list[Tensor]:
        return [self.boundary(b) for b in self.spec.boundaries]

    def features(self) -> Tensor:
        """[B, T, num_slots * H]: the drafter's fc input, slots concatenated in spec order."""
        return torch.cat(self.slots(), dim=-1)

    def last_hidden(self) -> Tensor:
        """Boundary L: the last block's output before the final norm."""
        return self.boundary(self.spec.num_blocks)
