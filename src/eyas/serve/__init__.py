"""``eyas serve``: an OpenAI-compatible server for a target and its EAGLE-3 drafter, which refuses a
mismatched pair at start-up and watches the served acceptance against the training prediction.

    from eyas.serve import load_served, ServerThread
    served = load_served("smollm2", "default")          # checks; RefusedError on a mismatch
    with ServerThread(served) as t:                     # 127.0.0.1, a free port
        ...  # openai.OpenAI(base_url=t.url + "/v1", api_key="-")

Modules: startup.py (load, the doctor's static stage and the contract, the refusal), worker.py (the
FIFO decode worker and why one request decodes at a time), protocol.py (request bodies, 4xx errors,
streamed text), app.py (the FastAPI routes), metrics.py (/metrics), watchdog.py (the sliding-window
acceptance check), server.py (uvicorn, graceful shutdown, a server thread).
"""

from eyas.serve.app import ServeOptions, ServeState, build_app
from eyas.serve.server import GracefulServer, ServerThread, free_port, make_loading_server, make_server, serve_forever
from eyas.serve.startup import Preflight, Problem, RefusedError, Served, check_pair, load_served

__all__ = [
    "GracefulServer", "Preflight", "Problem", "RefusedError", "ServeOptions", "ServeState", "Served", "ServerThread",
    "build_app", "check_pair", "free_port", "load_served", "make_loading_server", "make_server", "serve_forever",
]
