"""Batched speculative rounds against plain batched steps, per batch size, on the engine alone (no
server): the tokens per second of a running batch of R rows (R = 1, 2, 4, 8 by default) taking plain
steps, then chain rounds of depth 1 .. 4 (:meth:`eyas.engine.continuous.RowBatch.speculate`), at each
temperature. What ``eyas serve``'s BatchSpeculation chooses between, measured directly.
``--plain-every N`` makes every N-th step of a round setting a plain step, as a server's explorations
and stand-ins do, and ``--no-catch-up`` leaves the drafter behind after them (its rows go stale).

    PYTHONPATH=src .venv/bin/python benchmarks/row_speculation_cpu.py --target smollm2 --json \
        --plot benchmarks/results/2026-12-05-row-speculation-cpu.png

Each (R, temperature, depth) starts from the same R prompts (the first turns of the prompt sets
shipped with eyas, in turn over ``--sets``), prefilled into a fresh batch (not timed), then runs
``--steps`` steps or rounds (timed: every row's new tokens / wall seconds). Greedy rows are checked
against the plain steps' tokens (float32: equal). On a GPU the engine compiles each step and captures
it as a CUDA graph at its first use: ``--warm`` (the default there) runs every setting once untimed
first, so the figures are the steady state a server reaches (each row's ``compile_s`` says what the
timed pass still compiled: 0 when warm).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--draft", default=None, help="drafter directory (default: the one shipped for --target)")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--trees", default="", help="tree rounds too: ';'-separated DEPTH,TOPK,TOTAL")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--steps", type=int, default=24, help="steps or rounds timed per setting")
    ap.add_argument("--sets", default="mt_bench,gsm8k,sum,humaneval")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--warm", action=argparse.BooleanOptionalAction, default=None,
                    help="run each setting once untimed first (default: on a GPU)")
    ap.add_argument("--plain-every", type=int, default=0,
                    help="a plain step every N-th step of a round setting (as a server's explorations and "
                         "stand-ins): the drafter catches up on it before the next round")
    ap.add_argument("--catch-up", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-catch-up: the drafter skips the plain steps' tokens (the rows go stale; for comparison)")
    ap.add_argument("--plot", default=None, help="write a PNG: tokens/s against rows, a line per depth")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after each setting's measure, profile --profile-steps more steps (step_profile.py): "
                         "host and device time a step into the report, the top kernels into DIR/<setting>.txt")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    from eyas.bench.prompts import load_prompts
    from eyas.data.render import render_prompt
    from eyas.engine.batched import BatchedLlama
    from eyas.engine.continuous import RowBatch, RowRequest
    from eyas.engine.sampling import SamplingParams
    from eyas.serve import load_served

    sv = load_served(a.target, a.draft, tree="3", log=lambda m: print(f"load: {m}", file=sys.stderr))
    rows_list = [int(x) for x in a.rows.split(",")]
    from eyas.engine.tree import TreeSpec

    depths: list = [0] + [int(x) for x in a.depths.split(",")] + [TreeSpec.parse(x) for x in a.trees.split(";") if x]
    temps = [float(x) for x in a.temperatures.split(",")]
    R = max(rows_list)
    convs = [c for name in a.sets.split(",") for c in load_prompts(name, limit=R)]
    prompts = [render_prompt(c.messages[:1], sv.tokenizer).tolist() for c in convs]
    prompts = [prompts[i] for i in sorted(range(len(prompts)), key=lambda i: i % R)][:R]  # a mix of the sets
    extra = a.profile_steps if a.profile else 0
    limit = (max(getattr(d, "depth", d) for d in depths) + 1) * (a.steps + extra) + 8  # no row ends inside a setting
    engine = BatchedLlama(sv.loaded.model, rows=R)
    batch = RowBatch(engine, capacity=max(map(len, prompts)) + limit, drafter=sv.drafter,
                     boundaries=sv.target.spec.boundaries, row_buckets=rows_list)
    warm = engine.device.type == "cuda" if a.warm is None else a.warm
    if not a.catch_up:
        batch.spec.catch_up = lambda n, missed: None
    results = []
    for t in temps:
        sampling = SamplingParams(temperature=t)
        for n in rows_list:
            plain_tokens: dict[int, list[int]] = {}
            for depth in depths:
                label = getattr(depth, "label", depth)  # a chain: its depth (an int)
                for _ in range(2 if warm else 1):  # the last pass is the measure
                    for r in list(batch.busy):
                        batch.release(r)
                    batch.admit([RowRequest(p, limit, sampling, seed=i) for i, p in enumerate(prompts[:n])])
                    got: dict[int, list[int]] = {r: [] for r in range(n)}
                    accepted = rounds = 0
                    compiled = batch.compile_s
                    t0 = time.perf_counter()
                    for s in range(a.steps):
                        plain = not depth or (a.plain_every and s % a.plain_every == a.plain_every - 1)
                        for out in (batch.step() if plain else batch.speculate(depth)):
                            got[out.row] += out.tokens
                            accepted += out.accepted
                            rounds += not plain
                    seconds = time.perf_counter() - t0
                profiled = None
                if a.profile:  # the same rows, a few steps more, under the profiler (step_profile.py)
                    sys.path.insert(0, str(Path(__file__).resolve().parent))
                    from step_profile import StepProfile

                    with StepProfile() as prof:
                        for _ in range(a.profile_steps):
                            batch.step() if not depth else batch.speculate(depth)
                    profiled = prof.summary(a.profile_steps)
                    Path(a.profile).mkdir(parents=True, exist_ok=True)
                    prof.write_tables(Path(a.profile) / f"t{t:g}-rows{n}-{label}.txt")
                tokens = sum(map(len, got.values()))
                if depth == 0:
                    plain_tokens = got
                same = None
                if t == 0:
                    same = all(got[r][:len(plain_tokens[r])] == plain_tokens[r][:len(got[r])] for r in got)
                row = {"temperature": t, "rows": n, "depth": label, "tokens": tokens, "seconds": round(seconds, 4),
                       "tokens_per_s": round(tokens / seconds, 2),
                       "tau": round(tokens / (a.steps * n), 3),
                       "accepted_per_round": round(accepted / rounds, 3) if rounds else None,
                       "greedy_equal_to_plain": same, "compile_s": round(batch.compile_s - compiled, 3)}
                if profiled:
                    row["profile"] = profiled
                results.append(row)
                print(f"t={t:g} rows={n} depth={label}: {row['tokens_per_s']:8.1f} tok/s, tau {row['tau']:.2f}"
                      + ("" if same is None else f", equal to plain: {same}"), file=sys.stderr)
            base = next(x for x in results if x["temperature"] == t and x["rows"] == n and x["depth"] == 0)
            for x in results:
                if x["temperature"] == t and x["rows"] == n:
                    x["x_plain"] = round(x["tokens_per_s"] / base["tokens_per_s"], 3)
    report = {"target": a.target, "device": str(engine.device), "threads": torch.get_num_threads(), "warm": warm,
              "implementation": engine.implementation,
              "dtype": str(engine.dtype), "steps": a.steps, "sets": a.sets, "plain_every": a.plain_every,
              "catch_up": a.catch_up, "results": results}
    if a.plot:
        plot(results, temps, [getattr(d, "label", d) for d in depths], a.plot)
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        for x in results:
            print(f"t={x['temperature']:g} rows={x['rows']:3d} depth={x['depth']!s:>8}: {x['tokens_per_s']:8.1f} tok/s "
                  f"({x['x_plain']:.2f}x plain), tau {x['tau']:.2f}")
    return 0


def plot(results: list[dict], temps: list[float], depths: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for d in depths:
            xs = [x for x in results if x["temperature"] == t and x["depth"] == d]
            if not xs:
                continue
            ax.plot([x["rows"] for x in xs], [x["x_plain"] for x in xs], marker="o",
                    label="plain" if d == 0 else (f"tree {d}" if isinstance(d, str) else f"depth {d}"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows decoding together")
        ax.set_ylabel("tokens/s over plain batched steps")
        ax.set_title(f"temperature {t:g}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
