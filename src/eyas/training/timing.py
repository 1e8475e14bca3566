"""Throughput of the training loop, measured without a device sync per step.

The window's wall time leaves out evaluations and checkpoints (:meth:`PhaseTimer.exclude`), so
tokens/s is training throughput and the two shares add up to about 1 (the rest: host work between
steps that the GPU did not hide, and logging).

Each step marks three instants: before the batch (data + the target's forward, online), after it
(the drafter's forward, backward, all-reduce and optimizer step follow), and at its end. On CUDA
the marks are CUDA events recorded in the stream (recording does not wait for the GPU); they are
read when a summary is asked for (log steps), after one synchronisation there. On CPU every
operation is synchronous, so the marks are ``time.perf_counter()`` readings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Window:
    """One logging window: wall seconds, seconds in each phase, real and padded tokens."""

    wall_s: float
    target_s: float
    drafter_s: float
    tokens: int
    padded_tokens: int

    def row(self) -> dict[str, float]:
        """The figures metrics.jsonl records: real tokens per second (padding not counted), the
        shares of wall time in the target phase and in the drafter phase, and the padding share."""
        wall = max(self.wall_s, 1e-9)
        return {"tokens_per_s": round(self.tokens / wall, 1),
                "target_share": round(self.target_s / wall, 4),
                "drafter_share": round(self.drafter_s / wall, 4),
                "padding_share": round(1 - self.tokens / max(1, self.padded_tokens), 4)}


class PhaseTimer:
    """Marks per step, read once per window (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._steps: list[tuple[object, object, object]] = []
        self._tokens = self._padded = 0
        self._t0 = time.perf_counter()
        self._excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of wall time out of the window (evaluations, checkpoints: not training)."""
        self._excluded += seconds

    def mark(self) -> object:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def step(self, start: object, mid: object, end: object, tokens: int, padded_tokens: int) -> None:
        """Record one step's marks and its real and padded token counts (host ints)."""
        self._steps.append((start, mid, end))
        self._tokens += tokens
        self._padded += padded_tokens

    def read(self) -> Window:
        """The window since the last read (one synchronisation on CUDA), and start a new one."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        target = drafter = 0.0
        for a, b, c in self._steps:
            if self.cuda:
                target += a.elapsed_time(b) / 1000  # type: ignore[attr-defined]
                drafter += b.elapsed_time(c) / 1000  # type: ignore[attr-defined]
            else:
                target += b - a  # type: ignore[operator]
                drafter += c - b  # type: ignore[operator]
        w = Window(now - self._t0 - self._excluded, target, drafter, self._tokens, self._padded)
        self._steps, self._tokens, self._padded, self._t0, self._excluded = [], 0, 0, now, 0.0
        return w
