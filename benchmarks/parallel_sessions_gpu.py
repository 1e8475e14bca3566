"""Lone speculative sessions side by side, against the running batch's plain steps: is the way to
serve 2-4 clients speculatively to give each its own fast target on its own CUDA stream?

Why. A lone request's tree round (``eyas.engine.speculative``) accepts far more per round than a
batched round's chains and trees, and is launch-bound on a small target: its kernels leave most of
the GPU idle. K lanes (:mod:`eyas.serve.lanes`, as ``eyas serve --lone-sessions K`` builds and warms
them: twins of the fast target, each with its own static cache, CUDA graphs, drafter state and
stream) may overlap their rounds on the device; the host's Python per round is serialised by the GIL. Whether the sum
beats the batch's plain steps (what ``eyas serve`` runs for 2+ clients) is what this measures.

For each K in ``--sessions`` and each temperature, on the same K x ``--prompts-each`` prompts:

    threads-spec    K threads, thread i runs its prompts through speculative_generate on target i
    threads-plain   the same with plain_generate (the threads' own overhead, without speculation)
    round-robin     one host thread steps the K sessions in turn, each on its own stream (no GIL
                    contention; a pipelined round has queued the next one when step() returns)
    batch-plain     a RowBatch of K rows takes plain steps until every prompt is answered (K at a time)

Each is run once untimed first (compilation, graph capture), then timed: output tokens / wall.
Greedy outputs of the threads are checked against one target answering the same prompts alone
(``equal_to_alone``, ``round_robin_equal_to_alone``, ``batch_equal_to_alone``; float32 is exact, bf16
may round a tie differently only across engines).

    python benchmarks/parallel_sessions_gpu.py --target /tmp/smol.gguf --sessions 1,2,4 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch


def run_threads(lanes, jobs, fn) -> tuple[list[list[list[int]]], float]:
    """Thread i runs ``fn(lanes[i].target, prompt)`` for each prompt of jobs[i] under its lane's stream
    (eyas.serve.lanes), all released together. -> (tokens [i][j], wall seconds)."""
    from eyas.engine.stats import synchronize

    out: list[list[list[int]]] = [[] for _ in lanes]
    errors: list[BaseException] = []
    gate = threading.Barrier(len(lanes) + 1)

    def work(i: int) -> None:
        try:
            gate.wait()
            with lanes[i].active():
                for p in jobs[i]:
                    out[i].append(fn(lanes[i].target, p))
                synchronize(lanes[i].target.device)  # this lane's stream
        except BaseException as e:  # noqa: BLE001 -- re-raised by the caller
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(lanes))]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return out, seconds


def run_round_robin(lanes, jobs, begin) -> tuple[list[list[list[int]]], float]:
    """One host thread steps K sessions in turn, session i on lanes[i] (what ``eyas serve
    --lone-sessions`` does): a pipelined round (``eyas.engine.speculative``) has queued the session's
    next round when step() returns, so while the host waits for one session's read-back the others'
    rounds run on the device. ``begin(target, prompt)`` starts a session. -> (tokens [i][j], wall seconds)."""
    from eyas.engine.speculative import step

    out: list[list[list[int]]] = [[] for _ in lanes]
    todo = [list(j) for j in jobs]
    live: list = [None] * len(lanes)
    device = lanes[0].target.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    while any(todo) or any(x is not None for x in live):
        for i, lane in enumerate(lanes):
            with lane.active():
                if live[i] is None and todo[i]:
                    live[i] = begin(lane.target, todo[i].pop(0))
                if live[i] is not None:
                    step(live[i])
                    if live[i].done:
                        out[i].append(list(live[i].out.tokens))
                        live[i] = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def run_batch(batch, prompts, max_new, sampling, RowRequest) -> tuple[list[list[int]], float]:
    """Plain batched steps until every prompt is answered (admitted as rows free up)."""
    for r in list(batch.busy):
        batch.release(r)
    waiting = list(enumerate(prompts))
    got: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    t0 = time.perf_counter()
    while waiting or batch.busy:
        free = len(batch.free)
        if waiting and free:
            take, waiting = waiting[:free], waiting[free:]
            firsts = batch.admit([RowRequest(p, max_new, sampling, seed=i) for i, p in take])
            for (i, _), first in zip(take, firsts):
                owner[first.row], got[i] = i, list(first.tokens)
                if first.finished:
                    batch.release(first.row)
        for out in batch.step():
            got[owner[out.row]] += out.tokens
            if out.finished:
                batch.release(out.row)
    return [got[i] for i in range(len(prompts))], time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=None, help="drafter directory (default: the one shipped for --target)")
    ap.add_argument("--sessions", default="1,2,4", help="K: lone sessions side by side (and batch rows)")
    ap.add_argument("--prompts-each", type=int, default=3, help="prompts a session answers in turn")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", default="4,8,15")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--sets", default="mt_bench,gsm8k,humaneval,alpaca")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    from eyas.bench.prompts import load_prompts
    from eyas.data.render import render_prompt
    from eyas.engine.batched import BatchedLlama
    from eyas.engine.continuous import RowBatch, RowRequest
    from eyas.engine.sampling import SamplingParams
    from eyas.engine.speculative import plain_generate, speculative_generate, start
    from eyas.engine.tree import TreeSpec
    from eyas.serve import load_served
    from eyas.serve.lanes import make_lanes
    from eyas.serve.startup import generator_for

    sv = load_served(a.target, a.draft, tree=a.tree, device=a.device,
                     log=lambda m: print(f"load: {m}", file=sys.stderr))
    tree, eos = TreeSpec.parse(a.tree), tuple(sv.loaded.eos_ids)
    ks = [int(x) for x in a.sessions.split(",")]
    K = max(ks)
    need = K * a.prompts_each
    convs = [c for name in a.sets.split(",") for c in load_prompts(name, limit=need)]
    convs = [convs[i] for i in sorted(range(len(convs)), key=lambda i: i % need)][:need]  # a mix of the sets
    prompts = [render_prompt(c.messages[:1], sv.tokenizer).tolist() for c in convs]
    lanes, warmups = make_lanes(sv, K, warm_context=512)  # the server's lanes, warmed as its idle worker does
    for warm in warmups:
        warm()
    capacity = max(map(len, prompts)) + a.max_new_tokens + 8
    batches = {k: RowBatch(BatchedLlama(sv.loaded.model, rows=k), capacity=capacity, eos_ids=eos) for k in ks}
    results = []
    for temp in [float(x) for x in a.temperatures.split(",")]:
        sampling = SamplingParams(temperature=temp)

        def begin(target, p, sampling=sampling):
            return start(target, p, sv.drafter, tree=tree, sampling=sampling,
                         generator=generator_for(target.device, len(p)), max_new_tokens=a.max_new_tokens,
                         eos_token_ids=eos, timing="off")

        def spec_fn(target, p, sampling=sampling):
            return speculative_generate(target, sv.drafter, p, tree=tree, sampling=sampling,
                                        generator=generator_for(target.device, len(p)),
                                        max_new_tokens=a.max_new_tokens, eos_token_ids=eos, timing="off").tokens

        def plain_fn(target, p, sampling=sampling):
            return plain_generate(target, p, sampling=sampling, generator=generator_for(target.device, len(p)),
                                  max_new_tokens=a.max_new_tokens, eos_token_ids=eos, timing="off").tokens

        alone = [spec_fn(sv.target, p) for p in prompts] if sampling.greedy else None
        for k in ks:
            jobs = [prompts[i * a.prompts_each:(i + 1) * a.prompts_each] for i in range(k)]
            row = {"temperature": temp, "sessions": k, "prompts": k * a.prompts_each}
            for name, fn in (("threads_spec", spec_fn), ("threads_plain", plain_fn)):
                for i in range(k):  # untimed, one lane at a time: every shape compiled and captured
                    run_threads(lanes[i:i + 1], jobs[i:i + 1], fn)  # (dynamo compiles in one thread)
                out, seconds = run_threads(lanes[:k], jobs, fn)
                tokens = sum(len(x) for o in out for x in o)
                row[name] = round(tokens / seconds, 2)
                if name == "threads_spec" and alone is not None:
                    row["equal_to_alone"] = [x for o in out for x in o] == alone[:k * a.prompts_each]
            run_round_robin(lanes[:k], jobs, begin)  # untimed
            out, seconds = run_round_robin(lanes[:k], jobs, begin)
            row["round_robin_spec"] = round(sum(len(x) for o in out for x in o) / seconds, 2)
            if alone is not None:
                row["round_robin_equal_to_alone"] = [x for o in out for x in o] == alone[:k * a.prompts_each]
            run_batch(batches[k], [p for j in jobs for p in j], a.max_new_tokens, sampling, RowRequest)
            out_b, seconds = run_batch(batches[k], [p for j in jobs for p in j], a.max_new_tokens, sampling, RowRequest)
            row["batch_plain"] = round(sum(map(len, out_b)) / seconds, 2)
            if alone is not None:
                row["batch_equal_to_alone"] = out_b == alone[:k * a.prompts_each]
            row["spec_over_batch"] = round(max(row["threads_spec"], row["round_robin_spec"]) / row["batch_plain"], 3)
            results.append(row)
            print(f"t={temp:g} K={k}: threads spec {row['threads_spec']:.1f}, round-robin spec "
                  f"{row['round_robin_spec']:.1f}, threads plain {row['threads_plain']:.1f}, "
                  f"batch plain {row['batch_plain']:.1f} tok/s ({row['spec_over_batch']:.2f}x)", file=sys.stderr)
    report = {"target": a.target, "device": str(sv.loaded.device), "dtype": str(sv.loaded.dtype), "tree": a.tree,
              "implementation": sv.target.implementation, "max_new_tokens": a.max_new_tokens,
              "prompts_each": a.prompts_each, "results": results}
    if a.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
