"""Rendering many conversations: :func:`render_many`, :func:`~eyas.data.render.render` of each, in
worker processes from ``parallel_from`` conversations on (the results equal rendering each alone,
in order)."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from eyas.data.conversations import Conversation
from eyas.data.render import TEMPLATE_DEFAULT, RenderedSample, TemplateAlignmentError, render

# From this many conversations on, and with at least MIN_WORKERS processes, render_many renders in
# worker processes. SmolLM2's template takes 1.5 to 3.3 ms a conversation on this project's 2-core
# machine, so rendering is most of the ~170 s that a 43k-conversation training run spent before its
# first step on the H200's host (an estimate: benchmarks/results/2026-12-01-drafter3-h200.md). A spawned
# worker takes ~5 s to start (it imports torch and transformers): 1,000 conversations took 1.5 s
# here and 6.5 s with 2 workers on 2 cores. Below these, one process is faster.
PARALLEL_FROM = 10_000
MIN_WORKERS = 4
_CHUNK = 256  # conversations per task sent to a worker


def render_many(
    conversations: Sequence[Conversation | Sequence[Mapping[str, str]]],
    tokenizer: Any,
    max_length: int | None = None,
    system_prompt: str = TEMPLATE_DEFAULT,
    *,
    chat_template: str | None = None,
    workers: int | None = None,
    parallel_from: int = PARALLEL_FROM,
) -> list[RenderedSample | None]:
    """:func:`render` of every conversation, in order; None for one the chat template cannot align
    (:class:`TemplateAlignmentError`). Each result equals ``render`` of that conversation alone.

    From ``parallel_from`` conversations on, chunks of them are rendered by ``workers`` processes
    (default: this process's share of the CPUs it may use, divided among torchrun's WORLD_SIZE
    processes, at most 16, and only with at least ``MIN_WORKERS`` of them; 1 renders here). The
    workers are spawned, not forked: the caller may hold CUDA and OpenMP state that a forked child
    must not inherit. Each worker unpickles the tokenizer once and returns :class:`_Plain` samples
    (lists: torch would pass each tensor through a shared-memory file descriptor); the tensors are
    built here. If the workers cannot start (spawn re-imports the main script, which must guard its
    entry point), it says so and renders here."""
    share = len(os.sched_getaffinity(0)) // int(os.environ.get("WORLD_SIZE", "1"))  # torchrun: each rank renders
    n_workers = workers if workers is not None else min(16, share)
    if len(conversations) < parallel_from or n_workers < (2 if workers is not None else MIN_WORKERS):
        return [_render_or_none(c, tokenizer, max_length, system_prompt, chat_template) for c in conversations]
    chunks = [list(conversations[i:i + _CHUNK]) for i in range(0, len(conversations), _CHUNK)]
    try:
        with ProcessPoolExecutor(n_workers, mp_context=get_context("spawn"), initializer=_worker_init,
                                 initargs=(tokenizer, max_length, system_prompt, chat_template)) as pool:
            parts = list(pool.map(_render_chunk, chunks))
    except BrokenProcessPool as e:  # e.g. a script without `if __name__ == "__main__":`, which spawn re-imports
        warnings.warn(f"render_many: the worker processes failed ({e}); rendering the {len(conversations)} "
                      f"conversations in this process instead. A script that trains must guard its entry point "
                      f"with `if __name__ == \"__main__\":` for the workers to start", stacklevel=2)
        return [_render_or_none(c, tokenizer, max_length, system_prompt, chat_template) for c in conversations]
    return [None if r is None else RenderedSample(
        input_ids=torch.tensor(r.input_ids, dtype=torch.long), loss_mask=torch.tensor(r.loss_mask, dtype=torch.long),
        assistant_spans=r.assistant_spans, truncated=r.truncated, id=r.id) for part in parts for r in part]


def _render_or_none(conversation: Any, tokenizer: Any, max_length: int | None, system_prompt: str,
                    chat_template: str | None) -> RenderedSample | None:
    try:
        return render(conversation, tokenizer, max_length=max_length, system_prompt=system_prompt,
                      chat_template=chat_template)
    except TemplateAlignmentError:
        return None


class _Plain(NamedTuple):
    """A :class:`RenderedSample` as a render_many worker sends it back: lists instead of tensors."""

    input_ids: list[int]
    loss_mask: list[int]
    assistant_spans: list[tuple[int, int]]
    truncated: bool
    id: str | None


_WORKER: dict[str, Any] = {}  # a render_many worker's tokenizer and options (set once per process)


def _worker_init(tokenizer: Any, max_length: int | None, system_prompt: str, chat_template: str | None) -> None:
    torch.set_num_threads(1)
    _WORKER.update(tokenizer=tokenizer, max_length=max_length, system_prompt=system_prompt, chat_template=chat_template)


def _render_chunk(chunk: list[Any]) -> list[_Plain | None]:
    out: list[_Plain | None] = []
    for c in chunk:
        r = _render_or_none(c, _WORKER["tokenizer"], _WORKER["max_length"], _WORKER["system_prompt"],
                            _WORKER["chat_template"])
        out.append(None if r is None else _Plain(r.input_ids.tolist(), r.loss_mask.tolist(), r.assistant_spans,
                                                 r.truncated, r.id))
    return out
