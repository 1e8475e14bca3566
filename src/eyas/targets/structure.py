"""Where the parts of a Hugging Face causal LM live: its text config, decoder blocks, embedding and
final norm. Every package that needs the target's structure asks here, so that a new architecture
is taught in one place."""

from __future__ import annotations

from typing import Any

from torch import nn

from eyas.errors import EyasError


class ArchitectureError(EyasError, RuntimeError):
    """The model's embedding, decoder blocks or final norm could not be located."""


def text_config_of(config: Any) -> Any:
    """The text part of an HF config: a multimodal config's ``get_text_config()``, else itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def text_config(model: nn.Module) -> Any:
    """The text part of ``model.config`` (see :func:`text_config_of`)."""
    return text_config_of(model.config)


def find_decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder blocks: the one whose length is ``num_hidden_layers``.

    Looks at the usual places first (``model.layers``, ``transformer.h``, ...), then at every
    ModuleList in the module tree; ambiguous or absent gives an error naming what was found.
    """
    n = getattr(text_config(model), "num_hidden_layers", None) if hasattr(model, "config") else None
    if n is None:
        raise ArchitectureError(
            f"{type(model).__name__}: no config.num_hidden_layers; pass a Hugging Face model "
            f"(a PreTrainedModel with its config)"
        )
    candidates = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) == n
        # blocks are modules with parameters; skip lists of e.g. rotary caches
        and all(any(True for _ in m.parameters()) for m in mod)
    ]
    # Prefer the shallowest: nested lists of the same length (e.g. per-layer experts) live deeper.
    candidates.sort(key=lambda nm: nm[0].count("."))
    if not candidates:
        lists = [(name, len(m)) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        raise ArchitectureError(
            f"{type(model).__name__}: no ModuleList of {n} decoder blocks (config.num_hidden_layers); "
            f"ModuleLists found: {lists[:10]}"
        )
    return candidates[0][1]


def find_final_norm(model: nn.Module) -> nn.Module:
    """The norm applied after the last block (``model.norm``, ``transformer.ln_f``, ...)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f"):
        mod = getattr(base, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise ArchitectureError(
        f"{type(model).__name__}: no final norm found on {type(base).__name__} "
        f"(looked for norm, final_layernorm, ln_f, final_layer_norm, norm_f)"
    )


def find_embedding(model: nn.Module) -> nn.Module:
    emb = model.get_input_embeddings()
    if emb is None:
        raise ArchitectureError(f"{type(model).__name__}: get_input_embeddings() returned None")
    return emb


def num_blocks(model: nn.Module) -> int:
    return len(find_decoder_blocks(model))


def eos_token_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """Every id that ends a turn: the tokenizer's eos and the model's ``generation_config`` eos
    (a chat model often has both: ``<|im_end|>`` and ``<|endoftext|>``). Sorted; may be empty."""
    ids: set[int] = set()
    for v in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if v is not None:
            ids |= {int(x) for x in (v if isinstance(v, (list, tuple)) else [v])}
    return sorted(ids)
