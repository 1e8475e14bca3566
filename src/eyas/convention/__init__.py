"""The layer convention: residual-stream boundaries 0..L, the capture spec, and the converters to and
from every engine's layer ids (see docs/conventions.md)."""

from eyas.convention.boundaries import (
    BoundaryError,
    CaptureSpec,
    SGLangRule,
    boundaries_to_hf_indices,
    boundaries_to_sglang_ids,
    boundaries_to_vllm_ids,
    default_boundaries,
    hf_indices_to_boundaries,
    parse_boundaries,
    sglang_ids_to_boundaries,
    sglang_rules_agree,
    validate_boundaries,
    vllm_ids_to_boundaries,
)

__all__ = [
    "BoundaryError", "CaptureSpec", "SGLangRule", "boundaries_to_hf_indices", "boundaries_to_sglang_ids",
    "boundaries_to_vllm_ids", "default_boundaries", "hf_indices_to_boundaries", "parse_boundaries",
    "sglang_ids_to_boundaries", "sglang_rules_agree", "validate_boundaries", "vllm_ids_to_boundaries",
]
