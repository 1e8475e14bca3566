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

from eyas.capture.boundaries import CaptureSpec


class ArchitectureError(RuntimeError):
    """The model's embedding, decoder blocks or final norm could not be located."""


def _text_config(model: nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def find_decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks: the one whose length is ``num_hidden_layers``.

    Looks at the usual places first (``model.layers``, ``transformer.h``, ...), then at every
    ModuleList in the module tree; ambiguous or absent gives an error naming what was found.
    """
    n = getattr(_text_config(model), "num_hidden_layers", None) if hasattr(model, "config") else None
    if n is None:
        raise ArchitectureError(
            f"{type(model).__name__}: no config.num_hidden_layers; pass a Hugging Face model "
            f"(a PreTrainedModel with its config)"
        )
    candidates = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) == n
        # blocks are modules with parameters; skip lists of e.g. rotary caches
        and all(any(True for _ in m.parameters()) for m in mod)
    ]
    # Prefer the shallowest: nested lists of the same length (e.g. per-layer experts) live deeper.
    candidates.sort(key=lambda nm: nm[0].count("."))
    if not candidates:
        lists = [(name, len(m)) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        raise ArchitectureError(
            f"{type(model).__name__}: no ModuleList of {n} decoder blocks (config.num_hidden_layers); "
            f"ModuleLists found: {lists[:10]}"
        )
    return candidates[0][1]


def find_final_norm(model: nn.Module) -> nn.Module:
    """The norm applied after the last block (``model.norm``, ``transformer.ln_f``, ...)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f"):
        mod = getattr(base, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise ArchitectureError(
        f"{type(model).__name__}: no final norm found on {type(base).__name__} "
        f"(looked for norm, final_layernorm, ln_f, final_layer_norm, norm_f)"
    )


def find_embedding(model: nn.Module) -> nn.Module:
    emb = model.get_input_embeddings()
    if emb is None:
        raise ArchitectureError(f"{type(model).__name__}: get_input_embeddings() returned None")
    return emb


def num_blocks(model: nn.Module) -> int:
    return len(find_decoder_blocks(model))


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
    """

    def __init__(self, model: nn.Module, spec: CaptureSpec, include_last: bool = False,
                 detach: bool = True) -> None:
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

    def _keep(self, boundary: int, t: Tensor) -> None:
        self._store[boundary] = t.detach() if self.detach else t

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
