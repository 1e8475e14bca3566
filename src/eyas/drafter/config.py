"""The drafter's one flat, typed config. Saved into every checkpoint (``eyas.json``) and mapped
onto each engine's ``config.json`` by :mod:`eyas.interop`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

# The drafter's variant flags (fields of DrafterConfig below). Every engine config eyas writes
# states each one explicitly: loaders disagree on what an absent flag means.
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

class DrafterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- the midlayer (one Llama decoder layer whose q/k/v read 2*hidden_size) ---
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling dict (llama3, yarn, ...)

    # --- vocabularies: lm_head covers draft_vocab_size ids, mapped by d2t into vocab_size ---
    vocab_size: int  # the target's vocabulary (embed_tokens, t2d)
    draft_vocab_size: int

    # --- the target features: num_slots captured boundaries of target_hidden_size each ---
    target_hidden_size: int
    num_slots: int = 3

    # --- variant flags, always written explicitly (engines disagree on their defaults) ---
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h
    norm_before_fc: bool = False  # input_norm (RMSNorm over num_slots*target_hidden) before fc
    fc_norm: bool = False  # one RMSNorm per slot (fc_norm.i) before concatenation
    norm_output: bool = False  # feed back the post-norm hidden state instead of the pre-norm one

    @model_validator(mode="after")
    def _check(self) -> "DrafterConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size: expected 1..vocab_size ({self.vocab_size}), "
                f"found {self.draft_vocab_size}"
            )
        if self.norm_before_fc and self.fc_norm:
            # Engines disagree on their order (speculators rejects the pair): refuse the ambiguity.
            raise ValueError("norm_before_fc and fc_norm: expected at most one of them, found both true")
        if self.num_slots < 1:
            raise ValueError(f"num_slots: expected >= 1, found {self.num_slots}")
        return self

    @property
    def fc_in_features(self) -> int:
        return self.num_slots * self.target_hidden_size

    @classmethod
    def for_target(
        cls, target_config: Any, num_slots: int = 3, draft_vocab_size: int | None = None, **overrides: Any
    ) -> "DrafterConfig":
        """A drafter sized like one decoder block of ``target_config`` (an HF PretrainedConfig).

        MoE / MLA targets (DeepSeek-V3, Kimi) get a dense Llama midlayer of the same width, as
        the engines' ``llama_eagle3`` drafters do.
        """
        # Imported here: this module is read at CLI start (the engine registry), before torch is needed.
        from eyas.targets.structure import text_config_of

        tc = text_config_of(target_config)
        hidden = tc.hidden_size
        heads = tc.num_attention_heads
        kv_heads = getattr(tc, "num_key_value_heads", None) or heads
        head_dim = getattr(tc, "head_dim", None) or hidden // heads
        if getattr(tc, "model_type", "") in ("deepseek_v3", "deepseek_v2", "kimi_k2"):
            # MLA heads (qk_nope + qk_rope) have no dense equivalent; use a standard split.
            head_dim = hidden // heads
            kv_heads = heads
        rope_params = getattr(tc, "rope_parameters", None) or {}
        rope_scaling = getattr(tc, "rope_scaling", None)
        rope_theta = getattr(tc, "rope_theta", None) or rope_params.get("rope_theta", 10000.0)
        if rope_params and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        intermediate = getattr(tc, "intermediate_size", None) or 4 * hidden
        fields: dict[str, Any] = dict(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            hidden_act=getattr(tc, "hidden_act", "silu"),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size or tc.vocab_size,
            target_hidden_size=hidden,
            num_slots=num_slots,
        )
        fields.update(overrides)
        return cls(**fields)
