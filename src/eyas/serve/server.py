"""Running the app under uvicorn, with a graceful shutdown, and answering while the model loads.

``eyas serve`` opens its port first (:func:`make_loading_server`): until the pair is loaded, checked
and warmed, every route answers 503, ``/health`` with ``{"status": "loading", "step": ...}`` and
the rest with the error code ``loading`` and a Retry-After, so a load balancer or an orchestrator
sees the server coming up instead of a refused connection. :meth:`GracefulServer.ready` then swaps
the app in. A pair that the start-up checks refuse closes the port again (exit code 1).

On SIGINT/SIGTERM (:meth:`GracefulServer.handle_exit`) the app starts draining first: every new
POST gets 503 ``shutting_down`` (on a connection that is still open; uvicorn closes the listening
socket, so a new connection is refused), ``/health`` answers 503 "draining", and the requests
already queued or decoding finish (uvicorn waits for their connections, up to
``graceful_timeout`` seconds). The decode worker is stopped after the last one.

:func:`engine_state` starts the decode worker in an engine process of its own
(:mod:`eyas.serve.engine_process`, ``eyas serve``'s default). :class:`ServerThread` runs the same
server in a thread of this process (tests, the load script), with the worker in this process or
in an engine process.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

import uvicorn
from fastapi.responses import JSONResponse

from eyas.serve.app import ServeOptions, ServeState, build_app
from eyas.serve.engine_process import EngineOptions, EngineProcess
from eyas.serve.protocol import APIError
from eyas.serve.load_args import LoadArgs
from eyas.serve.startup import Served

LOADING_RETRY_S = 5


class Loading:
    """The ASGI app while the model loads (module docstring); ``step`` says what start-up does now."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.step = "starting"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            body = {"status": "loading", "step": self.step, "loading_s": round(time.perf_counter() - self.started, 1)}
        else:
            body = APIError(503, "loading", f"the model is loading ({self.step}); retry in {LOADING_RETRY_S} s").body()
        await JSONResponse(body, status_code=503, headers={"retry-after": str(LOADING_RETRY_S)})(scope, receive, send)


class Switch:
    """ASGI: forwards every request to ``app``, which :meth:`GracefulServer.ready` replaces."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


class GracefulServer(uvicorn.Server):
    """uvicorn with eyas' drain on SIGINT/SIGTERM; ``eyas_state`` is None while the model loads."""

    def __init__(self, config: uvicorn.Config, state: ServeState | None, switch: Switch | None = None) -> None:
        super().__init__(config)
        self.eyas_state = state
        self.switch = switch

    def ready(self, state: ServeState) -> None:
        """The pair is loaded: serve it (from a loading server, :func:`make_loading_server`)."""
        assert self.switch is not None, "ready() is for a server made by make_loading_server"
        self.eyas_state = state
        self.switch.app = build_app(state)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.eyas_state is not None:
            self.eyas_state.begin_drain()
        super().handle_exit(sig, frame)


def engine_state(load: LoadArgs | EngineProcess, options: ServeOptions, log: Callable[[str], None] | None = None,
                 make: Callable[..., Any] | None = None) -> ServeState:
    """The pair loaded, checked and warmed in an engine process of its own (``load``: its options,
    or the engine process already started), and the state that serves it; raises the engine
    process's :class:`~eyas.serve.startup.RefusedError` or error, the process ended. ``make``: the
    engine process's worker factory (a benchmark's stand-in engine)."""
    engine = load if isinstance(load, EngineProcess) else EngineProcess(
        load, EngineOptions(options.max_rows, options.speculation, options.batch_speculation, options.lone_sessions),
        max_queue=options.max_queue, make=make)
    if log is not None:
        engine.log = log
    try:
        info = engine.wait_ready()
    except BaseException:
        if engine.process.is_alive():
            engine.process.terminate()
        raise
    return ServeState(info, options, engine)


def make_server(served: Served | ServeState, host: str = "127.0.0.1", port: int = 8000,
                options: ServeOptions | None = None, graceful_timeout: float = 60.0,
                log_level: str = "info") -> GracefulServer:
    state = served if isinstance(served, ServeState) else ServeState(served, options or ServeOptions())
    app = build_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout,
                            lifespan="off")
    return GracefulServer(config, state)


def make_loading_server(host: str = "127.0.0.1", port: int = 8000, graceful_timeout: float = 60.0,
                        log_level: str = "info") -> tuple[GracefulServer, Loading]:
    """A server that answers "loading" (module docstring) until :meth:`GracefulServer.ready`."""
    loading = Loading()
    switch = Switch(loading)
    config = uvicorn.Config(switch, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout,
                            lifespan="off")
    return GracefulServer(config, None, switch), loading


def serve_forever(server: GracefulServer) -> None:
    try:
        server.run()
    finally:
        if server.eyas_state is not None:
            server.eyas_state.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerThread:
    """The server in a background thread on 127.0.0.1 and a free port: ``with ServerThread(served) as t: t.url``.

    ``served``: a loaded pair (its worker decodes on a thread of this process), or the
    :class:`LoadArgs` an engine process loads it with (:func:`engine_state`). ``make``: the worker's
    factory, as :func:`~eyas.serve.batching.make_worker` is called (a benchmark's stand-in engine)."""

    def __init__(self, served: Served | LoadArgs, options: ServeOptions | None = None, port: int | None = None,
                 make: Callable[..., Any] | None = None) -> None:
        self.port = port or free_port()
        options = options or ServeOptions()
        if isinstance(served, LoadArgs):
            state = engine_state(served, options, make=make)
        else:
            worker = None if make is None else make(served, options.max_rows, max_queue=options.max_queue,
                                                    speculation=options.speculation,
                                                    batch_speculation=options.batch_speculation)
            state = ServeState(served, options, worker)
        self.server = make_server(state, "127.0.0.1", self.port, options, graceful_timeout=30, log_level="warning")
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not the main thread
        self.thread = threading.Thread(target=serve_forever, args=(self.server,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> ServeState:
        assert self.server.eyas_state is not None
        return self.server.eyas_state

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.perf_counter()
        while not self.server.started:
            if not self.thread.is_alive() or time.perf_counter() - t0 > timeout:
                raise RuntimeError("eyas serve: the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.handle_exit(2, None)
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
