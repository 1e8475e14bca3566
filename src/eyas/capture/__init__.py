"""Capture: forward hooks that record residual-stream boundaries from any HF causal LM (the one
capture code path), and the per-slot fingerprints of what was captured."""

from eyas.capture.hooks import BoundaryCapture
from eyas.capture.stats import FingerprintAccumulator, default_channels, fingerprint_token_mask

__all__ = ["BoundaryCapture", "FingerprintAccumulator", "default_channels", "fingerprint_token_mask"]
