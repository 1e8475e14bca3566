"""What a serving engine is, to eyas: a :class:`ServerSpec`, and what it makes of a directory.

A spec answers, for one engine, every question eyas asks about serving a drafter directory:

- **reading** (:meth:`ServerSpec.read`): which ``config.json`` keys the engine reads, the
  boundaries its layer ids make it capture (per id-rule version, e.g. SGLang's ``legacy`` and
  ``pr25454``), the fallbacks for absent keys (absent ids -> the EAGLE-3 default ``[2, L//2, L-3]``;
  absent norm flags -> the engine's defaults), whether it loads the directory's layout at all,
  which boundaries it can capture (SGLang and vLLM capture block inputs only, so boundary L never
  arrives) and how many slots it builds ``fc`` for;
- **writing** (:meth:`ServerSpec.write_config`): the ``config.json`` an export writes for it;
- **fixing** (:meth:`ServerSpec.boundary_edits`): the config edits, in the engine's own id
  convention, that make it capture given boundaries;
- **importing** (:meth:`ServerSpec.trained_boundaries`): the boundaries a third-party directory of
  the engine's layout was trained on, by that layout's own convention (or the one the user names
  where the tools that write the layout disagree, :attr:`ServerSpec.ids_conventions`), and whether
  they are an assumption (:class:`TrainedBoundaries`).

The answers are typed: an :class:`EngineReading` with one :class:`KeyRead` per key read, an
:class:`Edit` per config edit, a :class:`WrittenConfig` per writer call.
"""

from __future__ import annotations

import json
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from eyas.convention.boundaries import default_boundaries
from eyas.drafter.config import NORM_FLAGS, DrafterConfig
from eyas.errors import EyasError
from eyas.interop.common import CONFIG_JSON

if TYPE_CHECKING:  # the directory as read (eyas_format imports the specs) and torch, for types only
    import torch
    from eyas.contract.contract import Contract
    from eyas.interop.eyas_format import Meta


class ServerError(EyasError, ValueError):
    """An engine or id-rule name eyas does not know."""


# ---------------------------------------------------------------------------------------------
# Typed results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edit:
    """One edit of a file in the drafter directory: set ``key`` (dotted for nested keys) to ``value``.

    ``shown`` is how the key is written in a fix ("top-level ..." where a nested key of the same
    name exists, a norm flag quoted as in the JSON); it does not take part in equality.
    """

    file: str  # "config.json" | "eyas.json"
    key: str
    value: Any
    shown: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.shown or self.key}: {json.dumps(self.value)}"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "value": self.value, "text": str(self)}


def flag_edit(flag: str, value: bool) -> Edit:
    """Write a norm flag explicitly into config.json (every engine reads the flags top-level)."""
    return Edit(CONFIG_JSON, flag, bool(value), shown=f'"{flag}"')


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
    """What one engine (following one id rule) builds from a drafter directory as it stands.

    ``boundaries`` are what its layer ids make it capture, in slot order (None when they cannot be
    worked out: invalid ids, or absent ids with an unknown block count); they are set even when the
    engine cannot serve the directory (``loadable`` false, ``why_not`` says why), so that a view
    can show what the ids say. ``flags`` are empty when the engine does not load the layout.
    """

    engine: str  # a registry name: eyas | sglang | vllm
    version: str | None  # the id rule followed (SGLang: legacy | pr25454), None for single-rule engines
    label: str  # for people: "SGLang (PR #25454 rule)"
    loadable: bool = True
    why_not: str | None = None
    refused_layout: str | None = None  # the directory layout the engine does not load at all
    boundaries: list[int] | None = None
    boundaries_note: str = ""
    flags: dict[str, bool] = field(default_factory=dict)
    flag_present: dict[str, bool] = field(default_factory=dict)
    target_hidden_size: int | None = None
    draft_vocab_size: int | None = None
    vocab_size: int | None = None
    fc_slots: int | None = None  # slots the engine builds fc for (None: as many as the weights have)
    keys: list[KeyRead] = field(default_factory=list)
    # True when ``boundaries`` are the trained ones only by assumption (eyas reading third-party
    # ids whose conventions disagree, no convention named); ``assumed_why`` says why and what settles it
    boundaries_assumed: bool = False
    assumed_why: str | None = None

    @property
    def rule(self) -> str | None:
        return self.version

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "version": self.version, "label": self.label, "loadable": self.loadable,
                "why_not": self.why_not, "boundaries": self.boundaries, "boundaries_note": self.boundaries_note,
                "flags": self.flags, "flags_present": self.flag_present, "target_hidden_size": self.target_hidden_size,
                "draft_vocab_size": self.draft_vocab_size, "vocab_size": self.vocab_size, "fc_slots": self.fc_slots,
                "keys": [k.to_dict() for k in self.keys], "boundaries_assumed": self.boundaries_assumed,
                "assumed_why": self.assumed_why}


@dataclass(frozen=True)
class TrainedBoundaries:
    """The boundaries a directory eyas did not write was trained on, as its layout's ids say.

    ``boundaries`` is None (and ``source`` says why) when they depend on an unknown block count.
    ``assumed`` is set (why, and what settles it) when the ids mean different boundaries to the
    tools that write the layout and no convention was named; ``readings`` then maps each
    convention to its boundaries (or why it cannot read them). ``convention`` is the convention
    the ids were read by, where more than one applies (None: the layout has one meaning).
    """

    boundaries: list[int] | None
    source: str
    assumed: str | None = None
    readings: dict[str, list[int] | str] = field(default_factory=dict)
    convention: str | None = None


@dataclass(frozen=True)
class WrittenConfig:
    """A config.json for one engine, the layer ids written into it, and the rule they follow."""

    config: dict[str, Any]
    ids_written: dict[str, list[int]]  # config key -> ids, as written
    rule: str | None = None  # the id rule the ids were written for (None: single-rule engine)
    notes: tuple[str, ...] = ()  # what the writer could not fill in as an engine needs it, for people


@dataclass(frozen=True)
class RuleCheck:
    """What an export should say about the engine's id rules for these boundaries."""

    rules_agree: bool | None = None  # every rule version captures the boundaries (None: one rule)
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------


def ids_or_none(value: Any) -> list[int] | None:
    """Layer ids as written in a config: a non-empty list, else None (absent)."""
    return [int(i) for i in value] if isinstance(value, (list, tuple)) and value else None


class ServerSpec(ABC):
    """One serving engine. Subclasses set the class attributes and implement :meth:`read`."""

    name: str  # the registry key and CLI value
    title: str  # for people: "SGLang"
    layout: str | None  # the directory layout it reads and writes natively (None: eyas reads every layout)
    export_names: tuple[str, ...] = ()  # names `eyas export --to` accepts for it (empty: not an export target)
    rules: tuple[str, ...] = ()  # id-rule versions, the default first (empty: one rule)
    id_key: str | None = None  # the config.json key its layer ids are read from (dotted when nested)
    captures_last_boundary: bool = True  # False: captures block inputs only, boundary L never arrives
    fc_slots: int | None = None  # slots its drafter class builds fc for (None: as the weights say)
    rules_disagree_note: str = ""  # what to do when no id list is read alike by every rule
    ids_conventions: tuple[str, ...] = ()  # what third-party ids may mean (empty: one meaning)

    # --- names ---

    def rule(self, version: str | None) -> str | None:
        """``version`` as one of :attr:`rules` (the default when None); None for a one-rule engine."""
        if not self.rules:
            return None
        if version is None:
            return self.rules[0]
        v = str(version).lower().replace("#", "").replace("pr-", "pr")
        if v not in self.rules:
            raise ServerError(f"--{self.name}-rule: expected one of {list(self.rules)}, found {version!r}")
        return v

    def rule_title(self, rule: str) -> str:
        return rule

    def label(self, version: str | None = None) -> str:
        rule = self.rule(version)
        return f"{self.title} ({self.rule_title(rule)} rule)" if rule is not None else self.title

    def view_key(self, rule: str | None) -> str:
        """The key of this engine (and rule) in the all-engines view: the name for the default rule."""
        return self.name if rule is None or rule == self.rules[0] else f"{self.name}_{rule}"

    # --- what the engine reads ---

    def read_ids(self, config: dict[str, Any]) -> list[int] | None:
        """The layer ids under :attr:`id_key`, as written (None when absent)."""
        return None

    def ids_not_read(self, config: dict[str, Any]) -> list[KeyRead]:
        """Other engines' id keys present in ``config``, shown as ignored by this one."""
        from eyas.interop.servers.registry import SERVERS  # the registry imports every spec module

        out = []
        for other in SERVERS.values():
            if other is not self and other.id_key is not None and other.id_key != self.id_key:
                ids = other.read_ids(config)
                if ids is not None:
                    out.append(KeyRead(other.id_key, True, ids, None, f"not read by {self.title}"))
        return out

    def flag_defaults(self, layout_name: str) -> dict[str, bool]:
        """The norm flags this engine assumes when config.json (of layout ``layout_name``) leaves
        them out: false, unless the engine's loader says otherwise."""
        return {f: False for f in NORM_FLAGS}

    def absent_flag_note(self, flag: str, layout_name: str) -> str:
        """Why an absent flag is read as true (only asked for flags whose default is true)."""
        return f"as {self.title} does"

    def flags_as_read(self, config: dict[str, Any], layout_name: str, where: str) -> dict[str, bool]:
        """The norm flags this engine builds the drafter with from ``config`` (its top-level flags,
        absent ones at :meth:`flag_defaults`); warns for each absent flag read as true, since
        serving what the engine serves is then a guess the user should see."""
        defaults = self.flag_defaults(layout_name)
        out = {}
        for flag in NORM_FLAGS:
            out[flag] = bool(config[flag]) if flag in config else defaults[flag]
            if flag not in config and defaults[flag]:
                warnings.warn(f"{where}: {flag} is absent; reading it as true, "
                              f"{self.absent_flag_note(flag, layout_name)}", stacklevel=4)
        return out

    @abstractmethod
    def read(self, meta: "Meta", num_blocks: int | None, rule: str | None,
             files_config: DrafterConfig | None = None, problems: Sequence[str] = ()) -> EngineReading:
        """What this engine builds from the directory ``meta`` describes, for a target of
        ``num_blocks`` blocks (None: unknown; defaults then stay unresolved). ``files_config`` is
        what config.json and the weights say when eyas.json does not (None when the weights were
        not read); ``problems`` what went wrong reading the directory."""

    def read_absent_ids(self, r: EngineReading, num_blocks: int | None) -> None:
        """No ids under :attr:`id_key`: the engine falls back to the EAGLE-3 default ``[2, L//2, L-3]``
        (left unresolved, None, while the block count is unknown)."""
        if num_blocks is None:
            r.boundaries_note = (f"{self.id_key} absent: {self.title}'s default [2, L//2, L-3] depends on the "
                                 f"target's block count, which is unknown")
        else:
            r.boundaries = default_boundaries(num_blocks)
            r.boundaries_note = f"{self.id_key} absent: {self.title}'s default [2, L//2, L-3] = {r.boundaries}"

    def can_capture(self, boundaries: Sequence[int], num_blocks: int) -> bool:
        return self.captures_last_boundary or num_blocks not in boundaries

    def check_capturable(self, r: EngineReading, num_blocks: int | None) -> None:
        """Mark ``r`` unloadable when it asks for a boundary the engine never captures."""
        L = num_blocks
        if L is not None and r.loadable and r.boundaries is not None and not self.can_capture(r.boundaries, L):
            r.loadable = False
            r.why_not = (f"boundary {L} (the last block's output) is slot {r.boundaries.index(L)}, but "
                         f"{self.title} captures block inputs only (boundaries 0..{L - 1}): it never arrives")

    def read_common_keys(self, r: EngineReading, config: dict[str, Any], llama: dict[str, Any],
                         flag_defaults: dict[str, bool]) -> None:
        """target_hidden_size, draft_vocab_size, vocab_size and the norm flags, as an engine's
        llama_eagle3 reads them: top-level keys with the Llama fields in ``llama`` as fallbacks."""
        th = config.get("target_hidden_size")
        r.target_hidden_size = int(th) if th else llama.get("hidden_size")
        r.keys.append(KeyRead("target_hidden_size", th is not None, th, r.target_hidden_size,
                              "" if th else f"absent: {self.title} uses hidden_size"))
        r.vocab_size = llama.get("vocab_size")
        dv = config.get("draft_vocab_size")
        r.draft_vocab_size = int(dv) if dv else r.vocab_size
        r.keys.append(KeyRead("draft_vocab_size", dv is not None, dv, r.draft_vocab_size,
                              "" if dv else f"absent: {self.title} sizes lm_head by vocab_size"))
        for flag in NORM_FLAGS:
            present = flag in config
            r.flag_present[flag] = present
            r.flags[flag] = bool(config[flag]) if present else flag_defaults[flag]
            r.keys.append(KeyRead(flag, present, config.get(flag), r.flags[flag],
                                  "" if present else f"absent: {self.title} reads {str(flag_defaults[flag]).lower()}"))

    # --- fixing ---

    def boundary_edits(self, meta: "Meta", boundaries: Sequence[int], num_blocks: int,
                       rule: str | None) -> tuple[list[Edit], str | None]:
        """The edits that make this engine capture ``boundaries``; (edits, problem) where
        ``problem`` says why no edit can."""
        bs = [int(b) for b in boundaries]
        if not self.can_capture(bs, num_blocks):
            return [], (f"boundary {num_blocks} (the last block's output) cannot be captured by "
                        f"{self.title}, which captures block inputs only: retrain the drafter on "
                        f"boundaries 0..{num_blocks - 1} (eyas train --boundaries)")
        return self.id_edits(meta, bs, num_blocks, rule)

    @abstractmethod
    def id_edits(self, meta: "Meta", boundaries: list[int], num_blocks: int,
                 rule: str | None) -> tuple[list[Edit], str | None]:
        """The edits of the keys this engine reads its ids from (boundaries already capturable)."""

    def rule_agnostic_ids(self, boundaries: Sequence[int], num_blocks: int) -> list[int] | None:
        """Ids that every rule version reads as ``boundaries`` (None: there are none)."""
        return None

    # --- writing and importing ---

    def write_config(self, cfg: DrafterConfig, boundaries: Sequence[int], num_blocks: int, *,
                     rule: str | None = None, dtype: torch.dtype | None = None,
                     contract: "Contract | None" = None, speculative_tokens: int = 3,
                     verifier: str | None = None) -> WrittenConfig:
        """``config.json`` for this engine. ``verifier``: the target model the engine resolves, for
        engines whose config names one (vLLM/speculators), already checked; None: from ``contract``."""
        raise ServerError(f"{self.title} has no config writer of its own")

    def rule_check(self, boundaries: Sequence[int], num_blocks: int, ids_written: dict[str, list[int]],
                   rule: str | None) -> RuleCheck:
        """What an export for this engine should say about its id rules (nothing for one rule)."""
        return RuleCheck()

    def trained_boundaries(self, config: dict[str, Any], num_blocks: int | None, where: str,
                           convention: str | None = None) -> TrainedBoundaries:
        """The boundaries a directory of this engine's layout, without eyas metadata, was trained
        on, where they come from, and whether they are assumed; boundaries None (and why) when that
        needs an unknown block count. ``convention`` (one of :attr:`ids_conventions`) is what the
        user says the ids mean; layouts with one meaning ignore it."""
        raise ServerError(f"{self.title} reads no layout of its own")
