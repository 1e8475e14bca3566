"""A bounded load test of ``eyas serve`` on 127.0.0.1: for 1, 4 and 16 concurrent clients, output
throughput and p50/p99 time to first token (TTFT) and time per output token (TPOT).

    python benchmarks/serve_load.py --target smollm2                  # starts its own server in-process
    python benchmarks/serve_load.py --url http://127.0.0.1:8000      # a server already running here
    python benchmarks/serve_load.py --target smollm2 --clients 1,4,16 --requests 2 --max-tokens 32 --json

Each client sends ``--requests`` streaming chat requests one after another (greedy, ``--max-tokens``
new tokens, prompts: the first turns of the MT-bench set shipped with eyas, in turn), and records per
request: TTFT = first content chunk - request sent (queue wait included), TPOT = (last chunk - first
chunk) / (completion tokens - 1), the completion tokens from the usage chunk. Throughput = all
completion tokens of a level / the level's wall time. It is bounded on purpose: at most 64 clients,
16 requests each and 512 new tokens, and only a server on 127.0.0.1 (it refuses any other host).
eyas serve decodes one request at a time (FIFO), so TTFT grows with the clients ahead in the queue
while throughput stays that of one stream: the table shows it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlparse

MAX_CLIENTS, MAX_REQUESTS, MAX_TOKENS = 64, 16, 512


@dataclass
class Sample:
    ttft: float
    tpot: float | None
    tokens: int
    wall: float


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def one_request(host: str, port: int, model: str, prompt: str, max_tokens: int, timeout: float) -> Sample:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    tokens = 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for c in chunk.get("choices", []):
            if c.get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
    conn.close()
    end = time.perf_counter()
    first = first or end
    last = last or end
    return Sample(first - t0, (last - first) / (tokens - 1) if tokens > 1 else None, tokens, end - t0)


def run_level(host: str, port: int, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
              timeout: float) -> dict:
    samples: list[Sample] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for r in range(requests):
            prompt = prompts[(i * requests + r) % len(prompts)]
            try:
                s = one_request(host, port, model, prompt, max_tokens, timeout)
            except Exception as e:  # noqa: BLE001 - reported in the results
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                samples.append(s)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [s.ttft for s in samples]
    tpot = [s.tpot for s in samples if s.tpot is not None]
    tokens = sum(s.tokens for s in samples)
    return {"clients": clients, "requests": len(samples), "errors": errors, "completion_tokens": tokens,
            "wall_s": round(wall, 3), "throughput_tok_s": round(tokens / wall, 2) if wall > 0 else None,
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
            "tpot_p50_s": round(percentile(tpot, 50), 4), "tpot_p99_s": round(percentile(tpot, 99), 4)}


def table(rows: list[dict]) -> str:
    head = "| clients | requests | tokens | wall s | tok/s | TTFT p50 s | TTFT p99 s | TPOT p50 ms | TPOT p99 ms |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['requests']} | {r['completion_tokens']} | {r['wall_s']:.1f} | "
                     f"{r['throughput_tok_s']:.1f} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                     f"{r['tpot_p50_s'] * 1e3:.1f} | {r['tpot_p99_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running eyas serve on 127.0.0.1 (else one is started in-process)")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=None, help="default: the drafter shipped for the target")
    ap.add_argument("--tree", default="5")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.clients.split(",")]
    if any(not 1 <= c <= MAX_CLIENTS for c in levels) or not 1 <= a.requests <= MAX_REQUESTS \
            or not 1 <= a.max_tokens <= MAX_TOKENS:
        ap.error(f"bounded: clients 1..{MAX_CLIENTS}, requests 1..{MAX_REQUESTS}, max tokens 1..{MAX_TOKENS}")
    from eyas.bench import load_prompts

    prompts = [next(m["content"] for m in c.messages if m["role"] == "user") for c in load_prompts("mt_bench")]
    server = None
    if a.url:
        u = urlparse(a.url)
        if u.hostname != "127.0.0.1":
            ap.error(f"--url: only a server on 127.0.0.1 is load-tested, found {u.hostname}")
        host, port = "127.0.0.1", u.port or 80
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/v1/models")
        model = json.loads(c.getresponse().read())["data"][0]["id"]
        c.close()
        setup = {"url": a.url}
    else:
        from eyas.serve import ServeOptions, ServerThread, load_served

        t0 = time.perf_counter()
        served = load_served(a.target, a.draft, tree=a.tree, log=lambda m: print(f"serve: {m}", file=sys.stderr))
        server = ServerThread(served, ServeOptions(max_queue=MAX_CLIENTS * MAX_REQUESTS)).start()
        host, port, model = "127.0.0.1", server.port, served.model_name
        t = served.tree
        setup = {"target": a.target, "draft": str(served.draft_path), "tree": a.tree,
                 "tree_served": t.to_dict(),
                 "target_impl": served.target.implementation, "device": str(served.target.device),
                 "load_s": round(time.perf_counter() - t0, 1)}
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    try:
        one_request(host, port, model, prompts[0], 4, a.timeout)  # warm-up, not counted
        rows = [run_level(host, port, model, prompts, c, a.requests, a.max_tokens, a.timeout) for c in levels]
    finally:
        if server is not None:
            server.stop()
    report = {**setup, "requests_per_client": a.requests, "max_tokens": a.max_tokens,
              "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "cpu_count": os.cpu_count(), "levels": rows}
    if a.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        print(table(rows))
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
