"""``/metrics`` of ``eyas serve``: Prometheus text, one registry per server (never the global one,
so two servers in one process, as in the tests, keep their own counts).

Names (counters carry ``_total`` in the exposition):

    eyas_requests_total{endpoint,status}           HTTP requests answered, by path and status code
    eyas_prompt_tokens_total, eyas_generation_tokens_total
    eyas_requests_cancelled_total                  requests whose client went away before the end (work freed)
    eyas_time_to_first_token_seconds               histogram: arrival (queue wait included) -> first token
    eyas_time_per_output_token_seconds             histogram: (last token - first token) / (tokens - 1)
    eyas_spec_decode_num_drafts_total              speculative rounds (vLLM's "drafts")
    eyas_spec_decode_num_draft_tokens_total        draft positions verified: the depth each round's tree reached
    eyas_spec_decode_num_accepted_tokens_total     drafts accepted
    eyas_spec_decode_num_accepted_tokens_per_pos_total{position}   rounds whose draft at depth position+1 was accepted
    eyas_spec_accept_length                        histogram of tokens per round (accepted + the bonus)
    eyas_spec_window_acceptance{position}          served acceptance per position over the watchdog's window
    eyas_spec_window_accept_length
    eyas_spec_predicted_acceptance{position}       what training predicted (eyas.json), chain of that depth
    eyas_spec_predicted_accept_length              for the served depth
    eyas_spec_acceptance_ratio                     served / predicted accepted drafts per round (window)
    eyas_spec_acceptance_alert                     1 while the watchdog's verdict is "broken" (alert on == 1)
    eyas_preflight_forced                          1 when started with --force past failed checks
    eyas_preflight_failures                        the failed start-up checks
    eyas_requests_running, eyas_requests_waiting, eyas_draining   requests decoding, queued; 1 while shutting down
    eyas_batch_rows                                busy rows of the running batch at the last step
    eyas_batch_speculation_depth                   drafts on a row's path in the last batched step (0: plain)
    eyas_batch_speculation_drafts                  drafts verified a row there (a tree's nodes, a chain's depth)
    eyas_decode_steps_total{kind}                  steps by what the scheduler chose: "speculative" (a request
                                                   alone: a drafting-verification round) or "batched" (one token per row)
    eyas_lone_request_tokens_per_second{kind,path} what the speculation policy measured for a lone request
                                                   (kind greedy|sampled, path speculative|plain; eyas.serve.policy)

The spec-decode counters use vLLM's names and meanings under the ``eyas_`` prefix, so ``eyas watch``
reads this endpoint as it reads vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from eyas.watch.verdict import Prediction, Verdict

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics:
    def __init__(self, depth: int, prediction: Prediction | None, forced: bool, failures: int) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("eyas_requests", "HTTP requests answered, by path and status code.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("eyas_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("eyas_generation_tokens", "Tokens generated.", registry=r)
        self.cancelled = Counter("eyas_requests_cancelled", "Requests whose client went away before the end.",
                                 registry=r)
        self.ttft = Histogram("eyas_time_to_first_token_seconds", "Arrival (queue wait included) to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("eyas_time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.drafts = Counter("eyas_spec_decode_num_drafts", "Speculative rounds (drafts).", registry=r)
        self.draft_tokens = Counter("eyas_spec_decode_num_draft_tokens",
                                    "Draft positions verified (the depth each round's tree reached).", registry=r)
        self.accepted = Counter("eyas_spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.accepted_per_pos = Counter("eyas_spec_decode_num_accepted_tokens_per_pos",
                                        "Rounds whose draft at depth position+1 was accepted.", ["position"],
                                        registry=r)
        for p in range(depth):  # present from the start, so a scrape before traffic reads 0 per position
            self.accepted_per_pos.labels(str(p))
        self.accept_length = Histogram("eyas_spec_accept_length", "Tokens per speculative round (accepted + bonus).",
                                       buckets=tuple(float(b) for b in range(1, depth + 2)), registry=r)
        self.window_acceptance = Gauge("eyas_spec_window_acceptance",
                                       "Served acceptance per position over the watchdog's window.", ["position"],
                                       registry=r)
        self.window_accept_length = Gauge("eyas_spec_window_accept_length",
                                          "Served accept length over the watchdog's window.", registry=r)
        self.predicted_acceptance = Gauge("eyas_spec_predicted_acceptance",
                                          "Acceptance per position predicted by training (eyas.json).", ["position"],
                                          registry=r)
        self.predicted_accept_length = Gauge("eyas_spec_predicted_accept_length",
                                             "Accept length predicted by training for the served depth.", registry=r)
        self.ratio = Gauge("eyas_spec_acceptance_ratio",
                           "Served / predicted accepted drafts per round over the watchdog's window.", registry=r)
        self.alert = Gauge("eyas_spec_acceptance_alert",
                           "1 while served acceptance is far below the training prediction (see eyas.watch.verdict).",
                           registry=r)
        self.forced = Gauge("eyas_preflight_forced", "1 when the server was started with --force past failed checks.",
                            registry=r)
        self.failures = Gauge("eyas_preflight_failures", "Start-up checks that failed.", registry=r)
        self.running = Gauge("eyas_requests_running", "Requests decoding now.", registry=r)
        self.batch_rows = Gauge("eyas_batch_rows", "Busy rows of the running batch at the last step.", registry=r)
        self.steps = Counter("eyas_decode_steps", "Decoding steps by kind: speculative (a request alone), batched "
                             "(a plain step of the batch) or batched_speculative (a round of the batch).",
                             ["kind"], registry=r)
        for kind in ("speculative", "batched", "batched_speculative"):
            self.steps.labels(kind)
        self.batch_depth = Gauge("eyas_batch_speculation_depth",
                                 "Drafts a row in the last batched step (0: a plain step), as the policy chose "
                                 "for the batch size.", registry=r)
        self.batch_drafts = Gauge("eyas_batch_speculation_drafts",
                                  "Drafts verified a row in the last batched step (a chain: its depth; a tree: "
                                  "its nodes; 0: a plain step).", registry=r)
        self.lone_rates = Gauge("eyas_lone_request_tokens_per_second",
                                "A lone request's decode rate per path, as the speculation policy measured it.",
                                ["kind", "path"], registry=r)
        self.waiting = Gauge("eyas_requests_waiting", "Requests queued.", registry=r)
        self.draining = Gauge("eyas_draining", "1 while shutting down (new requests get 503).", registry=r)
        self.forced.set(1 if forced else 0)
        self.failures.set(failures)
        self.ratio.set(float("nan"))
        if prediction is not None:
            for p, a in enumerate(prediction.acceptance[:depth]):
                self.predicted_acceptance.labels(str(p)).set(a)
            self.predicted_accept_length.set(prediction.accept_length(depth))

    def round(self, depth: int, accepted: int, emitted: int) -> None:
        """One speculative round: ``depth`` drafts, ``accepted`` of them kept, ``emitted`` tokens."""
        self.rounds(depth, [accepted], [emitted])

    def rounds(self, depth: int, accepted: Sequence[int], emitted: Sequence[int]) -> None:
        """A batched step's rounds at once (a chain of ``depth`` drafts a row; row i accepted
        ``accepted[i]`` and kept ``emitted[i]`` tokens): the same counts as :meth:`round` per row,
        each counter moved once (a counter's increment takes a lock: 256 rows x 6 of them were a
        millisecond a step)."""
        if not accepted:
            return
        self.drafts.inc(len(accepted))
        self.draft_tokens.inc(depth * len(accepted))
        self.accepted.inc(sum(accepted))
        for p in range(max(accepted)):
            self.accepted_per_pos.labels(str(p)).inc(sum(a > p for a in accepted))
        for e in emitted:
            self.accept_length.observe(e)

    def step(self, kind: str, rows: int, depth: int = 0, drafts: int | None = None) -> None:
        """One step of the decode worker: ``kind`` speculative, batched or batched_speculative (of
        ``depth`` drafts on a row's longest path, ``drafts`` verified a row: a tree's nodes, a
        chain's depth when None), over ``rows`` requests."""
        self.steps.labels(kind).inc()
        self.batch_rows.set(rows)
        if kind != "speculative":
            self.batch_depth.set(depth)
            self.batch_drafts.set(depth if drafts is None else drafts)

    def rates(self, per_s: dict[str, float | None]) -> None:
        """The policy's measured rates ({"greedy/speculative": tok/s or None, ...})."""
        for key, value in per_s.items():
            kind, path = key.split("/")
            self.lone_rates.labels(kind, path).set(float("nan") if value is None else value)

    def finished(self, prompt_tokens: int, new_tokens: int, ttft: float | None, tpot: float | None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(new_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    def verdict(self, v: Verdict) -> None:
        for p, a in enumerate(v.served_acceptance):
            self.window_acceptance.labels(str(p)).set(a)
        if v.served_accept_length is not None:
            self.window_accept_length.set(v.served_accept_length)
        self.ratio.set(v.ratio if v.ratio is not None else float("nan"))
        self.alert.set(1 if v.alert else 0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
