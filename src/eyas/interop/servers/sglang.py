"""SGLang (and SpecForge, which writes for it): every rule of how it reads a drafter directory.

SGLang loads ``LlamaForCausalLMEagle3`` directories only (not speculators' ``Eagle3Speculator``).
It reads its layer ids from ``eagle_config.eagle_aux_hidden_state_layer_ids`` only, and captures
the *input* of layer ``id + shift``, i.e. boundary ``id + shift``, where the shift depends on the
SGLang version (:class:`SGLangRule`):

=========  =============================================  =======================================
rule       shift                                          the EAGLE default [2, L//2, L-3] is
=========  =============================================  =======================================
legacy     +1 always (every SGLang before PR #25454)      written [1, L//2-1, L-4]
pr25454    +1 only when the first id is 1 (SpecForge      written [1, L//2-1, L-4] (both rules
           lists); ids used as written otherwise          read a list starting with 1 alike)
=========  =============================================  =======================================

Absent ids make SGLang fall back to the default ``[2, L//2, L-3]`` boundaries. Absent norm flags
read false; ``fc`` is built for 3 slots of ``target_hidden_size`` (llama_eagle3.py); capture is at
block inputs, so boundary L (the last block's output) never arrives.

SpecForge writes "output of block k" = boundary k+1 always; other tools write the ids as the SGLang
that serves them reads them, by that version's rule. So the nested ids of a directory eyas did not
write are ambiguous (:class:`IdsConvention`): :meth:`SGLangServer.trained_boundaries` reads them by
the convention the user names, else by SpecForge's and says where the readings differ that the
boundaries are assumed. Directories eyas wrote carry their boundaries under eyas keys and are not
read through the ids at all.

Adding an SGLang version with another rule is one more member of :class:`SGLangRule`.
"""

from __future__ import annotations

import warnings
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Sequence

from eyas.convention.boundaries import BoundaryError, default_boundaries, validate_boundaries
from eyas.drafter.config import NORM_FLAGS, DrafterConfig
from eyas.interop import speculators
from eyas.interop import sglang as layout
from eyas.interop.common import CONFIG_JSON, CheckpointError, default_assumed, default_boundaries_or_none, llama_fields
from eyas.interop.servers.spec import (
    Edit, EngineReading, KeyRead, RuleCheck, ServerSpec, TrainedBoundaries, WrittenConfig,
)
from eyas.interop.servers.vllm import TOP_IDS  # written too, so that vLLM loads an SGLang directory

if TYPE_CHECKING:
    import torch
    from eyas.contract.contract import Contract
    from eyas.interop.eyas_format import Meta

NESTED_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"


class SGLangRule(str, Enum):
    """How an SGLang version turns ``eagle_config.eagle_aux_hidden_state_layer_ids`` into captures.

    Each member is (CLI name, title, reading), newest first (the first is the default), where
    ``reading(ids)`` gives the shift SGLang adds to every id (boundary = id + shift) and a note
    saying why, for people.
    """

    rule_title: str
    reading: Callable[[list[int]], tuple[int, str]]

    def __new__(cls, value: str, rule_title: str, reading: Callable[[list[int]], tuple[int, str]]) -> "SGLangRule":
        member = str.__new__(cls, value)
        member._value_ = value
        member.rule_title = rule_title
        member.reading = reading
        return member

    PR25454 = ("pr25454", "PR #25454", lambda ids: (1, "+1 to every id (PR #25454 rule: the first id is 1)")
               if ids[0] == 1 else (0, "ids used as written (PR #25454 rule: the first id is not 1)"))
    LEGACY = ("legacy", "legacy", lambda ids: (1, "+1 to every id (legacy rule)"))

    def shift(self, ids: Sequence[int]) -> int:
        return self.reading(list(ids))[0]


class IdsConvention(str, Enum):
    """What the nested ids of a directory eyas did not write meant to the tool that trained it.

    Each member is (CLI name, title, the SGLang rule whose arithmetic it follows). SpecForge's
    "output of block k" is boundary k+1, the legacy rule's arithmetic, whatever SGLang serves it.
    """

    title: str
    rule: SGLangRule

    def __new__(cls, value: str, title: str, rule: SGLangRule) -> "IdsConvention":
        member = str.__new__(cls, value)
        member._value_ = value
        member.title = title
        member.rule = rule
        return member

    SPECFORGE = ("specforge", "specforge", SGLangRule.LEGACY)
    SGLANG = ("sglang", f"sglang ({SGLangRule.PR25454.rule_title})", SGLangRule.PR25454)
    SGLANG_LEGACY = ("sglang-legacy", "sglang-legacy", SGLangRule.LEGACY)


def ids_readings(ids: Sequence[int], num_blocks: int | None) -> dict[str, list[int] | str]:
    """``ids`` (nested, written by a tool other than eyas) read by every :class:`IdsConvention`:
    convention name -> boundaries, or why that reading is invalid for the target."""
    out: dict[str, list[int] | str] = {}
    for c in IdsConvention:
        try:
            out[c.value] = sglang_ids_to_boundaries(ids, num_blocks, c.rule)
        except BoundaryError as e:
            out[c.value] = str(e)
    return out


def readings_text(readings: dict[str, list[int] | str]) -> str:
    """``specforge: [3, 16, 28]; sglang (PR #25454): [2, 15, 27]; sglang-legacy: [3, 16, 28]``."""
    return "; ".join(f"{IdsConvention(k).title}: {v if isinstance(v, list) else 'invalid (' + v + ')'}"
                     for k, v in readings.items())


def sglang_ids_to_boundaries(
    ids: Sequence[int] | None, num_blocks: int | None, rule: SGLangRule | str = SGLangRule.PR25454
) -> list[int]:
    """What SGLang captures when it reads ``ids`` from ``eagle_config.eagle_aux_hidden_state_layer_ids``.

    ``ids=None`` (key absent) makes SGLang fall back to its default ``[2, L//2, L-3]`` boundaries.
    The result is validated against the target; with ``num_blocks`` unknown (None, e.g. a
    checkpoint read on its own) only the checks that need no target apply (>= 0, distinct).
    """
    rule = SGLangRule(rule)
    if ids is None:
        return default_boundaries(num_blocks)
    ids = [int(i) for i in ids]
    if not ids:
        raise BoundaryError("eagle_aux_hidden_state_layer_ids: expected a non-empty list, found []")
    shift = rule.shift(ids)
    try:
        return validate_boundaries([i + shift for i in ids], num_blocks)
    except BoundaryError as e:
        raise BoundaryError(
            f"eagle_aux_hidden_state_layer_ids {ids} read by SGLang ({rule.value} rule) -> {e}"
        ) from None


def boundaries_to_sglang_ids(
    boundaries: Sequence[int], num_blocks: int, rule: SGLangRule | str = SGLangRule.PR25454
) -> list[int]:
    """The ids to write into ``eagle_config.eagle_aux_hidden_state_layer_ids`` so that an SGLang
    following ``rule`` captures exactly ``boundaries``.

    A rule adds 0 or 1 to every id, so the ids are ``b - 1`` or ``b``: the SpecForge list ``b - 1``
    is tried first (when it starts with 1 every rule reads it alike), then ``b``; the first that the
    rule reads back as ``boundaries`` is written. Under PR #25454 a first boundary of 1 has neither
    (a first id of 1 is read as boundary 2, a first id of 0 as boundary 0).
    """
    rule = SGLangRule(rule)
    bs = validate_boundaries(boundaries, num_blocks)
    tried = []
    for ids in ([b - 1 for b in bs], list(bs)):
        try:
            read = sglang_ids_to_boundaries(ids, num_blocks, rule)
        except BoundaryError:
            read = None
        if read == bs:
            return ids
        tried.append(f"ids {ids} are read as {read if read is not None else 'invalid boundaries'}")
    raise BoundaryError(
        f"boundaries {bs}: SGLang under the {rule.rule_title} rule cannot capture boundary {bs[0]} as the first "
        f"slot ({'; '.join(tried)}); reorder the slots or target the legacy rule"
    )


def sglang_rules_agree(boundaries: Sequence[int], num_blocks: int) -> bool:
    """True when one id list makes every SGLang rule capture ``boundaries`` (first boundary is 2)."""
    bs = validate_boundaries(boundaries, num_blocks)
    ids = [b - 1 for b in bs]
    for rule in SGLangRule:
        try:
            if sglang_ids_to_boundaries(ids, num_blocks, rule) != bs:
                return False
        except BoundaryError:
            return False
    return True


def nested_ids(config: dict[str, Any]) -> list[int] | None:
    """``eagle_config.eagle_aux_hidden_state_layer_ids`` as written (None when absent)."""
    eagle = config.get("eagle_config")
    if isinstance(eagle, dict) and eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
        return [int(i) for i in eagle["eagle_aux_hidden_state_layer_ids"]]
    return None


def ids_for(boundaries: Sequence[int], num_blocks: int, rule: SGLangRule | str) -> tuple[list[int], SGLangRule]:
    """The nested ids for ``rule``, and the rule they were written for.

    A first boundary of 1 cannot be written for SGLang after PR #25454; rather than refuse to save a
    trained drafter, the ids are then written for the legacy rule (and the engines' view shows
    which SGLang captures what).
    """
    rule = SGLangRule(rule)
    try:
        return boundaries_to_sglang_ids(boundaries, num_blocks, rule), rule
    except BoundaryError as e:
        if rule is not SGLangRule.PR25454:
            raise
        warnings.warn(f"{e}; writing the ids for the legacy rule instead", stacklevel=4)
        return boundaries_to_sglang_ids(boundaries, num_blocks, SGLangRule.LEGACY), SGLangRule.LEGACY


class SGLangServer(ServerSpec):
    name = "sglang"
    title = "SGLang"
    layout = "sglang"
    export_names = ("sglang",)
    rules = tuple(r.value for r in SGLangRule)  # newest first: the default
    id_key = NESTED_IDS
    captures_last_boundary = False
    fc_slots = 3
    ids_conventions = tuple(c.value for c in IdsConvention)
    rules_disagree_note = ("no id list is read the same by both rules unless the first boundary is 2: "
                           "pin the SGLang version")

    def rule_title(self, rule: str) -> str:
        return SGLangRule(rule).rule_title

    def read_ids(self, config: dict[str, Any]) -> list[int] | None:
        return nested_ids(config)

    def read(self, meta: "Meta", num_blocks: int | None, rule: str | None,
             files_config: DrafterConfig | None = None, problems: Sequence[str] = ()) -> EngineReading:
        version = self.rule(rule)
        sg_rule = SGLangRule(version)
        L = num_blocks
        r = EngineReading(self.name, version, self.label(version), fc_slots=self.fc_slots)
        config = meta.config
        ids = nested_ids(config)
        if ids is None:
            self.read_absent_ids(r, L)
        else:
            how = sg_rule.reading(ids)[1]
            try:
                r.boundaries = sglang_ids_to_boundaries(ids, L, sg_rule)
                r.boundaries_note = f"{NESTED_IDS} {ids}: {how} -> boundaries {r.boundaries}"
            except BoundaryError as e:
                r.loadable, r.why_not = False, str(e)
                r.boundaries_note = f"{NESTED_IDS} {ids}: {how} -> {e}"
        if meta.layout != self.layout:  # what the ids say is shown, but SGLang loads no such directory
            r.loadable, r.refused_layout = False, meta.layout
            r.why_not = (f"SGLang loads {layout.ARCHITECTURE} directories; {meta.path} is in the speculators/vLLM "
                         f"format ({speculators.ARCHITECTURE})")
            return r
        r.keys.append(KeyRead(NESTED_IDS, ids is not None, ids, r.boundaries, r.boundaries_note))
        r.keys += self.ids_not_read(config)
        self.read_common_keys(r, config, config, self.flag_defaults(meta.layout))  # absent flags: false
        self.check_capturable(r, L)
        return r

    def id_edits(self, meta: "Meta", boundaries: list[int], num_blocks: int,
                 rule: str | None) -> tuple[list[Edit], str | None]:
        try:
            ids = boundaries_to_sglang_ids(boundaries, num_blocks, self.rule(rule))
        except BoundaryError as e:
            return [], str(e)
        return [Edit(CONFIG_JSON, NESTED_IDS, ids)], None

    def rule_agnostic_ids(self, boundaries: Sequence[int], num_blocks: int) -> list[int] | None:
        if not sglang_rules_agree(boundaries, num_blocks):
            return None
        return boundaries_to_sglang_ids(boundaries, num_blocks, SGLangRule.LEGACY)

    def write_config(self, cfg: DrafterConfig, boundaries: Sequence[int], num_blocks: int, *,
                     rule: str | None = None, dtype: torch.dtype | None = None,
                     contract: "Contract | None" = None, speculative_tokens: int = 3,
                     verifier: str | None = None) -> WrittenConfig:
        """``config.json`` for SGLang: the Llama fields, every norm flag, the nested ids for ``rule``
        (the legacy rule when PR #25454 cannot express them), top-level ids = boundaries (read by vLLM
        and the SafeAILab reference) and the unambiguous eyas record."""
        bs = validate_boundaries(boundaries, num_blocks, cfg.num_slots)
        ids, used = ids_for(bs, num_blocks, self.rule(rule))
        config: dict[str, Any] = {
            "architectures": [layout.ARCHITECTURE],
            **llama_fields(cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            # Written explicitly: loaders disagree on what an absent flag means.
            **{flag: getattr(cfg, flag) for flag in NORM_FLAGS},
            # vLLM (and the SafeAILab reference) read top-level ids as boundaries.
            TOP_IDS: bs,
            # SGLang reads only these, in its own convention (see module docstring).
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            # The unambiguous record: boundaries in the eyas convention, and what the ids were written for.
            "eyas_boundaries": bs,
            "eyas_num_target_blocks": num_blocks,
            "eyas_sglang_rule": used.value,
        }
        return WrittenConfig(config, {NESTED_IDS: ids, TOP_IDS: bs}, used.value)

    def rule_check(self, boundaries: Sequence[int], num_blocks: int, ids_written: dict[str, list[int]],
                   rule: str | None) -> RuleCheck:
        agree = sglang_rules_agree(boundaries, num_blocks)
        if agree:
            return RuleCheck(True)
        ids = ids_written[NESTED_IDS]
        others = [r for r in SGLangRule if r.value != rule]
        notes = tuple(
            f"SGLang's two id rules disagree for boundaries {list(boundaries)} (they agree only when the first "
            f"boundary is 2): ids {ids} are written for the {rule} rule; an SGLang following the "
            f"{other.value} rule would capture {sglang_ids_to_boundaries(ids, num_blocks, other)}"
            for other in others
        )
        return RuleCheck(False, notes)

    def trained_boundaries(self, config: dict[str, Any], num_blocks: int | None, where: str,
                           convention: str | None = None) -> TrainedBoundaries:
        """Nested ids (a directory eyas did not write) mean what the tool that trained the drafter
        meant (:class:`IdsConvention`): read by ``convention`` when the user names it; otherwise by
        SpecForge's, and where the conventions read the ids differently the boundaries are assumed
        (``assumed`` says so and ``readings`` names each one). Top-level ids alone are boundaries."""
        ids = nested_ids(config)
        top = config.get(TOP_IDS)
        if ids is not None:
            readings = ids_readings(ids, num_blocks)
            conv = IdsConvention(convention) if convention is not None else IdsConvention.SPECFORGE
            read = readings[conv.value]
            if not isinstance(read, list):
                raise CheckpointError(f"{where}: {NESTED_IDS}: {read} (read by the {conv.title} convention)")
            bs = read
            differ = len({tuple(v) if isinstance(v, list) else v for v in readings.values()}) > 1
            assumed = None
            if convention is not None:
                source = f"{NESTED_IDS} {ids} read by the {conv.title} convention (named by the user)"
            else:
                source = f"{NESTED_IDS} {ids} (SpecForge convention: boundary = id + 1)"
                if differ:
                    assumed = (f"{where}: {NESTED_IDS} {ids} were not written by eyas and the conventions read "
                               f"them differently ({readings_text(readings)}); {bs} (specforge) is assumed. Name "
                               f"the convention (--ids-convention specforge|sglang|sglang-legacy), or let "
                               f"`eyas doctor` settle it with the training shards or an eyas.json")
            if top and [int(i) for i in top] != bs:
                warnings.warn(
                    f"{where}: {NESTED_IDS} {ids} ({conv.title} convention: boundaries {bs}) and top-level "
                    f"{TOP_IDS} {list(top)} (boundaries) disagree; using {bs}",
                    stacklevel=4,
                )
            return TrainedBoundaries(bs, source, assumed, readings if differ else {},
                                     conv.value if convention is not None or differ else None)
        if top:
            return TrainedBoundaries([int(i) for i in top], f"top-level {TOP_IDS} (boundaries)")
        bs, source = default_boundaries_or_none(num_blocks, where, "layer ids")
        return TrainedBoundaries(bs, source, assumed=default_assumed(where, "layer ids") if bs is not None else None)

SGLANG = SGLangServer()
