"""Events from the decode thread to the event loop, a wake-up per batch rather than per event.

``loop.call_soon_threadsafe`` writes a byte to the loop's wake-up pipe and takes its lock at every
call: with 64 rows streaming, that is 64 system calls and 64 wake-ups a step, each holding the GIL
the decode thread needs next. An :class:`EventPump` collects the events posted since the loop last
ran it and schedules one flush for all of them: the first event of a batch schedules the flush, the
ones after it join the batch until the flush takes it. Invariant: each queue receives its events in
the order they were posted (one list, flushed in order, under one lock), and every posted event is
delivered (a post after the flush took the list schedules the next flush).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


class EventPump:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._batch: list[tuple[asyncio.Queue, Any]] = []

    def post(self, queue: asyncio.Queue, event: Any) -> None:
        """Thread-safe: ``event`` goes to ``queue`` on the loop's thread, in order."""
        with self._lock:
            self._batch.append((queue, event))
            first = len(self._batch) == 1
        if first:
            self.loop.call_soon_threadsafe(self._flush)

    def sender(self, queue: asyncio.Queue) -> Callable[[Any], None]:
        """A job's ``emit``: its events into ``queue``."""
        return lambda event: self.post(queue, event)

    def _flush(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
        for queue, event in batch:
            queue.put_nowait(event)
