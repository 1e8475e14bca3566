"""`eyas bench`: speculative, plain and Hugging Face `generate` on the same prompts, in one process.

Per prompt the three methods run back to back (so machine noise hits them alike); per set we report
the accept length tau, tokens/s as the EAGLE papers do (the mean of per-prompt tokens/s) and as
total tokens over total time, the speedups, the acceptance per draft position, and, for greedy
decoding, whether every speculative output equals the plain one token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from tqdm import tqdm

from eyas.data.conversations import Conversation
from eyas.data.render import render_prompt
from eyas.drafter.model import Eagle3Drafter
from eyas.targets import LoadedTarget
from eyas.engine import GenerationStats, SamplingParams, Target, TreeSpec, plain_generate, speculative_generate
from eyas.engine.stats import synchronize

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
    name: str
    greedy: bool
    runs: dict[str, MethodRuns] = field(default_factory=lambda: {m: MethodRuns() for m in METHODS})
    stats: list[GenerationStats] = field(default_factory=list)  # speculative, per prompt

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


@torch.no_grad()
def hf_generate(model: Any, ids: torch.Tensor, sampling: SamplingParams, max_new_tokens: int,
                eos_token_ids: list[int], pad_token_id: int | None) -> list[int]:
    """Hugging Face `generate` with every setting explicit (the model's generation_config could
    otherwise add top-k or a repetition penalty); returns the new tokens, EOS included."""
    kw: dict[str, Any] = dict(do_sample=False) if sampling.greedy else dict(
        do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         eos_token_id=eos_token_ids or None, pad_token_id=pad_token_id,
                         repetition_penalty=1.0, **kw)
    new = out[0, ids.shape[1]:].tolist()
    for i, t in enumerate(new):  # generate pads after EOS in batches; keep up to the first EOS
        if t in eos_token_ids:
            return new[: i + 1]
    return new


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
) -> SetResult:
    """Each prompt of the set through speculative decoding (``drafter`` on ``target``, the engine
    view of ``loaded``), plain decoding and HF ``generate`` of ``loaded.model``, back to back, each
    method seeded alike per prompt; all stop at the target's eos ids. ``compare_hf=False`` leaves HF
    ``generate`` out (its figures are then absent: 0 tokens/s, speedups and identity None)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = list(loaded.eos_ids)
    result = SetResult(name, sampling.greedy)
    for i, conv in enumerate(tqdm(prompts, desc=f"bench {name}", disable=not progress, dynamic_ncols=True)):
        ids = render_prompt(conv, tokenizer).to(target.device)[None]  # [1, n]
        g = torch.Generator(device=target.device).manual_seed(seed + i)
        t0 = time.perf_counter()
        r = speculative_generate(target, drafter, ids, tree=tree, sampling=sampling, max_new_tokens=max_new_tokens,
                                 eos_token_ids=eos, generator=g)
        synchronize(target.device)
        result.runs["speculative"].add(r.tokens, time.perf_counter() - t0)
        result.stats.append(r.stats)
        g = torch.Generator(device=target.device).manual_seed(seed + i)
        t0 = time.perf_counter()
        p = plain_generate(target, ids, sampling=sampling, max_new_tokens=max_new_tokens, eos_token_ids=eos, generator=g)
        synchronize(target.device)
        result.runs["plain"].add(p.tokens, time.perf_counter() - t0)
        if not compare_hf:
            continue
        t0 = time.perf_counter()
        h = hf_generate(model, ids, sampling, max_new_tokens, eos, tokenizer.pad_token_id)
        synchronize(target.device)
        result.runs["hf"].add(h, time.perf_counter() - t0)
    return result
