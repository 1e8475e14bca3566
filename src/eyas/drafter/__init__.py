"""The EAGLE-3 drafter: config and model.

The model (torch) loads on first use, so that reading a config (the engine specs, the CLI's choices)
does not import torch.
"""

from typing import Any

from eyas.drafter.config import NORM_FLAGS, DrafterConfig

__all__ = ["ConcatKVCache", "DrafterConfig", "DraftOutput", "Eagle3Drafter", "KVCache", "NORM_FLAGS"]


def __getattr__(name: str) -> Any:
    if name in ("ConcatKVCache", "DraftOutput", "Eagle3Drafter", "KVCache"):
        from eyas.drafter import model

        return getattr(model, name)
    raise AttributeError(f"module 'eyas.drafter' has no attribute {name!r}")
