"""``eyas watch``: a running SGLang or vLLM server's speculative acceptance against the drafter's
training prediction, once or every N seconds.

    eyas watch --metrics http://127.0.0.1:8000/metrics --draft runs/drafter-vllm [--every 30] [--json]

Each check scrapes the metrics (an http(s) URL, a file path or a ``file://`` URL), reads the
engine's speculative-decoding numbers (:mod:`eyas.watch.engines`) and judges them
(:func:`eyas.watch.verdict.judge`, the same verdict as ``eyas serve``'s watchdog). The first
check judges the lifetime totals; with ``--every``, each later one judges what happened since the
previous scrape (counter differences), so a deployment that breaks after a restart or a config
push is seen within one interval. SGLang exposes a mean accept length only: it is judged against
the prediction for ``--depth`` drafts (its ``--speculative-num-steps``; default every position
training measured).
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from eyas.errors import EyasError
from eyas.interop import read_contract, resolve_draft
from eyas.watch.engines import SGLANG, SpecCounters, difference, parse_metrics
from eyas.watch.verdict import DEFAULT_MIN_ROUNDS, Observation, Prediction, Verdict, doctor_command, judge, \
    prediction_from_metrics


class WatchError(EyasError):
    """A metrics source that cannot be read, or a drafter without what the watch needs."""


def read_metrics_text(source: str, timeout: float = 10.0) -> str:
    """The text at ``source``: an http(s) URL, a ``file://`` URL or a file path."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=timeout) as r:  # noqa: S310 - the user's own endpoint
                return r.read().decode("utf-8")
        except OSError as e:
            raise WatchError(f"--metrics {source}: cannot fetch: {e}") from e
    path = Path(source[len("file://"):] if source.startswith("file://") else source)
    if not path.is_file():
        raise WatchError(f"--metrics {source}: expected an http(s) URL, a file:// URL or a file, found no file {path}")
    return path.read_text(encoding="utf-8")


def drafter_prediction(draft: str | Path | None, target: str | None) -> tuple[Path, Prediction | None]:
    """The drafter directory and what its eyas.json predicts (None when it records no metrics)."""
    path = resolve_draft(draft, target or "smollm2")
    if not path.is_dir():
        raise WatchError(f"--draft {draft}: no such directory")
    contract = read_contract(path)
    metrics = contract.metrics if contract is not None else None
    return path, prediction_from_metrics(metrics, f"{path}/eyas.json contract.metrics")


@dataclass
class WatchCheck:
    """One check: what was scraped, what it judged and the verdict."""

    source: str
    engine: str
    window: str  # "lifetime" or "since the previous scrape"
    counters: SpecCounters
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        return {"metrics": self.source, "engine": self.engine, "window": self.window,
                "counters": self.counters.to_dict(), **self.verdict.to_dict()}


class Watcher:
    """Scrape, difference, judge; one :meth:`check` per interval."""

    def __init__(self, source: str, draft: str | Path | None, *, target: str | None = None, engine: str | None = None,
                 depth: int | None = None, min_rounds: int = DEFAULT_MIN_ROUNDS,
                 read: Callable[[str], str] = read_metrics_text) -> None:
        self.source, self.engine, self.depth, self.min_rounds, self.read = source, engine, depth, min_rounds, read
        self.draft, self.prediction = drafter_prediction(draft, target)
        contract = read_contract(self.draft)
        shipped = draft is None or str(draft) == "default"  # the drafter shipped for smollm2
        self.target = target or ("smollm2" if shipped else contract.target.source if contract is not None else None)
        self.previous: SpecCounters | None = None

    def check(self) -> WatchCheck:
        counters = parse_metrics(self.read(self.source), self.engine)
        window = "lifetime"
        judged = counters
        if self.previous is not None and counters.engine != SGLANG:
            judged, window = difference(counters, self.previous), "since the previous scrape"
        self.previous = counters
        obs = judged.observation(self.source)
        if self.depth is not None:
            obs = Observation(obs.rounds, obs.accepted_per_position[:self.depth], obs.accept_length,
                              self.depth, obs.source)
        doctor = doctor_command(self.target, str(self.draft), "eyas" if counters.engine == "eyas" else counters.engine)
        return WatchCheck(self.source, counters.engine, window, judged,
                          judge(obs, self.prediction, doctor=doctor, min_rounds=self.min_rounds))

    def checks(self, every: float | None, count: int | None = None) -> Iterator[WatchCheck]:
        """One check, or (``every``) one every ``every`` seconds, ``count`` times (None: forever)."""
        n = 0
        while True:
            yield self.check()
            n += 1
            if every is None or (count is not None and n >= count):
                return
            time.sleep(every)
