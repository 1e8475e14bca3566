"""Which target the engine serves a model with (``--target-impl``): the fast Llama-family target
(:class:`~eyas.engine.llama.LlamaTarget`) wherever it applies, else the Hugging Face one."""

from __future__ import annotations

from torch import nn

from eyas.convention.boundaries import CaptureSpec
from eyas.engine.llama import LlamaTarget, UnsupportedTarget, supports
from eyas.engine.target import Target

TARGET_IMPLEMENTATIONS = ("auto", "fast", "hf")


def build_target(model: nn.Module, spec: CaptureSpec, implementation: str = "auto", matvec: str = "auto",
                 attention: str = "auto") -> Target:
    """The target the engine serves ``model`` with (``--target-impl``).

    - ``fast``: :class:`LlamaTarget` (fixed shapes, compiled, CUDA graphs on a GPU; refused, with the
      reason, for an architecture it does not implement);
    - ``hf``: :class:`~eyas.engine.target.HFTarget`, any causal LM;
    - ``auto``: ``fast`` wherever it applies (on a GPU with CUDA graphs; on a CPU eagerly, where
      its static cache still beats the Hugging Face model: SmolLM2 in float32 on 2 cores, 22.6
      against 20.0 tok/s plain and 20.0 against 17.6 speculative), else ``hf``.
    The returned target's ``implementation`` says which one runs. ``matvec`` and ``attention``: the
    fast target's one-token products and its attention (:class:`LlamaTarget`, which checks them);
    asking for one that is not the default where the Hugging Face target runs is refused, with the
    reason.
    """
    from eyas.engine.target import HFTarget

    impl = str(implementation).lower()
    if impl not in TARGET_IMPLEMENTATIONS:
        raise UnsupportedTarget(f"--target-impl: expected one of {list(TARGET_IMPLEMENTATIONS)}, found {implementation!r}")
    on_gpu = next(model.parameters()).device.type == "cuda"
    if impl == "hf" or (impl == "auto" and supports(model) is not None):
        asked = [f"--{k} {v}" for k, v in (("matvec", matvec), ("attention", attention))
                 if v not in ("auto", "gemm", "eager")]  # what the fast target would change
        if asked:
            why = "--target-impl hf" if impl == "hf" else supports(model)
            raise UnsupportedTarget(f"{' '.join(asked)}: options of the fast Llama-family target, and this model runs "
                                    f"on the Hugging Face target ({why}); leave them out")
        return HFTarget(model, spec)
    return LlamaTarget(model, spec, cuda_graphs=on_gpu, matvec=matvec, attention=attention)
