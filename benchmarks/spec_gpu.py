"""eyas speculative decoding against eyas plain decoding and Hugging Face `generate` (eager, and
static cache + torch.compile), in ONE process, on the six EAGLE prompt sets (issue 10, item 4).

    PYTHONPATH=src:/tmp/deps python benchmarks/spec_gpu.py --target /tmp/smol.gguf \\
        --draft benchmarks/out/smollm2/drafter --out-dir benchmarks/out/spec_gpu --commit $(git rev-parse --short HEAD)

What runs, in this order (each decoder's first calls are warm-ups, never timed; ``--budget-s``
bounds the whole run, results are written after every step so a cut run keeps what it measured):

1. load the target (GGUF path or HF directory; bf16 on a GPU) and the drafter (eyas loader, contract
   checked); the engine's target is ``build_target(model, spec, --target-impl)`` ("fast": our
   static-cache target with CUDA graphs on a GPU); HF decoders use the same model object.
2. tree selection: every ``--trees`` tree and ``--chains`` chain, interleaved per prompt, on the
   first ``--select-prompts`` MT-bench prompts at temperature 0 (``--select-per-temperature``: at
   every temperature served, each within its share of the selection budget); the best tree and the
   best chain by tokens/s go on, per temperature (all are reported).
3. a profile (torch.profiler, CPU + CUDA activities) of one speculative round of the best tree
   (``--profile-rounds``, after ``--profile-skip`` rounds), and of one plain decoding step: top ops
   by device time, GPU kernels and host launch calls per round, the GPU's idle time split into short
   gaps (launches) and long ones (waits for the host: ``device_idle``) (``profile.txt``, summary in the
   report).
4. HF warm-ups: eager; then static cache + torch.compile the way transformers 5.x documents it:
   a fixed-size cache passed to ``generate`` makes it compile the decoding step itself
   (``compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")``; the docs advise
   against compiling ``model.forward`` by hand, which recompiles the prefill for every prompt
   length). One ``StaticCache(max_cache_len = longest prompt + max new tokens)`` is reused
   (reset) across calls, so the step compiles once and its CUDA graphs replay. The first calls'
   times (compilation) are reported apart; compilation is given up after ``--compile-timeout-s``.
5. the main loop, round-robin so that a budget cut leaves every (temperature, set) with about the
   same number of prompts: for prompt i, for each temperature, for each set, every decoder back to
   back on that prompt (same seed): ``spec_tree``, ``spec_chain``, ``eyas_plain``, ``hf_compiled``
   and, for the first ``--hf-eager-prompts`` prompts only, ``hf_eager``.

Reported per set and overall, per temperature: tau, acceptance per depth, tokens/s of each decoder
(mean of per-prompt rates, as the EAGLE papers, and total tokens / total time), speedups on the
prompts both decoders ran, time per round split into draft / verify / bookkeeping (GenerationStats),
peak GPU memory per decoder, and at temperature 0 the fraction of outputs token-identical to eyas
plain with the first differing position of the others. Writes ``results.json``, ``results.md`` and
``profile.txt`` to ``--out-dir`` (each atomically: a temp file, then a rename).

On a CPU (a smoke test) the HF decoder with a static cache runs without torch.compile
(``hf_static``), unless ``--hf-compile-cpu``. Without ``--draft`` an untrained drafter is built
(acceptance near zero: it measures the machinery, not a drafter).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from eyas.bench.run import sum_lists  # noqa: E402
from eyas.bench.hf import hf_runner  # noqa: E402  (HF generate with every setting explicit; eyas bench runs it too)
from eyas.engine.stats import synchronize  # noqa: E402

SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
WARMUP_MESSAGE = "Write a short paragraph about the ocean, then list three facts about whales."
DECODER_ORDER = ("spec_tree", "spec_chain", "eyas_plain", "hf_compiled", "hf_static", "hf_eager")


def log(msg: str) -> None:
    print(f"[spec_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


class time_limit:
    """Raise TimeoutError in the main thread after ``seconds`` (SIGALRM; a no-op where it is missing):
    bounds a torch.compile that would otherwise eat the whole budget."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = hasattr(signal, "setitimer") and seconds > 0

    def _fire(self, signum: int, frame: Any) -> None:
        raise TimeoutError(f"still compiling after {self.seconds:.0f} s")

    def __enter__(self) -> "time_limit":
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (the shorter length when one is a prefix of the
    other); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------
# Decoders: each returns (new tokens, GenerationStats or None); the caller times it.
# ---------------------------------------------------------------------------------------------


def accepted_kwargs(fn: Callable[..., Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The ``--engine-kwargs`` that ``fn`` accepts (the engine's API may grow, e.g. ``timing=``)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in extra.items() if k in params}


class Decoder:
    def __init__(self, name: str, run: Callable[[torch.Tensor, Any, int], tuple[list[int], Any]],
                 label: str) -> None:
        self.name, self.run, self.label = name, run, label
        self.errors = 0
        self.disabled: str | None = None


def eyas_spec(target: Any, drafter: Any, tree: Any, eos: list[int], max_new: int, extra: dict[str, Any]):
    from eyas.engine import speculative_generate

    kw = accepted_kwargs(speculative_generate, extra)

    def run(ids: torch.Tensor, sampling: Any, seed: int) -> tuple[list[int], Any]:
        g = torch.Generator(device=target.device).manual_seed(seed)
        r = speculative_generate(target, drafter, ids, tree=tree, sampling=sampling, max_new_tokens=max_new,
                                 eos_token_ids=eos, generator=g, **kw)
        return r.tokens, r.stats

    return run


def by_temperature(runs: dict[float, Callable[[torch.Tensor, Any, int], tuple[list[int], Any]]]):
    """One decoder over per-temperature runs (a tree chosen at each temperature). A temperature
    without its own run raises (recorded as that call's error): it is never served by another's tree."""

    def run(ids: torch.Tensor, sampling: Any, seed: int) -> tuple[list[int], Any]:
        t = float(sampling.temperature)
        if t not in runs:
            raise KeyError(f"no tree chosen for temperature {t} (chosen: {sorted(runs)})")
        return runs[t](ids, sampling, seed)

    return run


def eyas_plain(target: Any, eos: list[int], max_new: int, extra: dict[str, Any]):
    from eyas.engine import plain_generate

    kw = accepted_kwargs(plain_generate, extra)

    def run(ids: torch.Tensor, sampling: Any, seed: int) -> tuple[list[int], Any]:
        g = torch.Generator(device=target.device).manual_seed(seed)
        r = plain_generate(target, ids, sampling=sampling, max_new_tokens=max_new, eos_token_ids=eos, generator=g, **kw)
        return r.tokens, r.stats

    return run


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


def _rate_mean(rows: list[dict[str, Any]]) -> float:
    rates = [r["n"] / r["s"] for r in rows if r["s"] > 0]
    return sum(rates) / len(rates) if rates else 0.0


def _rate_total(rows: list[dict[str, Any]]) -> float:
    s = sum(r["s"] for r in rows)
    return sum(r["n"] for r in rows) / s if s > 0 else 0.0


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One decoder on one set (or pooled): rows are the per-prompt records without errors."""
    ok = [r for r in rows if "error" not in r]
    out: dict[str, Any] = {"prompts": len(ok), "errors": len(rows) - len(ok), "new_tokens": sum(r["n"] for r in ok),
                           "seconds": round(sum(r["s"] for r in ok), 3),
                           "tokens_per_s": round(_rate_mean(ok), 2), "tokens_per_s_total": round(_rate_total(ok), 2)}
    mem = [r["mem"] for r in ok if r.get("mem") is not None]
    if mem:
        out["peak_mem_gib"] = round(max(mem) / 2**30, 3)
    stats = [r["stats"] for r in ok if r.get("stats") is not None]
    if stats and any(s["accept_lengths"] for s in stats):
        per_round = [n for s in stats for n in s["accept_lengths"]]
        rounds = len(per_round)
        drafted = sum_lists([s["drafted_at_depth"] for s in stats])
        accepted = sum_lists([s["accepted_at_depth"] for s in stats])
        hist = Counter(per_round)
        out.update(
            tau=round(sum(per_round) / rounds, 3) if rounds else 1.0,
            rounds=rounds,
            acceptance_at_depth=[round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)],
            accept_length_histogram={str(k): hist[k] for k in sorted(hist)},
            ms_per_round={k: round(1e3 * sum(s[f"time_{k}"] for s in stats) / rounds, 3) if rounds else None
                          for k in ("draft", "verify", "bookkeeping")},
            prefill_ms_mean=round(1e3 * sum(s["time_prefill"] for s in stats) / len(stats), 3),
        )
        out["ms_per_round"]["total"] = round(sum(v for v in out["ms_per_round"].values() if v), 3)
    elif stats:  # plain decoding: one token per step
        steps = sum(s["rounds"] for s in stats)
        out["ms_per_step"] = {k: round(1e3 * sum(s[f"time_{k}"] for s in stats) / steps, 4) if steps else None
                              for k in ("verify", "bookkeeping")}
    return out


def paired_speedup(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any] | None:
    """a's speed over b's on the prompts both ran (mean of per-prompt rates, and total)."""
    ia = {r["i"]: r for r in a if "error" not in r}
    ib = {r["i"]: r for r in b if "error" not in r}
    common = sorted(set(ia) & set(ib))
    if not common:
        return None
    ra, rb = [ia[i] for i in common], [ib[i] for i in common]
    mb, tb = _rate_mean(rb), _rate_total(rb)
    return {"prompts": len(common), "mean": round(_rate_mean(ra) / mb, 3) if mb else None,
            "total": round(_rate_total(ra) / tb, 3) if tb else None}


def identity(rows: list[dict[str, Any]], ref: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Greedy: how many outputs equal eyas plain's, and where the others part from it."""
    ir = {r["i"]: r for r in ref if "error" not in r and "tokens" in r}
    pairs = [(r["i"], first_difference(r["tokens"], ir[r["i"]]["tokens"])) for r in rows
             if "error" not in r and "tokens" in r and r["i"] in ir]
    if not pairs:
        return None
    same = sum(1 for _, d in pairs if d is None)
    return {"identical": same, "compared": len(pairs), "fraction": round(same / len(pairs), 4),
            "first_difference": [{"prompt": i, "position": d} for i, d in pairs if d is not None]}


# ---------------------------------------------------------------------------------------------
# Profile of a few speculative rounds (and plain steps)
# ---------------------------------------------------------------------------------------------

LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                "cudaEventSynchronize", "cudaStreamWaitEvent")


def device_idle(spans: list[tuple[str, float, float]], window: int, long_us: float = 5.0, top: int = 8) -> dict[str, Any]:
    """Where the GPU sits idle between the profiled window's first and last device activity.

    spans: (name, start us, end us) of every kernel, copy and memset. The idle time is the span
    less the union of the activities; each gap between one activity's end and the next one's start
    (overlaps merged) is short (under ``long_us``: a launch within a CUDA graph or a queue already
    ahead of the GPU) or long (the GPU waited for the host: a graph launch, a copy or a sync that
    came late; under torch.profiler the host runs slower, so long gaps are an upper bound). Per
    round (``window`` rounds), with the ``top`` longest gaps and the activities around them."""
    if not spans:
        return {}
    spans = sorted(spans, key=lambda x: x[1])
    busy = gaps_short = gaps_long = 0.0
    n_short = n_long = 0
    longest: list[tuple[float, str, str]] = []
    name, start, end = spans[0]
    for nxt, s0, s1 in spans[1:]:
        if s0 > end:  # a gap: the GPU idle from end to s0
            busy += end - start
            gap = s0 - end
            if gap < long_us:
                gaps_short, n_short = gaps_short + gap, n_short + 1
            else:
                gaps_long, n_long = gaps_long + gap, n_long + 1
            longest.append((gap, name, nxt))
            name, start, end = nxt, s0, s1
        elif s1 > end:
            name, end = nxt, s1
    busy += end - start
    span = end - spans[0][1]
    per = max(window, 1)
    return {"span_us_per_round": round(span / per, 1), "busy_us_per_round": round(busy / per, 1),
            "idle_us_per_round": round((span - busy) / per, 1),
            "short_gaps_per_round": round(n_short / per, 1), "short_gap_us_per_round": round(gaps_short / per, 1),
            "long_gaps_per_round": round(n_long / per, 1), "long_gap_us_per_round": round(gaps_long / per, 1),
            "longest_gaps": [{"us": round(g, 1), "after": a[:80], "before": b[:80]}
                             for g, a, b in sorted(longest, reverse=True)[:top]]}


def idle_text(idle: dict[str, Any] | None) -> str:
    """device_idle's figures as the lines a profile's text starts with."""
    if not idle:
        return ""
    lines = [f"GPU idle {idle['idle_us_per_round']} us a round of a {idle['span_us_per_round']} us span: "
             f"{idle['short_gaps_per_round']} short gaps ({idle['short_gap_us_per_round']} us), "
             f"{idle['long_gaps_per_round']} long ones ({idle['long_gap_us_per_round']} us); the longest:"]
    lines += [f"  {g['us']:8.1f} us  after {g['after']}  before {g['before']}" for g in idle["longest_gaps"]]
    return "\n".join(lines) + "\n"


def profile_rounds(name: str, generate: Callable[[], Any], target: Any, rounds: int, skip: int) -> dict[str, Any]:
    """Profile ``rounds`` rounds of ``generate()`` (a speculative or plain generation on ``target``):
    the window runs from the target's (skip+2)-th forward call (call 1 is the prefill) to the
    forward ``rounds`` calls later, so it holds whole rounds (verify, bookkeeping, drafter update,
    next draft). Falls back to the whole generation when the engine calls the target otherwise."""
    from torch.profiler import ProfilerActivity, profile

    cuda = target.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=acts)
    state: dict[str, Any] = {"calls": 0, "start": None, "stop": None, "t0": 0.0, "t1": 0.0}
    orig = target.forward

    def wrapped(*a: Any, **k: Any) -> Any:
        state["calls"] += 1
        c = state["calls"]
        if c == skip + 2 and state["start"] is None:
            synchronize(target.device)
            prof.start()
            state["start"], state["t0"] = c, time.perf_counter()
        elif state["start"] is not None and state["stop"] is None and c == state["start"] + rounds:
            synchronize(target.device)
            state["t1"] = time.perf_counter()
            prof.stop()
            state["stop"] = c
        return orig(*a, **k)

    target.forward = wrapped
    try:
        result = generate()
    finally:
        target.__dict__.pop("forward", None)
    note = None
    if state["start"] is None:  # the engine never called target.forward enough: profile it all
        note = f"whole generation profiled ({state['calls']} target.forward calls seen)"
        prof = profile(activities=acts)
        synchronize(target.device)
        with prof:
            state["t0"] = time.perf_counter()
            result = generate()
            synchronize(target.device)
            state["t1"] = time.perf_counter()
        window = max(result.stats.rounds, 1)
    elif state["stop"] is None:
        synchronize(target.device)
        state["t1"] = time.perf_counter()
        prof.stop()
        window = state["calls"] - state["start"] + 1
        note = f"generation ended after {window} profiled rounds"
    else:
        window = rounds
    events = prof.events()
    launches = Counter(e.name for e in events if e.name in LAUNCH_NAMES)
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    kernel_us = sum(e.time_range.elapsed_us() for e in kernels)
    # Ops by total device time (parents include their children), then by self device time (the
    # kernels themselves); on a CPU by CPU time.
    groups = ((("device_time_total", "cuda_time_total"), ("self_device_time_total", "self_cuda_time_total"))
              if cuda else (("cpu_time_total",), ("self_cpu_time_total",)))
    tables = []
    for keys in groups:
        for key in keys:
            try:
                tables.append(f"sorted by {key}:\n"
                              + prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
                break
            except Exception:  # noqa: BLE001 - the key's name changed across torch versions
                continue
    table = "\n".join(tables)
    out = {
        "name": name, "rounds": window, "wall_ms_per_round": round(1e3 * (state["t1"] - state["t0"]) / window, 3),
        "gpu_kernels_per_round": round(len(kernels) / window, 1),
        "gpu_kernel_ms_per_round": round(kernel_us / 1e3 / window, 3),
        "host_calls_per_round": {k: round(v / window, 1) for k, v in sorted(launches.items())},
        "kernel_launches_per_round": round(sum(launches[k] for k in LAUNCH_NAMES if "Launch" in k
                                               and k != "cudaGraphLaunch") / window, 1),
        "graph_launches_per_round": round(launches["cudaGraphLaunch"] / window, 1),
        "device_idle": device_idle([(e.name, e.time_range.start, e.time_range.end) for e in kernels], window),
        "table": table,
    }
    if note:
        out["note"] = note
    return out


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _f(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"# eyas speculative decoding on {m.get('machine', '?')} ({m['date'][:10]})", ""]
    lines += [f"- Status: {res.get('status', '?')}; elapsed {res.get('elapsed_s', 0):.0f} s of a {m['budget_s']:.0f} s budget.",
              f"- Machine: {m.get('machine')}; torch {m.get('torch')}, transformers {m.get('transformers')}, "
              f"Python {m.get('python')}.",
              f"- Commit: {m.get('commit')}. Command: `{m.get('command')}`",
              f"- Target: {m.get('target')} ({m.get('target_impl')}, {m.get('dtype')}, {m.get('device')}); "
              f"drafter: {m.get('draft')}.",
              f"- Max new tokens {m['max_new_tokens']}; temperatures {m['temperatures']}; sets {', '.join(m['sets'])}; "
              f"up to {m['prompts_per_set']} prompts per set ({m['hf_eager_prompts']} for HF eager).",
              ""]
    d = res.get("drafter") or {}
    if d.get("metrics"):
        mt = d["metrics"]
        lines += [f"Drafter held-out metrics (eyas.json): simulated accept length {mt.get('simulated_accept_length')}, "
                  f"accuracy per position {mt.get('accuracy_per_position')}, step {mt.get('step')}.", ""]
    if d.get("train"):
        lines += [f"Drafter training (eyas train): {json.dumps(d['train'])}", ""]
    if d.get("pipeline"):
        pl = d["pipeline"]
        lines += [f"Drafter pipeline (train_smollm2_drafter.py): {json.dumps({k: pl.get(k) for k in ('regenerate', 'train', 'drafter_from', 'total_wall_s')})}", ""]
    selections = res.get("tree_selection_by_temperature") or {"t0": res.get("tree_selection")}
    for tkey, sel in selections.items():
        if not (sel and sel.get("candidates")):
            continue
        lines += [f"## Tree selection (MT-bench, temperature {tkey[1:]}, {sel.get('prompts')} prompts)", "",
                  "| tree (depth,topk,total) | tau | tok/s | ms/round draft | verify | bookkeeping | chosen |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for c in sel["candidates"]:
            s = c.get("summary") or {}
            mpr = s.get("ms_per_round") or {}
            chosen = "**tree**" if c["label"] == sel.get("best_tree") else ("**chain**" if c["label"] == sel.get("best_chain") else "")
            lines.append(f"| {c['label']} | {_f(s.get('tau'), 2)} | {_f(s.get('tokens_per_s'))} | {_f(mpr.get('draft'), 2)} | "
                         f"{_f(mpr.get('verify'), 2)} | {_f(mpr.get('bookkeeping'), 2)} | {chosen} |")
        lines.append("")
    ta = res.get("tree_auto")
    if ta:
        lines += [f"## --tree auto on the fast path ({ta.get('prompts')} MT-bench prompts, temperature 0)", "",
                  f"Chose {ta['depth']},{ta['top_k']},{ta['total_tokens']} in {ta.get('tune_seconds')} s: predicted "
                  f"{ta['round_ms']} ms per round and tau {ta['predicted_tau']}; measured {ta.get('measured_round_ms')} ms "
                  f"per round and tau {ta.get('measured_tau')} (round prediction error "
                  f"{_f(100 * ta['round_prediction_error'] if ta.get('round_prediction_error') is not None else None)}%).",
                  "", f"Reason: {ta.get('reason')}", ""]
    wu = res.get("warmup") or {}
    if wu:
        lines += ["Warm-up (not timed in the results): " + "; ".join(
            f"{k} {', '.join(f'{x:.2f}' for x in v.get('seconds', []))} s" for k, v in wu.items()), ""]
    for tkey, tres in (res.get("results") or {}).items():
        decs = [d for d in DECODER_ORDER if any(d in s for s in tres["sets"].values())]
        lines += [f"## Temperature {tres['temperature']}", "",
                  "tokens/s = mean of per-prompt rates (EAGLE papers); speedups on the prompts both decoders ran.", "",
                  "| set | n | tau tree | tau chain | " + " | ".join(decs) + f" | tree/plain | tree/{res.get('hf_static_name', 'hf_compiled')} | tree/hf_eager |"
                  + (" same as plain (tree, chain, HF) |" if tres["temperature"] == 0 else ""),
                  "| --- " * (4 + len(decs) + 3) + ("| --- " if tres["temperature"] == 0 else "") + "|"]
        rows = list(tres["sets"].items()) + [("**overall**", tres["overall"])]
        for name, s in rows:
            n = (s.get("eyas_plain") or s.get("spec_tree") or {}).get("prompts", 0)
            sp = s.get("speedups", {})
            cells = [name, str(n), _f((s.get("spec_tree") or {}).get("tau"), 2), _f((s.get("spec_chain") or {}).get("tau"), 2)]
            cells += [_f((s.get(d) or {}).get("tokens_per_s")) for d in decs]
            cells += [_f((sp.get("spec_tree/eyas_plain") or {}).get("mean"), 2),
                      _f((sp.get(f"spec_tree/{res.get('hf_static_name', 'hf_compiled')}") or {}).get("mean"), 2),
                      _f((sp.get("spec_tree/hf_eager") or {}).get("mean"), 2)]
            if tres["temperature"] == 0:
                ids = s.get("identical_to_plain", {})
                cells.append(", ".join(f"{ids[k]['identical']}/{ids[k]['compared']}" if ids.get(k) else "-"
                                       for k in ("spec_tree", "spec_chain", res.get("hf_static_name", "hf_compiled"))))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Acceptance per draft depth, time per round (ms: draft / verify / bookkeeping), peak memory (GiB):", ""]
        for name, s in rows:
            parts = []
            for d in ("spec_tree", "spec_chain"):
                x = s.get(d) or {}
                if x.get("acceptance_at_depth") is not None:
                    mpr = x.get("ms_per_round") or {}
                    parts.append(f"{d}: acc {[round(a, 2) for a in x['acceptance_at_depth']]}, "
                                 f"{_f(mpr.get('draft'), 2)} / {_f(mpr.get('verify'), 2)} / {_f(mpr.get('bookkeeping'), 2)} ms")
            mem = ", ".join(f"{d} {_f((s.get(d) or {}).get('peak_mem_gib'), 2)}" for d in decs if (s.get(d) or {}).get("peak_mem_gib"))
            lines.append(f"- {name}: " + "; ".join(parts) + (f"; peak memory {mem}" if mem else ""))
        if tres["temperature"] == 0:
            diffs = []
            for name, s in tres["sets"].items():
                for d, v in (s.get("identical_to_plain") or {}).items():
                    if v and v["first_difference"]:
                        diffs.append(f"{name}/{d}: " + ", ".join(f"prompt {x['prompt']} at token {x['position']}"
                                                                 for x in v["first_difference"][:8]))
            if diffs:
                lines += ["", "Greedy outputs that differ from eyas plain (first differing position):", ""]
                lines += [f"- {x}" for x in diffs]
        lines.append("")
    prof = res.get("profile") or {}
    if prof:
        lines += ["## Profile (torch.profiler; full tables in profile.txt)", "",
                  "| what | rounds | wall ms/round | GPU kernels/round | GPU kernel ms/round | kernel launches/round | "
                  "graph launches/round | GPU idle us/round (short gaps, long gaps) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for k, p in prof.items():
            if isinstance(p, dict) and "rounds" in p:
                idle = p.get("device_idle") or {}
                gaps = (f"{_f(idle['idle_us_per_round'])} ({_f(idle['short_gap_us_per_round'])} in "
                        f"{_f(idle['short_gaps_per_round'])}, {_f(idle['long_gap_us_per_round'])} in "
                        f"{_f(idle['long_gaps_per_round'])})") if idle else "-"
                lines.append(f"| {k} | {p['rounds']} | {_f(p['wall_ms_per_round'], 3)} | {_f(p['gpu_kernels_per_round'])} | "
                             f"{_f(p['gpu_kernel_ms_per_round'], 3)} | {_f(p['kernel_launches_per_round'])} | "
                             f"{_f(p['graph_launches_per_round'])} | {gaps} |")
            elif isinstance(p, dict) and "error" in p:
                lines.append(f"| {k} | error: {p['error'][:120]} | | | | | | |")
        lines.append("")
    if res.get("notes") or res.get("errors"):
        lines += ["## Notes and errors", ""]
        lines += [f"- {n}" for n in res.get("notes", [])]
        lines += [f"- error in {e['where']}: " + " ".join(e["error"].split())[:400] for e in res.get("errors", [])[:30]]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.budget = Budget(a.budget_s)
        self.out = Path(a.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.res: dict[str, Any] = {"status": "starting", "notes": [], "errors": []}
        # records[temp_key][set][decoder] = list of per-prompt dicts (tokens kept in memory only)
        self.records: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
        self.profile_text = ""

    # -- bookkeeping ------------------------------------------------------------------------

    def note(self, msg: str) -> None:
        log(f"note: {msg}")
        self.res["notes"].append(msg)

    def error(self, where: str, e: BaseException) -> None:
        msg = f"{type(e).__name__}: {e}"
        log(f"error in {where}: {msg}")
        self.res["errors"].append({"where": where, "error": msg[:2000], "traceback": traceback.format_exc()[-4000:]})

    def write(self, status: str | None = None) -> None:
        if status:
            self.res["status"] = status
        self.res["elapsed_s"] = round(self.budget.elapsed(), 1)
        self.res["results"] = self.summaries()
        try:
            atomic_write(self.out / "results.json", json.dumps(self.res, indent=2, default=str))
            atomic_write(self.out / "results.md", markdown(self.res))
            if self.profile_text:
                atomic_write(self.out / "profile.txt", self.profile_text)
        except Exception as e:  # noqa: BLE001 - never lose the run over a report
            log(f"could not write results: {e!r}")

    def summaries(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        hf_name = self.res.get("hf_static_name", "hf_compiled")
        for tkey, sets in self.records.items():
            temp = float(tkey[1:])
            greedy = temp == 0
            per_set: dict[str, Any] = {}
            pooled: dict[str, list[dict[str, Any]]] = {}
            for sname, decs in sets.items():
                # pooled rows get a set-qualified prompt index so pairing stays per prompt
                for d, rows in decs.items():
                    pooled.setdefault(d, []).extend({**r, "i": f"{sname}:{r['i']}"} for r in rows)
            for sname, decs in list(sets.items()) + [("__overall__", pooled)]:
                s: dict[str, Any] = {d: summarize(rows) for d, rows in decs.items() if rows}
                sp = {}
                for a_ in ("spec_tree", "spec_chain"):
                    for b_ in ("eyas_plain", hf_name, "hf_eager"):
                        if a_ in decs and b_ in decs:
                            v = paired_speedup(decs[a_], decs[b_])
                            if v:
                                sp[f"{a_}/{b_}"] = v
                if "eyas_plain" in decs:
                    for b_ in (hf_name, "hf_eager"):
                        if b_ in decs:
                            v = paired_speedup(decs["eyas_plain"], decs[b_])
                            if v:
                                sp[f"eyas_plain/{b_}"] = v
                s["speedups"] = sp
                if greedy and "eyas_plain" in decs:
                    s["identical_to_plain"] = {d: identity(rows, decs["eyas_plain"]) for d, rows in decs.items()
                                               if d != "eyas_plain"}
                s["prompt_rows"] = {d: [{k: v for k, v in r.items() if k not in ("tokens", "stats")}
                                        | ({"tau": round(sum(r["stats"]["accept_lengths"]) / len(r["stats"]["accept_lengths"]), 3)}
                                           if r.get("stats") and r["stats"].get("accept_lengths") else {})
                                        for r in rows] for d, rows in decs.items()} if sname != "__overall__" else None
                if sname == "__overall__":
                    s.pop("prompt_rows")
                    out.setdefault(tkey, {"temperature": temp, "sets": per_set})["overall"] = s
                else:
                    per_set[sname] = s
            out.setdefault(tkey, {"temperature": temp, "sets": per_set, "overall": {}})
        return out

    # -- timing one call ---------------------------------------------------------------------

    def timed(self, dec: Decoder, ids: torch.Tensor, sampling: Any, seed: int) -> dict[str, Any]:
        dev = self.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        synchronize(dev)
        t0 = time.perf_counter()
        tokens, stats = dec.run(ids, sampling, seed)
        synchronize(dev)
        dt = time.perf_counter() - t0
        row: dict[str, Any] = {"n": len(tokens), "s": round(dt, 5), "tokens": tokens}
        if dev.type == "cuda":
            row["mem"] = torch.cuda.max_memory_allocated(dev)
        if stats is not None:
            row["stats"] = {k: getattr(stats, k) for k in ("accept_lengths", "accepted_at_depth", "drafted_at_depth",
                                                            "rounds", "time_prefill", "time_draft", "time_verify",
                                                            "time_bookkeeping", "time_total")}
        return row

    def call(self, dec: Decoder, ids: torch.Tensor, sampling: Any, seed: int, where: str) -> dict[str, Any]:
        try:
            return self.timed(dec, ids, sampling, seed)
        except Exception as e:  # noqa: BLE001 - one decoder's failure must not end the run
            dec.errors += 1
            self.error(f"{dec.name} {where}", e)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if dec.errors >= self.a.max_errors:
                dec.disabled = f"{dec.errors} errors"
                self.note(f"{dec.name} disabled after {dec.errors} errors")
            return {"error": f"{type(e).__name__}: {e}"[:500]}

    # -- phases ------------------------------------------------------------------------------

    def setup(self) -> None:
        a = self.a
        import transformers

        from eyas.bench.prompts import load_prompts
        from eyas.convention import CaptureSpec
        from eyas.data.render import render_prompt
        from eyas.engine import SamplingParams, TreeSpec, build_target
        from eyas.interop import load_drafter, read_contract
        from eyas.targets import load_target

        self.SamplingParams, self.TreeSpec = SamplingParams, TreeSpec
        t0 = time.perf_counter()
        loaded = load_target(a.target, dtype=a.dtype, device=a.device)
        self.loaded, self.device, self.tokenizer = loaded, loaded.device, loaded.tokenizer
        log(f"target {a.target} loaded in {time.perf_counter() - t0:.1f} s: {loaded.num_blocks} blocks, {loaded.dtype}, "
            f"{loaded.device}, eos {list(loaded.eos_ids)}")
        drafter_info: dict[str, Any] = {"path": a.draft}
        drafter = None
        if a.draft:
            try:
                drafter, contract = load_drafter(a.draft, target=loaded, tokenizer=loaded.tokenizer, force=a.force)
            except Exception as e:  # noqa: BLE001 - a GPU call is too dear to lose over the contract
                self.error("load_drafter", e)
                if not a.force:
                    try:
                        drafter, contract = load_drafter(a.draft, target=loaded, tokenizer=loaded.tokenizer, force=True)
                        drafter_info["forced"] = True
                        self.note("THE DRAFTER'S CONTRACT DOES NOT MATCH THE TARGET (see errors): loaded with "
                                  "force=True, its figures are suspect")
                    except Exception as e2:  # noqa: BLE001
                        self.error("load_drafter (force)", e2)
        if drafter is not None:
            try:
                c = read_contract(a.draft)
                if c is not None and c.metrics is not None:
                    drafter_info["metrics"] = c.metrics.model_dump()
            except Exception as e:  # noqa: BLE001
                self.note(f"could not read the drafter's contract metrics: {e!r}")
            # train_smollm2_drafter.py's records: eyas train's config, and the pipeline's summary
            # (WORK/summary.json beside WORK/drafter, or train_summary.json beside $OUT/drafter)
            for name, key in (("train_config.json", "train"), ("../summary.json", "pipeline"),
                              ("../train_summary.json", "pipeline")):
                p = Path(a.draft) / name
                if p.exists() and key not in drafter_info:
                    try:
                        drafter_info[key] = json.loads(p.read_text())
                    except Exception:  # noqa: BLE001
                        pass
            if "pipeline" in drafter_info:
                pl = drafter_info["pipeline"]
                drafter_info["pipeline"] = {k: pl.get(k) for k in ("calibration", "regenerate", "train", "drafter_from",
                                                                    "total_wall_s") if k in pl}
        else:
            from eyas.drafter.build import new_drafter

            drafter, contract = new_drafter(loaded, loaded.tokenizer, None, a.draft_vocab, source=str(a.target), seed=0)
            drafter_info["path"] = "untrained (new_drafter)"
            self.note(("no --draft" if not a.draft else f"--draft {a.draft} could not be loaded")
                      + ": an UNTRAINED drafter (acceptance near zero; it measures the machinery only)")
        if "train" in drafter_info:  # the essentials only
            t = drafter_info["train"]
            drafter_info["train"] = {k: t.get(k) for k in ("steps", "batch_size", "lr", "ttt_steps", "draft_vocab_size",
                                                           "max_length", "data") if k in t}
        self.contract = contract
        drafter_info["boundaries"] = list(contract.capture.boundaries)
        drafter_info["draft_vocab_size"] = drafter.config.draft_vocab_size
        self.res["drafter"] = drafter_info
        self.drafter = drafter.to(loaded.device, dtype=loaded.dtype).eval()
        spec = CaptureSpec(tuple(contract.capture.boundaries), loaded.num_blocks)
        try:
            self.target = build_target(loaded.model, spec, a.target_impl, matvec=a.matvec, attention=a.attention)
        except Exception as e:  # noqa: BLE001 - e.g. an architecture the fast target does not implement
            self.error("build_target", e)
            self.note(f"--target-impl {a.target_impl} failed; using auto")
            self.target = build_target(loaded.model, spec, "auto")
        if a.drafter_compile != "auto":  # the engine compiles the drafter's steps where it graphs them
            self.target.compile_drafter = a.drafter_compile == "on"
        self.eos = list(loaded.eos_ids)
        self.context = int(getattr(self.target, "max_length", 0) or 2**31 - 1)
        self.pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else self.eos[0]
        from eyas.engine import plain_generate, speculative_generate

        self.res["meta"] = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
            else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "command": shlex.join([Path(sys.executable).name] + sys.argv), "commit": commit(a.commit),
            "target": a.target, "target_impl": getattr(self.target, "implementation", "?"), "dtype": str(loaded.dtype),
            "device": str(loaded.device), "draft": drafter_info["path"], "max_new_tokens": a.max_new_tokens,
            "temperatures": a.temperatures, "sets": a.sets, "prompts_per_set": a.prompts_per_set,
            "hf_eager_prompts": a.hf_eager_prompts, "budget_s": a.budget_s, "seed": a.seed,
            "engine_kwargs": a.engine_kwargs,
            "engine_api": {"speculative_generate": str(inspect.signature(speculative_generate)),
                           "plain_generate": str(inspect.signature(plain_generate))},
            "eos_ids": self.eos, "pad_id": self.pad,
            "drafter_compile": a.drafter_compile,
        }
        # Prompts: first turn, rendered with the chat template.
        self.prompts: dict[str, list[torch.Tensor]] = {}
        for s in a.sets:
            convs = load_prompts(s, a.prompts_per_set)
            self.prompts[s] = [render_prompt(c, loaded.tokenizer)[None].to(self.device) for c in convs]
        sel = load_prompts("mt_bench", a.select_prompts)
        self.select_prompts = [render_prompt(c, loaded.tokenizer)[None].to(self.device) for c in sel]
        self.warm_ids = render_prompt([{"role": "user", "content": WARMUP_MESSAGE}], loaded.tokenizer)[None].to(self.device)
        longest = max([p.shape[1] for ps in self.prompts.values() for p in ps] + [self.warm_ids.shape[1]])
        self.max_cache_len = longest + a.max_new_tokens + 8
        self.res["meta"]["longest_prompt_tokens"] = longest
        # every token bucket, with the key buckets of the longest sequence, compiled and captured now,
        # never inside a timed round
        self.target_warmup_s = (self.target.warmup(context=self.max_cache_len) if hasattr(self.target, "warmup")
                                else 0.0)
        self.res["meta"]["target_warmup_s"] = round(self.target_warmup_s, 2)
        log(f"prompts: {', '.join(f'{s} {len(p)}' for s, p in self.prompts.items())}; longest {longest} tokens; "
            f"target implementation {self.res['meta']['target_impl']}")
        if self.device.type == "cuda":
            self.res["meta"]["memory_after_load_gib"] = round(torch.cuda.memory_allocated(self.device) / 2**30, 3)

    def select_trees(self, temperature: float = 0.0, share: float = 1.0) -> tuple[Any, Any]:
        """Every candidate on the selection prompts at ``temperature`` (seeded per prompt), within
        ``share`` of the selection's budget; returns (best tree, best chain) by tokens/s."""
        a = self.a
        TreeSpec = self.TreeSpec
        cands = []
        for t in a.trees:
            spec = TreeSpec.parse(t)
            cands.append((f"{spec.depth},{spec.top_k},{spec.total_tokens}", spec, "tree" if spec.top_k > 1 else "chain"))
        for c in a.chains:
            spec = TreeSpec.chain(int(c))
            cands.append((f"{spec.depth},1,{spec.depth}", spec, "chain"))
        top = max(getattr(self.target, "buckets", ()) or (0,))
        for label, spec, _ in cands:
            if getattr(self.target, "cuda_graphs", False) and spec.total_tokens + 1 > top:
                self.note(f"tree {label}: {spec.total_tokens + 1} verified tokens exceed the largest CUDA-graph "
                          f"bucket ({top}) of the fast target: its verification runs eagerly")
        sampling = self.SamplingParams(float(temperature))
        decs = {label: Decoder(label, eyas_spec(self.target, self.drafter, spec, self.eos, a.max_new_tokens,
                                                a.engine_kwargs), label) for label, spec, _ in cands}
        rows: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in cands}
        sel_res: dict[str, Any] = {"temperature": float(temperature), "prompts": 0, "candidates": []}
        self.res.setdefault("tree_selection_by_temperature", {})[f"t{float(temperature):g}"] = sel_res
        if temperature == 0:
            self.res["tree_selection"] = sel_res
        for label, dec in decs.items():  # warm-up (CUDA graph capture of its buckets)
            for _ in range(a.warmup):
                r = self.call(dec, self.warm_ids, sampling, 0, "warm-up")
                if "error" in r:
                    dec.disabled = "warm-up failed"
                    break
        limit = self.budget.elapsed() + a.budget_s * a.select_share * share
        done = 0
        for i, ids in enumerate(self.select_prompts):
            # at least one prompt: a warm-up that ate the share (compilations) must not leave the
            # choice to the order the trees were given in
            if done and self.budget.elapsed() > limit:
                self.note(f"tree selection stopped after {done} prompts (its budget share {a.select_share:.0%})")
                break
            for label, dec in decs.items():
                if dec.disabled:
                    continue
                r = self.call(dec, ids, sampling, a.seed + i, f"selection prompt {i} t={temperature}")
                rows[label].append({"i": i, **r})
            done += 1
        sel_res["prompts"] = done
        best: dict[str, tuple[float, str, Any]] = {}
        for label, spec, kind in cands:
            s = summarize(rows[label])
            sel_res["candidates"].append({"label": label, "kind": kind, "summary": s,
                                          **({"disabled": decs[label].disabled} if decs[label].disabled else {})})
            if s["prompts"] and (kind not in best or s["tokens_per_s"] > best[kind][0]):
                best[kind] = (s["tokens_per_s"], label, spec)
        sel_res["best_tree"] = best["tree"][1] if "tree" in best else None
        sel_res["best_chain"] = best["chain"][1] if "chain" in best else None
        log(f"tree selection t={temperature}: " + "; ".join(f"{c['label']} tau {c['summary'].get('tau', 1):.2f} "
                                           f"{c['summary']['tokens_per_s']:.1f} tok/s" for c in sel_res["candidates"])
            + f" -> tree {sel_res['best_tree']}, chain {sel_res['best_chain']}")
        return (best["tree"][2] if "tree" in best else None), (best["chain"][2] if "chain" in best else None)

    def tree_auto_check(self) -> None:
        """``--tree auto`` on the fast path (issue 10, item 3): tune_tree calibrated on the first
        3 MT-bench prompts, then its tree served greedily on the selection prompts; the predicted
        round time against the rounds those generations paid (GenerationStats.time_rounds)."""
        from eyas.engine import speculative_generate
        from eyas.tune import tune_tree

        t0 = time.perf_counter()
        calibration = [p[0].tolist() for p in self.select_prompts[:3]]
        choice = tune_tree(self.target, self.drafter, calibration, self.contract, eos_token_ids=self.eos)
        tuned_s = time.perf_counter() - t0
        rounds = seconds = tokens = 0.0
        for ids in self.select_prompts:
            st = speculative_generate(self.target, self.drafter, ids, tree=choice.spec, max_new_tokens=self.a.max_new_tokens,
                                      eos_token_ids=self.eos, timing="off").stats
            rounds += len(st.accept_lengths)
            seconds += st.time_rounds
            tokens += sum(st.accept_lengths)
        measured_ms = 1e3 * seconds / rounds if rounds else None
        entry = choice.to_dict()
        entry.update(tune_seconds=round(tuned_s, 2), prompts=len(self.select_prompts),
                     measured_round_ms=round(measured_ms, 4) if measured_ms else None,
                     measured_tau=round(tokens / rounds, 4) if rounds else None,
                     round_prediction_error=round(choice.round_s * 1e3 / measured_ms - 1, 4) if measured_ms else None)
        self.res["tree_auto"] = entry
        log(f"--tree auto: {choice.spec} predicted {choice.round_s * 1e3:.3f} ms/round, tau {choice.predicted_tau:.2f}; "
            f"measured {measured_ms} ms/round, tau {entry['measured_tau']} ({tuned_s:.1f} s to tune)")

    def profile(self, tree: Any) -> None:
        from eyas.engine import plain_generate, speculative_generate

        a = self.a
        self.res["profile"] = {}
        texts = []
        ids = self.select_prompts[0] if self.select_prompts else self.warm_ids
        max_new = max(a.max_new_tokens, 4 * (a.profile_rounds + a.profile_skip + 2))
        jobs = []
        if tree is not None:
            jobs.append(("spec_tree", lambda: speculative_generate(
                self.target, self.drafter, ids, tree=tree, max_new_tokens=max_new, eos_token_ids=[],
                **accepted_kwargs(speculative_generate, a.engine_kwargs))))
        jobs.append(("eyas_plain", lambda: plain_generate(self.target, ids, max_new_tokens=max_new, eos_token_ids=[],
                                                          **accepted_kwargs(plain_generate, a.engine_kwargs))))
        for name, fn in jobs:
            try:
                fn()  # warm (graphs of every bucket it meets)
                p = profile_rounds(name, fn, self.target, a.profile_rounds, a.profile_skip)
                texts.append(f"=== {name}: {p['rounds']} rounds ({'speculative rounds' if name != 'eyas_plain' else 'plain decoding steps'}), "
                             f"{p['wall_ms_per_round']:.3f} ms wall per round, {p['gpu_kernels_per_round']} GPU kernels per round, "
                             f"host calls per round {p['host_calls_per_round']}"
                             + (f"; {p['note']}" if p.get("note") else "") + " ===\n" + idle_text(p.get("device_idle"))
                             + p.pop("table") + "\n")
                self.res["profile"][name] = p
                log(f"profile {name}: {p['wall_ms_per_round']:.3f} ms/round, {p['gpu_kernels_per_round']} kernels/round, "
                    f"{p['kernel_launches_per_round']} launches + {p['graph_launches_per_round']} graph launches per round")
            except Exception as e:  # noqa: BLE001
                self.error(f"profile {name}", e)
                self.res["profile"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        head = (f"torch.profiler of eyas decoding on {self.res['meta']['machine']}, target {self.res['meta']['target_impl']}; "
                f"window = whole rounds from the target's forward call {a.profile_skip + 2} on (call 1 is the prefill); "
                f"times are totals over the window (divide by its rounds)\n\n")
        self.profile_text = head + "\n".join(texts)

    def hf_decoders(self) -> list[Decoder]:
        a = self.a
        model = self.loaded.model
        out = []
        if "hf_eager" not in a.skip:
            dec = Decoder("hf_eager", hf_runner(model, self.eos, self.pad, a.max_new_tokens), "HF generate, eager, DynamicCache")
            t0 = time.perf_counter()
            r = self.call(dec, self.warm_ids, self.SamplingParams(0.0), 0, "warm-up")
            self.res.setdefault("warmup", {})["hf_eager"] = {"seconds": [round(time.perf_counter() - t0, 2)]}
            if "error" not in r:
                out.append(dec)
        if "hf_compiled" in a.skip:
            return out
        cuda = self.device.type == "cuda"
        compile_it = cuda or a.hf_compile_cpu
        name = "hf_compiled" if compile_it else "hf_static"
        self.res["hf_static_name"] = name
        if compile_it and self.budget.left() < a.compile_reserve_s:
            self.note(f"hf_compiled skipped: {self.budget.left():.0f} s left, compiling needs ~{a.compile_reserve_s:.0f} s")
            return out
        try:
            from transformers import CompileConfig, StaticCache

            cache = StaticCache(config=model.config, max_cache_len=self.max_cache_len)
        except Exception as e:  # noqa: BLE001
            self.error("hf static cache", e)
            return out
        if not compile_it:
            self.note("hf_static: static cache without torch.compile (CPU); pass --hf-compile-cpu to compile anyway")
        for fullgraph in ((True, False) if a.hf_fullgraph else (False,)):
            cc = None
            if compile_it:
                cc = CompileConfig(fullgraph=fullgraph, mode=a.hf_compile_mode)
                if not cuda:
                    cc._compile_all_devices = True
            dec = Decoder(name, hf_runner(model, self.eos, self.pad, a.max_new_tokens, cache=cache, compile_config=cc,
                                          disable_compile=not compile_it),
                          f"HF generate, StaticCache(max_cache_len={self.max_cache_len})"
                          + (f", decoding step torch.compile(mode={a.hf_compile_mode!r}, fullgraph={fullgraph})" if compile_it else ""))
            times, err = [], None
            for k in range(max(a.warmup, 2) + (1 if compile_it else 0)):
                t0 = time.perf_counter()
                # the first call compiles: bounded so that a slow compilation cannot take the budget
                limit = min(a.compile_timeout_s, self.budget.left() - a.reserve_s) if compile_it and k == 0 else 0
                with time_limit(max(limit, 1.0) if limit else 0):
                    r = self.call(dec, self.warm_ids, self.SamplingParams(0.0), 0, f"warm-up {k}")
                times.append(round(time.perf_counter() - t0, 2))
                if "error" in r:
                    err = r["error"]
                    break
            ok = err is None
            self.res.setdefault("warmup", {})[name] = {"seconds": times, "label": dec.label}
            if ok:
                if compile_it:
                    self.res["warmup"][name]["compile_s_estimate"] = round(times[0] - times[-1], 2)
                    log(f"{name}: warm-up calls {times} s (the first includes compilation)")
                out.append(dec)
                break
            # Only a graph break is worth a second compilation without fullgraph; anything else would
            # fail again after as long.
            if compile_it and fullgraph and any(w in err for w in ("Unsupported", "graph break", "fullgraph", "Graph break")):
                self.note("hf_compiled with fullgraph=True failed at a graph break; retrying with fullgraph=False")
                try:
                    torch._dynamo.reset()
                    model.__dict__.pop("_compiled_call", None)
                except Exception:  # noqa: BLE001
                    pass
                dec.errors = 0
                continue
            break
        return out

    def main_loop(self, decoders: list[Decoder]) -> None:
        a = self.a
        temps = a.temperatures
        n_max = max(len(p) for p in self.prompts.values())
        try:
            from tqdm import tqdm

            bar = tqdm(total=n_max, desc="prompts per set", mininterval=5, dynamic_ncols=True)
        except Exception:  # noqa: BLE001
            bar = None
        stop = False
        for i in range(n_max):
            for temp in temps:
                sampling = self.SamplingParams(float(temp))
                tkey = f"t{float(temp):g}"
                for s in a.sets:
                    if i >= len(self.prompts[s]):
                        continue
                    if self.budget.left() < a.reserve_s:
                        self.note(f"budget reached at prompt {i} (temperature {temp}, set {s}): the rest is skipped")
                        stop = True
                        break
                    ids = self.prompts[s][i]
                    if ids.shape[1] + a.max_new_tokens > self.context:
                        self.note(f"{s} prompt {i}: {ids.shape[1]} tokens + {a.max_new_tokens} new exceed the "
                                  f"target's context ({self.context}); skipped")
                        continue
                    for dec in decoders:
                        if dec.disabled or (dec.name == "hf_eager" and i >= a.hf_eager_prompts):
                            continue
                        r = self.call(dec, ids, sampling, a.seed + i, f"t={temp} {s} prompt {i}")
                        self.records.setdefault(tkey, {}).setdefault(s, {}).setdefault(dec.name, []).append({"i": i, **r})
                    self.write("running")
                if stop:
                    break
            if bar is not None:
                bar.update(1)
            if i == 0:
                per_prompt = self.budget.elapsed() - self.t_main
                self.note(f"first prompt of every set and temperature took {per_prompt:.1f} s; "
                          f"{n_max} prompts would take ~{per_prompt * n_max / 60:.1f} min at that rate")
            if stop:
                break
        if bar is not None:
            bar.close()

    def run(self) -> int:
        a = self.a
        try:
            self.setup()
        except Exception as e:  # noqa: BLE001 - nothing to measure without a target
            self.res.setdefault("meta", {"date": datetime.datetime.now().isoformat(timespec="seconds"), "budget_s": a.budget_s,
                                         "max_new_tokens": a.max_new_tokens, "temperatures": a.temperatures, "sets": a.sets,
                                         "prompts_per_set": a.prompts_per_set, "hf_eager_prompts": a.hf_eager_prompts})
            self.error("setup", e)
            self.write("failed in setup")
            return 1
        self.write("loaded")
        # The trees: chosen at temperature 0 for every temperature, or (--select-per-temperature) at each
        # temperature served: a sampled round keeps every draw, so sampling may want another shape.
        chosen: dict[float, tuple[Any, Any]] = {}
        selected = [float(t) for t in a.temperatures] if a.select_per_temperature else [0.0]
        for temp in selected:
            tree = chain = None
            try:
                tree, chain = self.select_trees(temp, share=1 / len(selected))
            except Exception as e:  # noqa: BLE001
                self.error(f"tree selection t={temp}", e)
            if tree is None and chain is None:
                fallback = self.TreeSpec.parse(a.trees[0]) if a.trees else self.TreeSpec.chain(5)
                self.note(f"no tree measured at temperature {temp}; using {fallback}")
                tree = fallback if fallback.top_k > 1 else None
                chain = fallback if fallback.top_k == 1 else None
            chosen[temp] = (tree, chain)
        for temp in a.temperatures:
            chosen.setdefault(float(temp), chosen[selected[0]])
        tree, chain = chosen[selected[0]]
        self.write("trees selected")
        if not a.no_tree_auto:
            try:
                self.tree_auto_check()
            except Exception as e:  # noqa: BLE001
                self.error("tree auto", e)
            self.write("tree auto checked")
        decoders: list[Decoder] = []
        for k, name in enumerate(("spec_tree", "spec_chain")):
            specs = {t: pair[k] for t, pair in chosen.items() if pair[k] is not None}
            if specs and name not in a.skip:
                runs = {t: eyas_spec(self.target, self.drafter, sp, self.eos, a.max_new_tokens, a.engine_kwargs)
                        for t, sp in specs.items()}
                label = (f"eyas speculative {next(iter(specs.values()))}" if len(set(specs.values())) == 1 else
                         "eyas speculative " + "; ".join(f"t={t:g}: {sp}" for t, sp in specs.items()))
                decoders.append(Decoder(name, by_temperature(runs), label))
        if "eyas_plain" not in a.skip:
            decoders.append(Decoder("eyas_plain", eyas_plain(self.target, self.eos, a.max_new_tokens, a.engine_kwargs),
                                    "eyas plain_generate"))
        for dec in decoders:  # warm-ups at every temperature
            t0 = time.perf_counter()
            for temp in a.temperatures:
                for _ in range(a.warmup):
                    r = self.call(dec, self.warm_ids, self.SamplingParams(float(temp)), 0, f"warm-up t={temp}")
                    if "error" in r:
                        dec.disabled = "warm-up failed"
            self.res.setdefault("warmup", {})[dec.name] = {"seconds": [round(time.perf_counter() - t0, 2)], "label": dec.label}
        decoders += self.hf_decoders()
        self.res["decoders"] = {d.name: d.label for d in decoders}
        self.write("warmed up")
        self.t_main = self.budget.elapsed()
        log(f"main loop: decoders {[d.name for d in decoders if not d.disabled]}; {self.budget.left():.0f} s left")
        self.main_loop(decoders)
        if not a.no_profile:  # after the timed requests: a profiler's CUPTI hooks can stay behind and slow launches
            self.profile(tree or chain)
            self.write("profiled")
        try:
            counters = torch._dynamo.utils.counters
            self.res["dynamo_counters"] = {k: dict(v) for k, v in counters.items()
                                           if k in ("stats", "graph_break", "recompiles")}
            self.res["dynamo_counters"]["inductor_cudagraph"] = {
                k: v for k, v in counters.get("inductor", {}).items() if "cudagraph" in k}
        except Exception:  # noqa: BLE001
            pass
        self.write("done")
        print(markdown(self.res), flush=True)
        log(f"wrote {self.out / 'results.json'}, {self.out / 'results.md'}"
            + (f", {self.out / 'profile.txt'}" if self.profile_text else "") + f" in {self.budget.elapsed():.0f} s")
        return 0


def commit(given: str | None) -> str:
    if given:
        return given
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) if sha else "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="GGUF file, HF directory or 'smollm2'")
    ap.add_argument("--draft", default=None, help="an eyas drafter directory (default: an untrained one)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="for the untrained drafter only")
    ap.add_argument("--force", action="store_true", help="load the drafter even when its contract does not match")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on a GPU, fp32 on the CPU")
    ap.add_argument("--target-impl", default="fast", help="fast | auto | hf (eyas.engine.build_target)")
    ap.add_argument("--matvec", default="auto", help="the fast target's products: auto | gemm | reduce | reduce-tuned | triton | triton-verify")
    ap.add_argument("--attention", default="auto", help="the fast target's attention: auto | eager | sdpa | split-kv")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "out" / "spec_gpu"))
    ap.add_argument("--commit", default=None, help="the git commit (default: git rev-parse, else unknown)")
    ap.add_argument("--sets", default=",".join(SETS), help="comma-separated EAGLE sets or prompt files")
    ap.add_argument("--prompts-per-set", type=int, default=80)
    ap.add_argument("--hf-eager-prompts", type=int, default=2, help="HF eager runs on the first N prompts of each set")
    ap.add_argument("--select-prompts", type=int, default=10, help="MT-bench prompts for the tree selection")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--trees", nargs="+", default=["6,8,32", "6,10,60", "8,8,48"],
                    help="DEPTH,TOPK,TOTAL candidates (space-separated)")
    ap.add_argument("--chains", nargs="*", default=["5", "6", "7"], help="chain depths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="warm-up generations per decoder (and temperature)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole run; remaining work is skipped past it")
    ap.add_argument("--reserve-s", type=float, default=10.0, help="stop the main loop when less than this is left")
    ap.add_argument("--select-share", type=float, default=0.2, help="tree selection stops past this share of the budget")
    ap.add_argument("--select-per-temperature", action="store_true",
                    help="choose the tree and the chain at every temperature served (default: at temperature 0 for all)")
    ap.add_argument("--compile-reserve-s", type=float, default=120.0, help="skip HF compile when less is left")
    ap.add_argument("--compile-timeout-s", type=float, default=240.0, help="give up compiling HF after this long")
    ap.add_argument("--hf-compile-mode", default="reduce-overhead")
    ap.add_argument("--no-hf-fullgraph", dest="hf_fullgraph", action="store_false",
                    help="compile with fullgraph=False at once (default: True, then False if it fails)")
    ap.add_argument("--hf-compile-cpu", action="store_true", help="compile the HF decoder on a CPU too (testing)")
    ap.add_argument("--drafter-compile", default="auto", choices=["auto", "on", "off"],
                    help="the drafter's round functions (the greedy draft, the re-read) compiled (inductor) before graph capture: auto = "
                         "where the engine graphs them (a GPU); off = eager kernels inside the graphs (before)")
    ap.add_argument("--skip", default="", help="decoders to leave out: spec_tree,spec_chain,eyas_plain,hf_compiled,hf_eager")
    ap.add_argument("--profile-rounds", type=int, default=1, help="speculative rounds (plain steps) profiled")
    ap.add_argument("--profile-skip", type=int, default=3, help="rounds before the profiled ones")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-tree-auto", action="store_true", help="skip the --tree auto prediction check")
    ap.add_argument("--max-errors", type=int, default=3, help="a decoder is disabled after this many errors")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON passed to speculative_generate/plain_generate where "
                                                          "their signatures accept it (e.g. '{\"timing\": \"events\"}')")
    a = ap.parse_args(argv)
    a.sets = [s for s in a.sets.split(",") if s]
    a.temperatures = [float(t) for t in a.temperatures.split(",") if t.strip()]
    a.trees = [t for x in a.trees for t in x.split()]
    a.chains = [c for x in (a.chains or []) for c in x.replace(",", " ").split()]
    a.skip = {s for s in a.skip.split(",") if s}
    a.engine_kwargs = json.loads(a.engine_kwargs)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log(f"budget {a.budget_s:.0f} s; out {a.out_dir}")
    return Bench(a).run()


if __name__ == "__main__":
    sys.exit(main())
