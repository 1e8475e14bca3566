"""The decode worker in a process of its own, so that the engine's steps never wait for the HTTP
side's interpreter lock (``eyas serve``'s default; ``--in-process`` keeps both in one process).

Why. In one process the event loop (requests, detokenization, an SSE chunk per stream per step)
and the decode worker share one interpreter lock, and the loop holds it most of the time: around a
stand-in engine whose 256-row step waits 4.4 ms (the H200's), the clients received 41% of the
tokens the steps made, and py-spy found the loop holding the lock in 270 of 546 samples
(``benchmarks/results/2026-12-06-serve-overhead-cpu.md``). vLLM's engine core and SGLang's
scheduler run in their own processes for the same reason. On the H100 it gave 1.1-2.6x the
throughput of one process from 4 clients on (``2026-12-06-serve-load-h100-engine-process.md``).

Shape::

    HTTP process                                      engine process (spawned)
    EngineProcess.submit(job) --("submit", ...)-->    receiver (main thread) -> worker.submit
    job.cancel()              --("cancel", id)-->     that job's cancelled flag
    reader thread <-- [a step's items] --  sender thread <-- Outbox (the worker thread's items,
          |                                                         flushed once a step)
          +--> job.emit (the EventPump), the metrics and watchdog hooks

``eyas serve`` starts the engine process before it imports the HTTP side (this module, jobs.py
and load_args.py import no torch, and ``eyas.serve`` imports its modules lazily), so that the two
processes' imports overlap: on the 2-core CPU, launch to ready took 10.4-10.7 s against
12.9-13.9 s when the process started after them (8.1-10.4 s in one process).
The engine process loads and checks the pair itself (:meth:`~eyas.serve.load_args.LoadArgs.load`),
sends its log lines while it does, then a :class:`~eyas.serve.startup.ServedInfo` (tokenizer,
limits, checks, trees, start-up times) that the HTTP side serves with; a refusal or an error
arrives as the exception and ends the process. A message is a list of tuples (a tag and plain
values), one list a step: tokens go as ``(TOKENS, id, [ids], time)``, not as objects.

Invariants: each job's events arrive in the order the worker made them (one worker thread, one
outbox, one pipe); a job counts as waiting until its first event arrives, then as running until
its ``done``; a cancel reaches the worker before its next step; ``perf_counter`` times cross
processes unchanged (a system-wide monotonic clock); if the engine process dies, every job in
flight ends with an error that names its exit code, and so does every later submit;
:meth:`EngineProcess.stop` lets every job finish, then waits for the process to exit. The parent
going away (the pipe closes) makes the engine process finish its jobs and exit.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import pickle
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from eyas.serve.jobs import Event, Job, QueueFull
from eyas.serve.load_args import LoadArgs

if TYPE_CHECKING:
    from eyas.serve.startup import ServedInfo

# Tags of what the engine process sends (the first field of each item).
TOKENS, DONE, FINISHED, ROUND, ROUNDS, STEP, CANCELLED_EARLY, STATUS, LOG, READY, FAILED, STOPPED = range(12)
STATUS_EVERY_S = 0.25  # how often the policies' state (for /health and /metrics) comes along


@dataclass(frozen=True)
class EngineOptions:
    """What the engine process builds its worker with (:func:`eyas.serve.batching.make_worker`)."""

    max_rows: int | None
    speculation: str
    batch_speculation: str | None = None
    lone_sessions: int = 1


# -- the engine process ---------------------------------------------------------------------------


class Outbox:
    """The worker thread's items, gathered and handed to the sender thread once a step (``flush``,
    the worker's ``on_tick``), with the policies' state every :data:`STATUS_EVERY_S` seconds and
    whenever the worker runs out of work (``idle``, its ``on_idle``: the state /health then shows
    is the final one)."""

    def __init__(self, out: "queue.SimpleQueue[Any]", status: Callable[[bool], tuple]) -> None:
        self.out, self.status = out, status
        self.items: list[tuple] = []
        self.status_at = 0.0

    def add(self, item: tuple) -> None:
        self.items.append(item)

    def flush(self, idle: bool = False) -> None:
        now = time.perf_counter()
        if idle or now - self.status_at >= STATUS_EVERY_S:
            self.status_at = now
            self.items.append(self.status(idle))
        if self.items:
            self.out.put(self.items)
            self.items = []

    def idle(self) -> None:
        self.flush(idle=True)


def _sendable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception that does not pickle
        return RuntimeError(f"{type(e).__name__}: {e}")


def engine_main(conn: Any, load: LoadArgs, options: EngineOptions, make: Callable[..., Any] | None = None,
                spawned_at: float | None = None) -> None:
    """The engine process: load the pair, then serve the HTTP side's submits until it says stop
    (or goes away). ``make``: the worker's factory (default :func:`~eyas.serve.batching.make_worker`;
    a benchmark's stand-in engine passes its own). The start-up's stages gain what happens around
    the loader's own: ``spawn`` (the parent's spawn call, at ``spawned_at``, to this function: a
    fresh interpreter and the unpickling of its arguments), ``imports`` (the loader's time outside
    its stages: torch, transformers and eyas imported) and ``worker`` (the batch built: its caches
    allocated)."""
    entered = time.perf_counter()
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def send_loop() -> None:
        while True:
            items = out.get()
            last = items is None
            batch = [] if last else list(items)
            while not last:  # whatever else is ready goes in the same message
                try:
                    more = out.get_nowait()
                except queue.Empty:
                    break
                last = more is None
                batch += more or []
            if batch:
                conn.send(batch)
            if last:
                return

    sender = threading.Thread(target=send_loop, name="eyas-engine-send", daemon=True)
    sender.start()
    try:
        served = load.load(log=lambda m: out.put([(LOG, m)]))
        stages = served.startup.seconds
        loaded = time.perf_counter()
        stages["imports"] = max(loaded - entered - sum(stages.values()), 0.0)  # the loader's time outside its stages
        if spawned_at is not None:
            stages["spawn"] = entered - spawned_at
        if make is None:
            from eyas.serve.batching import make_worker as make
        jobs: dict[str, Job] = {}
        worker: Any = None

        def status(idle: bool = False) -> tuple:
            policy = worker.policy.to_dict() if worker.policy is not None else None
            report = worker.batch_report() if hasattr(worker, "batch_report") else None
            return (STATUS, policy, report, idle)

        outbox = Outbox(out, status)

        def finished(job: Job, result: Any, first: float | None, last: float | None) -> None:
            outbox.add((FINISHED, job.id, result, first, last, job.started))

        # The HTTP side bounds the queue; here nothing is refused.
        worker = make(served, options.max_rows, max_queue=1 << 30, speculation=options.speculation,
                      batch_speculation=options.batch_speculation, lone_sessions=options.lone_sessions,
                      on_round=lambda *a: outbox.add((ROUND, *a)), on_rounds=lambda *a: outbox.add((ROUNDS, *a)),
                      on_done=finished, on_step=lambda *a: outbox.add((STEP, *a)))
        stages["worker"] = time.perf_counter() - loaded
        worker.on_cancelled_early = lambda job: outbox.add((CANCELLED_EARLY, job.id))
        worker.on_tick, worker.on_idle = outbox.flush, outbox.idle
        out.put([(READY, served.info(), worker.max_rows), status()])
    except BaseException as e:  # noqa: BLE001 - the HTTP side raises it
        out.put([(FAILED, _sendable(e))])
        out.put(None)
        sender.join()
        return

    def emit_for(job_id: str) -> Callable[[Event], None]:
        def emit(ev: Event) -> None:  # on the worker thread
            if ev.kind == "tokens":
                outbox.add((TOKENS, job_id, ev.tokens, ev.time))
            else:
                jobs.pop(job_id, None)
                outbox.add((DONE, job_id, ev.result, ev.error, ev.time))
        return emit

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the HTTP side went away: finish what was submitted, then exit
            msg = ("stop",)
        if msg[0] == "submit":
            _, job_id, prompt, sampling, n, stop, seed, enqueued = msg
            job = Job(prompt, sampling, n, stop, seed, emit_for(job_id), id=job_id, enqueued=enqueued)
            jobs[job_id] = job
            worker.submit(job)
        elif msg[0] == "cancel":
            job = jobs.get(msg[1])
            if job is not None:
                job.cancel()
        elif msg[0] == "stop":
            worker.stop()
            break
    outbox.items.append(status(True))
    out.put(outbox.items + [(STOPPED,)])
    out.put(None)
    sender.join()


# -- the HTTP side --------------------------------------------------------------------------------


class EngineGone(RuntimeError):
    pass


class Reported:
    """A policy as the engine process last reported it (``to_dict`` is all /health and /metrics use)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def to_dict(self) -> dict[str, Any]:
        return self.state


class EngineProcess:
    """The engine process seen from the HTTP side: a worker as :class:`~eyas.serve.app.ServeState`
    uses one (``submit``, ``stop``, ``waiting``, ``running_count``, ``max_rows``, ``policy``,
    ``batch_report`` and the ``on_*`` hooks, called on its reader thread).

    ``EngineProcess(load, options, log=print).wait_ready()`` spawns the process and returns the
    :class:`ServedInfo` once the pair is loaded and warmed (raising the engine process's
    :class:`~eyas.serve.startup.RefusedError` or error)."""

    def __init__(self, load: LoadArgs, options: EngineOptions, *, max_queue: int = 256,
                 log: Callable[[str], None] = lambda m: None, make: Callable[..., Any] | None = None) -> None:
        self.max_queue, self.log = max_queue, log
        self.on_round: Callable[..., None] | None = None
        self.on_rounds: Callable[..., None] | None = None
        self.on_done: Callable[..., None] | None = None
        self.on_step: Callable[..., None] | None = None
        self.on_cancelled_early: Callable[[Job], None] | None = None
        self.max_rows = 0
        self.policy: Reported | None = None
        self._report: dict[str, Any] | None = None
        self.settled = threading.Event()  # the engine went idle with every job done, and reported its state
        self.jobs: dict[str, Job] = {}  # submitted, not done
        self._fresh: set[str] = set()  # submitted, no event yet: waiting
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._gone: str | None = None  # why submits fail: the engine process exited
        ctx = mp.get_context("spawn")  # a fork would copy the HTTP side's threads (and CUDA cannot fork)
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=engine_main, args=(child, load, options, make, time.perf_counter()),
                                   name="eyas-engine")
        self.process.start()
        child.close()
        # Runs before multiprocessing's own exit handler (registered earlier, run later), which
        # joins every child: a server that ends before its engine process was stopped (a port in
        # use, SIGTERM while loading) would otherwise wait forever on a process waiting for it.
        atexit.register(self._reap)
        self._reader = threading.Thread(target=self._read, name="eyas-engine-read", daemon=True)

    # -- start-up -----------------------------------------------------------------------------------

    def wait_ready(self) -> "ServedInfo":
        while True:
            try:
                items = self._conn.recv()
            except (EOFError, OSError):
                self.process.join(5)
                raise EngineGone(f"the engine process exited with code {self.process.exitcode} while loading "
                                 "the pair (its error is above)") from None
            for item in items:
                if item[0] == LOG:
                    self.log(item[1])
                elif item[0] == FAILED:
                    self.process.join(30)
                    raise item[1]
                elif item[0] == STATUS:
                    self._status(item)
                elif item[0] == READY:
                    info, self.max_rows = item[1], item[2]
            if self.max_rows:
                self._reader.start()
                return info

    # -- the worker's interface -----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._fresh)

    @property
    def running_count(self) -> int:
        return len(self.jobs) - len(self._fresh)

    def batch_report(self) -> dict[str, Any] | None:
        return self._report

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._gone is None and len(self._fresh) >= self.max_queue:
                raise QueueFull(f"{len(self._fresh)} requests are waiting (the queue holds {self.max_queue})")
            job.id = job.id or f"req-{next(self._ids)}"
            self.jobs[job.id] = job
            self._fresh.add(job.id)
            self.settled.clear()
        job.on_cancel = lambda: self._send(("cancel", job.id))
        self._send(("submit", job.id, job.prompt, job.sampling, job.max_new_tokens, job.stop, job.seed, job.enqueued))
        if self._gone is not None:
            self._end(job.id, Event("done", error=self._gone, time=time.perf_counter()))
        return job

    def stop(self, timeout: float | None = None) -> None:
        """Every submitted job finishes, then the engine process exits."""
        self._send(("stop",))
        self._reader.join(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)

    def _reap(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()

    # -- the reader thread ------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError):  # the engine process is gone: _read ends the jobs
            pass

    def _read(self) -> None:
        while True:
            try:
                items = self._conn.recv()
            except (EOFError, OSError):
                self._ended()
                return
            for item in items:
                if item[0] == STOPPED:
                    return
                self._dispatch(item)

    def _dispatch(self, item: tuple) -> None:
        tag = item[0]
        if tag == TOKENS:
            _, job_id, tokens, t = item
            self._fresh.discard(job_id)
            job = self.jobs.get(job_id)
            if job is not None:
                job.emit(Event("tokens", tokens, time=t))
        elif tag == DONE:
            _, job_id, result, error, t = item
            self._end(job_id, Event("done", result=result, error=error, time=t))
        elif tag == FINISHED:
            _, job_id, result, first, last, started = item
            job = self.jobs.get(job_id)
            if job is not None:
                job.started = started
                if self.on_done is not None:
                    self.on_done(job, result, first, last)
        elif tag == ROUND and self.on_round is not None:
            self.on_round(*item[1:])
        elif tag == ROUNDS and self.on_rounds is not None:
            self.on_rounds(*item[1:])
        elif tag == STEP and self.on_step is not None:
            self.on_step(*item[1:])
        elif tag == CANCELLED_EARLY:
            job = self.jobs.get(item[1])
            if job is not None and self.on_cancelled_early is not None:
                self.on_cancelled_early(job)
        elif tag == STATUS:
            self._status(item)

    def _status(self, item: tuple) -> None:
        _, policy, report, idle = item
        self.policy = Reported(policy) if policy is not None else None
        self._report = report
        with self._lock:
            if idle and not self.jobs:  # nothing submitted since: the state is final until the next job
                self.settled.set()

    def _end(self, job_id: str, event: Event) -> None:
        with self._lock:
            job = self.jobs.pop(job_id, None)
            self._fresh.discard(job_id)
        if job is not None:
            job.emit(event)

    def _ended(self) -> None:
        """The engine process died: every job in flight ends with an error, and so will later ones."""
        self.process.join(5)
        self._gone = (f"the engine process exited with code {self.process.exitcode}; the server cannot decode: "
                      "restart eyas serve (its log says why the engine process ended)")
        now = time.perf_counter()
        for job_id in list(self.jobs):
            self._end(job_id, Event("done", error=self._gone, time=now))
