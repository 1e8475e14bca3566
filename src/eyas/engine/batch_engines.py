"""The batched engines: which one generates for a model (``--engine`` of ``eyas regenerate`` and
``eyas prompts``, and the server's worker: eyas' fast batched forward, :class:`eyas.engine.batched.
BatchedLlama`, where it runs the model, else Hugging Face ``generate``), and what a fast run reports
(:class:`BatchResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from eyas.data.generation import Answer

from eyas.engine.llama import UnsupportedTarget, supports

BATCH_ENGINES = ("auto", "fast", "hf")


def fast_unsupported(model: nn.Module) -> str | None:
    """None when :class:`~eyas.engine.batched.BatchedLlama` can run ``model``; else why not."""
    why = supports(model)
    if why is not None:
        return why
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"the target is split over {len(devices)} devices (--target-devices); the fast engine runs on one"
    return None


def choose_engine(model: nn.Module, engine: str = "auto") -> str:
    """``--engine`` resolved for ``model``: ``"fast"`` or ``"hf"``. ``auto``: fast for a supported
    model on CUDA (on a CPU both run eagerly and HF's left-padded batch is the tested default), else
    hf; ``fast`` for an unsupported model raises :class:`UnsupportedTarget` naming the reason."""
    choice = str(engine).lower()
    if choice not in BATCH_ENGINES:
        raise UnsupportedTarget(f"--engine: expected one of {list(BATCH_ENGINES)}, found {engine!r}")
    if choice == "hf":
        return "hf"
    why = fast_unsupported(model)
    if choice == "fast":
        if why is not None:
            raise UnsupportedTarget(f"--engine fast: {why}; use --engine hf (Hugging Face generate)")
        return "fast"
    return "fast" if why is None and next(model.parameters()).device.type == "cuda" else "hf"


@dataclass
class BatchResult:
    """One :meth:`BatchedLlama.run`: the answers in input order and what it cost."""

    answers: list[Answer]
    rows: int
    new_tokens: int = 0  # generated, eos tokens included
    prompt_tokens: int = 0
    decode_steps: int = 0  # fixed-shape steps (every row advances, busy or not)
    prefills: int = 0  # prefill forwards (groups)
    syncs: int = 0  # host reads of the state
    wall_s: float = 0.0
    compile_s: float = 0.0  # compiling and capturing buckets first used in this call (inside wall_s)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, compilation included."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def occupancy(self) -> float:
        """Share of the decode steps' row slots that produced a token (1.0: never an idle row)."""
        decoded = self.new_tokens - len(self.answers)  # each answer's first token comes from its prefill
        return decoded / (self.decode_steps * self.rows) if self.decode_steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "answers"}
        return {**d, "answers": len(self.answers), "tokens_per_s": round(self.tokens_per_s, 2),
                "occupancy": round(self.occupancy, 4)}
