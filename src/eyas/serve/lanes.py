"""Lanes: where lone requests decode speculatively side by side (``eyas serve --lone-sessions N``).

A lone request's tree rounds (:func:`eyas.engine.step`) accept far more tokens a round than a
batched round's drafts, but the served target's static KV cache holds one session at a time. A
*lane* is a fast target of its own (the same weights, its own cache, CUDA graphs and drafter state)
with a CUDA stream of its own, so up to N requests can each keep a lone session. The decode worker
steps them in turn on one thread (:class:`eyas.serve.batching.BatchWorker`): a round of the fast
target is pipelined, its next round already queued on the lane's stream when ``step`` returns, so
while the host waits for one lane's read-back the others' rounds run on the device.

Invariants: lane 0 is the served target on the current stream (one lane: the server as it was);
a lane's target and drafter state are touched only by the session on that lane; every lane but
the first becomes ready after its warm-up (its CUDA graphs captured; deferred to the worker's idle
time on a GPU, at once elsewhere), and a lane that is not ready takes no session.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from eyas.engine import HFTarget, LlamaTarget


@dataclass
class Lane:
    """A target a lone session decodes on, and the stream its work goes to (None: the current one)."""

    target: Any
    stream: Any = None  # torch.cuda.Stream | None
    ready: bool = True

    def active(self) -> ContextManager[Any]:
        """The context a session on this lane runs in: its stream current."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


def make_lanes(served: Any, count: int, warm_context: int, buckets: list[int] | None = None
               ) -> tuple[list[Lane], list[Callable[[], object]]]:
    """``count`` lanes for ``served`` (lane 0 its own target) and the units that warm the others
    (the fast target's steps compiled and captured for ``buckets`` over ``warm_context`` keys, as the
    served target was at start-up; each unit marks its lane ready). Where the target has no CUDA
    graphs (a CPU) the new lanes are ready at once and there is nothing to warm."""
    if count < 1:
        raise ValueError(f"--lone-sessions: expected at least 1, found {count}")
    first = served.target
    graphs = bool(getattr(first, "cuda_graphs", False))
    lanes = [Lane(first)]
    units: list[Callable[[], object]] = []
    for _ in range(count - 1):
        target = twin_target(first, served.loaded.model)
        stream = torch.cuda.Stream(device=first.device) if first.device.type == "cuda" else None
        lane = Lane(target, stream, ready=not graphs)
        if graphs:
            units.append(lambda lane=lane: _warm(lane, served, warm_context, buckets))
        lanes.append(lane)
    return lanes, units


def twin_target(target: Any, model: Any) -> Any:
    """A target like ``target`` over the same ``model`` (its weights shared, read only) with a cache,
    compiled steps and CUDA graphs of its own: the fast target with the same kernels, or the Hugging
    Face one."""
    if isinstance(target, LlamaTarget):
        return LlamaTarget(model, target.spec, max_length=target.max_length, cuda_graphs=target.cuda_graphs,
                           matvec=target.matvec, attention=target.attention)
    return HFTarget(model, target.spec, max_length=getattr(target, "max_length", None))


def _warm(lane: Lane, served: Any, context: int, buckets: list[int] | None) -> None:
    """The lane's target steps and its drafter state's rounds (greedy, and sampled without top-p)
    compiled and captured, as the served target's at start-up; then the lane is ready."""
    from eyas.serve.startup import WARM_SAMPLING, warm_rounds

    with lane.active():
        lane.target.warmup(buckets=buckets, context=context)
        if hasattr(lane.target, "prefer_ready"):
            lane.target.prefer_ready = True  # a bucket not captured yet pads to a captured one, as the served target
        if served.drafter is not None:
            warm_rounds(lane.target, served.drafter, served.tree, served.tokenizer.encode("Hello"), lambda m: None,
                        sampled=WARM_SAMPLING[:1])
    lane.ready = True
