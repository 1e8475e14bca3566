"""The target model as the decoding loop sees it: a KV cache that grows by forward passes and
shrinks to any subset of the last pass.

The decoding logic (``speculative.py``) only talks to :class:`Target`. :class:`HFTarget` implements it
for any Hugging Face causal LM with a DynamicCache and sdpa/eager attention; a faster
implementation (static cache + CUDA graphs for Llama-family targets) only has to honour the same
five methods and four attributes.

Cache semantics. The cache holds ``cache_len`` entries, entry i = token at position i. ``forward``
appends T entries (the verified block); ``keep(indices)`` then keeps the entries that were in the
cache before that forward (the committed prefix) plus the listed entries of the block, in the given
order, so the cache is compact again and entry i is again position i. A forward that is not
followed by ``keep`` commits its whole block.

Features. ``forward`` returns the captured boundaries of every appended token, taken with
:class:`~eyas.capture.hooks.BoundaryCapture`: the same code that captured the drafter's training data.
"""

from __future__ import annotations

import inspect
import warnings
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from eyas.convention.boundaries import CaptureSpec
from eyas.capture.hooks import BoundaryCapture
from eyas.targets.structure import text_config


class Target(ABC):
    """What the decoding loop needs from a target model (batch size 1).

    Attributes: ``spec`` (the captured boundaries), ``vocab_size`` (width of the logits),
    ``max_length`` (positions 0 .. max_length-1 exist), ``device``, ``implementation`` (what reports
    name it: "hf", "fast", "fast+cuda-graphs").
    """

    implementation: str = "unnamed"
    spec: CaptureSpec
    vocab_size: int
    max_length: int
    device: torch.device

    session: object | None = None  # the decoding session whose tokens the cache holds (speculative.start)

    # Cache bookkeeping every implementation shares, in host ints (reading them syncs nothing).
    _len: int = 0  # entries in the cache
    _committed: int = 0  # entries before the last forward (the block after them is keep's to choose from)

    @property
    def cache_len(self) -> int:
        """Entries in the KV cache (= the position of the next token to feed after ``keep``)."""
        return self._len

    def _appended(self, T: int) -> None:
        """Record that a forward appended T entries (the block ``keep`` chooses from)."""
        self._committed, self._len = self._len, self._len + T

    def _kept(self, indices: Sequence[int] | Tensor) -> tuple[Tensor, int, int]:
        """``keep``'s indices as a long device tensor, with P (the committed prefix) and k (kept);
        records cache_len = P + k. Host lists are range-checked here; a device tensor is not
        (checking it would read the device)."""
        P, T = self._committed, self._len - self._committed
        if not isinstance(indices, Tensor) and any(not 0 <= int(i) < T for i in indices):
            raise IndexError(f"keep: expected indices in 0..{T - 1} (the last forward's block), found {list(indices)}")
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.device).flatten()
        k = idx.numel()
        self._len = self._committed = P + k
        return idx, P, k

    @abstractmethod
    def reset(self) -> None:
        """Empty the KV cache."""

    @abstractmethod
    def forward(self, input_ids: Tensor, position_ids: Tensor, tree_mask: Tensor | None = None,
                capture: bool = True) -> tuple[Tensor, Tensor | None]:
        """Run T new tokens against the cache and append their entries.

        input_ids, position_ids: long [1, T].
        tree_mask: bool [T, T], True where new token i may attend new token j (its ancestors and
            itself); every new token also attends the whole cache. None = causal (a chain).
        Returns logits [1, T, vocab_size] and features [1, T, num_slots * H] (None when not
        ``capture``), valid until the next ``forward``: a target may return its own buffers (a
        CUDA graph's outputs, which the next replay overwrites); clone them to keep them longer.
        """

    @abstractmethod
    def keep(self, indices: Sequence[int] | Tensor) -> None:
        """Keep the committed prefix plus entries ``indices`` (0-based within the last forward's
        block, in this order); drop the rest of that block."""

    def truncate(self, length: int) -> None:
        """Drop the entries from ``length`` on (``length`` <= cache_len), after a ``keep`` that kept
        more than the round accepted (a pipelined round keeps its whole padded path before the host
        knows how much of it was accepted). Targets whose entries past cache_len are never
        attended (a static cache) implement it; the pipelined round runs only on those."""
        raise NotImplementedError(f"{type(self).__name__} cannot truncate its cache")

    def prefill(self, input_ids: Tensor, capture: bool = True) -> tuple[Tensor, Tensor | None]:
        """Reset, then run the prompt [1, n] causally at positions 0..n-1."""
        self.reset()
        n = input_ids.shape[1]
        positions = torch.arange(n, device=self.device)[None]
        return self.forward(input_ids, positions, None, capture=capture)


def _decoder_attention(model: nn.Module) -> str | None:
    cfg = text_config(model)
    return getattr(cfg, "_attn_implementation", None)


class HFTarget(Target):
    """Any Hugging Face causal LM (batch 1, DynamicCache, sdpa or eager attention).

    Tree verification passes a 4D additive float mask [1, 1, T, cache_len + T] (0 = attend,
    dtype-min = blocked): transformers returns a user-supplied 4D mask as-is, sdpa takes it as
    ``attn_mask`` and eager adds it to the scores, so one mask form serves both (a bool mask would
    be *added* as 0/1 by eager attention). flash-attention and flex ignore or reject such masks: the
    model is switched to sdpa with a warning. Sliding-window / linear-attention cache layers cannot
    be compacted to an arbitrary subset and are refused.
    """

    implementation = "hf"

    def __init__(self, model: nn.Module, spec: CaptureSpec, max_length: int | None = None) -> None:
        self.model = model.eval()
        self.spec = spec
        attn = _decoder_attention(model)
        if attn not in (None, "sdpa", "eager"):
            warnings.warn(f"HFTarget: attention '{attn}' ignores custom 4D tree masks; switching the "
                          f"model to 'sdpa'", stacklevel=2)
            model.set_attn_implementation("sdpa")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        cfg_len = getattr(text_config(model), "max_position_embeddings", None)
        self.max_length = int(max_length or cfg_len or 2**31 - 1)
        # transformers 5 renamed past_key_values to cache
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._capture = BoundaryCapture(model, spec)  # validates spec against the model's blocks
        self.reset()

    # -- cache --------------------------------------------------------------------------------

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        from transformers.cache_utils import DynamicLayer

        # With the config, transformers builds each layer's type (sliding window, linear attention).
        cache = DynamicCache(config=self.model.config)
        odd = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
        if odd:
            raise NotImplementedError(
                f"HFTarget: cache layers {sorted(odd)} (sliding window / linear attention) cannot keep an "
                f"arbitrary subset of positions; only full-attention targets are supported"
            )
        return cache

    def reset(self) -> None:
        self.cache = self._new_cache()
        self._len = self._committed = 0

    def keep(self, indices: Sequence[int] | Tensor) -> None:
        idx, P, k = self._kept(indices)
        contiguous = bool(torch.equal(idx, torch.arange(k, device=self.device)))
        src = P + idx
        for layer in self.cache.layers:
            if not layer.is_initialized or layer.keys.numel() == 0:
                continue
            if not contiguous:
                # Move the kept entries into place (advanced indexing reads a copy first, so
                # overlapping source and destination are fine), then cut the tail off (a view).
                layer.keys[..., P:P + k, :] = layer.keys[..., src, :]
                layer.values[..., P:P + k, :] = layer.values[..., src, :]
            layer.keys = layer.keys[..., : P + k, :]
            layer.values = layer.values[..., : P + k, :]

    # -- forward ------------------------------------------------------------------------------

    def _additive_mask(self, tree_mask: Tensor) -> Tensor:
        """bool [T, T] over the new tokens -> float [1, 1, T, cache_len + T] over the whole cache."""
        T = tree_mask.shape[0]
        allowed = torch.cat([torch.ones(T, self._len, dtype=torch.bool, device=self.device),
                             tree_mask.to(self.device, torch.bool)], dim=1)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None]

    @torch.no_grad()
    def forward(self, input_ids: Tensor, position_ids: Tensor, tree_mask: Tensor | None = None,
                capture: bool = True) -> tuple[Tensor, Tensor | None]:
        T = input_ids.shape[1]
        if int(position_ids.max()) >= self.max_length:
            raise ValueError(f"position {int(position_ids.max())} is past the context ({self.max_length} positions)")
        mask = None if tree_mask is None else self._additive_mask(tree_mask)
        kwargs = {self._cache_kw: self.cache, "attention_mask": mask, "position_ids": position_ids,
                  "use_cache": True}
        if capture:
            with self._capture as cap:
                out = self.model(input_ids=input_ids, **kwargs)
                features = cap.features()
            cap.clear()
        else:
            out = self.model(input_ids=input_ids, **kwargs)
            features = None
        self._appended(T)
        return out.logits, features
