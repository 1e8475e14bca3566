"""The HTTP side of ``eyas serve``: a FastAPI app over the decode worker.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events ending "data: [DONE]")
    GET  /v1/models             GET  /health           GET  /metrics

A handler validates the body (:mod:`eyas.serve.protocol`), renders and tokenises the prompt, checks
it against the context, enqueues a :class:`~eyas.serve.worker.Job` and relays the worker's events:
as SSE chunks (text released by :class:`~eyas.serve.protocol.TextStream`), or as one response once
the job is done. The worker's events cross from its thread to the event loop through an
:class:`~eyas.serve.pump.EventPump` (one wake-up of the loop per batch of events) into the request's
own asyncio queue; a stream sends the tokens queued by then as one chunk (one chunk a token while the
loop keeps up, fewer and larger ones when it falls behind). When the client goes away (the
stream's task is cancelled, or a non-streaming client is seen disconnected) the job is cancelled:
skipped if still queued, stopped between two rounds if decoding.

Responses carry ``usage`` and, in the extra field ``eyas``, the request's speculative statistics:
accept length (tau), rounds, acceptance per depth, stop reason, and the queue wait.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from eyas.data.render import render_prompt
from eyas.engine import SamplingParams
from eyas.engine.speculative import STOP_CANCELLED
from eyas.engine.stats import STOP_EOS, STOP_STRING
from eyas.serve.metrics import ServeMetrics
from eyas.serve.protocol import APIError, ChatRequest, CompletionRequest, TextStream, parse
from eyas.serve.pump import EventPump
from eyas.serve.startup import Served, ServedInfo
from eyas.serve.watchdog import Watchdog
from eyas.serve.batching import make_worker
from eyas.serve.worker import Event, Job, QueueFull

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
DISCONNECT_POLL_S = 0.25


@dataclass
class ServeOptions:
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_queue: int = 256
    default_max_tokens: int = 256
    watch_window: int = 512
    watch_min_rounds: int = 64
    max_rows: int | None = None  # the running batch's rows (None: 64 on a GPU, 8 on a CPU; 1: one request at a time)
    retry_after_s: int = 1  # what a 503 for a full queue tells the client to wait
    speculation: str = "auto"  # a request alone: auto (the faster path, measured), on (speculates), off (never)
    batch_speculation: str | None = None  # several rows: auto (measured per batch size), on, off (None: batch_mode's)
    lone_sessions: int = 1  # requests that may decode alone side by side, each on a lane (eyas.serve.lanes)


class ServeState:
    """What the app shares across requests: the served pair, the worker, the metrics, the watchdog.

    ``served``: a pair loaded in this process (its worker decodes on a thread of this process), or
    the :class:`ServedInfo` of an engine process's pair with ``worker`` that process
    (:class:`~eyas.serve.engine_process.EngineProcess`), whose hooks this state sets."""

    def __init__(self, served: Served | ServedInfo, options: ServeOptions, worker: Any = None) -> None:
        info = served.info() if isinstance(served, Served) else served
        self.served, self.options = info, options
        pf = info.preflight
        depth = max(info.tree.greedy.depth, info.tree.sampled.depth)
        self.metrics = ServeMetrics(depth, info.prediction, pf.forced, len(pf.failures))
        self.watchdog = Watchdog(info.prediction, target=info.target_name, draft=str(info.draft_path),
                                 window=options.watch_window, min_rounds=options.watch_min_rounds,
                                 on_verdict=self.metrics.verdict)
        if worker is None:
            if not isinstance(served, Served):
                raise TypeError("ServeState: a ServedInfo comes with the engine process that serves it (worker=...)")
            worker = make_worker(served, options.max_rows, max_queue=options.max_queue, speculation=options.speculation,
                                 batch_speculation=options.batch_speculation, lone_sessions=options.lone_sessions)
        worker.on_round, worker.on_rounds = self._round, self.metrics.rounds
        worker.on_done, worker.on_step = self._done, self.metrics.step
        self.worker = worker
        self.worker.on_cancelled_early = lambda job: self.metrics.cancelled.inc()
        self.draining = False
        self.created = int(time.time())
        self.pump: EventPump | None = None  # bound to the serving loop at its first request

    def pump_for(self, loop: asyncio.AbstractEventLoop) -> EventPump:
        if self.pump is None or self.pump.loop is not loop:
            self.pump = EventPump(loop)
        return self.pump

    def _round(self, depth: int, accepted: int, emitted: int, tree: bool = True) -> None:
        self.metrics.round(depth, accepted, emitted)
        if tree:  # the prediction is the tree's: a batched chain round accepts less at each depth
            self.watchdog.round(depth, accepted)

    def _done(self, job: Job, result: Any, first: float | None, last: float | None) -> None:
        n = len(result.tokens)
        ttft = first - job.enqueued if first is not None else None
        tpot = (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None
        self.metrics.finished(result.stats.prompt_tokens, n, ttft, tpot)
        if result.stats.stop_reason == STOP_CANCELLED:
            self.metrics.cancelled.inc()
        self.watchdog.check()

    def begin_drain(self) -> None:
        """Refuse new requests (503) from now on; the queued and decoding ones finish."""
        self.draining = True
        self.metrics.draining.set(1)

    def shutdown(self, timeout: float | None = None) -> None:
        self.begin_drain()
        self.worker.stop(timeout)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _finish_reason(stop_reason: str | None) -> str:
    return "stop" if stop_reason in (STOP_EOS, STOP_STRING) else "length"


def spec_stats(result: Any, job: Job) -> dict[str, Any]:
    st = result.stats
    return {"accept_length": round(st.tau, 4), "rounds": st.rounds, "speculative_rounds": len(st.accept_lengths),
            "acceptance_per_depth": [round(a, 4) for a in st.acceptance_at_depth],
            "accepted_at_depth": list(st.accepted_at_depth), "drafted_at_depth": list(st.drafted_at_depth),
            "stop_reason": st.stop_reason,
            "queue_s": round((job.started or job.enqueued) - job.enqueued, 4)}


class Guard:
    """Pure ASGI middleware (it never buffers a streamed response): a POST while draining gets 503, a
    POST whose Content-Length is over the limit gets 413 before its body is read, and every answer
    is counted in ``eyas_requests_total`` by path (the served routes, else "other") and status."""

    def __init__(self, app: Any, state: ServeState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        path = scope["path"] if scope["path"] in ROUTES else "other"  # bounded label values

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                state.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        refusal = None
        if scope["method"] == "POST":
            length = dict(scope["headers"]).get(b"content-length", b"")
            if state.draining:
                refusal = APIError(503, "shutting_down", "the server is shutting down: no new requests are accepted")
            elif length.isdigit() and int(length) > state.options.max_body_bytes:
                refusal = APIError(413, "body_too_large", f"the request body has {int(length)} bytes, more than the "
                                   f"{state.options.max_body_bytes} this server accepts")
        if refusal is not None:
            await _error(refusal)(scope, receive, counted)
        else:
            await self.app(scope, receive, counted)


async def sse(events: AsyncIterator[dict[str, str]]) -> AsyncIterator[bytes]:
    """Server-sent events framing: ``data: <payload>`` and a blank line per event.

    Written here rather than taken from sse-starlette: that package patches uvicorn's exit handler
    process-wide and ends every open stream when a server shuts down, which would cut the in-flight
    requests a graceful shutdown lets finish (and, in one process, every later server's streams).
    Starlette's StreamingResponse cancels the generator when the client disconnects, which is what
    frees the work."""
    async for event in events:
        yield f"data: {event['data']}\n\n".encode()


def build_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="eyas serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.eyas = state
    app.add_middleware(Guard, state=state)
    sv = state.served

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > state.options.max_body_bytes:  # a chunked body without a content-length
            raise APIError(413, "body_too_large", f"the request body has {len(raw)} bytes, more than the "
                           f"{state.options.max_body_bytes} this server accepts")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, "invalid_json", f"the request body is not JSON: {e}") from None

    def check_model(name: str) -> None:
        if name != sv.model_name:
            raise APIError(404, "model_not_found", f"model: this server serves {sv.model_name!r}, found {name!r}",
                           "model")

    def make_job(req: Any, prompt: list[int], max_tokens: int | None, emit: Any) -> Job:
        room = sv.max_length - len(prompt)
        if room < 1:
            raise APIError(400, "context_length_exceeded", f"the prompt has {len(prompt)} tokens; the context holds "
                           f"{sv.max_length}: no room for an answer", "messages")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, "context_length_exceeded", f"max_tokens: {max_tokens} new tokens after a prompt of "
                           f"{len(prompt)} tokens exceed the context of {sv.max_length} tokens (at most {room})",
                           "max_tokens")
        n = max_tokens if max_tokens is not None else min(state.options.default_max_tokens, room)
        try:
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p)
        except ValueError as e:
            raise APIError(400, "invalid_value", str(e)) from None
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        return Job(prompt, sampling, n, req.stops(), seed, emit)

    async def run(request: Request, req: Any, prompt: list[int], max_tokens: int | None, kind: str) -> Response:
        events: asyncio.Queue[Event] = asyncio.Queue()
        job = make_job(req, prompt, max_tokens, state.pump_for(asyncio.get_running_loop()).sender(events))
        try:
            state.worker.submit(job)
        except QueueFull as e:
            raise APIError(503, "queue_full", f"the server is busy: {e}; retry after {state.options.retry_after_s} s",
                           headers={"retry-after": str(state.options.retry_after_s)}) from None
        state.metrics.waiting.set(state.worker.waiting)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            return StreamingResponse(sse(stream(job, events, req, rid, created, kind, len(prompt))),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        return await whole(request, job, events, req, rid, created, kind, len(prompt))

    async def whole(request: Request, job: Job, events: asyncio.Queue[Event], req: Any, rid: str, created: int,
                    kind: str, n_prompt: int) -> Response:
        text = TextStream(sv.tokenizer, req.stops())
        checked = time.perf_counter()
        while True:
            try:
                ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                ev = None
            if time.perf_counter() - checked >= DISCONNECT_POLL_S:  # tokens or not, look at the client
                checked = time.perf_counter()
                if await request.is_disconnected():
                    job.cancel()
                    return Response(status_code=499)
            if ev is None:
                continue
            if ev.kind == "tokens":
                text.ids += ev.tokens
                continue
            if ev.error is not None:
                raise APIError(500, "engine_error", ev.error)
            result = ev.result
            content = text.final_text()
            usage = {"prompt_tokens": n_prompt, "completion_tokens": len(result.tokens),
                     "total_tokens": n_prompt + len(result.tokens)}
            reason = _finish_reason(result.stats.stop_reason)
            if kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason,
                          "logprobs": None}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": content, "finish_reason": reason, "logprobs": None}
                obj = "text_completion"
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": sv.model_name,
                                 "choices": [choice], "usage": usage, "eyas": spec_stats(result, job)})

    async def stream(job: Job, events: asyncio.Queue[Event], req: Any, rid: str, created: int, kind: str,
                     n_prompt: int) -> AsyncIterator[dict[str, str]]:
        text = TextStream(sv.tokenizer, req.stops())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(piece: str | None, reason: str | None = None, first: bool = False, **extra: Any) -> dict[str, str]:
            if kind == "chat":
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if piece:
                    delta["content"] = piece
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": None}
            return {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": sv.model_name,
                                        "choices": [choice], **extra})}

        finished = False
        try:
            if kind == "chat":
                yield chunk(None, first=True)
            held: Event | None = None
            while True:
                ev, held = held or await events.get(), None
                if ev.kind == "tokens":
                    ids = list(ev.tokens)
                    while not events.empty():  # what came in meanwhile goes in the same chunk
                        more = events.get_nowait()
                        if more.kind != "tokens":
                            held = more
                            break
                        ids += more.tokens
                    piece = text.push(ids)
                    if piece:
                        yield chunk(piece)
                    continue
                finished = True
                if ev.error is not None:
                    yield {"data": json.dumps(APIError(500, "engine_error", ev.error).body())}
                    yield {"data": "[DONE]"}
                    return
                result = ev.result
                rest = text.finish()
                usage = {"prompt_tokens": n_prompt, "completion_tokens": len(result.tokens),
                         "total_tokens": n_prompt + len(result.tokens)}
                yield chunk(rest or None, _finish_reason(result.stats.stop_reason), eyas=spec_stats(result, job))
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": sv.model_name,
                                               "choices": [], "usage": usage})}
                yield {"data": "[DONE]"}
                return
        finally:
            if not finished:  # the client went away mid-stream: free the work
                job.cancel()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req: ChatRequest = parse(ChatRequest, await body_of(request))
        check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = render_prompt(messages, sv.tokenizer).tolist()
        except Exception as e:  # noqa: BLE001 - a template that refuses the conversation
            raise APIError(400, "invalid_value", f"messages: the chat template cannot render them: {e}",
                           "messages") from None
        return await run(request, req, prompt, req.max_completion_tokens or req.max_tokens, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await body_of(request))
        check_model(req.model)
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], int):
            vocab = sv.vocab_size
            if any(t < 0 or t >= vocab for t in p):  # type: ignore[operator]
                raise APIError(400, "invalid_value", f"prompt: token ids must be in 0..{vocab - 1}", "prompt")
            prompt = list(p)  # type: ignore[arg-type]
        else:
            prompt = sv.tokenizer.encode(p if isinstance(p, str) else p[0])
        if not prompt:
            raise APIError(400, "empty_messages", "prompt: it encodes to no tokens", "prompt")
        return await run(request, req, prompt, req.max_tokens, "completion")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": sv.model_name, "object": "model", "created": state.created,
                                            "owned_by": "eyas", "max_model_len": sv.max_length}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        pf = sv.preflight
        v = state.watchdog.verdict
        status = "draining" if state.draining else "degraded" if (pf.forced or v.alert) else "ok"
        body = {"status": status, "model": sv.model_name, "target": sv.target_name, "draft": str(sv.draft_path),
                "forced": pf.forced, "preflight": pf.to_dict(), "watchdog": v.to_dict(),
                "queue": {"running": state.worker.running_count, "waiting": state.worker.waiting,
                          "max_rows": state.worker.max_rows},
                "speculation": None if state.worker.policy is None else state.worker.policy.to_dict(),
                "batch_speculation": (state.worker.batch_report()
                                      if hasattr(state.worker, "batch_report") else None),
                "tree": sv.tree.to_dict(), "startup": sv.startup.to_dict()}
        if pf.forced:
            body["warning"] = (f"started with --force past {len(pf.failures)} failed check(s): "
                               + "; ".join(p.code for p in pf.failures))
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.running.set(state.worker.running_count)
        if state.worker.policy is not None:
            state.metrics.rates(state.worker.policy.to_dict()["tokens_per_s"])
        state.metrics.waiting.set(state.worker.waiting)
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app
