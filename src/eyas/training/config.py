"""Every training flag and default in one flat, typed config, printed at start and saved into
every checkpoint (``train_config`` in eyas.json)."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, model_validator


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # --- what ---
    target: str = "smollm2"
    data: str = ""  # a shard directory (offline) or a conversations JSONL (online)
    out: str = "runs/drafter"
    boundaries: list[int] | None = None  # None: the data's (offline) or [2, L//2, L-3] (online)
    draft_vocab_size: int = 8192
    system_prompt: str = "template_default"  # online rendering only
    # An eyas drafter directory whose weights and draft vocabulary start the run (fine-tuning a
    # drafter on more data), instead of a fresh initialisation. Its contract is checked against the
    # target, and its boundaries, draft vocabulary size and variant flags must be this run's. The
    # optimizer and schedule start afresh; a checkpoint in ``out`` (a resume) takes precedence.
    init_from: str | None = None

    # --- the drafter variant: passed to DrafterConfig (which checks them), recorded in the contract ---
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h
    norm_before_fc: bool = False  # one RMSNorm over the concatenated slots before fc
    fc_norm: bool = False  # one RMSNorm per slot before the concatenation
    norm_output: bool = False  # feed back the post-norm hidden state instead of the pre-norm one

    # --- how long ---
    steps: int | None = None  # exactly one of steps / epochs
    epochs: float | None = None
    batch_size: int = 4  # sequences per rank per step (when tokens_per_batch is None)
    # Length-bucketed batches (eyas.training.order.BucketOrder): rows * padded length <= this many
    # tokens per rank per step, padded length a multiple of 64; None: batch_size samples per step.
    tokens_per_batch: int | None = None
    max_length: int = 1024
    # The wall time of a train() call (loading and tokenizing, evaluations and checkpoints included). The schedule
    # is refitted to it as the pace becomes known (eyas.training.loop.fit_schedule): the cosine ends
    # at the budget instead of being cut off at a high learning rate. None: run every planned step.
    time_budget_s: float | None = None

    # --- optimisation ---
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 0.5
    ttt_steps: int = 7
    ttt_decay: float = 0.8

    # --- bookkeeping ---
    val_fraction: float = 0.05
    max_val_samples: int = 64
    log_every: int = 10
    eval_every: int = 100
    # Stop when the held-out figure (validate's tau, else the simulated accept length) has not
    # improved for this many evaluations; None: train all the steps. out/best keeps the best.
    patience: int | None = None
    save_every: int = 200
    seed: int = 0
    device: str = "auto"  # auto: cuda when available
    target_devices: str | None = None  # --target-devices: the target split over these (eyas.targets.split)
    precision: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"give exactly one of steps / epochs; found steps={self.steps}, epochs={self.epochs}")
        if self.tokens_per_batch is not None and self.tokens_per_batch < 64:
            raise ValueError(f"tokens_per_batch: expected None or at least 64, found {self.tokens_per_batch}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s: expected None or more than 0, found {self.time_budget_s}")
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"patience: expected None or at least 1, found {self.patience}")
        for name in ("batch_size", "log_every", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected at least 1, found {getattr(self, name)}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction: expected 0 <= x < 1, found {self.val_fraction}")
        return self


def split_indices(n: int, cfg: TrainConfig) -> tuple[list[int], list[int]]:
    """Deterministic held-out split: a seeded permutation, the first val_fraction (capped) held out."""
    if n < 2:
        raise ValueError(f"training data: expected at least 2 samples with assistant tokens, found {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    n_val = min(cfg.max_val_samples, max(1, round(n * cfg.val_fraction))) if cfg.val_fraction > 0 else 0
    return sorted(perm[n_val:]), sorted(perm[:n_val])
