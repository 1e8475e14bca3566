"""``eyas serve`` launched as a user launches it, for the serving benchmarks (``serve_load.py``,
``serve_startup.py``): a separate process, so that the clients of a load test never share its
interpreter lock, and a start-up is timed from the command to the first ready ``/health``.

    with ServerProcess.launch(["--target", "smollm2", "--max-rows", "64"], port=8391) as server:
        server.ready_s, server.health()["startup"]  # ready: /health answered 200
    server.exit_code                                 # stopped with SIGTERM: 0 once drained

The server's stderr goes to a temporary file (a pipe nobody reads would block a chatty server);
its last lines are in the error when it exits early or is not ready within ``timeout``.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


def request(port: int, path: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    """One GET (or a POST of ``body``) to the server on 127.0.0.1: (status, JSON body)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    if body is None:
        c.request("GET", path)
    else:
        c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    status, data = r.status, json.loads(r.read() or b"{}")
    c.close()
    return status, data


@dataclass
class ServerProcess:
    """A running ``eyas serve`` on 127.0.0.1:``port``; a context manager stops it with SIGTERM."""

    proc: subprocess.Popen
    port: int
    command: str
    log_path: str
    port_open_s: float | None = None  # launch -> first answer of any kind (/health "loading")
    ready_s: float | None = None  # launch -> /health 200
    exit_code: int | None = None

    @classmethod
    def launch(cls, serve_args: list[str], port: int, env: dict | None = None, timeout: float = 900.0) -> "ServerProcess":
        cmd = [sys.executable, "-m", "eyas.cli.main", "serve", "--port", str(port), *serve_args]
        log = tempfile.NamedTemporaryFile("w", prefix=f"eyas-serve-{port}-", suffix=".log", delete=False)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        server = cls(proc, port, " ".join(cmd), log.name)
        try:
            server._wait_ready(t0, timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self, t0: float, timeout: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"eyas serve exited {self.proc.returncode}: {self.log_tail()}")
            try:
                status, _ = request(self.port, "/health")
                if self.port_open_s is None:
                    self.port_open_s = round(time.perf_counter() - t0, 2)
                if status == 200:
                    self.ready_s = round(time.perf_counter() - t0, 2)
                    return
            except (ConnectionError, OSError):
                pass
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"eyas serve not ready after {timeout} s: {self.log_tail()}")
            time.sleep(0.2)

    def health(self) -> dict:
        return request(self.port, "/health", timeout=30)[1]

    def model(self) -> str:
        return request(self.port, "/v1/models")[1]["data"][0]["id"]

    def log_tail(self, chars: int = 2000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains), then SIGKILL after ``timeout`` s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        return self.exit_code

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
