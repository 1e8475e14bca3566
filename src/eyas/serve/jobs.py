"""What a request handler and a decode worker hand each other: a :class:`Job` (the request, its
sampling and its stop conditions, and the channel its events go back on) and its events
(:class:`Event`: ``tokens``, then exactly one ``done``). A module without torch, so that ``eyas serve`` can start
its engine process before the HTTP side's heavier imports (:mod:`eyas.serve.engine_process`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from eyas.engine import SamplingParams


@dataclass
class Event:
    kind: str  # tokens | done
    tokens: list[int] = field(default_factory=list)
    result: Any = None  # GenerationResult on done
    error: str | None = None
    time: float = 0.0


@dataclass
class Job:
    prompt: list[int]
    sampling: "SamplingParams"
    max_new_tokens: int
    stop: list[str]
    seed: int
    emit: Callable[[Event], None]  # thread-safe: called from the worker thread
    id: str = ""
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None
    on_cancel: Callable[[], None] | None = None  # where the worker is elsewhere: tell it (once)

    def cancel(self) -> None:
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()


class QueueFull(Exception):
    pass


STOP = object()  # the worker's queue: finish what is queued, then end
