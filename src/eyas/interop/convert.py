"""Export an eyas drafter to an engine's format, and import one from another trainer's format.

Both go through :func:`~eyas.interop.eyas_format.read_checkpoint` (every check) and copy the stored
tensors unchanged (names mapped, dtype and bits kept).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from eyas.targets.loaded import LoadedTarget
from eyas.contract.contract import enforce
from eyas.interop import servers, speculators
from eyas.interop.common import CheckpointError, prepare_out_dir
from eyas.interop.engines import EngineView, view_engines
from eyas.interop.eyas_format import (
    against_target, new_contract, read_checkpoint, unknown_blocks_error, write_checkpoint,
)


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote, and what each engine will capture from it (``view``)."""

    format: str  # the directory layout written: "sglang" | "speculators"
    path: Path
    boundaries: list[int]
    num_target_blocks: int | None
    ids_written: dict[str, list[int]]  # config.json key -> the layer ids written under it
    sglang_rule: str | None  # the SGLang id rule the nested ids follow (None: none written)
    sglang_rules_agree: bool | None  # every SGLang rule captures the boundaries (None: not an SGLang export)
    view: EngineView
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "path": str(self.path), "boundaries": self.boundaries,
                "num_target_blocks": self.num_target_blocks, "ids_written": self.ids_written,
                "sglang_rule": self.sglang_rule, "sglang_rules_agree": self.sglang_rules_agree,
                "notes": self.notes, "view": self.view.to_dict()}


def export_drafter(
    src_dir: str | Path,
    to: str,
    out_dir: str | Path,
    sglang_rule: str | None = None,
    speculative_tokens: int = 3,
    verifier: str | None = None,
) -> ExportReport:
    """Write the drafter at ``src_dir`` for the engine ``to`` ("sglang", or "vllm" = speculators
    format), its layer ids in that engine's convention (SGLang: for ``sglang_rule``, default the
    current one), and say what every engine will capture from the result.

    ``verifier`` (speculators format only): the target as speculators and vLLM resolve it, a hub id
    or a local model directory; by default the contract's target when it was loaded from one, else
    null, with a warning saying what to pass."""
    spec = servers.for_export(to)
    if spec is None:
        raise CheckpointError(f"to: expected one of {sorted(servers.export_names())}, found {to!r}")
    if verifier is not None:
        if spec.layout != "speculators":
            raise CheckpointError(
                f"verifier: expected only for the speculators format (--to vllm), found {verifier!r} with --to {to}"
            )
        verifier = speculators.check_verifier(verifier)
    ckpt = read_checkpoint(src_dir)
    bs, L = ckpt.boundaries, ckpt.num_target_blocks
    written = write_checkpoint(
        out_dir, ckpt.config, ckpt.tensors, bs, L, ckpt.contract, spec.layout, sglang_rule, speculative_tokens,
        verifier=verifier, boundaries_assumed=ckpt.meta.boundaries_assumed, flags_assumed=ckpt.meta.flags_assumed,
    )
    notes: list[str] = list(written.notes)
    if ckpt.meta.boundaries_assumed:
        notes.append(f"the boundaries {bs} are assumed, not recorded: {ckpt.meta.boundaries_assumed}")
    for flag, why in ckpt.meta.flags_assumed.items():
        notes.append(f"{flag}={str(getattr(ckpt.config, flag)).lower()} is assumed: {why}")
    for note in written.notes:
        warnings.warn(note, stacklevel=2)
    check = spec.rule_check(bs, L if L is not None else max(bs), written.ids_written, written.sglang_rule)
    notes += check.notes
    engines = [s for s in servers.SERVERS.values() if s.layout is not None]
    by_fc = [s.title for s in engines if s.fc_slots is not None and s.fc_slots != ckpt.config.num_slots]
    if by_fc:
        # The engines' llama_eagle3.py size fc as fc_slots * target_hidden_size.
        owners = " and ".join(f"{title}'s" for title in by_fc)
        slots = " / ".join(sorted({str(s.fc_slots) for s in engines if s.fc_slots}))
        notes.append(f"the drafter has {ckpt.config.num_slots} slots; {owners} llama_eagle3 build fc for {slots}")
    inputs_only = [s.title for s in engines if not s.captures_last_boundary]
    if L is not None and L in bs and inputs_only:
        # They capture at the INPUT of a layer (boundaries 0..L-1): boundary L never arrives.
        notes.append(
            f"boundary {L} (the last block's output) is a slot, but {' and '.join(inputs_only)} only capture block "
            f"inputs (boundaries 0..{L - 1}): served by them, this drafter gets {len(bs) - 1} slots and fails"
        )
    if L is None:
        notes.append("the target's number of blocks is unknown: default ids cannot be resolved")
    return ExportReport(
        format=spec.layout or "sglang", path=written.path, boundaries=bs, num_target_blocks=L,
        ids_written=written.ids_written, sglang_rule=written.sglang_rule, sglang_rules_agree=check.rules_agree,
        view=view_engines(written.path), notes=notes,
    )


def import_drafter(
    src_dir: str | Path,
    out_dir: str | Path,
    num_target_blocks: int | None = None,
    target: LoadedTarget | nn.Module | None = None,
    force: bool = False,
    ids_convention: str | None = None,
) -> Path:
    """Convert an SGLang/SpecForge/EAGLE-3 or speculators directory to an eyas directory.

    Layer ids are read in the source layout's own convention, as its engine's spec says
    (:meth:`~eyas.interop.servers.ServerSpec.trained_boundaries`); absent ids mean the default
    ``[2, L//2, L-3]``. Nested SGLang ids mean what the tool that trained the drafter meant:
    ``ids_convention`` (specforge | sglang | sglang-legacy) names it; without it, ids those
    conventions read differently are read as SpecForge's and the eyas directory records in
    ``eyas.json`` that its boundaries are assumed (``boundaries_assumed``). The target's block count comes from the directory, else
    ``num_target_blocks`` or ``target``; when none says it the import is refused (an eyas directory
    records it). With ``target`` the drafter is checked against it (see
    :func:`~eyas.interop.load_drafter`) and the contract records it.

    The result is written to a temporary directory beside ``out_dir``, read back with every check,
    and only then moved into place: a failed import leaves ``out_dir`` as it was.
    """
    loaded = LoadedTarget.of(target) if target is not None else None
    blocks = loaded.num_blocks if loaded is not None else None
    if num_target_blocks is not None and blocks is not None and num_target_blocks != blocks:
        raise CheckpointError(
            f"num_target_blocks: expected {blocks} (the target's decoder blocks), found {num_target_blocks} (passed in)"
        )
    ckpt = read_checkpoint(src_dir, num_target_blocks, default_num_blocks=blocks, ids_convention=ids_convention)
    L = ckpt.num_target_blocks
    if L is None:
        raise unknown_blocks_error(ckpt.meta)
    contract = ckpt.contract
    if loaded is not None:
        forced = enforce(against_target(ckpt, loaded),
                         f"importing {ckpt.meta.path} for target {type(loaded.model).__name__}", force)
        if contract is None and not forced:  # never record a target the drafter does not fit
            contract = new_contract(ckpt, loaded)
    out = Path(out_dir)
    if out.exists():
        prepare_out_dir(out)  # refuses a file, or stale weights an engine would load, before any work
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".importing", dir=out.parent))
    try:
        write_checkpoint(tmp, ckpt.config, ckpt.tensors, ckpt.boundaries, L, contract, layout="eyas",
                         boundaries_assumed=ckpt.meta.boundaries_assumed, flags_assumed=ckpt.meta.flags_assumed)
        read_checkpoint(tmp)  # every check, on the files as written
        view_engines(tmp, require_blocks=True)  # and every engine's reading of them
        if out.exists():  # each file replaced atomically, once all of them are known good
            for f in sorted(tmp.iterdir()):
                os.replace(f, out / f.name)
            tmp.rmdir()
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
