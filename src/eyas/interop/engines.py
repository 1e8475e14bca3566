"""Which physical boundaries each engine captures when it loads a drafter directory as it stands.

Each engine is modelled by the one thing it reads from ``config.json`` (the conversions themselves
live in :mod:`eyas.convention.boundaries`):
- SGLang reads only ``eagle_config.eagle_aux_hidden_state_layer_ids`` (absent -> its default
  ``[2, L//2, L-3]``); before PR #25454 it adds 1 to every id, since then only when the first id is 1;
- vLLM reads only the top-level ``eagle_aux_hidden_state_layer_ids`` as boundaries (absent -> default);
- eyas reads ``eyas.json`` (without one, the directory's own convention, as :func:`load_drafter` does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from eyas.convention.boundaries import SGLangRule, sglang_ids_to_boundaries, vllm_ids_to_boundaries
from eyas.interop import sglang
from eyas.interop.common import CheckpointError
from eyas.interop.eyas_format import read_meta


def _engine_reads(
    convert: Callable[[list[int] | None, int], list[int]], ids: list[int] | None, num_blocks: int | None
) -> list[int] | None:
    """``convert(ids, L)``, or None when the ids are absent and the default needs an unknown L."""
    if not ids and num_blocks is None:
        return None
    # With explicit ids the converters do not use the block count.
    return convert(ids or None, num_blocks if num_blocks is not None else 0)


def engine_view(path: str | Path, num_target_blocks: int | None = None) -> dict[str, Any]:
    """The trained boundaries of the drafter at ``path`` and what each engine would capture.

    Returns {"path", "format", "boundaries", "boundaries_source", "num_target_blocks", "ids",
    "engines": {"eyas", "sglang", "sglang_legacy", "vllm"}, "differs": [engines whose capture is
    not the trained boundaries]}. An engine entry is None when it depends on an unknown block count.
    """
    meta = read_meta(path, num_target_blocks)
    if meta.boundaries is None:
        raise CheckpointError(f"{meta.boundaries_source}: pass num_target_blocks (CLI: --num-target-blocks)")
    L = meta.num_target_blocks
    nested = sglang.nested_ids(meta.config)
    top = meta.config.get("eagle_aux_hidden_state_layer_ids")
    top = [int(i) for i in top] if top else None
    engines = {
        "eyas": list(meta.boundaries),
        "sglang": _engine_reads(lambda i, n: sglang_ids_to_boundaries(i, n, SGLangRule.PR25454), nested, L),
        "sglang_legacy": _engine_reads(lambda i, n: sglang_ids_to_boundaries(i, n, SGLangRule.LEGACY), nested, L),
        "vllm": _engine_reads(vllm_ids_to_boundaries, top, L),
    }
    return {
        "path": str(meta.path),
        "format": meta.format,
        "boundaries": list(meta.boundaries),
        "boundaries_source": meta.boundaries_source,
        "num_target_blocks": L,
        "ids": {sglang.NESTED_IDS: nested, "eagle_aux_hidden_state_layer_ids": top},
        "engines": engines,
        "differs": [name for name, got in engines.items() if got is not None and got != meta.boundaries],
    }
