"""What a speculative round costs on the fast path, next to a plain step, with no GGUF: a SmolLM2-shaped
Llama with random weights (bf16) and a drafter of SmolLM2's shape (the shipped one by default; cost
only, acceptance is not measured here: a round's shapes are fixed by its tree, so its cost is too).

The figure that decides speculative decoding's speedup is the round's cost in plain steps:
speedup = tau * plain step / round. For each tree: the round timed end to end through the engine
(``eyas.tune.time_rounds``: draft, verify, accept, commit, the round's one read; no phase clock),
repeated and interleaved with plain steps so that both see the same machine, then the speedup that
cost gives at the accept lengths ``--tau`` (measured on MT-bench with the real model elsewhere).
With ``--profile``, torch.profiler of one round of the first tree and of one plain step: kernels,
graph launches, host calls, and the GPU's idle time split into short and long gaps
(``spec_gpu.device_idle``). With ``--requests N``, N whole requests per decoder and clock mode, and
where their time goes (start, first round, median round, last three); with ``--requests-after-profile``,
the same requests again after the profile (on the H200 a profiled process launches more slowly from
then on: ``benchmarks/results/2026-12-03-prompt-read-h200.md``).

With ``--target`` (a GGUF, a directory) the model is the real one, and with ``--prompt-set`` the
requests are that set's prompts rendered with its chat template (``--prompts`` of them), run in
turn for each decoder as spec_gpu.py runs them: where a real request's time goes, with real
acceptance, against the same prompts on the same weights randomised (``--random-weights``, no
acceptance) and with Python's garbage collector as it is or frozen after the warm-up (``--gc``):
per decoder, each step's wall time (percentiles, the time in steps slower than 3x the median),
the collector's pauses, and the phase clock's split (``--requests-only`` skips the round timings).

Run it once per version of the engine (PYTHONPATH=old_src, then src) on one machine to compare them.

    PYTHONPATH=src python benchmarks/round_cost_gpu.py --trees 4,8,15 5,8,15 --tau 2.84 2.90 \\
        --out round_cost.json --profile-out prof.txt [--label before]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from eyas.convention import CaptureSpec
from eyas.engine import GREEDY, GenerationStats, TreeSpec, build_target, plain_generate, speculative_generate
from eyas.tune import time_rounds

# after eyas: spec_gpu puts this checkout's src first on sys.path, and eyas must stay the one on
# PYTHONPATH (an older src, to compare versions)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_gpu import atomic_write, idle_text, profile_rounds  # noqa: E402  (a sibling benchmark script)

try:  # eyas bench's HF baseline; an older src under comparison may predate eyas.bench.hf
    from eyas.bench.hf import hf_runner
except ImportError:  # pragma: no cover
    from spec_gpu import hf_runner  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DRAFTER = REPO / "src" / "eyas" / "interop" / "embedded" / "smollm2-135m-instruct"


def smollm2_shaped(device: torch.device, tiny: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    big = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3)
    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2)
    cfg = LlamaConfig(**(small if tiny else big), max_position_embeddings=8192, rope_theta=100000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()


def drafter_for(model: torch.nn.Module, draft: str, tiny: bool) -> tuple[torch.nn.Module, CaptureSpec]:
    """The shipped drafter (its weights; the random target's embedding copied in) with the capture
    spec it reads, or an untrained one for ``--tiny`` / ``--draft untrained``."""
    import warnings

    L = model.config.num_hidden_layers
    if tiny or draft == "untrained":
        from eyas.drafter.build import new_drafter

        spec = CaptureSpec((0, L // 2, L) if L < 8 else (2, L // 2, L - 3), L)
        drafter = new_drafter(model, boundaries=spec.boundaries, draft_vocab_size=256 if tiny else 12288)[0]
    else:
        from eyas.interop import load_drafter

        with warnings.catch_warnings():  # a random target: its contract cannot match (force)
            warnings.simplefilter("ignore")
            drafter, contract = load_drafter(draft, target=model, force=True)
        spec = CaptureSpec(tuple(contract.capture.boundaries) if contract is not None else (2, 15, 27), L)
    dtype = next(model.parameters()).dtype
    return drafter.to(device=next(model.parameters()).device, dtype=dtype).eval(), spec


def load_real(path: str, draft: str, random_weights: bool):
    """The target at ``path`` (bf16 on the GPU; eyas' LoadedTarget: model, tokenizer, EOS ids), the
    drafter checked against it and the capture spec it reads; with ``random_weights`` the target's
    matrices are drawn anew (normal, std 0.02; norms stay), after the drafter was checked against the
    real ones: the same shapes, prompts and code, no acceptance."""
    from eyas.interop import load_drafter
    from eyas.targets import load_target

    loaded = load_target(path, dtype="auto", device="auto")
    drafter, contract = load_drafter(draft, target=loaded, tokenizer=loaded.tokenizer)
    if random_weights:
        torch.manual_seed(0)
        with torch.no_grad():
            for w in loaded.model.parameters():
                if w.dim() >= 2:
                    w.normal_(0.0, 0.02)
    spec = CaptureSpec(tuple(contract.capture.boundaries), loaded.num_blocks)
    return loaded, drafter.to(device=loaded.device, dtype=loaded.dtype).eval(), spec


def hf_compiled(loaded, cache_len: int, new: int, warm: list[int]) -> tuple[Callable[[list[int]], object], float]:
    """The hf_compiled decoder of spec_gpu.py and `eyas bench` on a GPU (eyas.bench.hf: Hugging Face
    generate, greedy, on a static cache with its decoding step compiled), compiled now on ``warm``:
    (run(prompt), seconds of the three warm-up calls)."""
    from transformers import CompileConfig, StaticCache

    eos = list(loaded.eos_ids)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else eos[0]
    cache = StaticCache(config=loaded.model.config, max_cache_len=cache_len)
    run = hf_runner(loaded.model, eos, pad, new, cache=cache,
                    compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))

    def generate(prompt: list[int]) -> object:
        return run(torch.tensor([prompt], device=loaded.device), GREEDY, 0)

    t0 = time.perf_counter()
    for _ in range(3):
        generate(warm)
    return generate, time.perf_counter() - t0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def decoder_name(tree: TreeSpec | None) -> str:
    return "plain" if tree is None else f"{tree.depth},{tree.top_k},{tree.total_tokens}"


class RequestTimes(NamedTuple):
    """One request through ``start`` and ``step``, the device synchronised around each part: its
    start (prefill; the drafter's read of the prompt), each step (a step ends with its read of the
    device), the whole request, and the engine's statistics."""

    start_s: float
    step_s: list[float]
    wall_s: float
    stats: GenerationStats


def run_request(target, drafter, tree: TreeSpec | None, prompt: list[int], new: int, timing: str) -> RequestTimes:
    """``new`` tokens from ``prompt``: speculative with ``tree``, plain without one."""
    from eyas.engine.speculative import start, step

    sync()
    t0 = time.perf_counter()
    s = start(target, prompt, drafter if tree is not None else None, tree=tree or TreeSpec.chain(1),
              max_new_tokens=new, timing=timing)
    sync()
    start_s, steps = time.perf_counter() - t0, []
    while not s.done:
        t1 = time.perf_counter()
        step(s)
        steps.append(time.perf_counter() - t1)
    stats = s.result().stats
    sync()
    return RequestTimes(start_s, steps, time.perf_counter() - t0, stats)


class GcPauses:
    """The garbage collector's pauses while ``active`` (gc.callbacks): seconds and collections per
    generation, summed until read with :meth:`take`. ``close`` unregisters it."""

    def __init__(self) -> None:
        self.seconds, self.counts, self._t0, self.active = 0.0, [0, 0, 0], 0.0, False
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.counts[info["generation"]] += 1

    def take(self) -> tuple[float, list[int]]:
        out, self.seconds, self.counts = (self.seconds, self.counts), 0.0, [0, 0, 0]
        return out

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def request_set_row(requests: list[RequestTimes], gc_s: float, gc_counts: list[int], timing: str) -> dict:
    """A decoder's requests summed up: tokens/s over the whole requests, tau, each step's wall time
    (mean, median, p90, p99, max, and the time in steps slower than 3x the median: stalls), the
    collector's pauses and (a phase clock on) the phases per step."""
    steps = [x for r in requests for x in r.step_s]
    med, wall = statistics.median(steps), sum(r.wall_s for r in requests)
    tokens = sum(r.stats.new_tokens for r in requests)
    accept = [a for r in requests for a in r.stats.accept_lengths]
    row = {"requests": len(requests), "new_tokens": tokens, "seconds": round(wall, 4),
           "tokens_per_s": round(tokens / wall, 1), "tau": round(statistics.mean(accept), 3) if accept else None,
           "steps": len(steps), "ms_start_mean": round(1e3 * statistics.mean(r.start_s for r in requests), 3),
           "ms_step_mean": round(1e3 * statistics.mean(steps), 4), "ms_step_p50": round(1e3 * med, 4),
           "ms_step_p90": round(1e3 * percentile(steps, 0.9), 4),
           "ms_step_p99": round(1e3 * percentile(steps, 0.99), 4),
           "ms_step_max": round(1e3 * max(steps), 4),
           "ms_in_stalls": round(1e3 * sum(x for x in steps if x > 3 * med), 3),
           "gc_ms": round(1e3 * gc_s, 3), "gc_collections": gc_counts}
    if timing != "off":
        row["ms_per_step_phases"] = {
            k: round(1e3 * sum(getattr(r.stats, f"time_{k}") for r in requests) / len(steps), 4)
            for k in ("draft", "verify", "bookkeeping")}
    return row


def request_sets(target, drafter, trees: list[TreeSpec], prompts: list[list[int]], new: int, gc_modes: list[str],
                 timings: list[str], phase: str = "",
                 between: Callable[[list[int]], object] | None = None) -> list[dict]:
    """Every prompt through every decoder in turn (plain, then each tree; as spec_gpu.py does), per
    garbage-collector mode and phase clock, each decoder's requests summed up (:func:`request_set_row`).
    ``between``: run on each prompt after the eyas decoders (another decoder in the same process, as
    spec_gpu.py interleaves Hugging Face's), not timed; ``phase`` labels the rows. A frozen collector
    is unfrozen at the end."""
    pauses = GcPauses()
    rows = []
    try:
        for mode in gc_modes:
            if mode == "freeze":  # as serving engines do after their warm-up (SGLang): the heap so far is never scanned
                gc.collect()
                gc.freeze()
            for timing in timings:
                decoders = [None, *trees]
                done: dict[TreeSpec | None, list[RequestTimes]] = {d: [] for d in decoders}
                paused: dict[TreeSpec | None, tuple[float, list[int]]] = {d: (0.0, [0, 0, 0]) for d in decoders}
                for prompt in prompts:
                    for tree in decoders:
                        pauses.active = True
                        done[tree].append(run_request(target, drafter, tree, prompt, new, timing))
                        pauses.active = False
                        seconds, counts = pauses.take()
                        paused[tree] = (paused[tree][0] + seconds, [x + y for x, y in zip(paused[tree][1], counts)])
                    if between is not None:
                        between(prompt)
                for tree in decoders:
                    row = {"phase": phase, "gc": mode, "timing": timing, "decoder": decoder_name(tree),
                           **request_set_row(done[tree], *paused[tree], timing)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        pauses.close()
        gc.unfreeze()
    return rows


def plain_step_ms(target, prompt: list[int], new: int) -> float:
    st = plain_generate(target, prompt, max_new_tokens=new, timing="off").stats
    return 1e3 * st.time_rounds / max(1, st.rounds - 1)


def whole_requests(target, drafter, trees: list[TreeSpec], prompt: list[int], n: int, new: int) -> list[dict]:
    """Whole requests of ``new`` tokens (no EOS), plain and per tree, with the phase clock off and with
    CUDA events (the engine's default on a GPU): ms per new token and per round, as a user's request
    pays them (prefill, the first round and the last rounds included), and where a request's time
    goes: ``start`` (prefill; the drafter's read of the prompt), its first round, the median round
    and its last three (:func:`run_request`)."""
    rows = []
    for timing in ("off", "events"):
        for tree in [None, *trees]:
            runs = [run_request(target, drafter, tree, prompt, new, timing) for _ in range(n)]
            walls = [r.wall_s for r in runs]
            rounds, tokens = sum(len(r.step_s) for r in runs), sum(r.stats.new_tokens for r in runs)
            row = {"decoder": decoder_name(tree), "timing": timing, "requests": n,
                   "ms_per_request": round(1e3 * statistics.median(walls), 3),
                   "ms_per_round": round(1e3 * sum(walls) / max(rounds, 1), 4),
                   "ms_per_token": round(1e3 * sum(walls) / max(tokens, 1), 4), "rounds_per_request": rounds / n,
                   "ms_start": round(1e3 * statistics.median(r.start_s for r in runs), 3),
                   "ms_first_round": round(1e3 * statistics.median(r.step_s[0] for r in runs), 3),
                   "ms_median_round": round(1e3 * statistics.median(statistics.median(r.step_s) for r in runs), 4),
                   "ms_last_three_rounds": round(1e3 * statistics.median(sum(r.step_s[-3:]) for r in runs), 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs="+", default=["4,8,15", "5,8,15", "4,8,31"])
    ap.add_argument("--tau", nargs="*", type=float, default=[],
                    help="accept lengths measured for the trees (same order): the speedup their cost gives")
    ap.add_argument("--draft", default=str(DRAFTER), help="a drafter directory, or 'untrained'")
    ap.add_argument("--matvec", default="auto")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--context", type=int, default=300, help="committed tokens before the timed rounds")
    ap.add_argument("--rounds", type=int, default=30, help="rounds (plain steps) per timing")
    ap.add_argument("--repeats", type=int, default=5, help="timings per tree, interleaved with plain ones")
    ap.add_argument("--requests", type=int, default=0,
                    help="whole requests per decoder and timing mode (prefill, first and last rounds included)")
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens of each whole request")
    ap.add_argument("--label", default="", help="a name for this run (e.g. the commit)")
    ap.add_argument("--tiny", action="store_true", help="a toy config on the CPU (smoke test)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler of one round and one plain step")
    ap.add_argument("--requests-after-profile", action="store_true",
                    help="--requests' whole requests again after --profile's (profiles['requests_after'])")
    ap.add_argument("--target", default=None, help="the real model (a GGUF, a directory) instead of a random one")
    ap.add_argument("--random-weights", action="store_true", help="with --target: its weights drawn anew")
    ap.add_argument("--prompt-set", default=None, help="requests on this set's prompts (e.g. mt_bench; needs --target)")
    ap.add_argument("--prompts", type=int, default=24, help="prompts of --prompt-set")
    ap.add_argument("--gc", nargs="+", default=["default"], choices=["default", "freeze"],
                    help="the garbage collector's modes for --prompt-set's requests, in order (frozen until they end)")
    ap.add_argument("--timings", nargs="+", default=["events", "off"], help="phase clocks for --prompt-set's requests")
    ap.add_argument("--hf-compiled", action="store_true",
                    help="--prompt-set's requests again with Hugging Face generate compiled (static cache, "
                         "reduce-overhead) run on each prompt between them, then again without it: does a "
                         "compiled HF decoder in the process slow eyas' (spec_gpu.py runs them so)")
    ap.add_argument("--requests-only", action="store_true", help="only --prompt-set's requests (no round timings)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.prompt_set and not args.target:
        ap.error("--prompt-set needs --target (its tokenizer renders the prompts)")
    loaded, sets = None, []
    if args.target:
        loaded, drafter, spec = load_real(args.target, args.draft, args.random_weights)
        model = loaded.model
    else:
        model = smollm2_shaped(device, args.tiny)
        drafter, spec = drafter_for(model, args.draft, args.tiny)
    target = build_target(model, spec, "fast", matvec=args.matvec, attention=args.attention)
    t0 = time.perf_counter()
    if hasattr(target, "warmup"):
        target.warmup()
    trees = [TreeSpec.parse(t) for t in args.trees]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=g).tolist()
    if args.prompt_set:
        from eyas.bench.prompts import load_prompts
        from eyas.data.render import render_prompt

        prompt_ids = [render_prompt(c, loaded.tokenizer).tolist() for c in load_prompts(args.prompt_set, args.prompts)]
        for tree in trees:  # the drafter's graphs and compilations, the verdict's: before any timed request
            speculative_generate(target, drafter, prompt_ids[0], tree=tree, max_new_tokens=args.new_tokens)
        plain_generate(target, prompt_ids[0], max_new_tokens=args.new_tokens)
        warm_s = time.perf_counter() - t0
        print(f"target {target.implementation}; warm-up {warm_s:.1f} s; {len(prompt_ids)} prompts of "
              f"{min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens", flush=True)
        sets = request_sets(target, drafter, trees, prompt_ids, args.new_tokens, args.gc, args.timings, "alone")
        if args.hf_compiled:
            hf, hf_compile_s = hf_compiled(loaded, max(map(len, prompt_ids)) + args.new_tokens + 8, args.new_tokens,
                                           prompt_ids[0])
            print(f"HF generate compiled in {hf_compile_s:.1f} s", flush=True)
            sets += request_sets(target, drafter, trees, prompt_ids, args.new_tokens, ["default"], args.timings,
                                 "hf-interleaved", between=hf)
            sets += request_sets(target, drafter, trees, prompt_ids, args.new_tokens, ["default"], args.timings,
                                 "after-hf")
        if args.requests_only:
            result = {"label": args.label, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "target": args.target, "random_weights": args.random_weights,
                      "target_impl": target.implementation, "prompt_set": args.prompt_set, "warmup_s": round(warm_s, 2),
                      "new_tokens": args.new_tokens, "request_sets": sets}
            if args.out:
                atomic_write(Path(args.out), json.dumps(result, indent=2) + "\n")
            return 0
    time_rounds(target, drafter, trees, rounds=2, warmup=3, context=args.context)  # captures, compilations
    plain_step_ms(target, prompt, 8)
    warm_s = time.perf_counter() - t0
    print(f"target {target.implementation}, matvec {getattr(target, 'matvec', '?')}; warm-up {warm_s:.1f} s", flush=True)

    plain: list[float] = []
    rounds: dict[TreeSpec, list[float]] = {t: [] for t in trees}
    for _ in range(args.repeats):  # interleaved: the machine drifts
        plain.append(plain_step_ms(target, prompt, args.rounds + 1))
        for tree, sec in time_rounds(target, drafter, trees, rounds=args.rounds, warmup=2, context=args.context).items():
            rounds[tree].append(1e3 * sec)
    plain_ms = statistics.median(plain)
    print(f"plain step: {plain_ms:.4f} ms (median of {args.repeats}: {[round(x, 4) for x in plain]})", flush=True)
    rows = []
    taus = dict(zip(trees, args.tau))
    for tree in trees:
        ms = statistics.median(rounds[tree])
        row = {"tree": f"{tree.depth},{tree.top_k},{tree.total_tokens}", "round_ms": round(ms, 4),
               "round_ms_all": [round(x, 4) for x in rounds[tree]], "round_in_plain_steps": round(ms / plain_ms, 3)}
        if tree in taus:
            row["tau"] = taus[tree]
            row["speedup_at_tau"] = round(taus[tree] * plain_ms / ms, 3)
        # phases by CUDA events (their sum is the device's time, idle included)
        st = speculative_generate(target, drafter, prompt, tree=tree, max_new_tokens=8 * (tree.depth + 1),
                                  timing="events").stats
        n = max(1, len(st.accept_lengths))
        row["events_ms_per_round"] = {k: round(1e3 * getattr(st, f"time_{k}") / n, 4)
                                      for k in ("draft", "verify", "bookkeeping")}
        rows.append(row)
        print(json.dumps(row), flush=True)

    requests = whole_requests(target, drafter, trees, prompt, args.requests, args.new_tokens) if args.requests else []

    profiles, text = {}, ""
    if args.profile:
        tree = trees[0]
        jobs = {"spec_round": lambda: speculative_generate(target, drafter, prompt, tree=tree,
                                                           max_new_tokens=12 * (tree.depth + 1), timing="off"),
                "plain_step": lambda: plain_generate(target, prompt, max_new_tokens=24, timing="off")}
        for name, fn in jobs.items():
            p = profile_rounds(name, fn, target, rounds=2, skip=4)
            text += (f"=== {name} ({tree if name == 'spec_round' else 'plain'}): {p['rounds']} rounds, "
                     f"{p['wall_ms_per_round']:.3f} ms wall per round (profiled), {p['gpu_kernels_per_round']} kernels "
                     f"({p['gpu_kernel_ms_per_round']} ms), host calls {p['host_calls_per_round']} ===\n"
                     + idle_text(p.get("device_idle")) + p.pop("table") + "\n")
            profiles[name] = p
            print(f"{name}: {p['gpu_kernels_per_round']} kernels, {p['gpu_kernel_ms_per_round']} ms of kernels, "
                  f"idle {p.get('device_idle', {}).get('idle_us_per_round')} us a round", flush=True)
        print(text)
        if args.requests_after_profile and args.requests:  # does the profiler leave launches slower behind it
            profiles["requests_after"] = whole_requests(target, drafter, trees, prompt, args.requests, args.new_tokens)
    result = {"label": args.label, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "target_impl": target.implementation,
              "matvec": getattr(target, "matvec", None), "attention": getattr(target, "attention", None),
              "drafter": args.draft, "context": args.context, "warmup_s": round(warm_s, 2),
              "plain_step_ms": round(plain_ms, 4), "plain_step_ms_all": [round(x, 4) for x in plain],
              "trees": rows, "requests": requests, "request_sets": sets,
              "profiles": profiles}
    if args.out:
        atomic_write(Path(args.out), json.dumps(result, indent=2) + "\n")
    if args.profile_out:
        atomic_write(Path(args.profile_out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
