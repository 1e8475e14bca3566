"""``eyas serve``'s start-up as a user sees it: the wall time from launching the command to the first
``/health`` that is no longer "loading", then to the first answered request, for ``--starts``
launches one after another on the same cache directory. The first launch of a fresh ``--cache``
is the cold start (the GGUF dequantised, every step compiled); the next ones are warm (inductor's and
Triton's caches in eyas' cache directory, ``serve/startup.py``).

    python benchmarks/serve_startup.py --target /tmp/smol.gguf --draft DIR --cache /tmp/eyas-cold --fresh --json

Each launch also reports the server's own account (``/health`` ``startup``: seconds per stage and
whether the compile cache was warm). The server is stopped with SIGTERM after each launch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_process.py beside it, however it is loaded
from serve_process import ServerProcess, request  # noqa: E402


def launch(args: argparse.Namespace, port: int) -> dict:
    serve_args = ["--target", args.target, "--tree", args.tree] + (["--draft", args.draft] if args.draft else []) \
        + args.serve_args
    t0 = time.perf_counter()
    with ServerProcess.launch(serve_args, port, env={"EYAS_CACHE": args.cache}, timeout=args.timeout) as server:
        out: dict = {"command": server.command, "port_open_s": server.port_open_s, "ready_s": server.ready_s,
                     "startup": server.health().get("startup")}
        status, _ = request(port, "/v1/chat/completions", {"model": server.model(), "max_tokens": 16, "messages": [
            {"role": "user", "content": "Say hello."}]}, timeout=args.timeout)
        out["first_answer_s"] = round(time.perf_counter() - t0, 2)
        out["first_answer_status"] = status
    out["exit_code"] = server.exit_code
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--tree", default="4,8,15")
    ap.add_argument("--cache", required=True, help="EYAS_CACHE for every launch")
    ap.add_argument("--fresh", action="store_true", help="empty --cache first: the first launch is a cold start")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("serve_args", nargs="*", help="more `eyas serve` options (after --)")
    a = ap.parse_args(argv)
    if a.fresh:
        shutil.rmtree(a.cache, ignore_errors=True)
    runs = []
    for i in range(a.starts):
        r = launch(a, a.port)
        r["start"] = i + 1
        runs.append(r)
        print(f"start {i + 1}: ready in {r['ready_s']} s, first answer at {r['first_answer_s']} s "
              f"(server: {r.get('startup')})", file=sys.stderr)
    report = {"target": a.target, "draft": a.draft, "tree": a.tree, "cache": a.cache, "fresh": a.fresh, "runs": runs}
    if a.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
