"""vLLM (and the speculators library whose format it loads): every rule of how it reads a drafter.

Facts from the sources (vllm-project/vllm ``vllm/transformers_utils/configs/speculators/algos.py``
and ``base.py``; speculators 0.9.0, see :mod:`eyas.interop.speculators` for the layout):

- layer ids are the top-level ``eagle_aux_hidden_state_layer_ids`` and ARE boundaries (the input
  of layer k = boundary k, as in the SafeAILab EAGLE reference); absent or empty ids fall back to
  the EAGLE-3 default ``[2, L//2, L-3]``. The nested SGLang ids are not read;
- vLLM loads both layouts: an SGLang-style ``LlamaForCausalLMEagle3`` directory (Llama fields at
  the top level, absent norm flags false) and a speculators ``Eagle3Speculator`` directory (Llama
  fields in ``transformer_layer_config``), whose loader reads an ABSENT ``norm_before_residual``
  as TRUE (the other flags as false; the speculators library itself defaults it to false);
- ``fc`` is built for 3 slots of ``target_hidden_size``; capture is at block inputs, so boundary L
  (the last block's output) never arrives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from eyas.convention.boundaries import BoundaryError, default_boundaries, validate_boundaries
from eyas.drafter.config import NORM_FLAGS, DrafterConfig
from eyas.interop import speculators as layout
from eyas.interop.common import CONFIG_JSON, CheckpointError, default_assumed, default_boundaries_or_none, llama_fields
from eyas.interop.servers.spec import (
    Edit, EngineReading, KeyRead, ServerSpec, TrainedBoundaries, WrittenConfig, ids_or_none,
)

if TYPE_CHECKING:
    import torch
    from eyas.contract.contract import Contract
    from eyas.interop.eyas_format import Meta

TOP_IDS = "eagle_aux_hidden_state_layer_ids"  # top-level: boundaries, as vLLM reads them


def vllm_ids_to_boundaries(ids: Sequence[int] | None, num_blocks: int | None) -> list[int]:
    """What vLLM captures for top-level ``eagle_aux_hidden_state_layer_ids`` (absent -> default).

    With ``num_blocks`` unknown (None) explicit ids are checked only for what needs no target."""
    if not ids:
        return default_boundaries(num_blocks)
    return validate_boundaries(ids, num_blocks)


def boundaries_to_vllm_ids(boundaries: Sequence[int], num_blocks: int) -> list[int]:
    return validate_boundaries(boundaries, num_blocks)


class VLLMServer(ServerSpec):
    name = "vllm"
    title = "vLLM"
    layout = "speculators"
    export_names = ("vllm", "speculators")
    id_key = TOP_IDS
    captures_last_boundary = False
    fc_slots = 3

    def read_ids(self, config: dict[str, Any]) -> list[int] | None:
        return ids_or_none(config.get(TOP_IDS))

    def flag_defaults(self, layout_name: str) -> dict[str, bool]:
        if layout_name == "speculators":  # vLLM's speculators loader
            return {f: f == "norm_before_residual" for f in NORM_FLAGS}
        return {f: False for f in NORM_FLAGS}

    def absent_flag_note(self, flag: str, layout_name: str) -> str:
        return "as vLLM's speculators loader does (the speculators library itself defaults it to false)"

    def read(self, meta: "Meta", num_blocks: int | None, rule: str | None,
             files_config: DrafterConfig | None = None, problems: Sequence[str] = ()) -> EngineReading:
        L = num_blocks
        r = EngineReading(self.name, None, self.label(), fc_slots=self.fc_slots)
        config = meta.config
        llama = (config.get("transformer_layer_config") or {}) if meta.layout == "speculators" else config
        top = self.read_ids(config)
        if top is None:
            self.read_absent_ids(r, L)
        else:
            try:
                r.boundaries = vllm_ids_to_boundaries(top, L)
                r.boundaries_note = f"top-level {TOP_IDS} {top}: boundaries as written"
            except BoundaryError as e:
                r.loadable, r.why_not = False, f"top-level {TOP_IDS} {top}: {e}"
                r.boundaries_note = r.why_not
        r.keys.append(KeyRead(TOP_IDS, top is not None, top, r.boundaries, r.boundaries_note))
        r.keys += self.ids_not_read(config)
        self.read_common_keys(r, config, llama, self.flag_defaults(meta.layout))
        self.check_capturable(r, L)
        return r

    def id_edits(self, meta: "Meta", boundaries: list[int], num_blocks: int,
                 rule: str | None) -> tuple[list[Edit], str | None]:
        return [Edit(CONFIG_JSON, TOP_IDS, boundaries_to_vllm_ids(boundaries, num_blocks),
                     shown=f"top-level {TOP_IDS}")], None

    def write_config(self, cfg: DrafterConfig, boundaries: Sequence[int], num_blocks: int, *,
                     rule: str | None = None, dtype: torch.dtype | None = None,
                     contract: "Contract | None" = None, speculative_tokens: int = 3,
                     verifier: str | None = None) -> WrittenConfig:
        """``config.json`` in the speculators format, which vLLM loads: every norm flag explicit (vLLM
        reads an absent norm_before_residual as true), ids = boundaries. ``verifier.name_or_path`` is
        resolved as a model by speculators and vLLM: ``verifier`` (a hub id or local directory), else
        the contract's target when it was loaded from a hub id or a local directory, else null with a
        note saying what to pass (never a display label)."""
        if cfg.norm_before_fc and cfg.fc_norm:
            raise CheckpointError(
                "drafter config: norm_before_fc and fc_norm: expected at most one true for the speculators "
                "format (Eagle3SpeculatorConfig rejects both, and applies them in the other order), "
                "found both true"
            )
        bs = validate_boundaries(boundaries, num_blocks, cfg.num_slots)
        target = contract.target if contract is not None else None
        notes: list[str] = []
        if verifier is not None:
            name_or_path = verifier
        else:
            name_or_path, why = layout.verifier_reference(target.source if target else None)
            if name_or_path is None:
                notes.append(f"speculators_config.verifier.name_or_path written as null: {why}; "
                             f"speculators and vLLM resolve it as a model, so {layout.VERIFIER_HINT}")
            elif why:
                notes.append(f"speculators_config.verifier.name_or_path: {why}")
        config = {
            "architectures": [layout.ARCHITECTURE],
            "speculators_model_type": layout.MODEL_TYPE,
            "speculators_config": {
                "algorithm": layout.MODEL_TYPE,
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": name_or_path,
                    "architectures": [target.architecture] if target else layout.local_architectures(name_or_path),
                },
            },
            "transformer_layer_config": llama_fields(cfg, dtype),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            # Every flag explicit: vLLM reads an absent norm_before_residual as true.
            **{flag: getattr(cfg, flag) for flag in NORM_FLAGS},
            TOP_IDS: bs,  # boundaries, as vLLM and speculators read them
            "eyas_boundaries": bs,
            "eyas_num_target_blocks": num_blocks,
        }
        return WrittenConfig(config, {TOP_IDS: bs}, notes=tuple(notes))

    def trained_boundaries(self, config: dict[str, Any], num_blocks: int | None, where: str,
                           convention: str | None = None) -> TrainedBoundaries:
        ids = self.read_ids(config)
        if ids:
            return TrainedBoundaries(ids, f"top-level {TOP_IDS} (boundaries)")
        bs, source = default_boundaries_or_none(num_blocks, where, TOP_IDS)
        return TrainedBoundaries(bs, source, assumed=default_assumed(where, TOP_IDS) if bs is not None else None)

VLLM = VLLMServer()

