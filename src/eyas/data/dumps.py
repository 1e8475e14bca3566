"""Hidden states captured by another engine, converted into eyas shards (``eyas import-hidden-states``).

For targets beyond one machine the capture runs in an engine that already spreads a model over
many GPUs and hosts (SGLang, vLLM); eyas converts what it writes. Two formats are read.

**SpecForge offline dumps** (``--format specforge``), written by SpecForge's
``scripts/prepare_hidden_states.py`` (the target inside SGLang) or
``scripts/prepare_hidden_states_hf.py`` (inside transformers: there ``hidden_state`` is
``hidden_states[-1]`` and each captured layer ``hidden_states[id + 1]``, in the order the ids are
given), run with ``--enable-aux-hidden-states``. Layout, as they write it::

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
SpecForge's ``hidden_state`` is the final norm's output, not boundary L, and the norm cannot be
undone: the shards record it in the manifest (``layout.last_hidden_normed``) and training applies
only lm_head to it.

**speculators offline data** (``--format speculators``; speculators 0.9.0, vLLM's
``extract_hidden_states`` speculative method). Three steps write it::

    speculators prepare-data --model M --data conversations.jsonl --render-endpoint http://HOST:8000 \\
        --output DATA                      # tokens and loss masks: a datasets.save_to_disk directory
    python scripts/launch_vllm.py M --target-layer-ids 2 15 27 -- --tensor-parallel-size 8
                                           # vllm serve M --speculative_config {"method":
                                           # "extract_hidden_states", ... "eagle_aux_hidden_state_layer_ids":
                                           # [2, 15, 27, L]} with the ExampleHiddenStatesConnector
    speculators generate-offline-data --preprocessed-data DATA --endpoint http://HOST:8000/v1 \\
        [--output DATA/hidden_states] [--world-size N --rank R]

    DATA/state.json, dataset_info.json, data-*.arrow   columns input_ids [T], loss_mask [T] (1 = trained), seq_len
    DATA/hidden_states/hs_0.safetensors                one file per row of DATA (the name is the row index):
    DATA/hidden_states/hs_1.safetensors                  token_ids      int64 [T]          = the row's input_ids
    ...                                                  hidden_states  dtype [T, S+1, H]  model dtype (bf16)

``hidden_states[:, i]`` is layer id ``i``'s value in layer order (vLLM appends each captured layer
while it runs the blocks). vLLM's id k is the input of block k, ``hidden_states + residual``: eyas
boundary k, the same number. ``launch_vllm.py`` appends ``num_hidden_layers`` (L) to
``--target-layer-ids`` (default ``[2, L//2, L-3]``) unless ``--no-include-last-layer``; vLLM stores
id L as the last block's output BEFORE the final norm (its docs: "not normalized using the output
norm"), which is boundary L, what eyas' own capture stores as ``last_hidden``. speculators' trainer
reads ``hidden_states[:, :-1]`` as the drafter's input and ``hidden_states[:, -1]`` as the
verifier's last hidden state; so does this converter. The loss mask is not in the files: it is the
``loss_mask`` column of the preprocessed dataset (``--preprocessed-data``, by default the directory
above the dump when it is one); reading it needs the ``datasets`` package. With the FP8 backend
(``launch_vllm.py --hidden-states-backend fp8``) ``hidden_states`` is float8_e4m3fn with
``hidden_states_scales`` float32 [T, 1, 1] (value = fp8 * scale); the converter dequantizes it.
Rows without a file (failed requests that speculators skipped, ``--max-samples``) are counted and
left out.

Common to both: the shards get every sample in file order; the manifest's contract holds the
target's identity (from ``--target``), the boundaries, the dtype and the fingerprint of the stored
slots; no tokenisation is recorded (the other tool rendered the chat template itself). Each shard
is written under a temporary name and renamed, then recorded in ``progress-r00.json``; a rerun of
the same import into the same directory keeps the shards already written and goes on (another dump,
target, boundaries, dtype or shard size is refused, naming what differs); the manifest is written
last, once.
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
from eyas.contract import CaptureContract, Contract, compare, target_identity
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
from eyas.errors import EyasError
from eyas.io import atomic_write_bytes, atomic_write_json, read_json_object

SPECFORGE = "specforge"
SPECULATORS = "speculators"
FORMATS = (SPECFORGE, SPECULATORS)
_DATA_FILE = re.compile(r"data_(\d+)\.ckpt$")
_HS_FILE = re.compile(r"hs_(\d+)\.safetensors$")
_FP8_SCALES = "hidden_states_scales"  # hs_connectors' FP8 backend
_RESUME_PARAMS = ("imported_from", "boundaries", "dtype", "shard_size", "world_size", "channels")


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
    shards_resumed: int = 0  # already written by an earlier run of the same import
    missing: int = 0  # speculators: rows of the preprocessed dataset without an hs_<row>.safetensors
    manifest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Dump:
    """One format's view of a dump: its sample files in stored order and how to read one.

    ``read(path)`` -> ``input_ids`` [T], ``loss_mask`` [T], ``slots`` [T, S, H] and ``last_hidden``
    [T, H], shapes checked against the target's H and the S boundaries."""

    format: str
    files: list[Path]
    read: Callable[[Path], dict[str, Tensor]]
    last_hidden_normed: bool  # the stored last layer is the final norm's output, not boundary L
    imported: dict[str, Any]  # the manifest's "imported" record
    missing: int = 0
    extra_layout: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# SpecForge
# ---------------------------------------------------------------------------------------------


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
    if not isinstance(d, dict):
        raise DumpError(f"{path}: expected a torch.save'd dict (SpecForge data_<idx>.ckpt), found {type(d).__name__}")
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


def _specforge_dump(dump: Path, hidden: int, bs: list[int]) -> _Dump:
    files = specforge_files(dump)
    return _Dump(
        format=SPECFORGE, files=files, read=lambda p: read_specforge_sample(p, hidden, len(bs)),
        last_hidden_normed=True,
        imported={"format": SPECFORGE, "dump": str(dump), "files": len(files),
                  "writer": "SpecForge scripts/prepare_hidden_states.py"},
        extra_layout={"last_hidden_normed": True,
                      "tensors": {"last_hidden": "dtype [N, H] (the final norm's OUTPUT: SpecForge's hidden_state; "
                                                 "training applies only lm_head)"}})


# ---------------------------------------------------------------------------------------------
# speculators (vLLM extract_hidden_states)
# ---------------------------------------------------------------------------------------------


def speculators_slots(layer_ids: Sequence[int], num_blocks: int) -> list[int]:
    """The drafter's slots of a speculators dump made with ``launch_vllm.py --target-layer-ids
    layer_ids``: the ids (vLLM's id k = eyas boundary k) less a trailing ``num_blocks``, the last
    layer, which launch_vllm.py appends itself and which the files hold as the last entry."""
    ids = [int(i) for i in layer_ids]
    return ids[:-1] if len(ids) > 1 and ids[-1] == num_blocks else ids


def speculators_files(dump: Path) -> list[tuple[int, Path]]:
    """Every ``hs_<row>.safetensors`` directly in ``dump``, by row."""
    if not dump.is_dir():
        raise DumpError(f"{dump}: expected speculators' hidden-state directory (generate-offline-data --output, "
                        f"by default PREPROCESSED_DATA/hidden_states), found no such directory")
    found = sorted((int(m.group(1)), p) for p in dump.glob("hs_*.safetensors") if (m := _HS_FILE.fullmatch(p.name)))
    if not found:
        hint = (f" (its subdirectory {dump / 'hidden_states'} is where generate-offline-data writes by default)"
                if (dump / "hidden_states").is_dir() else "")
        raise DumpError(f"{dump}: expected hs_<row>.safetensors files (speculators generate-offline-data), "
                        f"found none{hint}")
    return found


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def preprocessed_rows(path: Path) -> Any:
    """speculators' preprocessed dataset (``prepare-data --output``: a ``datasets`` directory with
    ``input_ids`` and ``loss_mask`` columns), rows as Python lists."""
    if not _is_saved_dataset(path):
        raise DumpError(f"{path}: expected speculators' preprocessed dataset (speculators prepare-data --output: "
                        f"state.json, dataset_info.json, data-*.arrow), found "
                        + ("no such directory" if not path.is_dir() else "no state.json/dataset_info.json"))
    try:
        from datasets import Dataset, load_from_disk
    except ImportError:
        raise DumpError(f"{path}: reading speculators' preprocessed dataset (the loss masks) needs the `datasets` "
                        f"package; found it not installed (pip install datasets)") from None
    try:
        ds = load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - any unreadable dataset is the same user error
        raise DumpError(f"{path}: expected a dataset saved by speculators prepare-data, found an unreadable one "
                        f"({type(e).__name__}: {e})") from None
    if not isinstance(ds, Dataset):
        raise DumpError(f"{path}: expected one dataset (speculators prepare-data --output), found {type(ds).__name__}")
    missing = [c for c in ("input_ids", "loss_mask") if c not in ds.column_names]
    if missing:
        raise DumpError(f"{path}: expected columns input_ids and loss_mask (speculators prepare-data); missing "
                        f"{missing}, found {ds.column_names}")
    return ds.with_format(None)


def read_speculators_sample(path: Path, row: dict[str, Any], row_index: int, hidden_size: int,
                            num_slots: int, data: Path | str = "the preprocessed dataset") -> dict[str, Tensor]:
    """One speculators file and its row of the preprocessed dataset -> ``input_ids`` [T],
    ``loss_mask`` [T], ``slots`` [T, S, H], ``last_hidden`` [T, H] (boundary L, pre-norm)."""
    from safetensors.torch import load_file

    try:
        d = load_file(str(path), device="cpu")
    except Exception as e:  # noqa: BLE001 - truncated copies and foreign files are the same user error
        raise DumpError(f"{path}: expected a safetensors file (vLLM's hidden-states connector), found an unreadable "
                        f"file ({type(e).__name__}: {e}); rerun speculators generate-offline-data, which "
                        f"regenerates unreadable files") from None
    missing = [k for k in ("token_ids", "hidden_states") if k not in d]
    if missing:
        raise DumpError(f"{path}: expected keys token_ids, hidden_states; missing {missing}, found {sorted(d)}")
    ids, hs = d["token_ids"].reshape(-1).long(), d["hidden_states"]
    t = ids.shape[0]
    want = [t, num_slots + 1, hidden_size]
    if list(hs.shape) != want:
        hint = ""
        if hs.dim() == 3 and hs.shape[0] == t and hs.shape[1] == num_slots:
            hint = (" (one layer short: made with launch_vllm.py --no-include-last-layer? eyas needs the last "
                    "layer, boundary L, for the training labels)")
        elif hs.dim() == 3 and hs.shape[0] == t and hs.shape[2] == hidden_size:
            hint = f" ({hs.shape[1] - 1} captured layers in the file: pass the ids it was made with)"
        raise DumpError(f"{path}: hidden_states: expected [T, S+1, H] = {want} (T = {t} token_ids, S = {num_slots} "
                        f"boundaries plus the last layer that launch_vllm.py appends, H = {hidden_size} the "
                        f"target's hidden size); found {list(hs.shape)}{hint}")
    if _FP8_SCALES in d:
        scales = d[_FP8_SCALES]
        if list(scales.shape) != [t, 1, 1]:
            raise DumpError(f"{path}: {_FP8_SCALES}: expected [{t}, 1, 1] (one float32 scale per token, the FP8 "
                            f"backend), found {list(scales.shape)}")
        hs = hs.float() * scales.float()
    elif not hs.is_floating_point() or hs.element_size() == 1:
        raise DumpError(f"{path}: hidden_states: expected bfloat16, float16 or float32 (or float8 with "
                        f"{_FP8_SCALES}), found {hs.dtype} without {_FP8_SCALES}")
    want_ids = [int(x) for x in row["input_ids"]]
    if ids.tolist() != want_ids:
        n = min(t, len(want_ids))
        at = next((i for i in range(n) if int(ids[i]) != want_ids[i]), n)
        raise DumpError(f"{path}: token_ids: expected row {row_index}'s input_ids of {data} ({len(want_ids)} "
                        f"tokens), found {t} tokens that differ from position {at}; the dump was made from "
                        f"another preprocessed dataset")
    mask = torch.as_tensor([int(x) for x in row["loss_mask"]], dtype=torch.long)
    if mask.shape[0] != t:
        raise DumpError(f"{data}: row {row_index}: loss_mask: expected {t} values (its input_ids), found "
                        f"{mask.shape[0]}")
    return {"input_ids": ids, "loss_mask": mask, "slots": hs[:, :num_slots], "last_hidden": hs[:, num_slots]}


def _speculators_dump(dump: Path, preprocessed: Path | None, hidden: int, bs: list[int]) -> _Dump:
    found = speculators_files(dump)
    if preprocessed is None:
        if not _is_saved_dataset(dump.parent):
            raise DumpError(f"{dump}: the loss masks are not in the hs_<row>.safetensors files but in speculators' "
                            f"preprocessed dataset; expected it in {dump.parent} (where generate-offline-data "
                            f"writes by default), found none there: pass --preprocessed-data (prepare-data --output)")
        preprocessed = dump.parent
    rows = preprocessed_rows(preprocessed)
    n = len(rows)
    bad = [(i, p) for i, p in found if i >= n]
    if bad:
        raise DumpError(f"{bad[0][1]}: expected a row of {preprocessed} (rows 0..{n - 1}), found row {bad[0][0]} "
                        f"({len(bad)} such files): the dump was made from another preprocessed dataset")
    index = {p: i for i, p in found}

    def read(p: Path) -> dict[str, Tensor]:
        i = index[p]
        return read_speculators_sample(p, rows[i], i, hidden, len(bs), preprocessed)

    return _Dump(
        format=SPECULATORS, files=[p for _, p in found], read=read, last_hidden_normed=False,
        imported={"format": SPECULATORS, "dump": str(dump), "preprocessed_data": str(preprocessed),
                  "files": len(found), "rows": n, "rows_without_file": n - len(found),
                  "writer": "speculators generate-offline-data (vLLM extract_hidden_states, launch_vllm.py)"},
        missing=n - len(found))


# ---------------------------------------------------------------------------------------------
# Shared: checks, resume, shard writing
# ---------------------------------------------------------------------------------------------


def _check_options(bs: list[int], dtype: str, shard_size: int, num_blocks: int) -> None:
    if bs != sorted(set(bs)):
        raise DumpError(f"boundaries: expected ascending and distinct (the engines store the captured layers in "
                        f"layer order), found {bs}")
    if not all(0 <= b <= num_blocks for b in bs):
        raise DumpError(f"boundaries: expected each in 0..{num_blocks} (the target's blocks), found {bs}")
    if dtype not in DTYPES:
        raise DumpError(f"dtype: expected {'|'.join(DTYPES)}, found {dtype!r}")
    if shard_size < 1:
        raise DumpError(f"shard_size: expected at least 1, found {shard_size}")


def _groups(files: Sequence[Path], shard_size: int) -> Iterator[list[Path]]:
    for i in range(0, len(files), shard_size):
        yield list(files[i:i + shard_size])


def _sample_id(fmt: str, path: Path) -> str:
    return f"{fmt}:{path.name.split('.')[0]}"


def _plan_digest(dump: _Dump) -> str:
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


def _read_checked(dump: _Dump, path: Path) -> dict[str, Tensor]:
    s = dump.read(path)
    if not (torch.isfinite(s["slots"]).all() and torch.isfinite(s["last_hidden"]).all()):
        raise DumpError(f"{path}: expected finite hidden states, found NaN or Inf (the engine's capture "
                        f"overflowed; regenerate this sample)")
    return s


def _convert(dump: _Dump, out: Path, contract: Contract, bs: list[int], dtype: str, shard_size: int,
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


def _prepare(identity: Any, boundaries: Sequence[int], dtype: str, shard_size: int) -> tuple[Contract, list[int]]:
    bs = [int(b) for b in boundaries]
    _check_options(bs, dtype, shard_size, identity.num_blocks)
    return Contract(target=identity, capture=CaptureContract(boundaries=bs, dtype=dtype)), bs


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


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
    """Convert a SpecForge dump at ``dump`` into eyas shards in ``out_dir`` (new, or an unfinished
    run of this same import, which resumes). ``target`` is the target model (an nn.Module; its
    identity goes into the contract, its H checks every file); ``boundaries`` the captured layers
    in eyas' convention, ascending (the order in which SGLang concatenates them)."""
    contract, bs = _prepare(target_identity(target, source), boundaries, dtype, shard_size)
    return _convert(_specforge_dump(Path(dump), contract.target.hidden_size, bs), Path(out_dir), contract, bs,
                    dtype, shard_size, log)


def import_speculators(
    dump: str | Path,
    out_dir: str | Path,
    target: Any,
    layer_ids: Sequence[int],
    *,
    preprocessed_data: str | Path | None = None,
    source: str | None = None,
    dtype: str = "bfloat16",
    shard_size: int = 256,
    log: Callable[[str], None] | None = None,
) -> ImportSummary:
    """Convert speculators' offline data (``hs_<row>.safetensors`` in ``dump``, loss masks in the
    preprocessed dataset ``preprocessed_data``, by default ``dump``'s parent) into eyas shards in
    ``out_dir`` (new, or an unfinished run of this same import, which resumes). ``layer_ids`` are
    ``launch_vllm.py --target-layer-ids``, with or without the last layer it appends (vLLM's id k is
    eyas boundary k); the slots are those less the last layer, which becomes ``last_hidden``."""
    identity = target_identity(target, source)
    slots = speculators_slots(layer_ids, identity.num_blocks)
    contract, bs = _prepare(identity, slots, dtype, shard_size)
    pre = Path(preprocessed_data) if preprocessed_data is not None else None
    return _convert(_speculators_dump(Path(dump), pre, contract.target.hidden_size, bs), Path(out_dir), contract,
                    bs, dtype, shard_size, log)


def import_dump(fmt: str, dump: str | Path, out_dir: str | Path, target: Any, boundaries: Sequence[int],
                **kwargs: Any) -> ImportSummary:
    """:func:`import_specforge` or :func:`import_speculators` by ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == SPECFORGE:
        if kwargs.pop("preprocessed_data", None) is not None:
            raise DumpError("preprocessed_data: a speculators dump's option; SpecForge's files hold their loss masks")
        return import_specforge(dump, out_dir, target, boundaries, **kwargs)
    if fmt == SPECULATORS:
        return import_speculators(dump, out_dir, target, boundaries, **kwargs)
    raise DumpError(f"format: expected {' | '.join(FORMATS)}, found {fmt!r}")
