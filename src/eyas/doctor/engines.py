"""How a drafter directory is read: what it was trained on, and what each engine builds from it.

:func:`read_drafter_dir` reads a drafter directory *tolerantly* (a config.json edited out of step
with eyas.json is the very thing the doctor diagnoses, so nothing here refuses an inconsistency
that :func:`eyas.interop.load_drafter` would refuse); :func:`read_engine` models one engine's
reading of that directory's ``config.json`` as it stands: which keys it reads, which defaults it
falls back to, the +1 rules (the conversions themselves are :mod:`eyas.convention.boundaries`'), and
which norm flags it builds the drafter with:

=========  ===============================  ==========================================  =================
engine     layer ids                        norm flags (absent ->)                      fc input
=========  ===============================  ==========================================  =================
eyas       eyas.json boundaries             eyas.json drafter_config                    num_slots x H_t
SGLang     eagle_config.eagle_aux_hidden_   top-level, absent -> false                  3 x target_hidden
           state_layer_ids (+1 rules);
           absent -> [2, L//2, L-3]
vLLM       top-level eagle_aux_hidden_      top-level, absent -> false; in a speculators  3 x target_hidden
           state_layer_ids = boundaries;    (Eagle3Speculator) directory an absent
           absent -> [2, L//2, L-3]         norm_before_residual reads TRUE
=========  ===============================  ==========================================  =================

SGLang does not load speculators-format (``Eagle3Speculator``) directories.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from torch import Tensor

from eyas.convention.boundaries import (
    BoundaryError,
    SGLangRule,
    boundaries_to_sglang_ids,
    default_boundaries,
    sglang_ids_to_boundaries,
    validate_boundaries,
)
from eyas.contract.contract import Contract
from eyas.doctor.common import ENGINE_LABELS, NESTED_IDS, NORM_FLAGS, TOP_IDS, Edit
from eyas.drafter.config import DrafterConfig
from eyas.interop import sglang, speculators
from eyas.interop.common import CONFIG_JSON, EYAS_JSON, CheckpointError, read_tensors
from eyas.interop.eyas_format import LAYOUTS, Meta, read_meta

ENGINES = ("eyas", "sglang", "vllm")
TRAIN_CONFIG = "train_config.json"


# ---------------------------------------------------------------------------------------------
# The directory
# ---------------------------------------------------------------------------------------------


@dataclass
class DrafterDir:
    path: Path
    meta: Meta
    tensors: dict[str, Tensor]  # eyas state_dict names
    weights_file: str
    files_config: DrafterConfig | None  # what config.json alone says (the layout's own reading)
    trained: DrafterConfig  # what the drafter was trained with: eyas.json, else files + weights
    trained_source: str
    train_config: Any | None  # eyas.training.config.TrainConfig from train_config.json, if any
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
    def has_eyas_json(self) -> bool:
        return self.meta.eyas is not None

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
            fields = LAYOUTS[meta.layout].config_fields(meta.config, str(cfile))
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


def read_drafter_dir(path: str | Path, num_blocks: int | None) -> DrafterDir:
    """Read a drafter directory for diagnosis. Raises CheckpointError only when nothing can be
    diagnosed (no config.json, no weights, no derivable boundaries)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = read_meta(path, default_num_blocks=num_blocks)
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
    train_config = None
    tc = meta.path / TRAIN_CONFIG
    if tc.exists():
        from eyas.training.config import TrainConfig

        try:
            train_config = TrainConfig.model_validate_json(tc.read_text())
        except (ValidationError, ValueError):
            problems.append(f"{tc}: unreadable; the held-out split of the training run cannot be reproduced")
    return DrafterDir(meta.path, meta, tensors, where, files_cfg, trained, source, train_config, problems)


# ---------------------------------------------------------------------------------------------
# One engine's reading of config.json
# ---------------------------------------------------------------------------------------------


@dataclass
class KeyRead:
    """One config.json key as the engine reads it."""

    key: str
    present: bool
    raw: Any  # as written (None when absent)
    used: Any  # what the engine uses
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "present": self.present, "raw": self.raw, "used": self.used, "note": self.note}


@dataclass
class EngineReading:
    engine: str  # eyas | sglang | vllm
    version: str | None  # sglang: legacy | pr25454
    loadable: bool = True
    why_not: str | None = None
    boundaries: list[int] | None = None
    boundaries_note: str = ""
    flags: dict[str, bool] = field(default_factory=dict)
    flag_present: dict[str, bool] = field(default_factory=dict)
    target_hidden_size: int | None = None
    draft_vocab_size: int | None = None
    vocab_size: int | None = None
    fc_slots: int | None = None  # slots the engine builds fc for (None: as many as the weights have)
    keys: list[KeyRead] = field(default_factory=list)

    @property
    def label(self) -> str:
        name = ENGINE_LABELS[self.engine]
        if self.engine == "sglang":
            return f"{name} ({'legacy' if self.version == SGLangRule.LEGACY.value else 'PR #25454'} rule)"
        return name

    @property
    def rule(self) -> SGLangRule:
        return SGLangRule(self.version or SGLangRule.PR25454.value)

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "version": self.version, "label": self.label, "loadable": self.loadable,
                "why_not": self.why_not, "boundaries": self.boundaries, "boundaries_note": self.boundaries_note,
                "flags": self.flags, "flags_present": self.flag_present, "target_hidden_size": self.target_hidden_size,
                "draft_vocab_size": self.draft_vocab_size, "vocab_size": self.vocab_size, "fc_slots": self.fc_slots,
                "keys": [k.to_dict() for k in self.keys]}


def normalise_engine(engine: str, version: str | None) -> tuple[str, str | None]:
    e = str(engine).lower()
    if e not in ENGINES:
        raise ValueError(f"--engine: expected one of {list(ENGINES)}, found {engine!r}")
    if e == "sglang":
        v = (version or SGLangRule.PR25454.value).lower().replace("#", "").replace("pr-", "pr")
        if v not in (SGLangRule.LEGACY.value, SGLangRule.PR25454.value):
            raise ValueError(f"--engine-version for sglang: expected 'legacy' or 'pr25454', found {version!r}")
        return e, v
    return e, version


def _ids(value: Any) -> list[int] | None:
    return [int(i) for i in value] if isinstance(value, (list, tuple)) and value else None


def _common_keys(r: EngineReading, config: dict[str, Any], llama: dict[str, Any], engine: str,
                 flag_defaults: dict[str, bool]) -> None:
    """target_hidden_size, draft_vocab_size, vocab_size and the norm flags, as SGLang/vLLM read them."""
    name = ENGINE_LABELS[engine]
    th = config.get("target_hidden_size")
    r.target_hidden_size = int(th) if th else llama.get("hidden_size")
    r.keys.append(KeyRead("target_hidden_size", th is not None, th, r.target_hidden_size,
                          "" if th else f"absent: {name} uses hidden_size"))
    r.vocab_size = llama.get("vocab_size")
    dv = config.get("draft_vocab_size")
    r.draft_vocab_size = int(dv) if dv else r.vocab_size
    r.keys.append(KeyRead("draft_vocab_size", dv is not None, dv, r.draft_vocab_size,
                          "" if dv else f"absent: {name} sizes lm_head by vocab_size"))
    for flag in NORM_FLAGS:
        present = flag in config
        r.flag_present[flag] = present
        r.flags[flag] = bool(config[flag]) if present else flag_defaults[flag]
        r.keys.append(KeyRead(flag, present, config.get(flag), r.flags[flag],
                              "" if present else f"absent: {name} reads {str(flag_defaults[flag]).lower()}"))


def read_engine(dd: DrafterDir, engine: str, version: str | None, num_blocks: int) -> EngineReading:
    """What ``engine`` builds from ``dd``'s files as they stand, for a target of ``num_blocks`` blocks."""
    engine, version = normalise_engine(engine, version)
    L = num_blocks
    r = EngineReading(engine, version)
    config = dd.config
    if engine == "eyas":
        cfg = dd.meta.drafter_config or dd.files_config
        r.boundaries = dd.boundaries
        r.boundaries_note = f"from {dd.meta.boundaries_source}"
        r.keys.append(KeyRead("eyas.json boundaries" if dd.has_eyas_json else "boundaries", True, dd.boundaries,
                              dd.boundaries, r.boundaries_note))
        if cfg is None:
            r.loadable, r.why_not = False, "; ".join(dd.problems) or "no readable drafter config"
            return r
        for flag in NORM_FLAGS:
            r.flags[flag] = bool(getattr(cfg, flag))
            r.flag_present[flag] = flag in config
            r.keys.append(KeyRead(flag, True, getattr(cfg, flag), r.flags[flag],
                                  "eyas.json drafter_config" if dd.meta.drafter_config else f"{CONFIG_JSON}"))
        r.target_hidden_size, r.draft_vocab_size, r.vocab_size = cfg.target_hidden_size, cfg.draft_vocab_size, cfg.vocab_size
        return r

    if engine == "sglang":
        if dd.layout == "speculators":
            r.loadable = False
            r.why_not = (f"SGLang loads {sglang.ARCHITECTURE} directories; {dd.path} is in the speculators/vLLM "
                         f"format ({speculators.ARCHITECTURE})")
            return r
        rule = r.rule
        ids = sglang.nested_ids(config)
        top = _ids(config.get(TOP_IDS))
        if ids is None:
            r.boundaries = default_boundaries(L)
            r.boundaries_note = f"{NESTED_IDS} absent: SGLang's default [2, L//2, L-3] = {r.boundaries}"
        else:
            if rule is SGLangRule.LEGACY:
                how = "+1 to every id (legacy rule)"
            elif ids[0] == 1:
                how = "+1 to every id (PR #25454 rule: the first id is 1)"
            else:
                how = "ids used as written (PR #25454 rule: the first id is not 1)"
            try:
                r.boundaries = sglang_ids_to_boundaries(ids, L, rule)
                r.boundaries_note = f"{NESTED_IDS} {ids}: {how} -> boundaries {r.boundaries}"
            except BoundaryError as e:
                r.loadable, r.why_not = False, str(e)
                r.boundaries_note = f"{NESTED_IDS} {ids}: {how} -> {e}"
        r.keys.append(KeyRead(NESTED_IDS, ids is not None, ids, r.boundaries, r.boundaries_note))
        if top is not None:
            r.keys.append(KeyRead(TOP_IDS, True, top, None, "not read by SGLang"))
        _common_keys(r, config, config, engine, {f: False for f in NORM_FLAGS})
        r.fc_slots = 3
        _block_inputs_only(r, L)
        return r

    # vLLM
    if dd.layout == "speculators":
        llama = config.get("transformer_layer_config") or {}
        defaults = {f: f == "norm_before_residual" for f in NORM_FLAGS}  # vLLM's speculators loader
    else:
        llama = config
        defaults = {f: False for f in NORM_FLAGS}
    top = _ids(config.get(TOP_IDS))
    if top is None:
        r.boundaries = default_boundaries(L)
        r.boundaries_note = f"{TOP_IDS} absent: vLLM's default [2, L//2, L-3] = {r.boundaries}"
    else:
        try:
            r.boundaries = validate_boundaries(top, L)
            r.boundaries_note = f"top-level {TOP_IDS} {top}: boundaries as written"
        except BoundaryError as e:
            r.loadable, r.why_not = False, f"top-level {TOP_IDS} {top}: {e}"
            r.boundaries_note = r.why_not
    r.keys.append(KeyRead(TOP_IDS, top is not None, top, r.boundaries, r.boundaries_note))
    nested = sglang.nested_ids(config)
    if nested is not None:
        r.keys.append(KeyRead(NESTED_IDS, True, nested, None, "not read by vLLM"))
    _common_keys(r, config, llama, engine, defaults)
    r.fc_slots = 3
    _block_inputs_only(r, L)
    return r


def _block_inputs_only(r: EngineReading, L: int) -> None:
    """SGLang and vLLM capture the INPUT of layers (boundaries 0..L-1): boundary L never arrives."""
    if r.loadable and r.boundaries is not None and L in r.boundaries:
        r.loadable = False
        r.why_not = (f"boundary {L} (the last block's output) is slot {r.boundaries.index(L)}, but "
                     f"{ENGINE_LABELS[r.engine]} captures block inputs only (boundaries 0..{L - 1}): it never arrives")


def capturable(engine: str, boundaries: list[int], L: int) -> bool:
    return engine == "eyas" or L not in boundaries


def served_config(dd: DrafterDir, reading: EngineReading) -> DrafterConfig:
    """The drafter the engine builds: the trained architecture with the engine's norm flags."""
    update = {f: reading.flags[f] for f in NORM_FLAGS if f in reading.flags}
    return dd.trained.model_copy(update=update)


# ---------------------------------------------------------------------------------------------
# Fixes: config edits in the engine's own convention
# ---------------------------------------------------------------------------------------------


def boundary_edits(dd: DrafterDir, reading: EngineReading, boundaries: list[int], num_blocks: int) -> tuple[list[Edit], str | None]:
    """The edits that make ``reading.engine`` capture ``boundaries``; (edits, problem)."""
    bs = [int(b) for b in boundaries]
    if not capturable(reading.engine, bs, num_blocks):
        return [], (f"boundary {num_blocks} (the last block's output) cannot be captured by "
                    f"{ENGINE_LABELS[reading.engine]}, which captures block inputs only: retrain the drafter on "
                    f"boundaries 0..{num_blocks - 1} (eyas train --boundaries)")
    if reading.engine == "eyas":
        if dd.has_eyas_json:
            return [Edit(EYAS_JSON, "boundaries", bs), Edit(EYAS_JSON, "contract.capture.boundaries", bs)], None
        return [Edit(CONFIG_JSON, "eyas_boundaries", bs)], None
    if reading.engine == "sglang":
        try:
            ids = boundaries_to_sglang_ids(bs, num_blocks, reading.rule)
        except BoundaryError as e:
            return [], str(e)
        return [Edit(CONFIG_JSON, NESTED_IDS, ids)], None
    return [Edit(CONFIG_JSON, TOP_IDS, bs)], None


def flag_edit(flag: str, value: bool) -> Edit:
    return Edit(CONFIG_JSON, flag, bool(value))
