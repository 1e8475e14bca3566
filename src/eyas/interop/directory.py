"""A drafter directory read *tolerantly*, for diagnosis.

:func:`read_drafter_dir` reads what :func:`eyas.interop.load_drafter` reads (config.json, eyas.json,
the weights) but refuses nothing that can still be diagnosed: a config.json edited out of step with
eyas.json is the very thing ``eyas doctor`` and ``eyas trace`` look for. It says what the drafter
was trained with (eyas.json, else config.json and the weights) and what config.json alone says;
how each engine reads the same files is :func:`eyas.interop.read_as`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from torch import Tensor

from eyas.contract.contract import Contract
from eyas.drafter.config import NORM_FLAGS, DrafterConfig
from eyas.interop.common import CONFIG_JSON, EYAS_JSON, CheckpointError, read_tensors
from eyas.interop.eyas_format import LAYOUTS, Meta, config_json_fields, read_meta

TRAIN_CONFIG = "train_config.json"  # written beside the checkpoints by eyas train


@dataclass
class DrafterDir:
    path: Path
    meta: Meta
    tensors: dict[str, Tensor]  # eyas state_dict names
    weights_file: str
    files_config: DrafterConfig | None  # what config.json alone says (the layout's own reading)
    trained: DrafterConfig  # what the drafter was trained with: eyas.json, else files + weights
    trained_source: str
    # train_config.json as written (a JSON object), for the training run's held-out split; the
    # training package gives it a type (interop sits below training).
    train_config_json: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def layout(self) -> str:
        return self.meta.layout

    @property
    def config(self) -> dict[str, Any]:
        return self.meta.config

    @property
    def contract(self) -> Contract | None:
        return self.meta.contract

    @property
    def boundaries(self) -> list[int]:
        assert self.meta.boundaries is not None
        return list(self.meta.boundaries)

    @property
    def trained_flags(self) -> dict[str, bool]:
        return {f: bool(getattr(self.trained, f)) for f in NORM_FLAGS}


def _implied_flags(tensors: dict[str, Tensor]) -> dict[str, bool]:
    """Norm flags the weights themselves prove (a norm module only exists when its flag is on)."""
    out = {}
    if "input_norm.weight" in tensors:
        out["norm_before_fc"] = True
    if any(k.startswith("fc_norm.") for k in tensors):
        out["fc_norm"] = True
    return out


def _files_config(meta: Meta, tensors: dict[str, Tensor]) -> tuple[DrafterConfig | None, str | None]:
    cfile = meta.path / CONFIG_JSON
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the doctor reports absent flags itself
            fields = config_json_fields(meta)
    except CheckpointError as e:
        return None, str(e)
    fc = tensors.get("fc.weight")
    if fc is None or fc.dim() != 2:
        return None, f"{cfile}: fc.weight: expected a 2-D tensor in the weights, found {None if fc is None else tuple(fc.shape)}"
    th = fields["target_hidden_size"]
    if fields["draft_vocab_size"] is None:
        head = tensors.get("lm_head.weight")
        fields["draft_vocab_size"] = head.shape[0] if head is not None else fields["vocab_size"]
    num_slots = max(1, fc.shape[1] // th) if th else 1
    try:
        return DrafterConfig(**fields, num_slots=num_slots), None
    except ValidationError as e:
        return None, f"{cfile}: not a valid drafter config ({e})"


def _read_train_config(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    if not path.exists():
        return None, None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        value = None
    if not isinstance(value, dict):
        return None, f"{path}: unreadable; the held-out split of the training run cannot be reproduced"
    return value, None


def read_drafter_dir(path: str | Path, num_blocks: int | None, ids_convention: str | None = None) -> DrafterDir:
    """Read a drafter directory for diagnosis. Raises CheckpointError only when nothing can be
    diagnosed (no config.json, no weights, no derivable boundaries). ``ids_convention``: what
    third-party nested SGLang ids mean (without it, boundaries those conventions read differently
    are marked assumed, ``meta.boundaries_assumed``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = read_meta(path, default_num_blocks=num_blocks, ids_convention=ids_convention)
    if meta.boundaries is None:
        raise CheckpointError(f"{meta.boundaries_source}: the drafter's boundaries are unknown")
    raw, where = read_tensors(meta.path)
    tensors = LAYOUTS[meta.layout].tensors_from_file(raw)
    files_cfg, files_problem = _files_config(meta, tensors)
    problems = [files_problem] if files_problem else []
    if meta.drafter_config is not None:
        trained, source = meta.drafter_config, f"{meta.path / EYAS_JSON} drafter_config"
    elif files_cfg is not None:
        implied = _implied_flags(tensors)
        trained = files_cfg.model_copy(update=implied) if implied else files_cfg
        source = str(meta.path / CONFIG_JSON)
        if implied:
            source += f" and the weights ({', '.join(sorted(implied))} from their norm tensors)"
    else:
        raise CheckpointError(files_problem or f"{meta.path}: cannot derive the drafter's config")
    train_config, problem = _read_train_config(meta.path / TRAIN_CONFIG)
    if problem:
        problems.append(problem)
    return DrafterDir(meta.path, meta, tensors, where, files_cfg, trained, source, train_config, problems)
