"""The serving layer's own ceiling, on the CPU: ``eyas serve``'s worker, event loop and streaming
around an engine that costs nothing but a fixed wait a step, so that what the clients receive
short of ``rows x 1000 / step_ms`` tokens/s is the host's work (scheduling, events, detokenization,
SSE chunks, metrics), which on a GPU competes with the engine for one interpreter lock.

    PYTHONPATH=src .venv/bin/python benchmarks/serve_overhead_cpu.py --clients 64,256 --step-ms 4.4 \
        --speculation off,on --json

A stand-in :class:`WaitBatch` replaces the :class:`~eyas.engine.continuous.RowBatch` of the real
server (the served pair is loaded as ``eyas serve`` loads it: tokenizer, templates, checks): each
step sleeps ``--step-ms`` (a GPU step's wait on the device, which releases the lock as a sleep
does) and gives every busy row the next token of an ordinary English text; a speculative round
(``--speculation on``) gives ``depth + 1`` tokens a row, every draft accepted. The server runs in
this process (uvicorn in a thread, the worker in another, as in ``eyas serve``);
``serve_load.py --url`` drives it from client processes. Figures: tokens/s received, the ideal
(every row a token a step, or depth + 1 a round), their ratio, TTFT and TPOT.

The GPU host has 16 cores; this machine may have 2, shared with the client processes: compare
settings within one run only.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
TEXT = ("The committee met on Tuesday to review the proposal. After a long discussion about costs, "
        "schedules and the risks of delay, the members agreed to fund a smaller first phase and to "
        "report back in the spring with measured results from the pilot sites. ")


class WaitBatch:
    """RowBatch's interface as BatchWorker uses it, with a step that only waits (module docstring)."""

    def __init__(self, rows: int, text_ids: list[int], step_s: float, speculative: bool) -> None:
        self.rows, self.text, self.step_s = rows, text_ids, step_s
        self.spec = object() if speculative else None  # BatchSpeculation turns on where there is a drafter
        self.engine = SimpleNamespace(compile_s=0.0)
        self.limit: list[int | None] = [None] * rows  # None: free
        self.generated = [0] * rows

    @property
    def free(self) -> list[int]:
        return [r for r, lim in enumerate(self.limit) if lim is None]

    @property
    def busy(self) -> list[int]:
        return [r for r, lim in enumerate(self.limit) if lim is not None]

    def mode(self) -> str:
        return "greedy"

    def _tokens(self, row: int, n: int):  # noqa: ANN202 - RowTokens
        from eyas.engine.continuous import RowTokens

        n = min(n, self.limit[row] - self.generated[row])
        start = self.generated[row]
        self.generated[row] += n
        toks = [self.text[(start + i) % len(self.text)] for i in range(n)]
        return RowTokens(row, toks, self.generated[row] >= self.limit[row], drafted=n - 1, accepted=n - 1)

    def admit(self, requests: list) -> list:
        time.sleep(self.step_s)  # a prefill: about a step
        out = []
        for q, row in zip(requests, self.free):
            self.limit[row], self.generated[row] = q.max_new_tokens, q.generated if q.resumed else 0
            if not q.resumed:
                out.append(self._tokens(row, 1))
        return out

    def step(self) -> list:
        time.sleep(self.step_s)
        return [self._tokens(r, 1) for r in self.busy]

    def speculate(self, depth: int) -> list:
        time.sleep(self.step_s * (1 + 0.25 * depth))  # a round: the verification plus the drafts
        return [self._tokens(r, depth + 1) for r in self.busy]

    def release(self, row: int) -> None:
        self.limit[row] = None


def measure(served, options, batch: WaitBatch, clients: int, requests: int, max_tokens: int,
            client_procs: int) -> dict:
    """One server with ``batch`` (a patched make_worker), loaded by serve_load.py --url."""
    import eyas.serve.app as app_module
    from eyas.serve import ServerThread
    from eyas.serve.batching import BatchWorker
    from eyas.serve.policy import SpeculationPolicy

    def make_worker(sv, max_rows, **kw):  # noqa: ANN001, ANN202 - make_worker's own
        worker = BatchWorker(sv, batch, **kw)
        worker.policy = SpeculationPolicy("off")  # a lone request takes a row: the real engine never runs
        return worker

    real = app_module.make_worker
    app_module.make_worker = make_worker
    try:
        with ServerThread(served, options) as t:
            cmd = [sys.executable, str(HERE / "serve_load.py"), "--url", t.url, "--clients", str(clients),
                   "--requests", str(requests), "--max-tokens", str(max_tokens), "--client-procs", str(client_procs),
                   "--json"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"serve_load.py exited {out.returncode}: {out.stderr[-2000:]}")
            level = json.loads(out.stdout)["levels"][0]
            chosen = t.state.worker.batch_report()
    finally:
        app_module.make_worker = real
    return {**level, "depths": chosen["steps"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--clients", default="64,256")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=4.4, help="a step's wait (the H200's plain step of 256 rows: 4.4)")
    ap.add_argument("--speculation", default="off", help="off (plain steps), on (rounds of depth 1-4), or both")
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from eyas.serve import ServeOptions, load_served

    served = load_served(a.target, a.draft, tree="3")
    text_ids = served.tokenizer(TEXT * 4, add_special_tokens=False)["input_ids"]
    rows = []
    for clients in [int(c) for c in a.clients.split(",")]:
        for spec in a.speculation.split(","):
            options = ServeOptions(max_rows=clients, max_queue=4096, speculation=spec, default_max_tokens=a.max_tokens)
            batch = WaitBatch(clients, text_ids, a.step_ms / 1e3, spec == "on")
            r = measure(served, options, batch, clients, a.requests, a.max_tokens, a.client_procs)
            # the ideal: every row its tokens at each step's wait, at the depths the server chose
            steps: collections.Counter[int] = collections.Counter()  # depth -> steps, over batch sizes
            for key, n in r["depths"].items():  # "64+/greedy/2": steps
                steps[int(key.rsplit("/", 1)[1])] += n
            n = sum(steps.values())
            tokens = sum((d + 1) * s for d, s in steps.items()) / n if n else 1.0
            wait = sum((1 + 0.25 * d) * s for d, s in steps.items()) / n if n else 1.0
            ideal = clients * tokens / (wait * a.step_ms / 1e3)
            row = {"clients": clients, "speculation": spec, "throughput_tok_s": r["throughput_tok_s"],
                   "ideal_tok_s": round(ideal, 1), "of_ideal": round(r["throughput_tok_s"] / ideal, 3),
                   "ttft_p50_s": r["ttft_p50_s"], "tpot_p50_s": r["tpot_p50_s"], "errors": len(r["errors"]),
                   "requests": r["requests"]}
            rows.append(row)
            print(f"{clients} clients, speculation {spec}: {row['throughput_tok_s']} tok/s "
                  f"({row['of_ideal']:.0%} of {row['ideal_tok_s']:.0f})", file=sys.stderr)
    report = {"target": a.target, "step_ms": a.step_ms, "max_tokens": a.max_tokens, "requests_per_client": a.requests,
              "client_procs": a.client_procs, "levels": rows}
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        for r in rows:
            print(r)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
