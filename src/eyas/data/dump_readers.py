"""Reading the two dump formats that :mod:`eyas.data.dumps` converts (the layouts and what each
tensor holds are in that module's docstring): SpecForge's ``data_<idx>.ckpt`` files and
speculators' ``hs_<row>.safetensors`` files with their preprocessed dataset. Each format's files are
found, read one sample at a time with shapes checked against the target, and offered to the
converter as a :class:`Dump` (files in stored order, how to read one, the manifest's records).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eyas.errors import EyasError

SPECFORGE = "specforge"
SPECULATORS = "speculators"
FORMATS = (SPECFORGE, SPECULATORS)
_DATA_FILE = re.compile(r"data_(\d+)\.ckpt$")
_HS_FILE = re.compile(r"hs_(\d+)\.safetensors$")
_FP8_SCALES = "hidden_states_scales"  # hs_connectors' FP8 backend


class DumpError(EyasError, ValueError):
    """A dump that cannot be read or converted; the message names the file, expected and found."""


@dataclass
class Dump:
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


def open_specforge_dump(dump: Path, hidden: int, bs: list[int]) -> Dump:
    files = specforge_files(dump)
    return Dump(
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


def open_speculators_dump(dump: Path, preprocessed: Path | None, hidden: int, bs: list[int]) -> Dump:
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

    return Dump(
        format=SPECULATORS, files=[p for _, p in found], read=read, last_hidden_normed=False,
        imported={"format": SPECULATORS, "dump": str(dump), "preprocessed_data": str(preprocessed),
                  "files": len(found), "rows": n, "rows_without_file": n - len(found),
                  "writer": "speculators generate-offline-data (vLLM extract_hidden_states, launch_vllm.py)"},
        missing=n - len(found))
