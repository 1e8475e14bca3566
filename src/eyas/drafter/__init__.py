"""The EAGLE-3 drafter: config and model."""

from eyas.drafter.config import DrafterConfig
from eyas.drafter.model import ConcatKVCache, DraftOutput, Eagle3Drafter, KVCache

__all__ = ["ConcatKVCache", "DrafterConfig", "DraftOutput", "Eagle3Drafter", "KVCache"]
