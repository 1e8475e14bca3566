"""``eyas serve``: an OpenAI-compatible server for a target and its EAGLE-3 drafter, which refuses a
mismatched pair at start-up and watches the served acceptance against the training prediction.

    from eyas.serve import load_served, ServerThread
    served = load_served("smollm2", "default")          # checks; RefusedError on a mismatch
    with ServerThread(served) as t:                     # 127.0.0.1, a free port
        ...  # openai.OpenAI(base_url=t.url + "/v1", api_key="-")

Modules: startup.py (load, the doctor's static stage and the contract, the refusal), load_args.py
(its options, picklable), jobs.py (a request's job and events), worker.py (the FIFO decode worker),
batching.py (continuous batching), policy.py (when to speculate), engine_process.py (the worker in
a process of its own), protocol.py (request bodies, 4xx errors, streamed text), app.py (the FastAPI
routes), pump.py (events into the event loop), metrics.py (/metrics), watchdog.py (the
sliding-window acceptance check), server.py (uvicorn, graceful shutdown, a server thread).
"""

import importlib
from typing import Any

# Names -> their module, imported at first use (PEP 562): `import eyas.serve.engine_process` or
# `eyas.serve.jobs` must not pull in torch, so that eyas serve starts its engine process first.
_EXPORTS = {
    "ServeOptions": "app", "ServeState": "app", "build_app": "app",
    "GracefulServer": "server", "ServerThread": "server", "free_port": "server", "make_loading_server": "server",
    "make_server": "server", "serve_forever": "server",
    "Preflight": "startup", "Problem": "startup", "RefusedError": "startup", "Served": "startup",
    "check_pair": "startup", "load_served": "startup",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'eyas.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"eyas.serve.{_EXPORTS[name]}"), name)
