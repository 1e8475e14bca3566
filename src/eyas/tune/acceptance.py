"""The acceptance side of ``--tree auto``: how often the drafter's candidates are the target's tokens.

The profile: conditional top-k hit rates per draft depth,

    c[d][k] = P(r_d < k  |  r_j < k for every j < d)          (d = 1..D, k = 1..K)

where r_d is the rank of the target's token among the drafter's candidates at depth d, given the
true prefix: "the target's token is in the drafter's top-k at depth d, given the path so far was
too". From c, q_d(i) = c[d][i+1] - c[d][i] = P(the target's token is the drafter's i-th choice at
depth d), which :mod:`eyas.tune.predict` turns into tau.

Two sources:

- :func:`measure_acceptance`, a calibration at the temperature served: the target's own
  continuation of a few prompts (plain decoding: greedy at temperature 0, plain sampling at T > 0
  with a seeded generator), then ONE teacher-forced pass of the drafter over it per draft depth
  (:func:`teacher_forced_ranks`: the training-time-test pattern of ``eyas.drafter.ttt``, which is
  exactly what the tree expansion computes when the drafted path equals the continuation's tokens),
  then :func:`hit_rates`. The per-position ranks are kept (``AcceptanceProfile.sequences``) so
  serving can be replayed over them.

  Why sampled text predicts sampled rounds: a sampled request drafts the greedy tree (each node's
  children are the drafter's top-k) and verifies it by EAGLE's rule for top-k drafts, under which
  child c of a node is the node's output with probability p_T(c), the target's own probability at
  temperature T (``eyas.engine.sampling``). So a round accepts a path exactly when the target's own
  sample follows it, and the greedy replay over text the target sampled at T is distributed as the
  engine's sampled rounds. At temperature 0 the continuation is the greedy one and the replay is
  the engine's greedy rounds.
- :func:`acceptance_from_metrics`, without calibration prompts: the top-1 conditional accuracies that
  training wrote into the drafter's contract (``eyas.json`` ``metrics``), top-k extrapolated as
  c[d][k] = 1 - (1 - c[d][1]) * spread^(k-1) (training records top-1 only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

from eyas.contract.contract import ValidationMetrics
from eyas.drafter.model import Eagle3Drafter
from eyas.drafter.ttt import TargetLabels, shift_left, ttt_forward
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative import plain_generate
from eyas.engine.target import Target
from eyas.tune.space import DEFAULT_DEPTHS, DEFAULT_TOPKS

CALIBRATION_TOKENS = 128  # tokens the target generates per calibration prompt (at most)
TOPK_SPREAD = 0.8  # acceptance_from_metrics: each extra candidate catches 20% of the remaining misses


@dataclass
class AcceptanceProfile:
    """hit[d-1][k-1] = c[d][k] = P(target token in the drafter's top-k at depth d | the path so far
    was in the top-k too); ``counts[d-1]`` = positions that reached depth d with the top-1 path
    (the denominator of c[d][1]; ``counts[0]`` = every calibrated position); ``source`` says where
    the numbers come from; ``temperature``: the temperature the calibration text was decoded at.

    ``sequences`` (calibration only): per calibration sequence, the per-position ranks [T][D] and
    valid flags [T][D] of :func:`teacher_forced_ranks`, which :func:`simulate_rounds` replays."""

    hit: list[list[float]]
    source: str = ""
    counts: list[int] = field(default_factory=list)
    sequences: list[tuple[list[list[int]], list[list[bool]]]] = field(default_factory=list, repr=False)
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not self.hit or not self.hit[0]:
            raise ValueError("acceptance profile: expected hit rates for at least one depth and top-k")

    @property
    def max_depth(self) -> int:
        return len(self.hit)

    @property
    def max_topk(self) -> int:
        return len(self.hit[0])

    @property
    def positions(self) -> int:
        """Calibrated round positions (0 for a profile from training metrics)."""
        return self.counts[0] if self.counts else 0

    def rank_probs(self, depth: int) -> list[float]:
        """q_d(i) = c[d][i+1] - c[d][i], i = 0..max_topk-1 (c[d][0] = 0), after making c
        non-decreasing in k; depths past the profile reuse its last depth."""
        row = self.hit[min(depth, self.max_depth) - 1]
        q, best = [], 0.0
        for c in row:
            c = min(1.0, max(best, c))
            q.append(c - best)
            best = c
        return q

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "top1_by_depth": [round(r[0], 4) for r in self.hit],
                f"top{self.max_topk}_by_depth": [round(r[-1], 4) for r in self.hit],
                "hit": [[round(c, 4) for c in r] for r in self.hit], "counts": self.counts,
                "positions": self.positions, "temperature": self.temperature,
                "tau_from": "replay" if self.sequences else "expectation"}


@torch.no_grad()
def teacher_forced_ranks(target: Target, drafter: Eagle3Drafter, seq: Sequence[int], start: int,
                         max_depth: int) -> tuple[Tensor, Tensor, Tensor]:
    """Ranks of ``seq``'s own tokens under the drafter along ``seq``, teacher-forced.

    Round at position t+1 (the drafter has committed entries 0..t, the root is x_{t+1}): the depth-d
    node is the candidate for x_{t+1+d}; when the nodes above it are ``seq``'s own tokens, its
    drafter output is TTT step d-1 at position t (tokens teacher-forced, the drafter's hidden fed
    back, position t+d-1, attending the committed prefix and the same position of earlier steps).

    The target's token at a position is the one ``seq`` holds there: the continuation the target
    decoded (its argmax when greedy, its sample at a temperature), so one function serves both.

    Returns ranks [T, D] (rank of x_{t+1+d} among the drafter's draft-vocabulary logits at depth d:
    0 = the drafter's top choice; a huge number when the token is not in the draft vocabulary), the
    drafter's top-1 target ids [T, D], and valid [T, D]: the position is a round the engine runs
    (t + 1 >= start: the root is a generated token, ``start`` = the prompt's length) and the depth's
    token lies inside ``seq``.
    """
    dev = target.device
    ids = torch.tensor([list(seq)], device=dev)
    T = ids.shape[1]
    logits, f = target.prefill(ids)
    target.reset()
    vd = drafter.config.draft_vocab_size
    draft_ids = drafter.draft_to_target(torch.arange(vd, device=dev))
    to_draft = torch.full((target.vocab_size,), -1, dtype=torch.long, device=dev)
    to_draft[draft_ids] = torch.arange(vd, device=dev)
    labels = TargetLabels.from_logits(logits, draft_ids)  # argmax [1, T]: the target's token after seq[..t]
    ttt = ttt_forward(drafter, ids, f.to(drafter.fc.weight.dtype), labels, torch.ones_like(ids), steps=max_depth,
                      keep_logits=True)
    t = torch.arange(T, device=dev)
    ranks, top1, valid = [], [], []
    never = torch.iinfo(torch.long).max // 2
    for k, step_logits in enumerate(ttt.logits):
        lg = step_logits[0].float()  # [T, Vd]: step k at t, the candidates for x_{t+2+k}
        did = to_draft[shift_left(ids, 2 + k)[0]]  # seq's token x_{t+2+k}, as a draft id (-1: none)
        score = lg.gather(-1, did.clamp(min=0)[:, None])
        rank = (lg > score).sum(-1)
        ranks.append(torch.where(did >= 0, rank, torch.full_like(rank, never)))
        top1.append(draft_ids[lg.argmax(-1)])
        valid.append((t + 1 >= start) & (t + 2 + k <= T - 1))
    return torch.stack(ranks, 1).cpu(), torch.stack(top1, 1).cpu(), torch.stack(valid, 1).cpu()


def hit_rates(ranks: Tensor, valid: Tensor, max_topk: int) -> tuple[list[list[float]], list[int]]:
    """c[d][k] = #(r_1..r_d < k) / #(r_1..r_{d-1} < k) over valid positions; a depth nobody
    reached repeats the depth above (0 at depth 1)."""
    D = ranks.shape[1]
    hit = [[0.0] * max_topk for _ in range(D)]
    counts = [0] * D
    for k in range(1, max_topk + 1):
        inside = ranks < k
        alive = torch.ones(ranks.shape[0], dtype=torch.bool)
        for d in range(D):
            den = alive & valid[:, d]
            num = den & inside[:, d]
            nd = int(den.sum())
            hit[d][k - 1] = int(num.sum()) / nd if nd else (hit[d - 1][k - 1] if d else 0.0)
            if k == 1:
                counts[d] = nd
            alive = alive & inside[:, d]
    return hit, counts


@torch.no_grad()
def measure_acceptance(
    target: Target,
    drafter: Eagle3Drafter,
    prompts: Sequence[Sequence[int] | Tensor],
    *,
    max_depth: int = max(DEFAULT_DEPTHS),
    max_topk: int = max(DEFAULT_TOPKS),
    new_tokens: int = CALIBRATION_TOKENS,
    eos_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    seed: int = 0,
    positions: int | None = None,
    progress: bool = False,
) -> AcceptanceProfile | None:
    """Calibration at ``temperature``: the target's continuation of each prompt by plain decoding (up
    to ``new_tokens``; greedy at 0, else plain sampling at ``temperature`` with prompt i's generator
    seeded ``seed + i``, so a calibration is reproducible), then the drafter's conditional top-k hit
    rates along it at every position (:func:`teacher_forced_ranks`).

    ``positions``: stop after the prompt that brings the calibrated round positions to at least this
    many (None: every prompt). ``progress``: a tqdm bar of the positions. None when no position
    could be measured. The target is reset at the end."""
    sampling = SamplingParams(temperature)  # checks the temperature
    all_ranks, all_valid = [], []
    measured = 0
    bar = tqdm(total=positions or None, desc=f"--tree auto: calibrating at temperature {temperature:g}",
               unit="pos", disable=not progress, dynamic_ncols=True, leave=False)
    try:
        for i, p in enumerate(prompts):
            if positions is not None and measured >= positions:
                break
            prompt = p.flatten().tolist() if isinstance(p, Tensor) else [int(x) for x in p]
            room = target.max_length - len(prompt)
            if not prompt or room < 2:
                continue
            g = torch.Generator(device=target.device).manual_seed(seed + i) if not sampling.greedy else None
            cont = plain_generate(target, prompt, sampling=sampling, max_new_tokens=min(new_tokens, room),
                                  eos_token_ids=eos_token_ids, generator=g, timing="off").tokens
            if len(cont) < 2:
                continue
            r, _, v = teacher_forced_ranks(target, drafter, prompt + cont, len(prompt), max_depth)
            all_ranks.append(r), all_valid.append(v)
            n = int(v[:, 0].sum())
            measured += n
            bar.update(n)
    finally:
        bar.close()
        target.reset()
    if not all_ranks or not bool(torch.cat(all_valid)[:, 0].any()):
        return None
    ranks, valid = torch.cat(all_ranks), torch.cat(all_valid)
    hit, counts = hit_rates(ranks, valid, max_topk)
    how = "greedy" if sampling.greedy else f"sampled (temperature {temperature:g})"
    sequences = [(r.tolist(), v.tolist()) for r, v in zip(all_ranks, all_valid)]
    return AcceptanceProfile(hit, f"{how} calibration on {len(all_ranks)} prompt(s), {measured} positions", counts,
                             sequences, temperature=float(temperature))


def acceptance_from_metrics(metrics: ValidationMetrics | None, max_topk: int = max(DEFAULT_TOPKS),
                            spread: float = TOPK_SPREAD) -> AcceptanceProfile | None:
    """From the contract's training metrics: c[d][1] = ``conditional_accuracy_per_position``
    (held-out TTT, top-1), and top-k extrapolated as c[d][k] = 1 - (1 - c[d][1]) * spread^(k-1)
    (an assumption: training records top-1 only). None without those metrics."""
    cond = metrics.conditional_accuracy_per_position if metrics is not None else None
    if not cond:
        return None
    hit = [[1 - (1 - float(c)) * spread ** (k - 1) for k in range(1, max_topk + 1)] for c in cond]
    step = metrics.step
    return AcceptanceProfile(hit, f"the drafter's training metrics (step {step}; top-1 measured, top-k "
                                  f"extrapolated with spread {spread})")
