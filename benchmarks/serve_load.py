"""A bounded load test of ``eyas serve`` on 127.0.0.1: for 1, 4 and 16 concurrent clients (or
``--clients``), output throughput and p50/p99 time to first token (TTFT) and time per output token
(TPOT), at each ``--temperatures``, with speculation as the server chooses it, always on and off
(``--speculation auto,on,off``).

    python benchmarks/serve_load.py --target smollm2                  # launches `eyas serve` itself
    python benchmarks/serve_load.py --url http://127.0.0.1:8000      # a server already running here
    python benchmarks/serve_load.py --target smollm2 --clients 1,4,16 --requests 2 --max-tokens 32 --json
    python benchmarks/serve_load.py --target smollm2 --clients 1,4,16,64,256 --temperatures 0,1 \
        --speculation auto,off --max-rows 256 --max-tokens 128 --json      # issue 33's table (a GPU)

Without ``--url`` it launches one ``eyas serve`` process per ``--speculation`` setting (ports
``--port``, ``--port`` + 1, ...), waits for each to be ready, and stops them with SIGTERM at the end
(their exit codes are in the report). The server runs in its own process, as a user runs it, and
the clients of a level are threads spread over ``--client-procs`` forked processes: hundreds of
client threads in the server's interpreter, or in one client interpreter, queue on its lock and
count their wait as the server's.

Each client sends ``--requests`` streaming chat requests one after another (more where
``--min-requests`` asks a level for more than its clients would send; ``--max-tokens`` new
tokens; prompts: the first turns of the MT-bench set shipped with eyas, in turn), and records per
request: TTFT = first content chunk - request sent (queue wait included), TPOT = (last chunk - first
chunk) / (completion tokens - 1), the completion tokens from the usage chunk. Throughput = all
completion tokens of a level / the level's wall time (first request sent to last answer read). It
is bounded on purpose: at most 256 clients, 16 requests each and 512 new tokens, and only a server
on 127.0.0.1 (it refuses any other host).

Each level also says what a user would check: ``x_single_stream`` (its throughput over the 1-client
level's, same temperature and speculation), ``x_speculation_off`` (speculation on over off, same
clients and temperature), and ``greedy_mismatches``: greedy answers whose text differs from the
answer the same prompt got first, at any level or setting (requests mixed up, or, in bf16, a batched
product rounding differently from a lone one; in float32 it must be 0). Each level runs on each
server in turn before the next level (a noisy machine's drift hits every setting alike), unless
``--one-at-a-time`` (each server alone on the GPU, all its levels, then stopped: servers of 256 rows
each hold a KV cache, and three did not fit an 80 GB H100). A stream that ends with an error chunk
counts as a failed request.
``--warm-pass`` runs every level once, untimed, first, a request a client (on a GPU each shape
compiles and captures at its first use), and the report's ``chosen`` holds each server's
``/health`` ``batch_speculation`` at the end (the tokens/s it measured per batch size, kind and
depth). Each level's ``server`` says what the server did during it: its decode steps by kind and
the seconds it spent compiling (the batch's steps, the lone requests' target), so that a level
that paid for a compilation shows it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import re
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_process.py beside it, however it is loaded
from serve_process import ServerProcess, request  # noqa: E402

MAX_CLIENTS, MAX_REQUESTS, MAX_TOKENS = 256, 16, 512


@dataclass
class Sample:
    ttft: float
    tpot: float | None
    tokens: int
    start: float  # time.perf_counter(): the request sent
    end: float  # the answer's last byte read
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
        if "error" in chunk:  # the server ended the stream with an error: the request failed
            conn.close()
            raise RuntimeError(f"streamed error: {chunk['error'].get('message', chunk['error'])}"[:300])
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
    return Sample(first - t0, (last - first) / (tokens - 1) if tokens > 1 else None, tokens, t0, end,
                  text="".join(pieces))


def run_clients(host: str, port: int, model: str, prompts: list[str], clients: range, requests: int, max_tokens: int,
                timeout: float, temperature: float) -> tuple[list[Sample], list[str]]:
    """``clients`` (their indices) as threads of this process, ``requests`` each, one after another."""
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

    threads = [threading.Thread(target=client, args=(i,)) for i in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, errors


def _client_process(barrier, results, *args) -> None:  # noqa: ANN001 - multiprocessing's own types
    barrier.wait()  # every process's clients start together
    results.put(run_clients(*args))


def run_level(host: str, port: int, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
              timeout: float, temperature: float = 0.0, greedy_texts: dict[int, str] | None = None,
              procs: int = 1) -> dict:
    """One level: ``clients`` concurrent clients, ``requests`` each, as threads spread over ``procs``
    processes (forked: a few hundred client threads in one interpreter would queue on its lock and
    add their wait to the server's TTFT and TPOT). The level's wall time runs from the first
    request sent to the last answer read, across processes (``time.perf_counter`` is the system's
    monotonic clock on Linux). ``greedy_texts`` (prompt index -> text, filled by the first level
    that answers a prompt) counts greedy answers that differ."""
    procs = max(1, min(procs, clients))
    args = (host, port, model, prompts)
    t0 = time.perf_counter()
    if procs == 1:
        samples, errors = run_clients(*args, range(clients), requests, max_tokens, timeout, temperature)
    else:
        ctx = multiprocessing.get_context("fork")
        barrier, results = ctx.Barrier(procs), ctx.Queue()
        shares = [range(clients)[p::procs] for p in range(procs)]
        workers = [ctx.Process(target=_client_process, args=(barrier, results, *args, share, requests, max_tokens,
                                                              timeout, temperature)) for share in shares]
        for w in workers:
            w.start()
        samples, errors = [], []
        for _ in workers:  # read before join: a child with a large result waits for its queue to drain
            s, e = results.get(timeout=timeout * requests + 60)
            samples += s
            errors += e
        for w in workers:
            w.join()
    wall = (max(s.end for s in samples) - min(s.start for s in samples)) if samples else time.perf_counter() - t0
    ttft = [s.ttft for s in samples]
    tpot = [s.tpot for s in samples if s.tpot is not None]
    tokens = sum(s.tokens for s in samples)
    mismatches = 0
    if temperature == 0 and greedy_texts is not None:
        for s in sorted(samples, key=lambda s: s.start):
            mismatches += greedy_texts.setdefault(s.prompt, s.text) != s.text
    return {"clients": clients, "temperature": temperature, "requests": len(samples), "errors": errors,
            "completion_tokens": tokens, "greedy_mismatches": mismatches, "client_processes": procs,
            "wall_s": round(wall, 3), "throughput_tok_s": round(tokens / wall, 2) if wall > 0 else None,
            "ttft_p50_s": round(percentile(ttft, 50), 4), "ttft_p99_s": round(percentile(ttft, 99), 4),
            "tpot_p50_s": round(percentile(tpot, 50), 4), "tpot_p99_s": round(percentile(tpot, 99), 4)}


def compare(rows: list[dict]) -> None:
    """Adds x_single_stream and x_speculation_off to each level (module docstring)."""
    for r in rows:
        single = next((o for o in rows if o["clients"] == 1 and o["temperature"] == r["temperature"]
                       and o.get("speculation") == r.get("speculation")), None)
        base, _, where = (r.get("speculation") or "").partition("/")  # "auto/in-process": auto, in-process
        off_label = "off" + (f"/{where}" if where else "")  # the same server with speculation off
        off = next((o for o in rows if o["clients"] == r["clients"] and o["temperature"] == r["temperature"]
                    and o.get("speculation") == off_label), None)
        ratio = (lambda a, b: round(a / b, 3) if a and b else None)
        r["x_single_stream"] = ratio(r["throughput_tok_s"], single and single["throughput_tok_s"])
        r["x_speculation_off"] = (ratio(r["throughput_tok_s"], off["throughput_tok_s"])
                                  if off is not None and base not in ("", "off") else None)


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


def setting_flags(suffix: str) -> list[str] | None:
    """The server flags of a --speculation setting's suffix: "" none, "in-process" --in-process,
    "lanesN" --lone-sessions N (eyas.serve.lanes); None: not a suffix."""
    if suffix in ("", "in-process"):
        return ["--in-process"] if suffix else []
    if suffix.startswith("lanes") and suffix[5:].isdigit() and int(suffix[5:]) >= 1:
        return ["--lone-sessions", suffix[5:]]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running eyas serve on 127.0.0.1 (else `eyas serve` is launched per --speculation)")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=None, help="default: the drafter shipped for the target")
    ap.add_argument("--tree", default="5")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--min-requests", type=int, default=0,
                    help="requests a level at least: its clients send more each (at most 16) where they are few, "
                         "so that a level of 1 or 4 clients lasts long enough to measure")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperatures", default="0", help="comma-separated; each level runs at each")
    ap.add_argument("--speculation", default="auto", help="auto, on, off, or several (a server launched for each); "
                    "X/in-process: the server with its worker in the HTTP process (eyas serve --in-process); "
                    "X/lanesN: eyas serve --lone-sessions N")
    ap.add_argument("--max-rows", type=int, default=None, help="the launched servers' running batch rows")
    ap.add_argument("--port", type=int, default=8391, help="the first launched server's port (the next: +1, ...)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="launch each setting's server after the previous one stopped, all its levels in a row "
                         "(servers of 256 rows each hold their own KV cache: several at once may not fit a GPU)")
    ap.add_argument("--client-procs", type=int, default=None,
                    help="processes the clients of a level are spread over (default: one per 8 clients, at most "
                         "one per CPU core)")
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
    if any(x.partition("/")[0] not in ("auto", "on", "off") or setting_flags(x.partition("/")[2]) is None
           for x in settings) or (a.url and settings != ["auto"]):
        ap.error(f"--speculation: auto, on, off (each optionally /in-process or /lanesN) or several, and only for "
                 f"launched servers; found {a.speculation!r}")
    from eyas.bench import load_prompts

    prompts = [next(m["content"] for m in c.messages if m["role"] == "user") for c in load_prompts("mt_bench")]
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    rows: list[dict] = []
    if a.url:
        u = urlparse(a.url)
        if u.hostname != "127.0.0.1":
            ap.error(f"--url: only a server on 127.0.0.1 is load-tested, found {u.hostname}")
        host, port = "127.0.0.1", u.port or 80
        model = request(port, "/v1/models", timeout=10)[1]["data"][0]["id"]
        setup: dict = {"url": a.url}
        rows = [{k: v for k, v in r.items() if k != "speculation"}
                for r in run_levels(host, {"as served": port}, model, prompts, levels, temperatures, a)]
    else:
        # One `eyas serve` per setting, launched one after another (the later ones start on the
        # compile cache the first filled), all up at once (an idle one costs nothing), their levels
        # interleaved so that a noisy machine's drift hits every setting alike.
        serve_args = ["--target", a.target, "--tree", a.tree, "--max-queue", str(MAX_CLIENTS * MAX_REQUESTS)] \
            + (["--draft", a.draft] if a.draft else []) + (["--max-rows", str(a.max_rows)] if a.max_rows else [])
        servers: dict[str, ServerProcess] = {}
        groups = [[x] for x in settings] if a.one_at_a_time else [settings]
        greedy_texts: dict[int, str] = {}  # shared: every server must give a prompt the same greedy answer
        setup = {}
        try:
            for group in groups:
                for x in group:
                    flags = ["--speculation", x.partition("/")[0]] + setting_flags(x.partition("/")[2])
                    servers[x] = ServerProcess.launch(serve_args + flags, a.port + len(servers), timeout=a.timeout)
                    print(f"serve: --speculation {x} ready in {servers[x].ready_s} s", file=sys.stderr)
                if not setup:
                    first = servers[group[0]]
                    h = first.health()
                    setup = {"target": a.target, "draft": a.draft or "default", "tree": a.tree,
                             "command": first.command.replace(f"--port {first.port}", "--port PORT"),
                             "startup": h.get("startup"), "max_rows": h["queue"]["max_rows"],
                             "one_at_a_time": a.one_at_a_time, "chosen": {}}
                ports = {x: servers[x].port for x in group}
                rows += run_levels("127.0.0.1", ports, servers[group[0]].model(), prompts, levels, temperatures, a,
                                   greedy_texts)
                for x in group:
                    setup["chosen"][x] = servers[x].health().get("batch_speculation")
                    if a.one_at_a_time:
                        servers[x].stop()
        finally:
            for t in servers.values():
                t.stop()
        setup["ready_s"] = {x: t.ready_s for x, t in servers.items()}
        setup["exit_codes"] = {x: t.exit_code for x, t in servers.items()}
    compare(rows)
    report = {**setup, "requests_per_client": a.requests, "min_requests": a.min_requests, "max_tokens": a.max_tokens,
              "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "cpu_count": os.cpu_count(), "levels": rows}
    if a.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        print(table(rows))
    return 1 if any(r["errors"] for r in rows) or any(setup.get("exit_codes", {}).values()) else 0


def client_procs(a: argparse.Namespace, clients: int) -> int:
    return a.client_procs or max(1, min(os.cpu_count() or 1, clients // 8))


def requests_each(a: argparse.Namespace, clients: int) -> int:
    """Requests per client at a level of ``clients``: ``--requests``, more where ``--min-requests`` asks."""
    return min(MAX_REQUESTS, max(a.requests, -(-a.min_requests // clients)))


def server_state(host: str, port: int) -> dict:
    """What a server has done so far: its decode steps by kind (``/metrics``) and the seconds it spent
    compiling, its batch's steps and its lone requests' target (``/health``, as the engine reported
    it when it last went idle). Taken before and after a level, the difference says which path the
    level's tokens took and whether it paid for a compilation (a stall of every row)."""
    _, health = request(port, "/health", timeout=10)
    batch = health.get("batch_speculation") or {}
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    steps = {m.group(1): float(m.group(2))
             for m in re.finditer(r'^eyas_decode_steps_total\{kind="([^"]+)"\} (\S+)$', text, re.M)}
    return {"compile_s": batch.get("compile_s") or 0.0, "target_compile_s": batch.get("target_compile_s") or 0.0,
            "steps": steps}


def state_change(before: dict, after: dict) -> dict:
    return {"compile_s": round(after["compile_s"] - before["compile_s"], 2),
            "target_compile_s": round(after["target_compile_s"] - before["target_compile_s"], 2),
            "steps": {k: int(v - before["steps"].get(k, 0.0)) for k, v in after["steps"].items()
                      if v != before["steps"].get(k, 0.0)}}


def run_levels(host: str, ports: dict[str, int], model: str, prompts: list[str], levels: list[int],
               temperatures: list[float], a: argparse.Namespace, greedy_texts: dict[int, str] | None = None) -> list[dict]:
    """Every level at every temperature on each server (setting -> port), the settings interleaved
    level by level, after a warm-up request each (not counted)."""
    for port in ports.values():
        one_request(host, port, model, prompts[0], 4, a.timeout)
    if a.warm_pass:
        for t in temperatures:
            for c in levels:
                for setting, port in ports.items():
                    run_level(host, port, model, prompts, c, 1, a.max_tokens, a.timeout, t, {}, client_procs(a, c))
                    print(f"warm: {setting}, temperature {t:g}, {c} clients", file=sys.stderr)
    greedy_texts = {} if greedy_texts is None else greedy_texts  # a prompt's first greedy answer, over servers
    rows = []
    for t in temperatures:
        for c in levels:
            for setting, port in ports.items():
                before = server_state(host, port)
                r = run_level(host, port, model, prompts, c, requests_each(a, c), a.max_tokens, a.timeout, t,
                              greedy_texts, client_procs(a, c))
                rows.append({"speculation": setting, **r, "server": state_change(before, server_state(host, port))})
                print(f"level: {setting}, temperature {t:g}, {c} clients: {r['throughput_tok_s']} tok/s, "
                      f"TTFT p50 {r['ttft_p50_s']} s", file=sys.stderr)  # progress
    return rows


if __name__ == "__main__":
    sys.exit(main())
