"""Checkpoint formats: the eyas directory (SGLang-loadable, with ``eyas.json``), SGLang / SpecForge /
SafeAILab-EAGLE (``LlamaForCausalLMEagle3``) and speculators / vLLM (``Eagle3Speculator``).

Layer ids are converted at this edge only (see :mod:`eyas.convention.boundaries`); every directory
eyas writes records the boundaries under unambiguous keys (``eyas.json``, ``eyas_boundaries``)
next to the ids each engine reads, and :func:`engine_view` says what each engine will capture.
"""

from eyas.interop.common import CheckpointError
from eyas.interop.convert import export_drafter, import_drafter
from eyas.interop.engines import engine_view
from eyas.interop.eyas_format import load_drafter, read_contract, save_drafter

__all__ = [
    "CheckpointError", "engine_view", "export_drafter", "import_drafter", "load_drafter",
    "read_contract", "save_drafter",
]
