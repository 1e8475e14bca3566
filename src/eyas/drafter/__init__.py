"""The EAGLE-3 drafter: config and model."""

from eyas.drafter.config import DrafterConfig
from eyas.drafter.model import DraftOutput, Eagle3Drafter, KVCache

__all__ = ["DrafterConfig", "DraftOutput", "Eagle3Drafter", "KVCache"]
