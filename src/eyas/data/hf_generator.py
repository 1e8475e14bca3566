"""The ``hf`` engine of regeneration (:class:`HFGenerator`, a
:class:`eyas.data.generation.BatchGenerator`): Hugging Face ``generate`` on a left-padded batch,
with one run-wide static cache (:class:`_StaticKV`, compiled with CUDA graphs on CUDA) or
``generate``'s dynamic cache. The ``cache`` option is described in :mod:`eyas.data.regenerate` (Speed).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from eyas.data.generation import BatchParams
from eyas.data.regenerate_options import CacheMode


def _hf_generation_config(params: BatchParams, pad_id: int, eos_ids: list[int], compiled: bool) -> Any:
    """The transformers GenerationConfig of ``params``; ``compiled``: generate compiles its decode
    step (static cache on CUDA) with CUDA graphs, else it never compiles."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    # Every knob set explicitly: generate() fills unset (None) fields from the model's own
    # generation_config, which may carry top_k / repetition_penalty defaults we do not want.
    kw: dict[str, Any] = dict(max_new_tokens=params.max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=eos_ids, repetition_penalty=1.0, num_beams=1)
    if not params.greedy:
        kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
    else:
        kw.update(do_sample=False)
    if compiled:
        kw.update(compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    else:
        kw.update(disable_compile=True)
    return GenerationConfig(**kw)


class _LeftPadding:
    """Temporarily: padding on the left (generation continues at the right end of every row) and a
    pad token (eos when the tokenizer has none)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def __enter__(self) -> int:
        self.side, self.pad = self.tok.padding_side, self.tok.pad_token
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        return int(self.tok.pad_token_id)

    def __exit__(self, *exc: Any) -> None:
        self.tok.padding_side = self.side
        if self.pad is None:
            self.tok.pad_token = None


class _StaticKV:
    """One transformers ``StaticCache`` for a whole run: [batch_size, ..., max_cache_len].

    Invariants: every batch given to :meth:`prepare` is padded to ``batch_size`` rows (copies of
    its first prompt), and the cache object is reset, not rebuilt, between batches, so its tensors
    keep their addresses and shapes and a compiled decode step (CUDA graphs) replays instead of
    recapturing. Only a prompt longer than planned (a later turn, with no ``max_prompt_tokens``)
    rebuilds it, longer (rounded up to 256 tokens, so rebuilds are rare)."""

    def __init__(self, model: Any, batch_size: int, max_cache_len: int, max_new_tokens: int) -> None:
        self.model, self.batch_size, self.max_new_tokens = model, batch_size, max_new_tokens
        self.max_cache_len = max_cache_len
        self.cache: Any = None
        self.rebuilds = 0

    def prepare(self, prompts: list[list[int]]) -> tuple[list[list[int]], Any]:
        """(prompts padded to ``batch_size`` rows, the reset cache to pass to generate)."""
        from transformers import StaticCache

        if not 0 < len(prompts) <= self.batch_size:
            raise ValueError(f"static cache: expected 1..{self.batch_size} prompts, found {len(prompts)}")
        need = max(len(p) for p in prompts) + self.max_new_tokens
        if need > self.max_cache_len:
            self.max_cache_len = -(-need // 256) * 256
            self.cache = None
            self.rebuilds += 1
        if self.cache is None:
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        else:
            self.cache.reset()
        return prompts + [prompts[0]] * (self.batch_size - len(prompts)), self.cache


@torch.no_grad()
def _generate_batch(model: Any, tokenizer: Any, prompts: list[list[int]], gen_config: Any,
                    eos_ids: list[int], static: _StaticKV | None = None) -> list[tuple[list[int], str]]:
    """Greedy/sampled continuations of a batch of prompts -> per prompt (answer ids without the
    end-of-turn token, finish reason "eos" | "length"). The eos token itself is counted by the caller.
    ``static``: decode with that run-wide static cache (the batch padded to its size with dummy
    rows, whose answers are not returned); None: generate's own dynamic cache."""
    n = len(prompts)
    extra: dict[str, Any] = {}
    if static is not None:
        # past_key_values: the name every transformers 5.x release reads (newer ones also take `cache`
        # and warn that past_key_values is deprecated; an unknown `cache` would be silently ignored
        # by an older one, which would decode on a dynamic cache).
        prompts, extra["past_key_values"] = static.prepare(prompts)
    enc = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")  # left-padded [B, T]
    device = next(model.parameters()).device
    input_ids, attn = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*")
        out = model.generate(input_ids=input_ids, attention_mask=attn, generation_config=gen_config, **extra)
    new = out[:n, input_ids.shape[1]:].tolist()  # [n, <= max_new_tokens], finished rows padded
    results = []
    eos = set(eos_ids)
    for row in new:
        stop = next((j for j, t in enumerate(row) if t in eos), None)
        # Without an eos the row ran to max_new_tokens: no padding inside it (a row is only
        # padded after it emitted eos), so all of it is the answer.
        results.append((row, "length") if stop is None else (row[:stop], "eos"))
    return results


class HFGenerator:
    """The ``hf`` engine (:class:`eyas.data.generation.BatchGenerator`): Hugging Face ``generate`` on
    a left-padded batch.

    ``cache`` as :attr:`RegenerateOptions.cache`: static (one run-wide :class:`_StaticKV` of
    ``batch_size`` rows, sized by :meth:`reserve`; compiled with CUDA graphs on CUDA) or dynamic.
    A sampled call seeds torch's global generator with ``params.seed`` first (``generate`` draws
    from it), so each call is reproducible by itself."""

    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, cache: CacheMode = "auto", batch_size: int = 64) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.static = _use_static_cache(cache, model)
        self.compiled = self.static and next(model.parameters()).device.type == "cuda"
        self.implementation = "static, compiled" if self.compiled else "static" if self.static else "dynamic"
        self.kv: _StaticKV | None = None
        self.last_decode_steps = 0
        self._configs: dict[tuple, Any] = {}

    def reserve(self, max_prompt_tokens: int, max_new_tokens: int) -> None:
        if self.static:
            self.kv = _StaticKV(self.model, self.batch_size, max_prompt_tokens + max_new_tokens, max_new_tokens)

    def generate(self, prompts: list[list[int]], params: BatchParams) -> list[tuple[list[int], str]]:
        if self.static and self.kv is None:  # reserve() not called: size the cache for this batch
            self.reserve(max(len(p) for p in prompts), params.max_new_tokens)
        with _LeftPadding(self.tokenizer) as pad_id:
            key = (params.max_new_tokens, params.eos_ids, params.temperature, params.top_p, pad_id)
            if key not in self._configs:
                self._configs[key] = _hf_generation_config(params, pad_id, list(params.eos_ids), self.compiled)
            if not params.greedy and params.seed is not None:
                torch.manual_seed(params.seed)
            answers = _generate_batch(self.model, self.tokenizer, prompts, self._configs[key], list(params.eos_ids),
                                      self.kv)
        self.last_decode_steps = max(len(a) + (f == "eos") for a, f in answers)
        return answers

def _use_static_cache(mode: CacheMode, model: Any) -> bool:
    """``cache`` resolved for ``model``: auto is static on CUDA, dynamic elsewhere (and for a target
    split across devices, ``--target-devices``: one run-wide static cache would sit on one device)."""
    if mode == "auto":
        split = len(set(dict(getattr(model, "hf_device_map", None) or {}).values())) > 1
        return next(model.parameters()).device.type == "cuda" and not split
    return mode == "static"
