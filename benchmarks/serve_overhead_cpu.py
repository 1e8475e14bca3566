"""The serving layer's own ceiling, on the CPU: ``eyas serve``'s worker, event loop and streaming
around an engine that costs nothing but a fixed wait a step, so that what the clients receive
short of ``rows x 1000 / step_ms`` tokens/s is the host's work (scheduling, events, detokenization,
SSE chunks, metrics), which on a GPU competes with the engine for one interpreter lock.

    PYTHONPATH=src .venv/bin/python benchmarks/serve_overhead_cpu.py --clients 64,256 --step-ms 4.4 \
        --speculation off,on --mode in-process,engine-process --json

A stand-in ``WaitBatch`` (``serve_stand_in.py``) replaces the :class:`~eyas.engine.continuous.RowBatch` of the real
server (the served pair is loaded as ``eyas serve`` loads it: tokenizer, templates, checks): each
step sleeps ``--step-ms`` (a GPU step's wait on the device, which releases the lock as a sleep
does) and gives every busy row the next token of an ordinary English text; a speculative round
(``--speculation on``) gives ``depth + 1`` tokens a row, every draft accepted. The server runs in
this process (uvicorn in a thread); its worker in a thread beside it (``--mode in-process``) or in
an engine process of its own (``--mode engine-process``, ``eyas serve``'s default);
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
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # serve_stand_in by its name: an engine process imports it to build the worker

from serve_stand_in import stand_in_worker  # noqa: E402


def measure(served, options, mode: str, step_s: float, speculative: bool, clients: int, requests: int,
            max_tokens: int, client_procs: int) -> dict:
    """One server around the stand-in engine (``mode``: its worker in this process, or in an engine
    process of its own, which loads the pair itself), loaded by serve_load.py --url."""
    from eyas.serve import ServerThread
    from eyas.serve.load_args import LoadArgs

    make = partial(stand_in_worker, step_s=step_s, speculative=speculative)
    where = LoadArgs(served.target_name, str(served.draft_path), tree="3") if mode == "engine-process" else served
    with ServerThread(where, options, make=make) as t:
        cmd = [sys.executable, str(HERE / "serve_load.py"), "--url", t.url, "--clients", str(clients),
               "--requests", str(requests), "--max-tokens", str(max_tokens), "--client-procs", str(client_procs),
               "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"serve_load.py exited {out.returncode}: {out.stderr[-2000:]}")
        level = json.loads(out.stdout)["levels"][0]
        if hasattr(t.state.worker, "settled"):  # an engine process: its state as it went idle
            t.state.worker.settled.wait(10)
        chosen = t.state.worker.batch_report()
    return {**level, "depths": chosen["steps"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--clients", default="64,256")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=4.4, help="a step's wait (the H200's plain step of 256 rows: 4.4)")
    ap.add_argument("--speculation", default="off", help="off (plain steps), on (the batch policy's rounds: chains and trees), or both")
    ap.add_argument("--mode", default="in-process", help="in-process (worker and HTTP in one process), "
                    "engine-process (the worker in its own, eyas serve's default), or both")
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from eyas.engine.tree import TreeSpec
    from eyas.serve import ServeOptions, load_served

    served = load_served(a.target, a.draft, tree="3")
    rows = []
    for clients in [int(c) for c in a.clients.split(",")]:
        for mode, spec in [(m, sp) for m in a.mode.split(",") for sp in a.speculation.split(",")]:
            options = ServeOptions(max_rows=clients, max_queue=4096, speculation=spec, default_max_tokens=a.max_tokens)
            r = measure(served, options, mode, a.step_ms / 1e3, spec == "on", clients, a.requests, a.max_tokens,
                        a.client_procs)
            # the ideal: every row its tokens at each step's wait, at the depths the server chose
            steps: collections.Counter[int] = collections.Counter()  # depth -> steps, over batch sizes
            for key, n in r["depths"].items():  # "64+/greedy/2" or "4+/greedy/3,4,12" (a tree): steps
                label = key.rsplit("/", 1)[1]  # the arm's label: "0" (plain) or a TreeSpec's
                steps[0 if label == "0" else TreeSpec.parse(label).depth] += n  # the stand-in emits depth + 1 a row
            n = sum(steps.values())
            tokens = sum((d + 1) * s for d, s in steps.items()) / n if n else 1.0
            wait = sum((1 + 0.25 * d) * s for d, s in steps.items()) / n if n else 1.0
            ideal = clients * tokens / (wait * a.step_ms / 1e3)
            row = {"clients": clients, "mode": mode, "speculation": spec, "throughput_tok_s": r["throughput_tok_s"],
                   "ideal_tok_s": round(ideal, 1), "of_ideal": round(r["throughput_tok_s"] / ideal, 3),
                   "ttft_p50_s": r["ttft_p50_s"], "tpot_p50_s": r["tpot_p50_s"], "errors": len(r["errors"]),
                   "requests": r["requests"]}
            rows.append(row)
            print(f"{clients} clients, {mode}, speculation {spec}: {row['throughput_tok_s']} tok/s "
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
