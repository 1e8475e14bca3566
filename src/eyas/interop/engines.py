"""A drafter directory as each serving engine reads it: :func:`read_as` for one engine,
:func:`view_engines` for every engine of the registry at once.

Every command that says what an engine will capture goes through :func:`read_as`: ``eyas info``,
``export``, ``import`` and ``new`` (through :func:`view_engines`), ``eyas doctor`` and ``eyas trace``
(on a directory read tolerantly, :func:`eyas.interop.directory.read_drafter_dir`). The rules
themselves are each engine's spec (:mod:`eyas.interop.servers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from eyas.contract.contract import Contract
from eyas.drafter.config import NORM_FLAGS, DrafterConfig
from eyas.interop import servers
from eyas.interop.common import CheckpointError
from eyas.interop.directory import DrafterDir
from eyas.interop.eyas_format import PASS_BLOCKS, Meta, read_meta, unknown_blocks_error
from eyas.interop.servers import Edit, EngineReading


def _meta(directory: str | Path | Meta | DrafterDir, num_blocks: int | None, ids_convention: str | None) -> Meta:
    if isinstance(directory, DrafterDir):
        return directory.meta
    if isinstance(directory, Meta):
        return directory
    return read_meta(directory, default_num_blocks=num_blocks, ids_convention=ids_convention)


def read_as(
    engine: str,
    directory: str | Path | Meta | DrafterDir,
    num_blocks: int | None = None,
    rule: str | None = None,
    ids_convention: str | None = None,
) -> EngineReading:
    """What ``engine`` (following id ``rule``; default: its current one) builds from ``directory``'s
    files as they stand, for a target of ``num_blocks`` blocks (None: unknown, defaults unresolved).
    ``ids_convention`` says what a path's third-party nested SGLang ids mean (a directory already
    read was read with its own); the eyas reading marks boundaries it could only assume
    (``boundaries_assumed``).

    ``directory`` is a path, or a directory already read: its metadata (:class:`Meta`) or, for
    diagnosis, a :class:`DrafterDir` (then what config.json and the weights say stands in for a
    missing eyas.json). Raises :class:`~eyas.interop.servers.ServerError` for an unknown engine or
    rule; every problem with the files is in the reading (``loadable``, ``why_not``).
    """
    spec = servers.get(engine)
    meta = _meta(directory, num_blocks, ids_convention)
    if isinstance(directory, DrafterDir):
        return spec.read(meta, num_blocks, rule, directory.files_config, directory.problems)
    return spec.read(meta, num_blocks, rule)


def boundary_edits(directory: Meta | DrafterDir, reading: EngineReading, boundaries: Sequence[int],
                   num_blocks: int) -> tuple[list[Edit], str | None]:
    """The edits that make ``reading``'s engine (and rule) capture ``boundaries``; (edits, problem)."""
    meta = directory.meta if isinstance(directory, DrafterDir) else directory
    return servers.get(reading.engine).boundary_edits(meta, boundaries, num_blocks, reading.rule)


def served_config(dd: DrafterDir, reading: EngineReading) -> DrafterConfig:
    """The drafter the engine builds: the trained architecture with the engine's norm flags."""
    update = {f: reading.flags[f] for f in NORM_FLAGS if f in reading.flags}
    return dd.trained.model_copy(update=update)


@dataclass(frozen=True)
class EngineView:
    """The trained boundaries of a drafter directory and what each engine (and id rule) captures.

    ``engines`` maps a view key (the engine's name for its current rule, ``name_rule`` for another,
    e.g. ``sglang_legacy``) to the boundaries it captures; None when that depends on an unknown
    block count or the ids cannot be read.
    """

    path: Path
    format: str
    boundaries: list[int]
    boundaries_source: str
    num_target_blocks: int | None
    ids: dict[str, list[int] | None]  # each engine's id key -> the ids as written
    readings: dict[str, EngineReading]
    contract: Contract | None  # eyas.json's contract (None: no eyas.json, or imported without a target)
    boundaries_assumed: str | None = None  # why the trained boundaries are only assumed (None: the directory says)
    id_readings: dict[str, list[int] | str] = field(default_factory=dict)  # each convention's reading, where they differ
    ids_convention: str | None = None  # the convention third-party nested ids were read by, where several apply
    flags_assumed: dict[str, str] = field(default_factory=dict)  # norm flags not known to be the trained ones -> why

    @property
    def engines(self) -> dict[str, list[int] | None]:
        return {key: r.boundaries for key, r in self.readings.items()}

    @property
    def differs(self) -> list[str]:
        """The engines whose capture is not the trained boundaries."""
        return [name for name, got in self.engines.items() if got is not None and got != self.boundaries]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "format": self.format,
            "boundaries": list(self.boundaries),
            "boundaries_source": self.boundaries_source,
            "num_target_blocks": self.num_target_blocks,
            "ids": dict(self.ids),
            "engines": dict(self.engines),
            "differs": self.differs,
            "boundaries_assumed": self.boundaries_assumed is not None,
            "boundaries_assumed_why": self.boundaries_assumed,
            "ids_convention": self.ids_convention,
            "id_readings": dict(self.id_readings),
            "flags_assumed": dict(self.flags_assumed),
        }


def view_engines(path: str | Path, num_target_blocks: int | None = None,
                 require_blocks: bool = False, ids_convention: str | None = None) -> EngineView:
    """Every engine's reading of the drafter at ``path`` (metadata only: the weights are not read).

    ``ids_convention`` says what third-party nested SGLang ids mean (see
    :func:`~eyas.interop.eyas_format.read_meta`); without it the view says when the trained
    boundaries are only assumed, and each convention's reading where they differ.

    ``num_target_blocks`` is asserted: a directory that records another count is refused. With
    ``require_blocks`` a directory that does not say its target's block count (and none passed) is
    refused too, saying what to pass; otherwise what depends on it is reported as unknown.
    """
    meta = read_meta(path, num_target_blocks, ids_convention=ids_convention)
    if meta.boundaries is None:
        raise CheckpointError(f"{meta.boundaries_source}: {PASS_BLOCKS}")
    if require_blocks and meta.num_target_blocks is None:
        raise unknown_blocks_error(meta)
    L = meta.num_target_blocks
    readings = {spec.view_key(rule): spec.read(meta, L, rule) for spec, rule in servers.readings()}
    ids = {spec.id_key: spec.read_ids(meta.config) for spec in servers.SERVERS.values() if spec.id_key}
    return EngineView(
        path=meta.path, format=meta.format, boundaries=list(meta.boundaries),
        boundaries_source=meta.boundaries_source, num_target_blocks=L, ids=ids,
        readings=readings, contract=meta.contract, boundaries_assumed=meta.boundaries_assumed,
        id_readings=dict(meta.id_readings), ids_convention=meta.ids_convention,
        flags_assumed=dict(meta.flags_assumed),
    )
