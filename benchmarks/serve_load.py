"""A bounded load test of ``eyas serve`` on 127.0.0.1: for 1, 4 and 16 concurrent clients (or
``--clients``), output throughput and p50/p99 time to first token (TTFT) and time per output token
(TPOT), at each ``--temperatures``, with speculation as the server chooses it, always on and off
(``--speculation auto,on,off``).

    python benchmarks/serve_load.py --target smollm2                  # starts its own server in-process
    python benchmarks/serve_load.py --url http://127.0.0.1:8000      # a server already running here
    python benchmarks/serve_load.py --target smollm2 --clients 1,4,16 --requests 2 --max-tokens 32 --json
    python benchmarks/serve_load.py --target smollm2 --clients 1,4,16,64,256 --temperatures 0,1 \
        --speculation auto,off --max-rows 256 --max-tokens 128 --json      # issue 33's table (a GPU)

Each client sends ``--requests`` streaming chat requests one after another (greedy, ``--max-tokens``
new tokens, prompts: the first turns of the MT-bench set shipped with eyas, in turn), and records per
request: TTFT = first content chunk - request sent (queue wait included), TPOT = (last chunk - first
chunk) / (completion tokens - 1), the completion tokens from the usage chunk. Throughput = all
completion tokens of a level / the level's wall time. It is bounded on purpose: at most 256 clients,
16 requests each and 512 new tokens, and only a server on 127.0.0.1 (it refuses any other host).

Each level also says what a user would check: ``x_single_stream`` (its throughput over the 1-client
level's, same temperature and speculation), ``x_speculation_off`` (speculation on over off, same
clients and temperature), and ``greedy_mismatches``: greedy answers whose text differs from the
answer the same prompt got first, at any level or setting (requests mixed up, or, in bf16, a batched
product rounding differently from a lone one; in float32 it must be 0). In-process, one server is
started per ``--speculation`` setting on the same loaded model, and each level runs on each server
in turn before the next level (a noisy machine's drift hits every setting alike). ``--warm-pass``
runs every level once, untimed, first (on a GPU each shape compiles and captures at its first use),
and the report's ``chosen`` holds each server's ``/health`` ``batch_speculation`` at the end (the
tokens/s it measured per batch size, kind and depth).
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

MAX_CLIENTS, MAX_REQUESTS, MAX_TOKENS = 256, 16, 512


@dataclass
class Sample:
    ttft: float
    tpot: float | None
    tokens: int
    wall: float
    prompt: int = 0  # its index in the prompts
    text: str = ""


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def one_request(host: str, port: int, model: str, prompt: str, max_tokens: int, timeout: float,
                temperature: float = 0.0, seed: int = 0) -> Sample:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": temperature, "seed": seed, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    tokens = 0
    pieces = []
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
                pieces.append(c["delta"]["content"])
                last = time.perf_counter()
                first = first or last
    conn.close()
    end = time.perf_counter()
    first = first or end
    last = last or end
    return Sample(first - t0, (last - first) / (tokens - 1) if tokens > 1 else None, tokens, end - t0,
                  text="".join(pieces))


def run_level(host: str, port: int, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
              timeout: float, temperature: float = 0.0, greedy_texts: dict[int, str] | None = None) -> dict:
    """One level: ``clients`` concurrent clients, ``requests`` each. ``greedy_texts`` (prompt index ->
    text, filled by the first level that answers a prompt) counts greedy answers that differ."""
    samples: list[Sample] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for r in range(requests):
            k = (i * requests + r) % len(prompts)
            try:
                s = one_request(host, port, model, prompts[k], max_tokens, timeout, temperature, seed=k)
                s.prompt = k
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
    mismatches = 0
    if temperature == 0 and greedy_texts is not None:
        for s in samples:
            mismatches += greedy_texts.setdefault(s.prompt, s.text) != s.text
    return {"clients": clients, "temperature": temperature, "requests": len(samples), "errors": errors,
            "completion_tokens": tokens, "greedy_mismatches": mismatches,
            "wall_s": round(wall, 3), "throughput_tok_s": round(tokens / wall, 2) if wall > 0 else None,
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
            "tpot_p50_s": round(percentile(tpot, 50), 4), "tpot_p99_s": round(percentile(tpot, 99), 4)}


def compare(rows: list[dict]) -> None:
    """Adds x_single_stream and x_speculation_off to each level (module docstring)."""
    for r in rows:
        single = next((o for o in rows if o["clients"] == 1 and o["temperature"] == r["temperature"]
                       and o.get("speculation") == r.get("speculation")), None)
        off = next((o for o in rows if o["clients"] == r["clients"] and o["temperature"] == r["temperature"]
                    and o.get("speculation") == "off"), None)
        ratio = (lambda a, b: round(a / b, 3) if a and b else None)
        r["x_single_stream"] = ratio(r["throughput_tok_s"], single and single["throughput_tok_s"])
        r["x_speculation_off"] = (ratio(r["throughput_tok_s"], off["throughput_tok_s"])
                                  if off is not None and r.get("speculation") not in (None, "off") else None)


def table(rows: list[dict]) -> str:
    head = ("| speculation | T | clients | requests | tokens | wall s | tok/s | x 1 client | x spec off | TTFT p50 s "
            "| TTFT p99 s | TPOT p50 ms | TPOT p99 ms | greedy mismatches |")
    lines = [head, "|" + "---|" * 14]
    num = (lambda x, f: "-" if x is None else format(x, f))
    for r in rows:
        lines.append(f"| {r.get('speculation', 'as served')} | {r['temperature']:g} | {r['clients']} | {r['requests']} | "
                     f"{r['completion_tokens']} | {r['wall_s']:.1f} | {r['throughput_tok_s']:.1f} | "
                     f"{num(r.get('x_single_stream'), '.2f')} | {num(r.get('x_speculation_off'), '.2f')} | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['tpot_p50_s'] * 1e3:.1f} | "
                     f"{r['tpot_p99_s'] * 1e3:.1f} | {r['greedy_mismatches']} |")
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
    ap.add_argument("--temperatures", default="0", help="comma-separated; each level runs at each")
    ap.add_argument("--speculation", default="auto", help="in-process: auto, on, off, or several (a server each)")
    ap.add_argument("--max-rows", type=int, default=None, help="in-process: the running batch's rows")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--warm-pass", action="store_true",
                    help="run every level once, untimed, before the timed pass (a GPU compiles and captures each "
                         "shape at its first use)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.clients.split(",")]
    temperatures = [float(x) for x in a.temperatures.split(",")]
    settings = [x.strip() for x in a.speculation.split(",")]
    if any(not 1 <= c <= MAX_CLIENTS for c in levels) or not 1 <= a.requests <= MAX_REQUESTS \
            or not 1 <= a.max_tokens <= MAX_TOKENS:
        ap.error(f"bounded: clients 1..{MAX_CLIENTS}, requests 1..{MAX_REQUESTS}, max tokens 1..{MAX_TOKENS}")
    if any(x not in ("auto", "on", "off") for x in settings) or (a.url and settings != ["auto"]):
        ap.error(f"--speculation: auto, on, off or several, and only for an in-process server; found {a.speculation!r}")
    from eyas.bench import load_prompts

    prompts = [next(m["content"] for m in c.messages if m["role"] == "user") for c in load_prompts("mt_bench")]
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    rows: list[dict] = []
    if a.url:
        u = urlparse(a.url)
        if u.hostname != "127.0.0.1":
            ap.error(f"--url: only a server on 127.0.0.1 is load-tested, found {u.hostname}")
        host, port = "127.0.0.1", u.port or 80
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/v1/models")
        model = json.loads(c.getresponse().read())["data"][0]["id"]
        c.close()
        setup: dict = {"url": a.url}
        rows = [{k: v for k, v in r.items() if k != "speculation"}
                for r in run_levels(host, {"as served": port}, model, prompts, levels, temperatures, a)]
    else:
        from eyas.serve import ServeOptions, ServerThread, load_served

        t0 = time.perf_counter()
        served = load_served(a.target, a.draft, tree=a.tree, log=lambda m: print(f"serve: {m}", file=sys.stderr))
        setup = {"target": a.target, "draft": str(served.draft_path), "tree": a.tree,
                 "tree_served": served.tree.to_dict(), "target_impl": served.target.implementation,
                 "device": str(served.target.device), "load_s": round(time.perf_counter() - t0, 1)}
        # One server per setting, all up at once (idle ones cost nothing), their levels interleaved
        # so that a noisy machine's drift hits every setting alike.
        servers = {x: ServerThread(served, ServeOptions(max_queue=MAX_CLIENTS * MAX_REQUESTS, max_rows=a.max_rows,
                                                        speculation=x)).start() for x in settings}
        setup["max_rows"] = next(iter(servers.values())).state.worker.max_rows
        try:
            ports = {x: t.port for x, t in servers.items()}
            rows = run_levels("127.0.0.1", ports, served.model_name, prompts, levels, temperatures, a)
            setup["chosen"] = {x: health(port).get("batch_speculation") for x, port in ports.items()}
        finally:
            for t in servers.values():
                t.stop()
    compare(rows)
    report = {**setup, "requests_per_client": a.requests, "max_tokens": a.max_tokens,
              "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "cpu_count": os.cpu_count(), "levels": rows}
    if a.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        print(table(rows))
    return 1 if any(r["errors"] for r in rows) else 0


def health(port: int) -> dict:
    """The server's /health (what its policies chose, per batch size and kind)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/health")
    body = json.loads(c.getresponse().read())
    c.close()
    return body


def run_levels(host: str, ports: dict[str, int], model: str, prompts: list[str], levels: list[int],
               temperatures: list[float], a: argparse.Namespace) -> list[dict]:
    """Every level at every temperature on each server (setting -> port), the settings interleaved
    level by level, after a warm-up request each (not counted)."""
    for port in ports.values():
        one_request(host, port, model, prompts[0], 4, a.timeout)
    if a.warm_pass:
        for t in temperatures:
            for c in levels:
                for setting, port in ports.items():
                    run_level(host, port, model, prompts, c, a.requests, a.max_tokens, a.timeout, t, {})
                    print(f"warm: {setting}, temperature {t:g}, {c} clients", file=sys.stderr)
    greedy_texts: dict[int, str] = {}  # shared: every server must give a prompt the same greedy answer
    rows = []
    for t in temperatures:
        for c in levels:
            for setting, port in ports.items():
                r = run_level(host, port, model, prompts, c, a.requests, a.max_tokens, a.timeout, t, greedy_texts)
                rows.append({"speculation": setting, **r})
                print(f"level: {setting}, temperature {t:g}, {c} clients: {r['throughput_tok_s']} tok/s, "
                      f"TTFT p50 {r['ttft_p50_s']} s", file=sys.stderr)  # progress
    return rows


if __name__ == "__main__":
    sys.exit(main())
