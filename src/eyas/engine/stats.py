"""Per-request statistics of a generation, and the clock that fills them.

Definitions (the ones ``eyas bench`` prints):

    rounds          target forward passes that produced tokens; the prefill counts as one, so the
                    plain decoder has exactly one round per token and tau = 1
    tau             accept length = mean of accept_lengths (tokens per drafting-verification
                    round, as the EAGLE papers report it; 1.0 for the plain decoder)
    accept_lengths  tokens emitted by each speculative round (accepted drafts + the bonus token),
                    prefill excluded; the histogram ``eyas bench`` plots
    accepted_at_depth[d]  rounds whose draft token at depth d+1 was accepted
    drafted_at_depth[d]   rounds whose tree reached depth d+1 (the denominator of the rate)
    time_*          seconds in prefill / drafting (tree + drafter re-run) / target verification /
                    bookkeeping (acceptance walk, cache compaction, stop checks)
    time_rounds     wall seconds inside the rounds after the prefill (``speculative.step``), with no
                    sync of its own: each round ends with its read of the device, so consecutive
                    rounds' wall times add up to what they cost (work queued after the read overlaps
                    the next round's host work and is paid there); round_ms = time_rounds / rounds
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch

from eyas.engine.errors import RequestError

# Why a generation ended.
STOP_EOS = "eos"
STOP_STRING = "stop_string"
STOP_MAX_NEW_TOKENS = "max_new_tokens"
STOP_MAX_LENGTH = "max_length"  # the model's context (max position embeddings) is full


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    accepted_at_depth: list[int] = field(default_factory=list)
    drafted_at_depth: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_bookkeeping: float = 0.0
    time_total: float = 0.0
    time_rounds: float = 0.0  # wall time inside step(), all rounds (see the module docstring)
    stop_reason: str = ""

    @property
    def tau(self) -> float:
        """Tokens per drafting-verification round (accepted drafts + the bonus), as the EAGLE papers
        report it; the first token, which comes from the prefill alone, is not a round. Plain
        decoding is 1.0."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def round_s(self) -> float:
        """Seconds per round after the prefill (speculative: per drafting-verification round)."""
        n = len(self.accept_lengths) or max(self.rounds - 1, 0)
        return self.time_rounds / n if n else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    @property
    def acceptance_at_depth(self) -> list[float]:
        """Per draft depth: fraction of the rounds that drafted that deep whose token was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at_depth, self.drafted_at_depth)]

    def record_round(self, tree_depth: int, accepted: int, emitted: int) -> None:
        """One speculative round: the tree reached ``tree_depth``, ``accepted`` drafts were accepted,
        ``emitted`` tokens were kept (accepted + bonus, fewer when a stop condition cut the round)."""
        grow = max(tree_depth - len(self.drafted_at_depth), 0)
        self.drafted_at_depth += [0] * grow
        self.accepted_at_depth += [0] * grow
        for d in range(tree_depth):
            self.drafted_at_depth[d] += 1
        for d in range(accepted):
            self.accepted_at_depth[d] += 1
        self.accept_lengths.append(emitted)
        self.rounds += 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(tau=self.tau, tokens_per_s=self.tokens_per_s, acceptance_at_depth=self.acceptance_at_depth,
                 round_s=self.round_s)
        return d


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on the current stream (a no-op on the CPU): timing needs it, kernels
    are asynchronous. The stream's, not the whole device's: sessions stepped side by side on their own
    streams (benchmarks/parallel_sessions_gpu.py) must not wait for each other."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


TIMINGS = ("auto", "off", "sync", "events")


class Clock:
    """Accumulates the time of each phase into ``stats.time_<phase>``; ``timing`` says how:

    - ``sync``: wall time, synchronising the device at every phase boundary (kernels are
      asynchronous: without the sync a phase would be charged for the previous phase's queued work).
      Exact per phase, but each sync stalls the pipeline: a few microseconds, and the host can no
      longer queue the next phase while the device works;
    - ``events``: CUDA events recorded at the boundaries (no sync); the phases' device times are
      summed once, at ``finish``. On the CPU this is ``sync`` (which syncs nothing there);
    - ``off``: no phase times, only the total;
    - ``auto``: ``events`` on CUDA, ``sync`` on the CPU.
    The total is wall time from construction to ``finish``, which synchronises once.
    """

    def __init__(self, stats: GenerationStats, device: torch.device, timing: str = "auto") -> None:
        if timing not in TIMINGS:
            raise RequestError(f"timing: expected one of {list(TIMINGS)}, found {timing!r}")
        self.stats, self.device = stats, device
        cuda = device.type == "cuda"
        self.mode = {"auto": "events" if cuda else "sync", "events": "events" if cuda else "sync"}.get(timing, timing)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        synchronize(device)
        self.start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.mode == "off":
            yield
        elif self.mode == "events":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((phase, begin, end))
        else:
            synchronize(self.device)
            t0 = time.perf_counter()
            try:
                yield
            finally:
                synchronize(self.device)
                self._add(phase, time.perf_counter() - t0)

    def _add(self, phase: str, seconds: float) -> None:
        name = f"time_{phase}"
        setattr(self.stats, name, getattr(self.stats, name) + seconds)

    def finish(self) -> None:
        synchronize(self.device)
        self.stats.time_total = time.perf_counter() - self.start
        for phase, begin, end in self._events:
            self._add(phase, begin.elapsed_time(end) / 1000)
        self._events.clear()
