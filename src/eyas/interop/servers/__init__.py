"""One model of each serving engine (eyas, SGLang, vLLM), each a spec in a registry.

    from eyas.interop.servers import SERVERS, get, names
    get("sglang").rules           # ("pr25454", "legacy")
    get("vllm").write_config(...)  # config.json for vLLM (speculators format)

Each engine's layer-id rules, flag defaults, keys read, fallbacks, config writer and fix edits live
in its own module (``eyas.py``, ``sglang.py``, ``vllm.py``) and nowhere else. Reading a directory
the way an engine does is :func:`eyas.interop.read_as`; every engine at once,
:func:`eyas.interop.view_engines`.
"""

from eyas.interop.servers.registry import (
    SERVERS, export_names, for_export, for_layout, get, names, readings, register, unregister,
)
from eyas.interop.servers.spec import (
    Edit, EngineReading, KeyRead, RuleCheck, ServerError, ServerSpec, TrainedBoundaries, WrittenConfig, flag_edit,
)

__all__ = [
    "SERVERS", "Edit", "EngineReading", "KeyRead", "RuleCheck", "ServerError", "ServerSpec",
    "TrainedBoundaries", "WrittenConfig", "export_names", "flag_edit", "for_export", "for_layout", "get", "names", "readings",
    "register", "unregister",
]
