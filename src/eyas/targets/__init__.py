"""Targets: resolve and load `--target` (the embedded SmolLM2, a directory, a hub id)."""

from eyas.targets.loading import (
    EMBEDDED,
    TargetNotFound,
    TargetSource,
    load_target,
    load_tokenizer,
    resolve_target,
    smollm2_gguf,
)

__all__ = ["EMBEDDED", "TargetNotFound", "TargetSource", "load_target", "load_tokenizer",
           "resolve_target", "smollm2_gguf"]
