"""Where a step's time goes: torch.profiler over a few steps, summarised as the host's and the
device's time a step, how much of the wall the device was busy, and the top kernels and host ops.

    with StepProfile() as p:
        for _ in range(n):
            run_one_step()
    summary = p.summary(steps=n)  # dict, JSON-ready
    p.write_tables(path)          # the top kernels (device time) and host ops (self CPU time)

Why this shape. A round that costs more plain steps than its arithmetic says is either bound by
the device (kernels: their count and their time, from the CUDA activity) or by the host (the gaps
between a step's graph replays, where Python prepares the next one). ``busy_share`` is the union
of the kernels' intervals over the wall: near 1 the device is the bound, well under 1 the host is.
On a CPU there is no device activity: the summary then has the host's figures alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


class StepProfile:
    """A torch.profiler context over ``steps`` steps (module docstring); the device is synchronised
    on entry and exit, so the wall is the steps' own."""

    def __init__(self) -> None:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=acts)
        self.wall_s = 0.0

    def __enter__(self) -> "StepProfile":
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wall_s = time.perf_counter() - self._t0
        self.prof.__exit__(*exc)

    def _kernels(self) -> list:
        return [e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    def summary(self, steps: int) -> dict:
        """Per step: wall_ms, and with device activity kernels, kernel_ms (summed), busy_ms (their
        union) and busy_share (busy over wall)."""
        kernels = self._kernels()
        wall_ms = 1e3 * self.wall_s / steps
        out = {"steps": steps, "wall_ms": round(wall_ms, 4)}
        if not kernels:  # a CPU: no device activity to split the wall by
            return out
        busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
        out |= {"kernels": round(len(kernels) / steps, 1),
                "kernel_ms": round(sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps, 4),
                "busy_ms": round(busy_us / 1e3 / steps, 4)}
        out["busy_share"] = round(out["busy_ms"] / wall_ms, 4)
        return out

    def write_tables(self, path: str | Path, rows: int = 40) -> None:
        """The top ``rows`` by device time, then by host self time, as torch's tables (text)."""
        averages = self.prof.key_averages()
        parts = []
        if self._kernels():
            parts += ["# by device time", averages.table(sort_by="self_device_time_total", row_limit=rows)]
        parts += ["# by host self time", averages.table(sort_by="self_cpu_time_total", row_limit=rows)]
        Path(path).write_text("\n\n".join(parts) + "\n")
