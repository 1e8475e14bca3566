"""Targets: resolve and load `--target` (the embedded SmolLM2, a directory, a hub id) into a
:class:`LoadedTarget`, with its structure, identity, device and dtype."""

from eyas.targets.identity import (
    TargetIdentity,
    WeightsSample,
    changed_count,
    changed_parts,
    describe_changes,
    modified_copy,
    target_identity,
    weights_fingerprint,
    weights_sample,
)
from eyas.targets.loaded import LoadedTarget
from eyas.targets.loading import (
    EMBEDDED,
    TargetNotFound,
    TargetSource,
    load_target,
    load_tokenizer,
    resolve_target,
    smollm2_gguf,
    target_for,
)
from eyas.targets.placement import PlacementError, resolve_device, resolve_dtype
from eyas.targets.split import TargetDevices, parse_target_devices, place_model, split_device_map

__all__ = ["EMBEDDED", "LoadedTarget", "PlacementError", "TargetIdentity", "TargetNotFound", "TargetSource",
           "TargetDevices", "WeightsSample", "changed_count", "changed_parts", "describe_changes", "load_target", "load_tokenizer",
           "modified_copy", "parse_target_devices", "place_model", "resolve_device", "resolve_dtype", "resolve_target", "smollm2_gguf", "split_device_map", "target_for",
           "target_identity", "weights_fingerprint", "weights_sample"]
