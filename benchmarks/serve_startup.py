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
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time


def get(port: int, path: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    if body is None:
        c.request("GET", path)
    else:
        c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    status, data = r.status, json.loads(r.read() or b"{}")
    c.close()
    return status, data


def launch(args: argparse.Namespace, port: int) -> dict:
    cmd = [sys.executable, "-m", "eyas.cli.main", "serve", "--target", args.target, "--port", str(port),
           "--tree", args.tree] + (["--draft", args.draft] if args.draft else []) + args.serve_args
    env = {**os.environ, "EYAS_CACHE": args.cache}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out: dict = {"command": " ".join(cmd)}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"eyas serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                status, health = get(port, "/health")
                if "port_open_s" not in out:
                    out["port_open_s"] = round(time.perf_counter() - t0, 2)
                if status == 200:
                    out["ready_s"] = round(time.perf_counter() - t0, 2)
                    out["startup"] = health.get("startup")
                    break
            except (ConnectionError, OSError):
                pass
            if time.perf_counter() - t0 > args.timeout:
                raise RuntimeError(f"not ready after {args.timeout} s")
            time.sleep(0.2)
        _, model = get(port, "/v1/models")
        name = model["data"][0]["id"]
        status, _ = get(port, "/v1/chat/completions", {"model": name, "max_tokens": 16, "messages": [
            {"role": "user", "content": "Say hello."}]}, timeout=args.timeout)
        out["first_answer_s"] = round(time.perf_counter() - t0, 2)
        out["first_answer_status"] = status
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        out["exit_code"] = proc.returncode
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
