"""The on-disk format of a shard directory (the layout is in :mod:`eyas.data.shards`): its file
names and constants, the JSON of the manifest and the progress files, and :func:`finalize_manifest`,
which merges every rank's progress file into the manifest.

Shared by the writers (:func:`eyas.data.shards.capture_shards`, :mod:`eyas.data.dumps`) and the
reader (:class:`eyas.data.shard_dataset.ShardDataset`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from eyas.io import atomic_write_json, read_json_object
from eyas.capture.stats import FingerprintAccumulator
from eyas.contract import Contract, compare
from eyas.errors import EyasError

FORMAT = "eyas-hidden-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def is_shard_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a finished capture (a directory with its manifest), not a conversations file."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).exists()


DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_PROBLEMS_KEPT = 20  # render problems kept in a progress file and in the manifest


class ShardError(EyasError, ValueError):
    """A shard set that cannot be written, resumed or read; the message names the file."""


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:02d}-{index:05d}.safetensors"


def progress_name(rank: int) -> str:
    return f"progress-r{rank:02d}.json"


# ---------------------------------------------------------------------------------------------
# Atomic file writes
# ---------------------------------------------------------------------------------------------


def write_shard_json(path: Path, obj: Any) -> None:
    """Write a manifest or progress file atomically (a crash leaves the previous version)."""
    atomic_write_json(path, obj, indent=1)


def read_shard_json(path: Path, what: str) -> dict[str, Any]:
    """A manifest or progress file (``what`` names it in errors); ShardError unless it is eyas' format."""
    obj = read_json_object(path, ShardError, what)
    if str(obj.get("format", "")).split("+")[0] != FORMAT:
        raise ShardError(f"{path}: not an eyas {what} (format {obj.get('format')!r}, expected {FORMAT!r})")
    return obj


# ---------------------------------------------------------------------------------------------
# Finalising: the manifest, merged from every rank's progress file
# ---------------------------------------------------------------------------------------------


def finalize_manifest(out_dir: str | os.PathLike) -> Path:
    """Merge every rank's progress file into ``manifest.json``: contract (with the fingerprint of
    all shards), counts, shard list, and rank 0's ``manifest_extra`` (what an import adds, so the
    manifest is written once). Errors name the rank file that is missing or incomplete."""
    out = Path(out_dir)
    first = read_shard_json(out / progress_name(0), "progress file (rank 0)")
    world = int(first["world_size"])
    progs = [first] + [read_shard_json(out / progress_name(r), f"progress file (rank {r})") for r in range(1, world)]
    for r, p in enumerate(progs):
        path = out / progress_name(r)
        if not p.get("complete"):
            raise ShardError(f"{path}: rank {r} has {len(p['shards'])} of {p['num_shards']} shards; "
                             f"rerun its capture (it resumes) before finalising")
        if p["params"] != first["params"] or p["world_size"] != world:
            raise ShardError(f"{path}: rank {r} ran with other parameters than rank 0: {p['params']} vs {first['params']}")
        mism = compare(Contract.model_validate(first["contract"]), Contract.model_validate(p["contract"]))
        if mism:
            raise ShardError(f"{path}: rank {r} captured another target than rank 0: " + "; ".join(map(str, mism)))
    shards = [e for p in progs for e in p["shards"]]  # rank order, then index order
    contract = Contract.model_validate(first["contract"])
    if shards:
        acc = FingerprintAccumulator.merged([FingerprintAccumulator.from_state(e["fingerprint"]) for e in shards])
        contract = contract.model_copy(update={"fingerprint": acc.result()})
    counts = {k: sum(int(p["counts"].get(k, 0)) for p in progs)
              for k in ("conversations", "samples", "tokens", "loss_tokens", "no_loss_tokens", "truncated",
                        "render_problems")}
    counts["shards"] = len(shards)
    params = first["params"]
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "contract": contract.model_dump(mode="json"),
        "counts": counts,
        "layout": {
            "num_slots": len(params["boundaries"]), "hidden_size": contract.target.hidden_size,
            "dtype": params["dtype"],
            "tensors": {"input_ids": "int32 [N]", "loss_mask": "uint8 [N]", "offsets": "int64 [S+1]",
                        "slots": "dtype [N, num_slots, H]", "last_hidden": "dtype [N, H] (boundary L, pre-norm)"},
        },
        "params": params,
        "world_size": world,
        "source_data": first.get("source_data"),
        "problems": [x for p in progs for x in p.get("problems", [])][:MAX_PROBLEMS_KEPT],
        "shards": [{k: e[k] for k in ("file", "rank", "index", "samples", "tokens", "loss_tokens", "bytes",
                                      "sha256", "ids")} for e in shards],
    }
    _merge(manifest, first.get("manifest_extra") or {})  # e.g. an import's layout flags and source
    path = out / MANIFEST
    write_shard_json(path, manifest)
    return path


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    """``extra``'s keys into ``into``, merging nested dicts key by key (layout.tensors stays whole)."""
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v
