"""Hidden states captured by another engine, converted into eyas shards (``eyas import-hidden-states``).

For targets beyond one machine the capture runs in an engine that already spreads a model over
many GPUs and hosts (SGLang, vLLM); eyas converts what it writes. One format is read so far:

SpecForge offline dumps (``specforge``), written by SpecForge's ``scripts/prepare_hidden_states.py``
(the target inside SGLang) or ``scripts/prepare_hidden_states_hf.py`` (inside transformers: there
``hidden_state`` is ``hidden_states[-1]`` and each captured layer ``hidden_states[id + 1]``, in the
order the ids are given), run with ``--enable-aux-hidden-states``. Layout, as they write it::

    OUTPUT_PATH/rows_0-5000/data_0.ckpt       torch.save of one dict per sample:
    OUTPUT_PATH/rows_0-5000/data_1.ckpt         input_ids         [T]          token ids
    ...                                         loss_mask         [T]          1 = assistant token
    OUTPUT_PATH/rows_5000-10000/data_5000.ckpt  hidden_state      [1, T, H]    the last layer's output
                                                                               AFTER the final norm
                                                aux_hidden_state  [1, T, S*H]  the captured layers,
                                                                               concatenated in layer order

The files do not record which layers were captured: the script captures
``--aux-hidden-states-layers`` (comma-separated; default ``[1, L//2-1, L-4]``), ids passed to
SGLang's ``set_eagle3_layers_to_capture``, which adds 1 to each (the script's own comment says so),
or read as ``hidden_states[id + 1]``: SpecForge's "output of block k" = eyas boundary k+1. (SGLang
since PR #25454 adds the 1 to ids in a drafter's config only when the first id is 1.) So
the converter takes the boundaries from the caller, who names them in eyas' convention or gives the
ids with the convention that reads them (the CLI refuses ids whose readings differ without one).

What is stored differs from ``eyas capture`` in one place: the dump's ``hidden_state`` is the final
norm's output, not boundary L, and the norm cannot be undone. The shards record it in the
manifest (``layout.last_hidden_normed``) and training applies only lm_head to it. Every sample is
stored in input order; the manifest's contract holds the target's identity, the boundaries, the
dtype and the fingerprint of the stored slots; no tokenisation is recorded (SpecForge rendered the
conversations with its own ``--chat-template``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eyas.capture.stats import FingerprintAccumulator
from eyas.contract import CaptureContract, Contract, target_identity
from eyas.data.shards import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    finalize_manifest,
    progress_name,
    shard_name,
)
from eyas.errors import EyasError
from eyas.io import atomic_write_bytes, atomic_write_json, read_json_object

SPECFORGE = "specforge"
FORMATS = (SPECFORGE,)
_DATA_FILE = re.compile(r"data_(\d+)\.ckpt$")


class DumpError(EyasError, ValueError):
    """A dump that cannot be read or converted; the message names the file, expected and found."""


@dataclass
class ImportSummary:
    out_dir: str
    format: str
    boundaries: list[int]
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    shards: int = 0
    manifest: str = ""
    skipped: list[str] = field(default_factory=list)  # files without aux_hidden_state, ...

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def specforge_files(dump: Path) -> list[Path]:
    """Every ``data_<idx>.ckpt`` under ``dump`` (any depth: ``rows_a-b/`` groups), by index."""
    if not dump.is_dir():
        raise DumpError(f"{dump}: expected a SpecForge hidden-state directory (prepare_hidden_states.py "
                        f"--output-path), found no such directory")
    found = [(int(m.group(1)), p) for p in dump.rglob("data_*.ckpt") if (m := _DATA_FILE.search(p.name))]
    if not found:
        raise DumpError(f"{dump}: expected data_<idx>.ckpt files (SpecForge prepare_hidden_states.py), found none")
    return [p for _, p in sorted(found)]


def read_specforge_sample(path: Path, hidden_size: int, num_slots: int) -> dict[str, Tensor]:
    """One SpecForge sample -> ``input_ids`` [T], ``loss_mask`` [T], ``slots`` [T, S, H],
    ``last_hidden`` [T, H] (post-norm); shapes checked against the target's H and the S boundaries."""
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
        raise DumpError(f"{path}: expected a torch.save'd dict (SpecForge data_<idx>.ckpt), found an unreadable "
                        f"file ({type(e).__name__}: {e})") from None
    missing = [k for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state") if k not in d]
    if missing:
        hint = (" (dumped without --enable-aux-hidden-states: it holds no captured layers)"
                if missing == ["aux_hidden_state"] else "")
        raise DumpError(f"{path}: expected keys input_ids, loss_mask, hidden_state, aux_hidden_state; "
                        f"missing {missing}{hint}")
    ids, mask = d["input_ids"].reshape(-1), d["loss_mask"].reshape(-1)
    hid, aux = d["hidden_state"], d["aux_hidden_state"]
    hid = hid[0] if hid.dim() == 3 else hid
    aux = aux[0] if aux.dim() == 3 else aux
    t = ids.shape[0]
    if mask.shape[0] != t or hid.shape != (t, hidden_size) or aux.shape != (t, num_slots * hidden_size):
        raise DumpError(f"{path}: expected input_ids/loss_mask [{t}], hidden_state [1, {t}, {hidden_size}], "
                        f"aux_hidden_state [1, {t}, {num_slots} x {hidden_size}] (the target's hidden size, "
                        f"{num_slots} boundaries); found loss_mask {list(mask.shape)}, hidden_state "
                        f"{list(d['hidden_state'].shape)}, aux_hidden_state {list(d['aux_hidden_state'].shape)}")
    return {"input_ids": ids, "loss_mask": mask, "slots": aux.reshape(t, num_slots, hidden_size),
            "last_hidden": hid}


def _groups(files: Sequence[Path], shard_size: int) -> Iterator[list[Path]]:
    for i in range(0, len(files), shard_size):
        yield list(files[i:i + shard_size])


def import_specforge(
    dump: str | Path,
    out_dir: str | Path,
    target: Any,
    boundaries: Sequence[int],
    *,
    source: str | None = None,
    dtype: str = "bfloat16",
    shard_size: int = 256,
    log: Callable[[str], None] | None = None,
) -> ImportSummary:
    """Convert a SpecForge dump at ``dump`` into eyas shards in ``out_dir`` (which must not hold a
    capture yet). ``target`` is the target model (an nn.Module; its identity goes into the
    contract, its H checks every file); ``boundaries`` the captured layers in eyas' convention,
    ascending (the order in which SGLang concatenates them)."""
    dump, out = Path(dump), Path(out_dir)
    bs = [int(b) for b in boundaries]
    if bs != sorted(set(bs)):
        raise DumpError(f"boundaries: expected ascending and distinct (SGLang concatenates the captured layers in "
                        f"layer order), found {bs}")
    if dtype not in DTYPES:
        raise DumpError(f"dtype: expected {'|'.join(DTYPES)}, found {dtype!r}")
    if shard_size < 1:
        raise DumpError(f"shard_size: expected at least 1, found {shard_size}")
    if (out / MANIFEST).exists() or (out.is_dir() and any(out.glob("progress-r*.json"))):
        raise DumpError(f"{out}: already holds a capture (manifest or progress files); expected a new directory")
    files = specforge_files(dump)
    identity = target_identity(target, source)
    hidden = identity.hidden_size
    if not all(0 <= b <= identity.num_blocks for b in bs):
        raise DumpError(f"boundaries: expected each in 0..{identity.num_blocks} (the target's blocks), found {bs}")
    contract = Contract(target=identity, capture=CaptureContract(boundaries=bs, dtype=dtype))
    read_specforge_sample(files[0], hidden, len(bs))  # a wrong H or slot count fails before anything is written
    out.mkdir(parents=True, exist_ok=True)
    summary = ImportSummary(out_dir=str(out), format=SPECFORGE, boundaries=bs)
    channels = FingerprintAccumulator(bs, hidden).channels
    entries = []
    store = DTYPES[dtype]
    for k, group in enumerate(_groups(files, shard_size)):
        acc = FingerprintAccumulator(bs, hidden, channels)
        samples = [read_specforge_sample(p, hidden, len(bs)) for p in group]
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
        ids = [f"{SPECFORGE}:{p.stem}" for p in group]
        from safetensors.torch import save

        meta = {"eyas": json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "rank": 0, "index": k,
                                    "boundaries": bs, "dtype": dtype, "ids": ids, "imported_from": SPECFORGE})}
        data = save(tensors, metadata=meta)
        atomic_write_bytes(out / shard_name(0, k), data)
        entries.append({"file": shard_name(0, k), "rank": 0, "index": k, "samples": len(samples),
                        "tokens": int(offsets[-1]), "loss_tokens": int(tensors["loss_mask"].sum()),
                        "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "batch_size": 1,
                        "ids": ids, "fingerprint": acc.state()})
        summary.samples += len(samples)
        summary.tokens += int(offsets[-1])
        summary.loss_tokens += int(tensors["loss_mask"].sum())
        if log is not None:
            log(f"shard {k}: {len(samples)} samples, {int(offsets[-1])} tokens")
    summary.shards = len(entries)
    params = {"boundaries": bs, "dtype": dtype, "shard_size": shard_size, "world_size": 1, "channels": channels,
              "imported_from": SPECFORGE}
    atomic_write_json(out / progress_name(0), {
        "format": FORMAT + "+progress", "version": FORMAT_VERSION, "rank": 0, "world_size": 1, "params": params,
        "plan_sha256": None, "num_shards": len(entries),
        "counts": {"conversations": summary.samples, "samples": summary.samples, "tokens": summary.tokens,
                   "loss_tokens": summary.loss_tokens},
        "problems": [], "source_data": str(dump), "contract": contract.model_dump(mode="json"),
        "shards": entries, "complete": True,
    })
    path = finalize_manifest(out)
    manifest = read_json_object(path, DumpError, "manifest")
    manifest["layout"]["last_hidden_normed"] = True
    manifest["layout"]["tensors"]["last_hidden"] = ("dtype [N, H] (the final norm's OUTPUT: SpecForge's hidden_state; "
                                                    "training applies only lm_head)")
    manifest["imported"] = {"format": SPECFORGE, "dump": str(dump), "files": len(files),
                            "writer": "SpecForge scripts/prepare_hidden_states.py"}
    atomic_write_json(path, manifest)
    summary.manifest = str(path)
    return summary
