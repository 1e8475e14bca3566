"""The FIFO decode worker: one thread, one queue, one request decoding at a time (the continuous
batching worker, :mod:`eyas.serve.batching`, serves many at once where the batched engine runs).

Scheduling, and why. Each request is an engine :class:`~eyas.engine.Session`, advanced by
:func:`~eyas.engine.step`. The target's KV cache holds one session at a time (the session that last
prefilled it; a step on another raises ``SessionError``), so interleaving sessions round-robin would
re-prefill the whole sequence at every switch: a prefill per switch for nothing. The worker
therefore takes requests in arrival order (FIFO: nobody is overtaken) and steps one session to its
end before starting the next. Invariants:

- only the worker thread touches the target, the drafter and the sessions: request handlers only
  enqueue a :class:`Job` and read the events it sends back, so state never mixes between requests;
- each job's events arrive in order on its own channel (``emit``): ``tokens`` (the tokens a round
  committed), then exactly one ``done`` (the result, or the error);
- a cancelled job (the client went away) is skipped if still queued, and if decoding, the session
  is cancelled between two rounds: at most one round of work is spent after the cancel (a streamed
  request is cancelled as soon as Starlette sees the disconnect, a non-streamed one within 0.25 s);
- :meth:`DecodeWorker.stop` lets every queued job finish, then ends the thread (graceful shutdown).

"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import warnings
from typing import Any, Callable

import torch

from eyas.engine import start, step
from eyas.serve.jobs import STOP, Event, Job, QueueFull
from eyas.serve.startup import Served, generator_for

__all__ = ["STOP", "DecodeWorker", "Event", "Job", "QueueFull", "Worker"]


SWITCH_INTERVAL_S = 0.0005  # the GIL's switch interval while a decode worker runs (_run_loop)
# Deferred start-up work (Served.deferred) waits for this many seconds without a request: a unit
# cannot be interrupted (a compilation, about a second on a warm cache), so it must not land between
# the requests of a client that sends them back to back; a server left idle (its first minutes, the
# gaps of interactive use) still runs it all
QUIET_BEFORE_DEFERRED_S = 2.0


class Worker:
    """What every decode worker shares: one thread, a bounded queue, the jobs' events.

    Subclasses implement :meth:`_loop`; :meth:`submit` and :meth:`stop` are the request handlers'
    side. ``on_round(depth, accepted, emitted, tree)`` sees every speculative round of every request
    (``tree``: a lone request's tree round; else a batched chain round), and
    ``on_done(job, result, first_token_time, last_token_time)`` every finished one (the metrics and
    the watchdog); ``on_cancelled_early(job)`` a job cancelled before it decoded."""

    def __init__(self, served: Served, *, max_queue: int = 256,
                 on_round: Callable[[int, int, int, bool], None] | None = None,
                 on_done: Callable[[Job, Any, float | None, float | None], None] | None = None) -> None:
        self.served, self.max_queue = served, max_queue
        self.on_round, self.on_done = on_round, on_done
        self.on_cancelled_early: Callable[[Job], None] | None = None
        self.on_tick: Callable[[], None] | None = None  # after each step's events (an engine process sends them)
        self.on_idle: Callable[[], None] | None = None  # before waiting for work (an engine process reports its state)
        self.on_rounds: Callable[[int, list[int], list[int]], None] | None = None  # BatchWorker's (its docstring)
        self.on_step: Callable[..., None] | None = None
        self.queue: queue.Queue[Any] = queue.Queue()
        self.waiting = 0  # jobs submitted and not yet decoding
        self.max_rows = 1  # requests decoding at once, at most
        self.policy: Any = None  # where a lone request may take another path: its SpeculationPolicy
        self.deferred: list[Callable[[], object]] = list(getattr(served, "deferred", ()))  # see _background
        self.quiet_s = QUIET_BEFORE_DEFERRED_S
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.thread = threading.Thread(target=self._run_loop, name="eyas-decode", daemon=True)

    @property
    def running(self) -> Job | None:
        """A job decoding now (None: none)."""
        raise NotImplementedError

    @property
    def running_count(self) -> int:
        return 0 if self.running is None else 1

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self.waiting >= self.max_queue:
                raise QueueFull(f"{self.waiting} requests are waiting (the queue holds {self.max_queue})")
            self.waiting += 1
        job.id = job.id or f"req-{next(self._ids)}"
        self.queue.put(job)
        return job

    def stop(self, timeout: float | None = None) -> None:
        """Finish every queued job, then end the thread."""
        self.queue.put(STOP)
        self.thread.join(timeout)

    def _ticked(self) -> None:
        if self.on_tick is not None:
            self.on_tick()

    def _idle(self) -> None:
        if self.on_idle is not None:
            self.on_idle()
        self._background()

    def _background(self) -> None:
        """The start-up's deferred work (``Served.deferred``: compilations no short request needs),
        one unit at a time after ``quiet_s`` seconds without a job: a job that arrives waits for
        one unit at most, and a client sending requests back to back never does. A unit that fails
        warns; the step it would have compiled compiles at its first use."""
        while self.deferred and self._quiet(self.quiet_s):
            unit = self.deferred.pop(0)
            try:
                unit()
            except Exception as e:  # noqa: BLE001 - never end the worker over a warm-up
                warnings.warn(f"a deferred start-up compilation failed ({type(e).__name__}: {e}); it runs at first use")
            if self.on_idle is not None:  # /health's count of what is left
                self.on_idle()

    def _quiet(self, seconds: float) -> bool:
        """Whether ``seconds`` pass with nothing submitted (False as soon as something is)."""
        with self.queue.not_empty:
            return not self.queue.not_empty.wait_for(lambda: len(self.queue.queue) > 0, timeout=seconds)

    def _taken(self) -> None:
        with self._lock:
            self.waiting -= 1

    def _skip_cancelled(self, job: Job) -> bool:
        """A job whose client left while it waited: answered 'cancelled', nothing computed."""
        if not job.cancelled.is_set():
            return False
        job.emit(Event("done", error="cancelled", time=time.perf_counter()))
        if self.on_cancelled_early is not None:
            self.on_cancelled_early(job)
        return True

    def _report_rounds(self, stats: Any, drafted_before: list[int], accepted_before: list[int]) -> None:
        """``on_round`` for the speculative round that just moved ``stats`` (the depth its tree
        reached and the drafts accepted, from the per-depth counters before and after)."""
        if self.on_round is None or not stats.accept_lengths:
            return
        depth = sum(1 for i, d in enumerate(stats.drafted_at_depth)
                    if d > (drafted_before[i] if i < len(drafted_before) else 0))
        accepted = sum(1 for i, a in enumerate(stats.accepted_at_depth)
                       if a > (accepted_before[i] if i < len(accepted_before) else 0))
        self.on_round(depth, accepted, stats.accept_lengths[-1], True)

    def _start_session(self, job: Job, target: Any = None) -> Any:
        """The job's engine session on ``target`` (default: the served target), prefill and first token done."""
        sv = self.served
        job.started = time.perf_counter()
        return start(sv.target if target is None else target, job.prompt, sv.drafter, tree=sv.tree,
                     sampling=job.sampling, max_new_tokens=job.max_new_tokens, eos_token_ids=sv.loaded.eos_ids, stop_strings=job.stop,
                     decode=sv.tokenizer.decode if job.stop else None,
                     generator=generator_for(sv.target.device, job.seed), timing="off")

    def _run_loop(self) -> None:
        torch.set_grad_enabled(False)
        # The decode thread shares the GIL with the event loop that streams its tokens. Python hands
        # the GIL to a waiting thread only every switch interval (5 ms by default): each time the
        # decode thread waits for the GPU and wants the GIL back while the loop is busy, the next
        # step would start up to 5 ms late, more than a whole batched step of a small model takes.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._loop()

    def _loop(self) -> None:
        raise NotImplementedError


class DecodeWorker(Worker):
    """Decodes jobs one at a time in arrival order on its own thread (see the module docstring):
    the worker of a target the batched engine cannot run, or of ``--max-rows 1``."""

    def __init__(self, served: Served, **kwargs: Any) -> None:
        super().__init__(served, **kwargs)
        self._running: Job | None = None
        self.thread.start()

    @property
    def running(self) -> Job | None:
        return self._running

    def _loop(self) -> None:
        while True:
            self._idle()
            job = self.queue.get()
            if job is STOP:
                return
            self._taken()
            self._running = job
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001 - a request's failure must not end the worker
                job.emit(Event("done", error=f"{type(e).__name__}: {e}", time=time.perf_counter()))
            finally:
                self._running = None
                self._ticked()

    def _run(self, job: Job) -> None:
        if self._skip_cancelled(job):
            return
        s = self._start_session(job)
        first = last = None
        if s.out.tokens:
            first = last = time.perf_counter()
            job.emit(Event("tokens", list(s.out.tokens), time=first))
            self._ticked()
        stats = s.stats
        while not s.done:
            if job.cancelled.is_set():
                s.cancel()
                break
            drafted_before, accepted_before = list(stats.drafted_at_depth), list(stats.accepted_at_depth)
            tokens = step(s)
            self._report_rounds(stats, drafted_before, accepted_before)
            if tokens:
                last = time.perf_counter()
                first = first or last
                job.emit(Event("tokens", tokens, time=last))
                self._ticked()
        result = s.result()
        if self.on_done is not None:
            self.on_done(job, result, first, last)
        job.emit(Event("done", result=result, time=time.perf_counter()))
