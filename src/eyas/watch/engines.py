"""Reading the speculative-decoding metrics that serving engines expose in the Prometheus text format.

The names, as each engine's own code registers them (facts checked against the engines' sources;
tests/data/metrics/SOURCE.md names the files):

- vLLM (``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingProm``): counters
  ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
  ``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_accepted_tokens_per_pos``
  (label ``position`` = 0 .. num_speculative_tokens-1), each labelled ``model_name`` and ``engine``;
  prometheus_client exposes a counter's samples with the suffix ``_total``. Per position
  acceptance = accepted_per_pos / num_drafts; mean accept length = 1 + accepted / num_drafts.
- SGLang (``python/sglang/srt/metrics/collector.py``): the gauge ``sglang:spec_accept_length``, the
  mean accept length (accepted drafts + the bonus token per verify forward) over the scheduler's
  last logging interval, labelled ``model_name`` and the parallel ranks; ``sglang:spec_accept_rate``
  beside it. No per-position counts and no round count.
- eyas serve: the vLLM set under the prefix ``eyas_`` (``eyas_spec_decode_num_drafts`` ...), so
  ``eyas watch`` reads eyas's own ``/metrics`` too.

Counters are cumulative since the server started: one scrape gives the lifetime totals, two give
what happened in between (:func:`difference`). Samples of several engines or ranks (label sets other
than ``position``) are summed; SGLang's gauges are averaged over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from eyas.errors import EyasError
from eyas.watch.verdict import Observation

VLLM, SGLANG, EYAS = "vllm", "sglang", "eyas"
PREFIXES = {VLLM: "vllm:spec_decode_", EYAS: "eyas_spec_decode_"}
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"


class MetricsError(EyasError):
    """Metrics text that holds no speculative-decoding metrics eyas can read."""


@dataclass
class SpecCounters:
    """One scrape's speculative-decoding numbers, engine-neutral."""

    engine: str
    drafts: float | None = None  # rounds
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    accepted_per_position: list[float] = field(default_factory=list)
    accept_length: float | None = None  # SGLang's gauge
    accept_rate: float | None = None

    def observation(self, source: str = "") -> Observation:
        if self.engine == SGLANG:
            return Observation(None, [], accept_length=self.accept_length, source=source)
        rounds = int(round(self.drafts or 0))
        per_pos = [int(round(a)) for a in self.accepted_per_position]
        length = None
        if not per_pos and rounds and self.accepted_tokens is not None:
            length = 1.0 + self.accepted_tokens / rounds
        return Observation(rounds, per_pos, accept_length=length, depth=len(per_pos) or None, source=source)

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accepted_per_position": self.accepted_per_position,
                "accept_length": self.accept_length, "accept_rate": self.accept_rate}


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    try:
        return [(s.name, dict(s.labels), float(s.value))
                for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError) as e:
        raise MetricsError(f"not Prometheus text format: {e}") from e


def parse_metrics(text: str, engine: str | None = None) -> SpecCounters:
    """The speculative-decoding counters in ``text`` (``engine`` None: whichever engine's are there,
    vLLM first, then eyas, then SGLang). Raises :class:`MetricsError` when there are none."""
    samples = _samples(text)
    names = {n for n, _, _ in samples}
    order = [engine] if engine else [VLLM, EYAS, SGLANG]
    for eng in order:
        if eng == SGLANG:
            if SGLANG_ACCEPT_LENGTH in names:
                return _sglang(samples)
            continue
        prefix = PREFIXES.get(eng)
        if prefix is None:
            raise MetricsError(f"engine: expected one of {[VLLM, SGLANG, EYAS]}, found {eng!r}")
        if any(n.startswith(prefix + "num_drafts") for n in names):
            return _counters(samples, eng, prefix)
    raise MetricsError(
        "no speculative-decoding metrics found: expected vLLM's vllm:spec_decode_num_drafts_total (the server "
        "runs with --speculative-config), SGLang's sglang:spec_accept_length (--enable-metrics) or eyas serve's "
        f"eyas_spec_decode_num_drafts_total; found {len(names)} other metric(s)"
        + (f", e.g. {sorted(names)[:5]}" if names else ""))


def _counters(samples: list[tuple[str, dict[str, str], float]], engine: str, prefix: str) -> SpecCounters:
    out = SpecCounters(engine)
    per_pos: dict[int, float] = {}
    sums: dict[str, float] = {}
    for name, labels, value in samples:
        if not name.startswith(prefix) or name.endswith("_created"):
            continue
        key = name[len(prefix):]
        key = key[:-len("_total")] if key.endswith("_total") else key
        if key == "num_accepted_tokens_per_pos":
            pos = int(labels.get("position", "-1"))
            if pos < 0:
                raise MetricsError(f"{name}: a sample without a position label")
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        else:
            sums[key] = sums.get(key, 0.0) + value
    out.drafts = sums.get("num_drafts")
    out.draft_tokens = sums.get("num_draft_tokens")
    out.accepted_tokens = sums.get("num_accepted_tokens")
    if per_pos:
        out.accepted_per_position = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]
    return out


def _sglang(samples: list[tuple[str, dict[str, str], float]]) -> SpecCounters:
    lengths = [v for n, _, v in samples if n == SGLANG_ACCEPT_LENGTH]
    rates = [v for n, _, v in samples if n == SGLANG_ACCEPT_RATE]
    return SpecCounters(SGLANG, accept_length=sum(lengths) / len(lengths),
                        accept_rate=sum(rates) / len(rates) if rates else None)


def difference(after: SpecCounters, before: SpecCounters) -> SpecCounters:
    """What the counters did between two scrapes (a gauge engine: the later scrape). A counter that
    went down (the server restarted) gives the later totals."""
    if after.engine == SGLANG or before.engine != after.engine or (after.drafts or 0) < (before.drafts or 0):
        return after
    sub = (lambda a, b: None if a is None else a - (b or 0.0))
    per_pos = [a - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0.0)
               for i, a in enumerate(after.accepted_per_position)]
    return SpecCounters(after.engine, sub(after.drafts, before.drafts), sub(after.draft_tokens, before.draft_tokens),
                        sub(after.accepted_tokens, before.accepted_tokens), per_pos)
