"""The continuous-batching worker of ``eyas serve``: many requests decode at once, and a request
alone decodes speculatively.

Scheduling. The worker thread owns a :class:`~eyas.engine.continuous.RowBatch` of ``--max-rows``
rows on the batched engine, and the served target and drafter for speculative decoding. Between
two steps it takes what was submitted, then:

1. A request that is **alone** (no row busy, nobody waiting) decodes speculatively on the served
   target, round after round (:func:`~eyas.engine.step`), where that is measured to be faster than
   a lone plain row (:class:`~eyas.serve.policy.SpeculationPolicy`, per greedy and sampled
   requests): at batch size 1 a round of tau tokens costs about two plain steps, so speculation
   pays there if it pays anywhere; else it takes a row like any request. With ``lone_sessions`` N
   (``--lone-sessions``), up to N requests decode alone side by side, each on a *lane* of its own (a
   twin of the fast target on its own CUDA stream, :mod:`eyas.serve.lanes`), stepped in turn.
2. When more requests are in flight than there are ready lanes, the lone requests **join the
   batch**: each one's prompt and tokens are prefilled into a row, which continues from its last
   token (:class:`~eyas.engine.continuous.RowRequest` ``next_token``); lanes take requests again once
   the batch has emptied.
3. Otherwise waiting requests are prefilled into free rows (in arrival order: nobody is overtaken),
   and one batched step runs: a plain step (a token per row) or, where ``--batch-speculation``
   asks for them (:func:`~eyas.serve.policy.batch_mode`: off by default, measured not to pay), a
   batched speculative round (:meth:`~eyas.engine.continuous.RowBatch.speculate`: a chain or a
   tree of drafts per row, one verification for all rows, each row its own accepted length), the
   arm measured fastest for this many rows and this kind of step (``auto``,
   :class:`~eyas.serve.policy.BatchSpeculation`: it turns speculation down, then off, as the batch
   grows and a forward stops being bound by reading the weights). Each row's tokens go to its
   request at once (streaming per row); a row whose request ends (eos, its ``max_tokens``, a stop
   string, a client gone) is freed at once, and the next step can fill it.

Compilation. On a GPU each (keys, mode, rows) shape of the batch's step is compiled and captured at
its first use, which stalls every row (a second on a warm cache). The worker prepares them while
the server is quiet (after 2 s without a request: the widest shape first, then the shapes of
contexts up to 512 tokens, then, where the batch may speculate, the rounds' (rows, draft, mode,
keys) shapes of batches up to ``BatchSpeculation.max_rows``), and until a shape is prepared a
covering one stands in for it for as long as that costs less than compiling it
(:meth:`~eyas.engine.continuous.RowBatch.step`); a round whose shape is not prepared waits the same
way, plain steps running in its place (:meth:`~eyas.engine.continuous.RowBatch.round_ready`).

Invariants: only the worker thread touches the engines and the sessions; each job's events arrive
in order, ``tokens`` then exactly one ``done``; a greedy request gets the tokens it would get alone
(losslessness of the speculative paths; the batched step's rows never read each other's cache);
:meth:`stop` lets every queued and running request finish. What was chosen shows in
``/metrics``: ``eyas_decode_steps_total{kind}`` (speculative rounds of a lone request, batched
plain steps, batched speculative rounds), ``eyas_batch_rows`` (busy rows at the last step) and
``eyas_batch_speculation_depth`` (the depth of the last batched step, 0 for plain) and
``eyas_batch_speculation_drafts`` (the drafts it verified a row: a tree's nodes). Every
speculative round, lone or batched, counts in the acceptance metrics; the watchdog compares the
lone requests' tree rounds with the calibrated prediction (a batched round drafts another shape
than the tree the prediction is for).
"""

from __future__ import annotations

import functools
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from eyas.engine import step
from eyas.engine.batch_engines import fast_unsupported
from eyas.engine.batched import BatchedLlama
from eyas.engine.continuous import RowBatch, RowRequest
from eyas.engine.speculative import STOP_CANCELLED, GenerationResult
from eyas.engine.stats import STOP_EOS, STOP_MAX_NEW_TOKENS, GenerationStats
from eyas.engine.stopping import StopCriteria
from eyas.serve.lanes import Lane, make_lanes
from eyas.serve.policy import BatchSpeculation, SpeculationPolicy, arm_size, batch_mode
from eyas.serve.startup import START_CONTEXT, Served, start_buckets
from eyas.serve.worker import STOP, DecodeWorker, Event, Job, Worker

DEFAULT_ROWS = {"cuda": 64, "cpu": 8}  # --max-rows by device: a CPU's memory holds fewer rows' caches


def make_worker(served: Served, max_rows: int | None = None, *, max_queue: int = 256, speculation: str = "auto",
                batch_speculation: str | None = None, lone_sessions: int = 1,
                on_round: Callable[[int, int, int, bool], None] | None = None,
                on_rounds: Callable[[int, list[int], list[int]], None] | None = None,
                on_done: Callable[[Job, Any, float | None, float | None], None] | None = None,
                on_step: Callable[..., None] | None = None) -> Worker:
    """The server's worker: a :class:`BatchWorker` of ``max_rows`` rows (None: :data:`DEFAULT_ROWS`
    for the target's device) where the batched engine runs the target, else (an architecture it
    does not run, a target split over devices, ``max_rows`` 1) the FIFO :class:`DecodeWorker`.
    ``speculation``: a request alone; ``batch_speculation``: the batch's rounds
    (:func:`~eyas.serve.policy.batch_mode`: off unless asked); ``lone_sessions``: how many requests
    may decode alone side by side, each on a lane of its own (:mod:`eyas.serve.lanes`)."""
    model, device = served.loaded.model, served.target.device
    rows = int(max_rows if max_rows is not None else DEFAULT_ROWS.get(device.type, 8))
    if rows < 1:
        raise ValueError(f"--max-rows: expected at least 1, found {rows}")
    if rows == 1 or fast_unsupported(model) is not None:
        return DecodeWorker(served, max_queue=max_queue, on_round=on_round, on_done=on_done)
    # The batch gets the drafter only where it may speculate (else no batched drafter state).
    drafter = served.drafter if batch_mode(speculation, batch_speculation) != "off" else None
    batch = RowBatch(BatchedLlama(model, rows=rows), capacity=served.max_length, eos_ids=served.loaded.eos_ids,
                     drafter=drafter, boundaries=served.target.spec.boundaries if drafter is not None else ())
    buckets = start_buckets(served.target.buckets, served.tree) if hasattr(served.target, "buckets") else None
    lanes, warmups = make_lanes(served, lone_sessions, START_CONTEXT, buckets)
    return BatchWorker(served, batch, speculation=speculation, batch_speculation=batch_speculation, max_queue=max_queue,
                       lanes=lanes, lane_warmups=warmups, on_round=on_round, on_done=on_done, on_step=on_step,
                       on_rounds=on_rounds)


@dataclass
class Live:
    """A request decoding in a row: its job, its tokens, its stop conditions and its clock."""

    job: Job
    stop: StopCriteria
    stats: GenerationStats
    tokens: list[int] = field(default_factory=list)
    first: float | None = None
    last: float | None = None
    reason: str | None = None
    spec_tokens: int = 0  # tokens and wall seconds of its speculative rounds (the policy's measure)
    spec_seconds: float = 0.0


class BatchWorker(Worker):
    """Continuous batching with speculation for a request alone (module docstring).

    ``on_step(kind, rows, depth[, drafts])`` sees every step: ``"speculative"`` (a lone request's
    round), ``"batched"`` (a plain step of ``rows`` busy rows) or ``"batched_speculative"`` (a round
    of ``depth`` drafts on a row's path, ``drafts`` verified a row: a tree's nodes). ``on_rounds(depth, accepted, emitted)`` sees a batched round's rows at
    once (per row: drafts accepted, tokens kept); without it ``on_round`` sees each row's."""

    def __init__(self, served: Served, batch: RowBatch, *, speculation: str = "auto", batch_speculation: str | None = None,
                 batch_max_rows: int | None = None, lanes: Sequence[Lane] = (),
                 lane_warmups: Sequence[Callable[[], object]] = (), on_step: Callable[..., None] | None = None,
                 on_rounds: Callable[[int, list[int], list[int]], None] | None = None, **kwargs: Any) -> None:
        super().__init__(served, **kwargs)
        self.batch, self.on_step, self.on_rounds = batch, on_step, on_rounds
        self.max_rows = batch.rows
        self.policy = SpeculationPolicy(speculation if served.drafter is not None else "off")
        self.batch_policy = BatchSpeculation(batch_mode(speculation, batch_speculation) if batch.spec is not None
                                             else "off", max_rows=batch_max_rows)
        self.pending: deque[Job] = deque()  # taken off the queue, waiting for a row
        self.rows: dict[int, Live] = {}  # row -> its request
        # where lone requests decode (eyas.serve.lanes; one lane: the served target), and the lone
        # requests decoding now: each its speculative session and its lane
        self.lanes: list[Lane] = list(lanes) if lanes else [Lane(served.target)]
        self.solos: list[tuple[Live, Any, Lane]] = []
        self.starting: Job | None = None  # a lone request whose prefill runs now
        self.stopping = False
        if getattr(batch.engine, "compile", False):  # the batch's step shapes, compiled while idle (first)
            shapes = batch.step_shapes(START_CONTEXT)
            # the widest first: it stands in for every other until each is compiled (RowBatch._stand_in)
            widest = (shapes[-1][0], "top_p", batch.rows)
            self.deferred[:0] = [functools.partial(batch.engine.prepare, K, mode, n) for K, mode, n in [widest] + shapes]
            if batch.spec is not None and self.batch_policy.mode != "off":  # then the rounds it may take
                p = self.batch_policy
                rows = p.max_rows or batch.rows
                rounds = (batch.round_shapes(START_CONTEXT, p.drafts("greedy"), rows, modes=["greedy"])
                          + batch.round_shapes(START_CONTEXT, p.drafts("sampled"), rows, modes=["sample"]))
                self.deferred[len(shapes) + 1:len(shapes) + 1] = [functools.partial(batch.spec.prepare, *shape)
                                                                  for shape in rounds]
        self.deferred[:0] = list(lane_warmups)  # the lanes first: a few clients are served by them
        self.thread.start()

    @property
    def running(self) -> Job | None:
        if self.solos:
            return self.solos[0][0].job
        if self.starting is not None:
            return self.starting
        return next(iter(self.rows.values())).job if self.rows else None

    @property
    def running_count(self) -> int:
        return len(self.rows) + len(self.solos) + (self.starting is not None)

    def free_lanes(self) -> list[Lane]:
        """The lanes ready for a lone request, none of whose sessions decodes on them now."""
        taken = {id(lane) for _, _, lane in self.solos}
        return [lane for lane in self.lanes if lane.ready and id(lane) not in taken]

    def batch_report(self) -> dict[str, Any]:
        """``/health``'s ``batch_speculation``: the depth chosen per batch size and its measured rates,
        the seconds the batched engine spent compiling and capturing shapes (at their first use they
        stall every row: a load test warms them first), the same for the target that lone requests
        decode on (its start-up included), and the start-up work still deferred (the batch's step
        shapes first, which the worker prepares while the server is idle)."""
        return {**self.batch_policy.to_dict(), "lanes": len(self.lanes),
                "lanes_ready": sum(lane.ready for lane in self.lanes), "compile_s": round(self.batch.compile_s, 2),
                "target_compile_s": round(float(getattr(self.served.target, "compile_seconds", 0.0)), 2),
                "deferred_left": len(self.deferred)}

    # -- the loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self._take(block=not (self.rows or self.solos or self.pending))
            if self.stopping and not (self.rows or self.solos or self.pending):
                return
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - a failure ends the requests it touched, not the worker
                self._fail_all(f"{type(e).__name__}: {e}")
            self._ticked()

    def _take(self, block: bool) -> None:
        """Move submitted jobs to ``pending`` (waiting for one when ``block``); they count as
        ``waiting`` until they leave it (:meth:`_next`)."""
        if block:
            self._idle()
        while True:
            try:
                item = self.queue.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is STOP:
                self.stopping = True
                continue
            self.pending.append(item)

    def _next(self) -> Job:
        """The first pending job, which starts decoding now."""
        self._taken()
        return self.pending.popleft()

    def _tick(self) -> None:
        """One scheduling decision and the work it leads to (module docstring, 1.-3.)."""
        for job in [j for j in self.pending if j.cancelled.is_set()]:
            self.pending.remove(job)
            self._taken()
            self._skip_cancelled(job)
        if self.solos:
            lone = self._lone()
            if lone or len(self.batch.free) < len(self.solos):  # (no rows for them all: they stay alone)
                for lane in self.free_lanes()[:len(self.pending)] if lone else ():
                    self._start_solo(self._next(), lane)
                self._solo_rounds()
                return
            self._join_batch()
        if not self.rows and self.pending and self._lone():
            for lane in self.free_lanes()[:len(self.pending)]:
                self._start_solo(self._next(), lane)
            return
        self._admit()
        self._batched_step()

    def _lone(self) -> bool:
        """Whether every request waiting can decode alone next to the lone ones decoding: a ready
        lane free for each, and the policy speculating for each kind among them (module docstring, 1.)."""
        if len(self.pending) > len(self.free_lanes()):
            return False
        in_flight = len(self.solos) + len(self.pending)
        # one decision per kind of request (the policy's exploration counts decisions, not requests)
        first = {self.policy.kind(job.sampling): job for job in reversed(self.pending)}
        return all(self.policy.speculate(job.sampling, in_flight) for job in first.values())

    # -- a request alone: speculative rounds --------------------------------------------------------

    def _start_solo(self, job: Job, lane: Lane) -> None:
        self.starting = job
        try:
            with lane.active():
                s = self._start_session(job, lane.target)
        except Exception as e:  # noqa: BLE001 - this request fails; the worker goes on
            job.emit(Event("done", error=f"{type(e).__name__}: {e}", time=time.perf_counter()))
            return
        finally:
            self.starting = None
        live = Live(job, s.out.stop, s.stats)
        self.solos.append((live, s, lane))
        self._emit(live, list(s.out.tokens))
        if s.done:
            self._finish_solo(self.solos[-1])

    def _solo_rounds(self) -> None:
        """A round of each lone request, in turn, each on its lane's stream (eyas.serve.lanes: its
        next round is queued there when step() returns, so the lanes' rounds overlap on the device).
        With several, the pass's tokens over its wall seconds is the lanes' rate for the policy."""
        k, emitted, t_pass = len(self.solos), 0, time.perf_counter()
        kinds = {self.policy.kind(live.job.sampling) for live, _, _ in self.solos}
        for solo in list(self.solos):
            live, s, lane = solo
            if live.job.cancelled.is_set():
                s.cancel()
            else:
                drafted_before, accepted_before = list(s.stats.drafted_at_depth), list(s.stats.accepted_at_depth)
                t0 = time.perf_counter()
                with lane.active():
                    tokens = step(s)
                live.spec_seconds += time.perf_counter() - t0
                live.spec_tokens += len(tokens)
                self._report_rounds(s.stats, drafted_before, accepted_before)
                if self.on_step is not None:
                    self.on_step("speculative", 1, 0)
                self._emit(live, tokens)
                emitted += len(tokens)
            if s.done:
                self._finish_solo(solo)
        if k > 1 and len(kinds) == 1:
            self.policy.measured_in_flight(kinds.pop(), "speculative", emitted, time.perf_counter() - t_pass, k)

    def _finish_solo(self, solo: tuple[Live, Any, Lane]) -> None:
        self.solos = [x for x in self.solos if x is not solo]
        live, s, _ = solo
        self._measured_solo(live)
        self._done(live, s.result())

    def _measured_solo(self, live: Live) -> None:
        """The lone request's speculative rate, for the policy (two rounds at least: the first
        rounds of a request may include one-off work)."""
        if live.spec_tokens and len(live.stats.accept_lengths) >= 2:
            self.policy.measured(live.job.sampling, "speculative", live.spec_tokens, live.spec_seconds)

    def _join_batch(self) -> None:
        """The lone requests continue in rows: each its prompt and tokens but the last prefilled, the
        last fed next (more are waiting than lanes can take: module docstring, 2.)."""
        for live, s, _ in self.solos:  # (a row reads the session's tokens, nothing of its lane's device state)
            job = live.job
            live.tokens = list(s.out.tokens)
            (row,) = self.batch.free[:1]
            self.batch.admit([RowRequest(s.x[:-1], job.max_new_tokens, job.sampling, job.seed, next_token=s.x[-1],
                                         generated=len(live.tokens))])
            self.rows[row] = live
            self._measured_solo(live)
        self.solos = []

    # -- the batch ----------------------------------------------------------------------------------

    def _admit(self) -> None:
        free = self.batch.free
        jobs = [self._next() for _ in range(min(len(free), len(self.pending)))]
        if not jobs:
            return
        sv = self.served
        now = time.perf_counter()
        lives = []
        for job in jobs:
            job.started = now
            stop = StopCriteria(job.max_new_tokens, sv.loaded.eos_ids, job.stop,
                                sv.tokenizer.decode if job.stop else None)
            lives.append(Live(job, stop, GenerationStats(prompt_tokens=len(job.prompt))))
        try:
            first = self.batch.admit([RowRequest(j.prompt, j.max_new_tokens, j.sampling, j.seed) for j in jobs])
        except Exception as e:  # noqa: BLE001 - these requests fail (no row was taken); the others go on
            for job in jobs:
                job.emit(Event("done", error=f"{type(e).__name__}: {e}", time=time.perf_counter()))
            return
        for live, got in zip(lives, first):
            self.rows[got.row] = live
            live.stats.rounds += 1  # the prefill's round
            self._row_tokens(got.row, got.tokens, got.finished)

    def _batched_step(self) -> None:
        for row, live in list(self.rows.items()):
            if live.job.cancelled.is_set():
                live.reason = STOP_CANCELLED
                self._end_row(row)
        if not self.rows:
            return
        n = len(self.rows)
        kind = "greedy" if self.batch.mode() == "greedy" else "sampled"
        wanted = self.batch_policy.choose(n, kind)
        # a round shape not compiled yet waits while plain steps cost less than its compilation
        shape = self.batch.round_shape(wanted) if wanted is not None else None
        owed = shape if shape is not None and not self.batch.round_ready(shape) else None
        draft = self.batch_policy.last = None if owed else wanted
        depth = draft.depth if draft is not None else 0  # drafts on a row's longest path (0: a plain step)
        alone = next(iter(self.rows.values())) if n == 1 else None
        compiled_before = self.batch.compile_s
        t0 = time.perf_counter()
        stepped = self.batch.speculate(draft, shape) if draft is not None else self.batch.step()
        # the step's metrics first: a client that has its last token sees its step counted
        if depth and self.on_rounds is not None:
            self.on_rounds(depth, [got.accepted for got in stepped], [len(got.tokens) for got in stepped])
        if self.on_step is not None:
            self.on_step("batched_speculative" if depth else "batched", n, depth, arm_size(draft))
        for got in stepped:
            live = self.rows[got.row]
            if depth:
                live.stats.record_round(depth, got.accepted, len(got.tokens))
                if self.on_round is not None and self.on_rounds is None:
                    self.on_round(depth, got.accepted, len(got.tokens), False)
            else:
                live.stats.rounds += 1
            self._row_tokens(got.row, got.tokens, got.finished)
        # The step's cost as the policies see it: the engine's step and the host's work on its
        # tokens (streaming, stop checks, metrics), which grows with a round's tokens and rows. A step
        # that compiled or captured its shape first is no measure of its speed.
        seconds = time.perf_counter() - t0
        if owed is not None:
            self.batch.charge(owed, seconds)
        if self.batch.compile_s == compiled_before:
            tokens = sum(len(got.tokens) for got in stepped)
            if alone is not None:  # a row alone in the batch: the lone policy's other measure
                self.policy.measured(alone.job.sampling, "row", tokens, seconds)
            elif len(self.lanes) > 1:  # what the lanes are weighed against at n requests in flight
                self.policy.measured_in_flight(kind, "row", tokens, seconds, n)
            self.batch_policy.measured(n, kind, draft, tokens, seconds)

    def _row_tokens(self, row: int, tokens: list[int], finished: bool) -> None:
        """A row's new tokens: emitted up to a stop condition, which ends the row. The device's
        ``finished`` (eos, the row's limit) always comes with the host's own check firing; should it
        not, the row still ends (a finished row feeds no new token)."""
        live = self.rows[row]
        kept = []
        for t in tokens:
            live.tokens.append(t)
            kept.append(t)
            live.reason = live.stop.check(live.tokens)
            if live.reason is not None:
                break
        self._emit(live, kept)
        if finished and live.reason is None:
            live.reason = STOP_EOS if live.tokens and live.tokens[-1] in live.stop.eos else STOP_MAX_NEW_TOKENS
        if live.reason is not None:
            self._end_row(row)

    def _end_row(self, row: int) -> None:
        live = self.rows.pop(row)
        self.batch.release(row)
        stats = live.stats
        stats.new_tokens, stats.stop_reason = len(live.tokens), live.reason or ""
        stats.time_total = time.perf_counter() - (live.job.started or live.job.enqueued)
        self._done(live, GenerationResult(list(live.tokens), stats))

    # -- events ---------------------------------------------------------------------------------------

    def _emit(self, live: Live, tokens: list[int]) -> None:
        if not tokens:
            return
        live.last = time.perf_counter()
        live.first = live.first or live.last
        live.job.emit(Event("tokens", tokens, time=live.last))

    def _done(self, live: Live, result: GenerationResult) -> None:
        if self.on_done is not None:
            self.on_done(live.job, result, live.first, live.last)
        live.job.emit(Event("done", result=result, time=time.perf_counter()))

    def _fail_all(self, error: str) -> None:
        """An engine failure: every request decoding ends with the error; the rows are freed."""
        lives = list(self.rows.values()) + [live for live, _, _ in self.solos]
        for row in list(self.rows):
            self.batch.release(row)
        self.rows.clear()
        self.solos = []
        for live in lives:
            live.job.emit(Event("done", error=error, time=time.perf_counter()))
