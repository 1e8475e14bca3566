"""Held-out metrics of a training run (:func:`evaluate`: TTT over the validation samples, summed
over the ranks, also outside repetition loops), the best evaluation so far (:class:`Best`, which
patience counts from) and the run's plot (:func:`plot_metrics`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from eyas.contract.contract import ValidationMetrics
from eyas.data.loops import loop_body_mask
from eyas.drafter.model import Eagle3Drafter
from eyas.drafter.ttt import Tally, ttt_forward
from eyas.training.batches import pad_right
from eyas.training.config import TrainConfig
from eyas.training.distributed import Dist
from eyas.training.order import budget_batches, sample_lengths


NO_LOOPS = "_no_loops"  # suffix of the held-out figures over the positions outside repetition loops


def keep_outside_loops(sample: dict[str, Any]) -> torch.Tensor:
    """Bool [T]: the sample's loss positions whose token is not inside a repetition loop's body
    (eyas.data.loops); a TTT position is counted there iff its predicted token is kept."""
    ids = sample["input_ids"]
    return sample["loss_mask"].bool() & ~loop_body_mask(ids)


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, batches: Any, samples: Any, val_idx: Sequence[int], cfg: TrainConfig,
             d: Dist, outside_loops: dict[int, torch.Tensor] | None = None) -> ValidationMetrics:
    """Held-out metrics (summed over the ranks); with ``outside_loops`` (sample index -> bool [T],
    :func:`keep_outside_loops`) also the same figures over the positions outside repetition loops,
    as extra fields with the suffix ``_no_loops``."""
    drafter.eval()
    tally, tally_nl = Tally(cfg.ttt_steps), Tally(cfg.ttt_steps)
    mine = list(val_idx)[d.rank :: d.world]
    if cfg.tokens_per_batch is None:
        chunks = [mine[i : i + cfg.batch_size] for i in range(0, len(mine), cfg.batch_size)]
    else:  # similar lengths together under the training budget (the sums do not depend on the grouping)
        lengths = sample_lengths(samples, mine)
        chunks = [[mine[p] for p in b] for b in budget_batches(range(len(mine)), lengths, cfg.tokens_per_batch)]
    for chunk in chunks:
        b = batches.make([samples[j] for j in chunk])
        keep = None
        if outside_loops is not None:
            keep = pad_right([outside_loops[j] for j in chunk]).to(b.input_ids.device)
            keep = torch.nn.functional.pad(keep, (0, b.input_ids.shape[1] - keep.shape[1]))  # [B, T]
        r = ttt_forward(drafter, b.input_ids, b.features, b.labels, b.loss_mask, cfg.ttt_steps, cfg.ttt_decay,
                        count_mask=keep)
        tally.add(r)
        if r.subset is not None:
            tally_nl.add(r.subset)
    tally.all_reduce()
    tally_nl.all_reduce()
    drafter.train()
    m = tally.summary()
    if outside_loops is None:
        return m
    nl = tally_nl.summary().model_dump()
    return m.model_copy(update={k + NO_LOOPS: v for k, v in nl.items()})


def plot_metrics(metrics_path: Path, png: Path) -> None:
    """Train loss; held-out simulated accept length (with and without loops, and the validate
    hook's tau when recorded) against step; per-position accuracy of the last evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    fig, (a, c, b) = plt.subplots(1, 3, figsize=(16, 4))
    a.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    a.set_xlabel("step"), a.set_ylabel("TTT loss"), a.legend()
    for key, label in (("simulated_accept_length", "simulated accept length"),
                       ("simulated_accept_length" + NO_LOOPS, "... outside loops"), ("tau", "tau (validate)")):
        pts = [(r["step"], r[key]) for r in val if r.get(key) is not None]
        if pts:
            c.plot(*zip(*pts), "o-", label=label)
    c.set_xlabel("step"), c.set_ylabel("tokens per round")
    if val:
        c.legend()
        last = next((r for r in reversed(val) if r.get("accuracy_per_position")), None)
        if last is not None:
            ks = range(len(last["accuracy_per_position"]))
            b.plot(ks, last["accuracy_per_position"], "o-", label="accuracy")
            b.plot(ks, last["conditional_accuracy_per_position"], "s-", label="conditional accuracy")
            b.set_title(f"held-out @ step {last['step']}: simulated accept length "
                        f"{last['simulated_accept_length']:.2f}")
            b.set_xlabel("draft position"), b.set_ylim(0, 1), b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


@dataclass
class Best:
    """The best evaluation so far, by ``key`` (validate's "tau" when it returns one, else the
    simulated accept length); ``evals_since``: evaluations since it (patience counts them)."""

    step: int | None = None
    score: float = -math.inf
    key: str = "simulated_accept_length"
    evals_since: int = 0
    row: dict[str, Any] | None = None  # the evaluation's figures, for the final contract

    def update(self, step: int, row: dict[str, Any]) -> bool:
        """Count one evaluation; True when it is a new best (strictly better)."""
        key = "tau" if row.get("tau") is not None else "simulated_accept_length"
        score = row.get(key)
        if score is None:
            return False
        if score > self.score or self.step is None:
            self.step, self.score, self.key, self.evals_since, self.row = step, float(score), key, 0, dict(row)
            return True
        self.evals_since += 1
        return False
