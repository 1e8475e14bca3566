"""`eyas bench`: speculative, plain and Hugging Face `generate` on the same prompts, in one process.

Per prompt the methods run back to back (so machine noise hits them alike): speculative decoding
with each tree benchmarked, then eyas plain decoding, then the HF baseline (:mod:`eyas.bench.hf`);
every method of a prompt is seeded alike. Per set and tree we report the accept length tau, tokens/s
as the EAGLE papers do (the mean of per-prompt tokens/s) and as total tokens over total time, the
speedups over plain and HF (each tree against the same plain and HF runs), the acceptance per draft
position, and, for greedy decoding, whether every speculative output equals the plain one token for
token. :func:`merge` pools a tree's sets into one ``overall`` result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from tqdm import tqdm

from eyas.data.conversations import Conversation
from eyas.data.render import render_prompt
from eyas.drafter.model import Eagle3Drafter
from eyas.targets import LoadedTarget
from eyas.engine import GenerationStats, SamplingParams, Target, TreeSpec, plain_generate, speculative_generate
from eyas.engine.stats import synchronize

if TYPE_CHECKING:
    from eyas.bench.hf import HFGenerate

METHODS = ("speculative", "plain", "hf")


@dataclass
class MethodRuns:
    new_tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, tokens: list[int], seconds: float) -> None:
        self.new_tokens.append(len(tokens))
        self.seconds.append(seconds)
        self.outputs.append(tokens)

    def tokens_per_s_mean(self) -> float:
        """Mean of per-prompt tokens/s (what the EAGLE papers report)."""
        rates = [n / s for n, s in zip(self.new_tokens, self.seconds) if s > 0]
        return sum(rates) / len(rates) if rates else 0.0

    def tokens_per_s_total(self) -> float:
        return sum(self.new_tokens) / sum(self.seconds) if sum(self.seconds) > 0 else 0.0


@dataclass
class SetResult:
    """One prompt set with one tree: its speculative runs and stats, and the plain and HF runs it is
    compared with (shared, as objects, by the trees benchmarked on the same prompts)."""

    name: str
    greedy: bool
    runs: dict[str, MethodRuns] = field(default_factory=lambda: {m: MethodRuns() for m in METHODS})
    stats: list[GenerationStats] = field(default_factory=list)  # speculative, per prompt
    tree: TreeSpec | None = None
    temperature: float = 0.0

    def summary(self) -> dict[str, Any]:
        # tau: tokens per drafting-verification round (accepted drafts + the bonus), as in the EAGLE
        # papers; the first token, which comes from the prefill alone, is not a round.
        per_round = [n for s in self.stats for n in s.accept_lengths]
        new = sum(s.new_tokens for s in self.stats)
        drafted = sum_lists([s.drafted_at_depth for s in self.stats])
        accepted = sum_lists([s.accepted_at_depth for s in self.stats])
        mean = {m: round(r.tokens_per_s_mean(), 2) for m, r in self.runs.items()}
        total = {m: round(r.tokens_per_s_total(), 2) for m, r in self.runs.items()}
        spec, plain, hf = (self.runs[m] for m in METHODS)
        return {
            "set": self.name,
            "tree": self.tree.label if self.tree is not None else None,
            "temperature": self.temperature,
            "prompts": len(self.stats),
            "new_tokens": new,
            "rounds": len(per_round),  # speculative rounds after the prefill
            "tau": round(sum(per_round) / len(per_round), 3) if per_round else 1.0,  # = GenerationStats.tau
            "tokens_per_s": mean,
            "tokens_per_s_total": total,
            "speedup_vs_plain": _ratio(mean["speculative"], mean["plain"]),
            "speedup_vs_hf": _ratio(mean["speculative"], mean["hf"]),
            "speedup_vs_plain_total": _ratio(total["speculative"], total["plain"]),
            "speedup_vs_hf_total": _ratio(total["speculative"], total["hf"]),
            "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)],
            "accept_length_histogram": _histogram(per_round),
            "time_split_s": {k: round(sum(getattr(s, f"time_{k}") for s in self.stats), 3)
                             for k in ("prefill", "draft", "verify", "bookkeeping")},
            # a speculative round after the prefill, as a request pays it (GenerationStats.time_rounds)
            "round_ms": round(1e3 * sum(s.time_rounds for s in self.stats) / len(per_round), 4) if per_round else None,
            "identical_to_plain": (all(a == b for a, b in zip(spec.outputs, plain.outputs)) if self.greedy else None),
            "identical_to_hf": (all(a == b for a, b in zip(spec.outputs, hf.outputs))
                                if self.greedy and hf.outputs else None),  # None: greedy off, or HF not run
        }


def merge(results: Sequence[SetResult], name: str = "overall") -> SetResult:
    """The results of several sets (one tree, one temperature) pooled as one set: every prompt's
    runs and stats, in order."""
    out = SetResult(name, all(r.greedy for r in results), tree=results[0].tree if results else None,
                    temperature=results[0].temperature if results else 0.0)
    for r in results:
        for m in METHODS:
            runs = out.runs[m]
            runs.new_tokens += r.runs[m].new_tokens
            runs.seconds += r.runs[m].seconds
            runs.outputs += r.runs[m].outputs
        out.stats += r.stats
    return out


def sum_lists(lists: Sequence[list[int]]) -> list[int]:
    """Element-wise sum of lists of different lengths (per-depth counts of many requests)."""
    out: list[int] = []
    for xs in lists:
        out += [0] * (len(xs) - len(out))
        for i, x in enumerate(xs):
            out[i] += x
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _histogram(values: list[int]) -> dict[int, int]:
    h: dict[int, int] = {}
    for v in values:
        h[v] = h.get(v, 0) + 1
    return dict(sorted(h.items()))


def bench_trees(
    name: str,
    prompts: Sequence[Conversation],
    loaded: LoadedTarget,
    target: Target,
    drafter: Eagle3Drafter,
    trees: Sequence[TreeSpec],
    sampling: SamplingParams,
    max_new_tokens: int,
    seed: int = 0,
    progress: bool = True,
    hf: HFGenerate | None = None,
    sampled_drafts: str = "top-k",
    warm: bool = False,
) -> list[SetResult]:
    """Each prompt of the set through speculative decoding with each tree of ``trees`` (``drafter``
    on ``target``, the engine view of ``loaded``; ``sampled_drafts``: how a sampled request drafts),
    then plain decoding, then ``hf`` (None: not run; its figures are then absent: 0 tokens/s,
    speedups and identity None), back to back, each seeded ``seed + i`` for prompt i; all stop at the
    target's eos ids. One result per tree, in order; they share the plain and HF runs.

    ``warm``: the first prompt through every method once, untimed, before the timed ones: on a GPU a
    tree new to the process compiles and captures its drafter's steps, and a temperature new to it its
    acceptance, inside its first request (seconds), which would otherwise land in one tree's figures."""
    tokenizer = loaded.tokenizer
    eos = list(loaded.eos_ids)
    shared = {"plain": MethodRuns(), "hf": MethodRuns()}
    results = [SetResult(name, sampling.greedy, runs={"speculative": MethodRuns(), **shared}, tree=t,
                         temperature=sampling.temperature) for t in trees]

    def run(ids: torch.Tensor, i: int, record: bool) -> None:
        for tree, result in zip(trees, results):
            g = torch.Generator(device=target.device).manual_seed(seed + i)
            t0 = time.perf_counter()
            r = speculative_generate(target, drafter, ids, tree=tree, sampling=sampling, max_new_tokens=max_new_tokens,
                                     eos_token_ids=eos, generator=g, sampled_drafts=sampled_drafts)
            synchronize(target.device)
            if record:
                result.runs["speculative"].add(r.tokens, time.perf_counter() - t0)
                result.stats.append(r.stats)
        g = torch.Generator(device=target.device).manual_seed(seed + i)
        t0 = time.perf_counter()
        p = plain_generate(target, ids, sampling=sampling, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                           generator=g)
        synchronize(target.device)
        if record:
            shared["plain"].add(p.tokens, time.perf_counter() - t0)
        if hf is None:
            return
        t0 = time.perf_counter()
        h = hf(ids, sampling, seed + i)
        synchronize(target.device)
        if record:
            shared["hf"].add(h, time.perf_counter() - t0)

    rendered = [render_prompt(conv, tokenizer).to(target.device)[None] for conv in prompts]  # [1, n] each
    if warm and rendered:
        run(rendered[0], 0, record=False)
    for i, ids in enumerate(tqdm(rendered, desc=f"bench {name}", disable=not progress, dynamic_ncols=True)):
        run(ids, i, record=True)
    return results


def bench_set(
    name: str,
    prompts: Sequence[Conversation],
    loaded: LoadedTarget,
    target: Target,
    drafter: Eagle3Drafter,
    tree: TreeSpec,
    sampling: SamplingParams,
    max_new_tokens: int,
    seed: int = 0,
    progress: bool = True,
    compare_hf: bool = True,
    hf: HFGenerate | None = None,
) -> SetResult:
    """:func:`bench_trees` with one tree; ``compare_hf`` without ``hf``: eager HF ``generate``
    (``compare_hf=False`` leaves HF out)."""
    if hf is None and compare_hf:
        from eyas.bench.hf import hf_baseline

        hf = hf_baseline(loaded.model, loaded.eos_ids, loaded.tokenizer.pad_token_id, max_new_tokens, mode="eager")
    return bench_trees(name, prompts, loaded, target, drafter, [tree], sampling, max_new_tokens, seed, progress,
                       hf if compare_hf else None)[0]
