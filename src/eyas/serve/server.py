"""Running the app under uvicorn, with a graceful shutdown.

On SIGINT/SIGTERM (:meth:`GracefulServer.handle_exit`) the app starts draining first: every new
POST gets 503 ``shutting_down`` (on a connection that is still open; uvicorn closes the listening
socket, so a new connection is refused), ``/health`` answers 503 "draining", and the requests
already queued or decoding finish (uvicorn waits for their connections, up to
``graceful_timeout`` seconds). The decode worker is stopped after the last one.

:class:`ServerThread` runs the same server in a thread of this process (tests, the load script).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from eyas.serve.app import ServeOptions, ServeState, build_app
from eyas.serve.startup import Served


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.eyas_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.eyas_state.begin_drain()
        super().handle_exit(sig, frame)


def make_server(served: Served, host: str = "127.0.0.1", port: int = 8000, options: ServeOptions | None = None,
                graceful_timeout: float = 60.0, log_level: str = "info") -> GracefulServer:
    state = ServeState(served, options or ServeOptions())
    app = build_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout,
                            lifespan="off")
    return GracefulServer(config, state)


def serve_forever(server: GracefulServer) -> None:
    try:
        server.run()
    finally:
        server.eyas_state.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerThread:
    """The server in a background thread on 127.0.0.1 and a free port: ``with ServerThread(served) as t: t.url``."""

    def __init__(self, served: Served, options: ServeOptions | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.server = make_server(served, "127.0.0.1", self.port, options, graceful_timeout=30, log_level="warning")
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not the main thread
        self.thread = threading.Thread(target=serve_forever, args=(self.server,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> ServeState:
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
