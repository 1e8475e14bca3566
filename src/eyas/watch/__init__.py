"""Acceptance monitoring: the verdict that ``eyas serve``'s watchdog and ``eyas watch`` share, and the
reading of SGLang's and vLLM's speculative-decoding metrics.

    from eyas.watch import Watcher
    check = Watcher("http://127.0.0.1:8000/metrics", "runs/drafter-vllm").check()
    check.verdict.status, check.verdict.message, check.to_dict()

Modules: verdict.py (served vs predicted acceptance, the thresholds and why), engines.py (the
engines' metric names and the parser), run.py (scrape, difference, judge).
"""

from eyas.watch.engines import MetricsError, SpecCounters, difference, parse_metrics
from eyas.watch.run import WatchCheck, Watcher, WatchError, read_metrics_text
from eyas.watch.verdict import (
    BROKEN, BROKEN_LENGTH_RATIO, BROKEN_RATIO, INSUFFICIENT, LOW, LOW_LENGTH_RATIO, LOW_RATIO, NO_PREDICTION, OK, Observation, Prediction, Verdict,
    doctor_command, judge, prediction_from_metrics, window_observation,
)

__all__ = [
    "BROKEN", "BROKEN_LENGTH_RATIO", "BROKEN_RATIO", "INSUFFICIENT", "LOW", "LOW_LENGTH_RATIO", "LOW_RATIO", "MetricsError", "NO_PREDICTION", "OK", "Observation",
    "Prediction", "SpecCounters", "Verdict", "WatchCheck", "WatchError", "Watcher", "difference", "doctor_command",
    "judge", "parse_metrics", "prediction_from_metrics", "read_metrics_text", "window_observation",
]
