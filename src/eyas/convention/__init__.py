"""The layer convention: residual-stream boundaries 0..L, the capture spec, and HF hidden-state
indices (see docs/conventions.md). Each serving engine's own layer ids are converted in its module
of :mod:`eyas.interop.servers`."""

from eyas.convention.boundaries import (
    BoundaryError,
    CaptureSpec,
    boundaries_to_hf_indices,
    default_boundaries,
    hf_indices_to_boundaries,
    parse_boundaries,
    validate_boundaries,
)

__all__ = [
    "BoundaryError", "CaptureSpec", "boundaries_to_hf_indices", "default_boundaries", "hf_indices_to_boundaries",
    "parse_boundaries", "validate_boundaries",
]
