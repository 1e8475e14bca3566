"""Resumable training state in safetensors + JSON (never pickle): optimizer, scheduler, RNG, step.

A checkpoint directory is written under a temporary name and renamed when complete, so a crash
leaves either the previous checkpoint or the new one, never half of one.
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
STATE_TENSORS = f"{STATE_DIR}/train_state.safetensors"
STATE_JSON = f"{STATE_DIR}/train_state.json"


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
    tensors, optim_meta = _split_optimizer(opt)
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    sched_state = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    (directory / STATE_DIR).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / STATE_TENSORS))
    (directory / STATE_JSON).write_text(json.dumps(
        {"step": step, "optimizer": optim_meta, "scheduler": sched_state, **extra}, indent=2))


def load_train_state(directory: Path, opt: torch.optim.Optimizer,
                     sched: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
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
