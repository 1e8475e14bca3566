"""How regeneration asks a target for answers: a small typed interface between the data layer and
whatever generates (``eyas regenerate --engine``).

:func:`eyas.data.regenerate.regenerate` hands each batch of prompts (one resume unit's prompts of one
turn, at most ``batch_size``) to a :class:`BatchGenerator` with the batch's :class:`BatchParams`, and
gets back, per prompt and in input order, the answer's token ids without its end-of-turn token and
why it ended. Two implement it:

- ``hf`` (:class:`eyas.data.hf_generator.HFGenerator`, the default): Hugging Face ``generate`` on a
  left-padded batch, with a static cache compiled on CUDA;
- ``fast`` (:class:`eyas.engine.batched.BatchedLlama`): eyas' own Llama-family forward on a fixed
  number of rows with continuous batching, compiled and CUDA-graphed on a GPU.

The data layer (floor 6) never imports the engine (floor 7): the CLI builds the generator and
passes it in.

Contract of ``generate``, for every implementation:

- the answer to a prompt is the target's continuation of exactly that prompt (no padding token or
  other row leaks into it); greedy answers are the target's argmax token by token;
- an answer ends at the first token of ``eos_ids`` (finish ``"eos"``, the token itself left out of
  the ids) or after ``max_new_tokens`` tokens (finish ``"length"``, eos counted among them: an eos as
  the last allowed token is still ``"eos"``);
- sampled answers (``temperature > 0``) are reproducible: the same prompts, parameters and
  ``seed`` on the same machine give the same answers. Which random numbers a prompt gets is the
  implementation's own rule, so the two engines sample different (equally distributed) answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

Finish = Literal["eos", "length"]
Answer = tuple[list[int], Finish]  # (answer ids without the end-of-turn token, why it ended)


@dataclass(frozen=True)
class BatchParams:
    """What one ``generate`` call decodes with. ``temperature`` 0 is greedy (``top_p`` and ``seed``
    are then unused); ``seed`` makes a sampled call reproducible."""

    max_new_tokens: int
    eos_ids: tuple[int, ...]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, found {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"expected temperature >= 0 and 0 < top_p <= 1, found {self.temperature}, {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@runtime_checkable
class BatchGenerator(Protocol):
    """Answers batches of prompts. ``name`` is the engine (``"hf"`` | ``"fast"``), reported in the
    summary; ``implementation`` says how it runs (its cache, compiled or not), for the summary too;
    ``last_decode_steps`` is how many decoding steps the last ``generate`` call ran (each step
    advances every row of the batch by one token)."""

    name: str
    implementation: str
    last_decode_steps: int

    def reserve(self, max_prompt_tokens: int, max_new_tokens: int) -> None:
        """Size any run-wide state (a static cache) for prompts up to ``max_prompt_tokens`` and
        answers up to ``max_new_tokens``, before the first call; a longer prompt later still works
        (the state grows)."""
        ...

    def generate(self, prompts: list[list[int]], params: BatchParams) -> list[Answer]:
        """Per prompt, in input order: (answer ids without the end-of-turn token, finish)."""
        ...
