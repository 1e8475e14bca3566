"""eyas itself as the serving engine: it reads what the drafter was trained on, not engine ids.

eyas takes the boundaries from ``eyas.json`` (else ``config.json``'s ``eyas_boundaries``, else the
directory layout's own convention, as :func:`eyas.interop.load_drafter` does) and the norm flags
from ``eyas.json``'s ``drafter_config`` (else from config.json and the weights). It captures any
boundary 0..L, boundary L included (its hooks see the last block's output before the final norm),
and builds ``fc`` for as many slots as the weights have. It writes the SGLang layout plus
``eyas.json`` (:mod:`eyas.interop.eyas_format`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from eyas.drafter.config import NORM_FLAGS, DrafterConfig
from eyas.interop.common import CONFIG_JSON, EYAS_JSON
from eyas.interop.servers.sglang import SGLANG
from eyas.interop.servers.spec import Edit, EngineReading, KeyRead, ServerSpec, TrainedBoundaries, WrittenConfig

if TYPE_CHECKING:
    import torch
    from eyas.contract.contract import Contract
    from eyas.interop.eyas_format import Meta


class EyasServer(ServerSpec):
    name = "eyas"
    title = "eyas"
    layout = None  # reads every layout; writes SGLang's
    captures_last_boundary = True
    fc_slots = None

    def read(self, meta: "Meta", num_blocks: int | None, rule: str | None,
             files_config: DrafterConfig | None = None, problems: Sequence[str] = ()) -> EngineReading:
        r = EngineReading(self.name, None, self.label())
        has_eyas_json = meta.eyas is not None
        r.boundaries = list(meta.boundaries) if meta.boundaries is not None else None
        r.boundaries_note = f"from {meta.boundaries_source}"
        if meta.boundaries_assumed:  # third-party ids the conventions read differently, none named
            r.boundaries_assumed, r.assumed_why = True, meta.boundaries_assumed
            r.boundaries_note += " (ASSUMED)"
        r.keys.append(KeyRead("eyas.json boundaries" if has_eyas_json else "boundaries", True, r.boundaries,
                              r.boundaries, r.boundaries_note))
        cfg = meta.drafter_config or files_config
        if cfg is None:
            r.loadable, r.why_not = False, "; ".join(problems) or "no readable drafter config"
            return r
        for flag in NORM_FLAGS:
            r.flags[flag] = bool(getattr(cfg, flag))
            r.flag_present[flag] = flag in meta.config
            r.keys.append(KeyRead(flag, True, getattr(cfg, flag), r.flags[flag],
                                  "eyas.json drafter_config" if meta.drafter_config else CONFIG_JSON))
        r.target_hidden_size, r.draft_vocab_size, r.vocab_size = cfg.target_hidden_size, cfg.draft_vocab_size, cfg.vocab_size
        return r

    def id_edits(self, meta: "Meta", boundaries: list[int], num_blocks: int,
                 rule: str | None) -> tuple[list[Edit], str | None]:
        if meta.eyas is not None:
            return [Edit(EYAS_JSON, "boundaries", boundaries), Edit(EYAS_JSON, "contract.capture.boundaries", boundaries)], None
        return [Edit(CONFIG_JSON, "eyas_boundaries", boundaries)], None

    def write_config(self, cfg: DrafterConfig, boundaries: Sequence[int], num_blocks: int, *,
                     rule: str | None = None, dtype: torch.dtype | None = None,
                     contract: "Contract | None" = None, speculative_tokens: int = 3,
                     verifier: str | None = None) -> WrittenConfig:
        """An eyas directory is SGLang-loadable: its config.json is SGLang's (eyas.json beside it)."""
        return SGLANG.write_config(cfg, boundaries, num_blocks, rule=rule, dtype=dtype)

    def trained_boundaries(self, config: dict[str, Any], num_blocks: int | None, where: str,
                           convention: str | None = None) -> TrainedBoundaries:
        return SGLANG.trained_boundaries(config, num_blocks, where, convention)


EYAS = EyasServer()
