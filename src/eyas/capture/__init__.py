"""Capture: the layer convention (boundaries), converters to every engine's ids, and the hooks
that record boundaries from any HF causal LM."""

from eyas.capture.boundaries import (
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
from eyas.capture.hooks import (
    ArchitectureError,
    BoundaryCapture,
    find_decoder_blocks,
    find_embedding,
    find_final_norm,
    num_blocks,
)

__all__ = [
    "ArchitectureError", "BoundaryCapture", "BoundaryError", "CaptureSpec", "SGLangRule",
    "boundaries_to_hf_indices", "boundaries_to_sglang_ids", "boundaries_to_vllm_ids",
    "default_boundaries", "find_decoder_blocks", "find_embedding", "find_final_norm",
    "hf_indices_to_boundaries", "num_blocks", "parse_boundaries", "sglang_ids_to_boundaries",
    "sglang_rules_agree", "validate_boundaries", "vllm_ids_to_boundaries",
]
