"""Resumable training state in safetensors + JSON (never pickle): optimizer, scheduler, RNG, step.

A checkpoint directory is written under a temporary name and renamed when complete, so a crash
leaves either the previous checkpoint or the new one, never half of one.

The tensors (AdamW's two moments: twice the drafter in float32) are written as safetensors shards
of at most ``SHARD_BYTES`` each (16 MiB: files that any filesystem, upload or sync handles), with
an index ``train_state.index.json``: per tensor its dtype, shape and parts, each part a
(shard file, key) whose flattened values, concatenated in order, are the tensor's. A tensor
larger than a shard is cut into flat pieces; smaller ones are packed whole, first fit in order.
Reading joins the parts back bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

# In a subfolder: engines load every *.safetensors beside config.json as weights.
STATE_DIR = "resume"
STATE_TENSORS = f"{STATE_DIR}/train_state.safetensors"  # before shards: one file (still read)
STATE_INDEX = f"{STATE_DIR}/train_state.index.json"
STATE_JSON = f"{STATE_DIR}/train_state.json"
SHARD_BYTES = 16 * 2**20
_ENTRY_BYTES = 128  # bound on a header entry without its key: {"dtype":"BF16","shape":[...],"data_offsets":[...]}
_HEADER_BYTES = 1024  # the header's length prefix, braces, __metadata__ and alignment padding
_RESERVE = _HEADER_BYTES + _ENTRY_BYTES + 1024  # what a full-size piece leaves for its header (key <= 1 KiB)


def save_sharded(tensors: dict[str, torch.Tensor], directory: Path, prefix: str,
                 max_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """Write ``tensors`` as ``{prefix}-NNNNN.safetensors`` files of at most ``max_bytes`` each
    under ``directory``; returns the index (see the module docstring). A file's size is its
    tensors' bytes plus the JSON header, which each entry is charged for at a bound of
    ``_ENTRY_BYTES`` + its key (the header's own braces fit in the reserve a piece leaves)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    index: dict[str, Any] = {"tensors": {}, "max_bytes": max_bytes}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        flat = t.reshape(-1)
        per = max(1, (max_bytes - _RESERVE) // max(1, t.element_size()))  # elements per piece
        parts = []
        for a in range(0, max(1, flat.numel()), per):
            piece = flat[a : a + per].clone()  # own storage: safetensors refuses shared views
            key = f"{name}#{len(parts)}"
            nbytes = piece.numel() * piece.element_size() + _ENTRY_BYTES + len(key.encode())
            if sizes[-1] and sizes[-1] + nbytes > max_bytes - _HEADER_BYTES:
                shards.append({})
                sizes.append(0)
            shards[-1][key] = piece
            sizes[-1] += nbytes
            parts.append([len(shards) - 1, key])
        index["tensors"][name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                  "parts": parts}
    directory.mkdir(parents=True, exist_ok=True)
    files = [f"{prefix}-{i + 1:05d}.safetensors" for i in range(len(shards))]
    for f, shard in zip(files, shards):
        save_file(shard, str(directory / f))
    for entry in index["tensors"].values():
        entry["parts"] = [[files[i], key] for i, key in entry["parts"]]
    index["files"] = files
    return index


def load_sharded(directory: Path, index: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors :func:`save_sharded` wrote, joined back exactly."""
    loaded = {f: load_file(str(directory / f)) for f in index["files"]}
    out = {}
    for name, entry in index["tensors"].items():
        flat = torch.cat([loaded[f][key] for f, key in entry["parts"]])
        expected = getattr(torch, entry["dtype"])
        if flat.dtype != expected:
            raise ValueError(f"{directory}: tensor {name!r}: expected dtype {expected}, found {flat.dtype}")
        out[name] = flat.reshape(entry["shape"])
    return out


def _split_optimizer(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim.{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _join_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        if name.startswith("optim."):
            _, pid, k = name.split(".", 2)
            state.setdefault(int(pid), {})[k] = t
    for name, v in meta["scalars"].items():
        pid, k = name.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def save_train_state(directory: Path, step: int, opt: torch.optim.Optimizer,
                     sched: torch.optim.lr_scheduler.LRScheduler, extra: dict[str, Any]) -> None:
    """Write the resumable state under ``directory/resume`` (shards, index, then the JSON whose
    presence marks a complete checkpoint: :func:`checkpoint_dirs`)."""
    tensors, optim_meta = _split_optimizer(opt)
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    sched_state = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    index = save_sharded(tensors, directory / STATE_DIR, "train_state")
    (directory / STATE_INDEX).write_text(json.dumps(index, indent=1))
    (directory / STATE_JSON).write_text(json.dumps(
        {"step": step, "optimizer": optim_meta, "scheduler": sched_state, **extra}, indent=2))


def load_train_state(directory: Path, opt: torch.optim.Optimizer,
                     sched: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    if (directory / STATE_INDEX).exists():
        tensors = load_sharded(directory / STATE_DIR, json.loads((directory / STATE_INDEX).read_text()))
    else:  # a checkpoint written before the state was sharded
        tensors = load_file(str(directory / STATE_TENSORS))
    meta = json.loads((directory / STATE_JSON).read_text())
    opt.load_state_dict(_join_optimizer(tensors, meta["optimizer"]))
    sched.load_state_dict({**meta["scheduler"], "lr_lambdas": [None] * len(opt.param_groups)})
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return meta


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints under ``out/checkpoints``, oldest first."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith("step-") and (p / STATE_JSON).exists()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def commit_dir(tmp: Path, final: Path) -> None:
    """Atomically replace ``final`` by the fully written ``tmp``."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
