"""The watchdog: served acceptance per position against the training prediction, over a sliding window.

It keeps the last ``window`` speculative rounds of all requests as (depth reached, drafts accepted),
and after every finished request judges them with :func:`eyas.watch.verdict.judge`, the verdict
``eyas watch`` gives for SGLang and vLLM (thresholds and why: :mod:`eyas.watch.verdict`). On entering
"broken" it logs one warning (logger ``eyas.serve``) with the numbers, the likely causes and the
``eyas doctor`` command, and sets ``eyas_spec_acceptance_alert`` to 1; on leaving it, it logs that
acceptance recovered and sets the gauge back to 0. Rounds are appended from the decode thread and
judged there, so no lock is needed beyond the deque's own atomic appends; /health reads the last
verdict (an immutable object).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from eyas.watch.verdict import DEFAULT_MIN_ROUNDS, Prediction, Verdict, doctor_command, judge, window_observation

DEFAULT_WINDOW = 512
log = logging.getLogger("eyas.serve")


class Watchdog:
    def __init__(self, prediction: Prediction | None, *, target: str, draft: str, window: int = DEFAULT_WINDOW,
                 min_rounds: int = DEFAULT_MIN_ROUNDS, on_verdict: Callable[[Verdict], None] | None = None) -> None:
        self.prediction, self.min_rounds, self.on_verdict = prediction, min_rounds, on_verdict
        self.rounds: deque[tuple[int, int]] = deque(maxlen=window)
        self.doctor = doctor_command(target, draft)
        self.verdict: Verdict = judge(window_observation([]), prediction, doctor=self.doctor, min_rounds=min_rounds)
        self.fired = 0  # how many times it entered the alert state

    def round(self, depth: int, accepted: int) -> None:
        self.rounds.append((depth, accepted))

    def check(self) -> Verdict:
        before = self.verdict
        v = judge(window_observation(list(self.rounds), "eyas serve window"), self.prediction, doctor=self.doctor,
                  min_rounds=self.min_rounds)
        self.verdict = v
        if v.alert and not before.alert:
            self.fired += 1
            log.warning("eyas serve watchdog: %s", v.message)
        elif before.alert and not v.alert:
            log.warning("eyas serve watchdog: acceptance recovered (%s): %s", v.status, v.message)
        if self.on_verdict is not None:
            self.on_verdict(v)
        return v
