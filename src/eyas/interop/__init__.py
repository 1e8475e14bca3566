"""Checkpoint formats and serving engines: the eyas directory (SGLang-loadable, with ``eyas.json``),
SGLang / SpecForge / SafeAILab-EAGLE (``LlamaForCausalLMEagle3``) and speculators / vLLM
(``Eagle3Speculator``); one spec per serving engine in :mod:`eyas.interop.servers`.

Layer ids are converted at this edge only, each engine's in its own server module; every directory
eyas writes records the boundaries under unambiguous keys (``eyas.json``, ``eyas_boundaries``) next
to the ids each engine reads. :func:`read_as` says what one engine builds from a directory,
:func:`view_engines` what every engine captures.

The names below load on first use: the engine registry (``eyas.interop.servers``, which the CLI
reads for its choices) imports without torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CheckpointError": "eyas.interop.common",
    "DrafterDir": "eyas.interop.directory", "read_drafter_dir": "eyas.interop.directory",
    "EngineView": "eyas.interop.engines", "boundary_edits": "eyas.interop.engines", "read_as": "eyas.interop.engines",
    "served_config": "eyas.interop.engines", "view_engines": "eyas.interop.engines",
    "ExportReport": "eyas.interop.convert", "export_drafter": "eyas.interop.convert",
    "import_drafter": "eyas.interop.convert",
    "embedded_drafter": "eyas.interop.embedded", "resolve_draft": "eyas.interop.embedded",
    "build_drafter": "eyas.interop.eyas_format", "load_drafter": "eyas.interop.eyas_format",
    "read_contract": "eyas.interop.eyas_format", "save_drafter": "eyas.interop.eyas_format",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'eyas.interop' has no attribute {name!r}")
    return getattr(import_module(module), name)
