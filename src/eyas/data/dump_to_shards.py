"""Writing a dump as eyas shards (step 2 of :mod:`eyas.data.dumps`, after a reader of
:mod:`eyas.data.dump_readers` has opened it): :func:`convert_dump` cuts the dump's files into
shards, writes each under a temporary name and records it in ``progress-r00.json``, resumes an
earlier run of the same import (refusing an output directory that holds anything else, naming what
differs) and writes the manifest last; :class:`ImportSummary` is what it returns.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eyas.capture.stats import FingerprintAccumulator
from eyas.contract import Contract, compare
from eyas.data.dump_readers import Dump, DumpError
from eyas.data.runs import changed_params
from eyas.data.shard_format import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    finalize_manifest,
    progress_name,
    shard_name,
)
from eyas.io import atomic_write_bytes, atomic_write_json, read_json_object

_RESUME_PARAMS = ("imported_from", "boundaries", "dtype", "shard_size", "world_size", "channels")


@dataclass
class ImportSummary:
    out_dir: str
    format: str
    boundaries: list[int]
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    shards: int = 0
    shards_resumed: int = 0  # already written by an earlier run of the same import
    missing: int = 0  # speculators: rows of the preprocessed dataset without an hs_<row>.safetensors
    manifest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _groups(files: Sequence[Path], shard_size: int) -> Iterator[list[Path]]:
    for i in range(0, len(files), shard_size):
        yield list(files[i:i + shard_size])


def _sample_id(fmt: str, path: Path) -> str:
    return f"{fmt}:{path.name.split('.')[0]}"


def _plan_digest(dump: Dump) -> str:
    """Names and sizes of the dump's files, in order: a rerun resumes only over the same files."""
    h = hashlib.sha256()
    for p in dump.files:
        h.update(f"{p.name}\t{p.stat().st_size}\n".encode())
    return h.hexdigest()


def _resume(out: Path, params: dict[str, Any], imported: dict[str, Any], contract: Contract, digest: str,
            plan: list[list[Path]]) -> list[dict[str, Any]]:
    """The shards an earlier run of this same import left complete (0..k-1, up to the first missing
    or resized file); an output directory holding anything else is refused, naming what differs."""
    if (out / MANIFEST).exists():
        raise DumpError(f"{out}: already holds a finished capture ({MANIFEST}); expected a new directory")
    for tmp in out.glob(".shard-r00-*.tmp"):  # left by a crash inside atomic_write
        tmp.unlink(missing_ok=True)
    path = out / progress_name(0)
    if not path.exists():
        if out.is_dir() and any(out.glob("progress-r*.json")):
            raise DumpError(f"{out}: holds progress files of a multi-rank capture; expected a new directory")
        return []
    prog = read_json_object(path, DumpError, "progress file")
    recorded = prog.get("params") or {}
    if not recorded.get("imported_from"):
        raise DumpError(f"{path}: holds an unfinished `eyas capture`, not an import; expected a new directory")
    diff = changed_params(recorded, params, _RESUME_PARAMS, "the earlier run had")
    before = (prog.get("manifest_extra") or {}).get("imported") or {}
    diff += [f"{k}: the earlier run had {before.get(k)!r}, now {v!r}"
             for k, v in imported.items() if before.get(k) != v]
    diff += [str(m) for m in compare(Contract.model_validate(prog["contract"]), contract)]
    if prog.get("plan_sha256") != digest:
        diff.append("the dump's files changed (names or sizes) since the earlier run")
    if diff:
        raise DumpError(f"{path}: cannot resume, the earlier import differs: " + "; ".join(diff)
                        + f". Use another output directory, or delete {out} to start over")
    kept = []
    for k, entry in enumerate(prog.get("shards", [])):
        f = out / entry["file"]
        if entry["index"] != k or k >= len(plan) or not f.exists() or f.stat().st_size != entry["bytes"]:
            break  # this shard and every later one are written again
        kept.append(entry)
    return kept


def _read_checked(dump: Dump, path: Path) -> dict[str, Tensor]:
    s = dump.read(path)
    if not (torch.isfinite(s["slots"]).all() and torch.isfinite(s["last_hidden"]).all()):
        raise DumpError(f"{path}: expected finite hidden states, found NaN or Inf (the engine's capture "
                        f"overflowed; regenerate this sample)")
    return s


def convert_dump(dump: Dump, out: Path, contract: Contract, bs: list[int], dtype: str, shard_size: int,
             log: Callable[[str], None] | None) -> ImportSummary:
    """Write ``dump``'s samples as eyas shards in ``out`` (resuming an earlier run of the same
    import), then the manifest."""
    hidden = contract.target.hidden_size
    channels = FingerprintAccumulator(bs, hidden).channels
    params = {"boundaries": bs, "dtype": dtype, "shard_size": shard_size, "world_size": 1, "channels": channels,
              "imported_from": dump.format}
    plan = list(_groups(dump.files, shard_size))
    digest = _plan_digest(dump)
    entries = _resume(out, params, dump.imported, contract, digest, plan)
    _read_checked(dump, dump.files[0])  # a wrong H, slot count or key fails before anything is written
    out.mkdir(parents=True, exist_ok=True)
    summary = ImportSummary(out_dir=str(out), format=dump.format, boundaries=bs, shards_resumed=len(entries),
                            missing=dump.missing)
    extra = {"layout": {"last_hidden_normed": dump.last_hidden_normed, **dump.extra_layout},
             "imported": dump.imported}

    def save_progress() -> None:
        atomic_write_json(out / progress_name(0), {
            "format": FORMAT + "+progress", "version": FORMAT_VERSION, "rank": 0, "world_size": 1, "params": params,
            "plan_sha256": digest, "num_shards": len(plan),
            "counts": {"conversations": sum(e["samples"] for e in entries),
                       "samples": sum(e["samples"] for e in entries), "tokens": sum(e["tokens"] for e in entries),
                       "loss_tokens": sum(e["loss_tokens"] for e in entries)},
            "problems": [], "source_data": str(dump.imported["dump"]), "contract": contract.model_dump(mode="json"),
            "manifest_extra": extra, "shards": entries, "complete": len(entries) == len(plan),
        }, indent=1)

    from safetensors.torch import save

    store = DTYPES[dtype]
    for k in range(len(entries), len(plan)):
        group = plan[k]
        acc = FingerprintAccumulator(bs, hidden, channels)
        samples = [_read_checked(dump, p) for p in group]
        lengths = torch.tensor([s["input_ids"].shape[0] for s in samples], dtype=torch.int64)
        offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        tensors = {
            "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
            "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),
            "offsets": offsets,
            "slots": torch.cat([s["slots"] for s in samples]).to(store).contiguous(),
            "last_hidden": torch.cat([s["last_hidden"] for s in samples]).to(store).contiguous(),
        }
        for s in samples:  # as eyas capture: the stored values, every token but the first (the sink)
            t = s["input_ids"].shape[0]
            acc.update_batch(s["slots"].to(store)[None], torch.ones(1, t, dtype=torch.long))
        ids = [_sample_id(dump.format, p) for p in group]
        meta = {"eyas": json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "rank": 0, "index": k,
                                    "boundaries": bs, "dtype": dtype, "ids": ids, "imported_from": dump.format})}
        data = save(tensors, metadata=meta)
        atomic_write_bytes(out / shard_name(0, k), data)
        entries.append({"file": shard_name(0, k), "rank": 0, "index": k, "samples": len(samples),
                        "tokens": int(offsets[-1]), "loss_tokens": int(tensors["loss_mask"].sum()),
                        "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "batch_size": 1,
                        "ids": ids, "fingerprint": acc.state()})
        save_progress()
        if log is not None:
            log(f"shard {k}: {len(samples)} samples, {int(offsets[-1])} tokens")
    save_progress()  # complete (also when every shard was already there)
    summary.shards = len(entries)
    summary.samples = sum(e["samples"] for e in entries)
    summary.tokens = sum(e["tokens"] for e in entries)
    summary.loss_tokens = sum(e["loss_tokens"] for e in entries)
    summary.manifest = str(finalize_manifest(out))
    return summary
