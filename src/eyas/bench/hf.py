"""Hugging Face ``generate``: the baseline ``eyas bench`` and the GPU benchmark scripts compare against.

On a GPU the strongest baseline present is ``generate`` with a static cache and its decoding step
compiled, the way transformers documents it: a fixed-size ``StaticCache`` passed to ``generate``
together with a ``CompileConfig`` makes ``generate`` compile the one-token decoding step itself
(``fullgraph=True, mode="reduce-overhead"``: CUDA graphs); the prefill stays eager, so a new prompt
length does not recompile. One cache (``max_cache_len`` = the longest prompt + the new tokens) is
reset and reused by every call, so its tensors keep their addresses and the compiled step's graphs
replay. The first calls compile and capture: :meth:`HFGenerate.warm` runs them before anything is
timed. A compilation that stops at a graph break is retried once without ``fullgraph``; one that
still fails leaves eager ``generate`` as the baseline, and the label says so.

On the CPU the baseline is eager ``generate`` (a ``DynamicCache``, nothing compiled): compiling for
a CPU bench costs minutes and needs a C compiler.

Every call sets the sampling settings explicitly (the model's ``generation_config`` could otherwise
add top-k or a repetition penalty), seeds torch's global generator with the call's seed, and keeps
the new tokens up to the first EOS (``generate`` pads after it).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from eyas.engine.sampling import GREEDY, SamplingParams

HF_EAGER = "generate, eager"
HF_COMPILED = "generate, static cache, torch.compile"
HF_BASELINES = ("auto", "compiled", "eager")  # `eyas bench --hf-baseline`: auto = compiled on a GPU, eager elsewhere

Runner = Callable[[torch.Tensor, Any, int], tuple[list[int], Any]]


def hf_runner(model: Any, eos: list[int], pad: int | None, max_new: int, cache: Any = None, compile_config: Any = None,
              disable_compile: bool = False) -> Runner:
    """``run(ids [1, n], sampling, seed) -> (new tokens up to the first EOS, None)``: Hugging Face
    ``generate`` with every setting explicit. ``cache``: a StaticCache reused across calls (reset
    before each: its tensors keep their addresses, so the compiled step's CUDA graphs replay
    instead of re-recording); ``compile_config``: generate compiles the decoding step (transformers'
    auto-compile with a static cache; the prefill stays eager); ``disable_compile``: never compile."""
    from transformers import GenerationConfig

    def run(ids: torch.Tensor, sampling: Any, seed: int) -> tuple[list[int], Any]:
        kw: dict[str, Any] = dict(max_new_tokens=max_new, eos_token_id=eos or None, pad_token_id=pad,
                                  repetition_penalty=1.0, num_beams=1)
        if sampling.greedy:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0)
        if compile_config is not None:
            kw["compile_config"] = compile_config
        if disable_compile:
            kw["disable_compile"] = True
        cfg = GenerationConfig(**kw)
        torch.manual_seed(seed)
        extra = {}
        if cache is not None:
            cache.reset()
            extra["past_key_values"] = cache
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **extra)
        new = out[0, ids.shape[1]:].tolist()
        for i, t in enumerate(new):  # keep up to the first EOS, as the eyas decoders do
            if t in eos:
                return new[: i + 1], None
        return new, None

    return run


@dataclass
class HFGenerate:
    """The HF baseline of a bench: ``label`` says which ran (:data:`HF_COMPILED` or :data:`HF_EAGER`,
    with a note when compiling failed); ``warmup_s`` the warm-up calls' seconds (the first compiles)."""

    run: Runner
    label: str
    compiled: bool
    warmup_s: list[float] = field(default_factory=list)
    note: str = ""

    def __call__(self, ids: torch.Tensor, sampling: SamplingParams, seed: int) -> list[int]:
        return self.run(ids, sampling, seed)[0]

    def warm(self, ids: torch.Tensor, calls: int = 3, sampling: SamplingParams = GREEDY) -> list[float]:
        """``calls`` untimed calls on ``ids`` (the first compiles and captures); their seconds."""
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            self(ids, sampling, 0)
            if ids.device.type == "cuda":
                torch.cuda.synchronize(ids.device)
            times.append(round(time.perf_counter() - t0, 3))
        self.warmup_s += times
        return times

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "compiled": self.compiled, "warmup_s": self.warmup_s, "note": self.note}


def _graph_break(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return any(w in text for w in ("Unsupported", "graph break", "Graph break", "fullgraph"))


def hf_baseline(model: Any, eos: Sequence[int], pad: int | None, max_new_tokens: int, *, mode: str = "auto",
                max_cache_len: int | None = None, warm_ids: torch.Tensor | None = None,
                compile_mode: str = "reduce-overhead") -> HFGenerate:
    """The baseline for ``model`` (module docstring). ``mode``: auto (compiled on a GPU, eager
    elsewhere) | compiled | eager; ``max_cache_len``: the static cache's length (the longest prompt
    + ``max_new_tokens``); ``warm_ids`` [1, n]: a prompt the compiled step is compiled and warmed on
    now (needed to catch a failing compilation here rather than inside the timed calls)."""
    if mode not in HF_BASELINES:
        raise ValueError(f"--hf-baseline: expected one of {', '.join(HF_BASELINES)}, found {mode!r}")
    eos = list(eos)
    pad = pad if pad is not None else (eos[0] if eos else None)
    device = next(model.parameters()).device
    eager = HFGenerate(hf_runner(model, eos, pad, max_new_tokens, disable_compile=True), HF_EAGER, False)
    if mode == "eager" or (mode == "auto" and device.type != "cuda"):
        return eager
    from transformers import CompileConfig, StaticCache

    cache = StaticCache(config=model.config, max_cache_len=int(max_cache_len or 2048))
    error: BaseException | None = None
    for fullgraph in (True, False):
        cc = CompileConfig(fullgraph=fullgraph, mode=compile_mode)
        if device.type != "cuda":
            cc._compile_all_devices = True  # transformers compiles on CUDA only unless told
        hf = HFGenerate(hf_runner(model, eos, pad, max_new_tokens, cache=cache, compile_config=cc), HF_COMPILED, True)
        if warm_ids is None:
            return hf
        try:
            hf.warm(warm_ids)
            if not fullgraph:
                hf.note = "compiled without fullgraph (a graph break with fullgraph=True)"
            return hf
        except Exception as e:  # noqa: BLE001  (a failed compilation leaves eager generate as the baseline)
            error = e
            try:
                torch._dynamo.reset()
                model.__dict__.pop("_compiled_call", None)
            except Exception:  # noqa: BLE001
                pass
            if not _graph_break(e):
                break
    eager.note = f"compiling generate failed ({type(error).__name__}: {str(error)[:200]}); eager generate instead"
    eager.label = f"{HF_EAGER} (compiling failed)"
    return eager
