"""`eyas train`: the training loop, top to bottom.

    set up (distributed, device, target) -> samples (online or shards) -> held-out split
    -> draft vocabulary -> drafter + contract -> AdamW + warm-up/cosine -> resume if possible
    -> for each step: batch -> TTT loss -> backward -> all-reduce -> clip -> step
       (log, evaluate, checkpoint every N) -> final evaluation -> eyas-format drafter + plot
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from eyas.convention.boundaries import CaptureSpec
from eyas.io import atomic_write_text
from eyas.targets import LoadedTarget, load_target, resolve_device
from eyas.capture.stats import FingerprintAccumulator
from eyas.contract.contract import SlotFingerprint, ValidationMetrics
from eyas.data.shards import is_shard_dir
from eyas.drafter.build import drafter_flags, new_drafter
from eyas.drafter.config import NORM_FLAGS
from eyas.drafter.model import Eagle3Drafter
from eyas.training.batches import Batch, OfflineBatches, OnlineBatches
from eyas.training.config import TrainConfig, split_indices
from eyas.training.state import checkpoint_dirs, commit_dir, load_train_state, save_train_state
from eyas.drafter.ttt import Tally, ttt_forward
from eyas.training.vocab import build_draft_vocab, count_targets

METRICS_FILE = "metrics.jsonl"


# ---------------------------------------------------------------------------------------------
# Set-up helpers
# ---------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device_kind: str) -> Dist:
    """torchrun sets WORLD_SIZE and RANK (LOCAL_RANK picks the GPU: eyas.targets.placement); gloo on
    CPU, NCCL on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size())


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up to lr, then cosine down to lr * min_lr_ratio at the last step."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


def epoch_order(train_idx: Sequence[int], epoch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    return [train_idx[i] for i in torch.randperm(len(train_idx), generator=g).tolist()]


def step_samples(train_idx: Sequence[int], step: int, cfg: TrainConfig, d: Dist) -> list[int]:
    """The sample indices of this rank at ``step``: the data position is a function of the step
    alone, so resuming at step s reads exactly what an uninterrupted run would."""
    global_batch = cfg.batch_size * d.world
    start = step * global_batch
    out = []
    for j in range(start + d.rank * cfg.batch_size, start + (d.rank + 1) * cfg.batch_size):
        epoch, pos = divmod(j, len(train_idx))
        out.append(epoch_order(train_idx, epoch, cfg.seed)[pos])
    return out


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_samples(cfg: TrainConfig, target: LoadedTarget, force: bool) -> tuple[Any, CaptureSpec, bool, str]:
    """(indexable samples, capture spec, offline?, system prompt mode)."""
    L, tokenizer = target.num_blocks, target.tokenizer
    if is_shard_dir(cfg.data):
        from eyas.data.shards import ShardDataset

        ds = ShardDataset(cfg.data, features=True)
        ds.check_target(target, tokenizer, force=force)  # same fingerprint, blocks, template, ...
        if cfg.boundaries is not None and list(cfg.boundaries) != list(ds.contract.capture.boundaries):
            raise ValueError(
                f"--boundaries {cfg.boundaries}: the shards in {cfg.data} hold boundaries "
                f"{ds.contract.capture.boundaries}; recapture or drop --boundaries")
        mode = ds.contract.tokenisation.system_prompt if ds.contract.tokenisation else cfg.system_prompt
        return ds, CaptureSpec(tuple(ds.contract.capture.boundaries), L), True, mode
    from eyas.data.conversations import read_conversations
    from eyas.data.render import TemplateAlignmentError, render, system_prompt_mode

    result = read_conversations(cfg.data, on_error="skip")
    samples, misaligned = [], 0
    for conv in result.conversations:
        try:
            r = render(conv, tokenizer, max_length=cfg.max_length, system_prompt=cfg.system_prompt)
        except TemplateAlignmentError:
            misaligned += 1
            continue
        if r.num_assistant_tokens > 0:  # prompt-only conversations carry no loss
            samples.append({"input_ids": r.input_ids, "loss_mask": r.loss_mask})
    if result.problems or misaligned:
        warnings.warn(f"{cfg.data}: skipped {len(result.problems)} bad records and {misaligned} conversations "
                      f"the chat template cannot align; first: {result.problems[:1]}", stacklevel=2)
    return samples, CaptureSpec.create(L, cfg.boundaries), False, system_prompt_mode(cfg.system_prompt)


def online_fingerprint(batches: OnlineBatches, samples: Any, indices: Sequence[int], spec: CaptureSpec,
                       hidden_size: int) -> list[SlotFingerprint]:
    """Per-slot fingerprint of the live capture over some training samples (offline training
    takes the one `eyas capture` stored in the shards' manifest)."""
    acc = FingerprintAccumulator(spec.boundaries, hidden_size)
    for i in indices:
        feats = batches.make([samples[i]]).features[0]  # [T, S * H]
        acc.update_sequence(feats.view(feats.shape[0], spec.num_slots, hidden_size).double())
    return acc.result()


def token_pairs(samples: Any, indices: Sequence[int]):
    for i in indices:
        s = samples[i]
        yield s["input_ids"], s["loss_mask"]


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, batches: Any, samples: Any, val_idx: Sequence[int], cfg: TrainConfig,
             d: Dist) -> ValidationMetrics:
    drafter.eval()
    tally = Tally(cfg.ttt_steps)
    mine = list(val_idx)[d.rank :: d.world]
    for i in range(0, len(mine), cfg.batch_size):
        b = batches.make([samples[j] for j in mine[i : i + cfg.batch_size]])
        tally.add(ttt_forward(drafter, b.input_ids, b.features, b.labels, b.loss_mask, cfg.ttt_steps, cfg.ttt_decay))
    tally.all_reduce()
    drafter.train()
    return tally.summary()


def plot_metrics(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    a.set_xlabel("step"), a.set_ylabel("TTT loss"), a.legend()
    if val:
        last = val[-1]
        ks = range(len(last["accuracy_per_position"]))
        b.plot(ks, last["accuracy_per_position"], "o-", label="accuracy")
        b.plot(ks, last["conditional_accuracy_per_position"], "s-", label="conditional accuracy")
        b.set_title(f"held-out @ step {last['step']}: simulated accept length {last['simulated_accept_length']:.2f}")
        b.set_xlabel("draft position"), b.set_ylim(0, 1), b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    out: Path  # the eyas-format drafter directory
    drafter: Eagle3Drafter  # this rank's weights (identical on every rank)
    steps_done: int


def train(cfg: TrainConfig, force: bool = False, stop_after: int | None = None,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train a drafter per ``cfg`` into ``cfg.out`` (an eyas-format drafter at the end).

    ``stop_after`` ends the process-local run early after that many steps (as a crash would),
    leaving the checkpoints for a resume; tests use it.
    """
    from eyas.interop import save_drafter

    device = resolve_device(cfg.device)  # under torchrun: cuda:LOCAL_RANK
    d = init_distributed(device.type)
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    out = Path(cfg.out)
    if d.main:
        log(f"eyas train config: {cfg.model_dump_json()}")
        out.mkdir(parents=True, exist_ok=True)

    # Target and data. The target stays frozen; with bf16 the target runs in bf16 on GPU.
    target = load_target(cfg.target, dtype=torch.bfloat16 if use_bf16 else torch.float32, device=device)
    model, tokenizer = target.model, target.tokenizer
    for p in model.parameters():
        p.requires_grad_(False)
    samples, spec, offline, sys_mode = load_samples(cfg, target, force)
    train_idx, val_idx = split_indices(len(samples), cfg)

    # Draft vocabulary from the training split only (never the held-out samples), over the config's
    # vocabulary (DrafterConfig.for_target sizes t2d by it).
    vocab = build_draft_vocab(count_targets(token_pairs(samples, train_idx), target.text_config.vocab_size),
                              cfg.draft_vocab_size)
    if d.main:
        log(f"{len(train_idx)} training / {len(val_idx)} held-out samples ({'offline shards' if offline else 'online'}); "
            f"draft vocab {cfg.draft_vocab_size} covers {vocab.coverage:.2%} of {vocab.num_targets} training targets")

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    drafter, contract = new_drafter(target, tokenizer, spec.boundaries, cfg.draft_vocab_size, source=target.name,
                                    capture_dtype="bfloat16" if use_bf16 else "float32", seed=cfg.seed,
                                    **{flag: getattr(cfg, flag) for flag in NORM_FLAGS})
    drafter.set_vocab_map(vocab.ids)
    contract = contract.model_copy(update={"drafter": drafter_flags(drafter.config, "trained")})
    if contract.tokenisation is not None:
        contract.tokenisation.system_prompt = sys_mode  # type: ignore[assignment]
    drafter.to(device).train()
    draft_ids = drafter.draft_to_target(torch.arange(cfg.draft_vocab_size, device=device))
    batches = (OfflineBatches(model, draft_ids, device) if offline
               else OnlineBatches(model, spec, draft_ids, device, torch.bfloat16 if use_bf16 else None))
    # The training fingerprint that doctor and trace hold live captures against.
    if offline:
        contract.fingerprint = samples.contract.fingerprint
    elif d.main:
        contract.fingerprint = online_fingerprint(batches, samples, train_idx[:64], spec, target.hidden_size)

    total_steps = cfg.steps if cfg.steps is not None else math.ceil(
        cfg.epochs * len(train_idx) / (cfg.batch_size * d.world))  # type: ignore[operator]
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total_steps))

    # Resume from the newest complete checkpoint: weights, optimizer, scheduler, RNG, data position.
    start = 0
    ckpts = checkpoint_dirs(out)
    if ckpts:
        from eyas.interop import load_drafter

        latest = ckpts[-1]
        loaded, _ = load_drafter(latest, target=target)  # the embedding comes from the target
        drafter.load_state_dict(loaded.state_dict())
        start = load_train_state(latest, opt, sched)["step"]
        if d.main:
            log(f"resumed from {latest} at step {start}")

    metrics_path = out / METRICS_FILE
    if d.main and start == 0 and metrics_path.exists():
        metrics_path.unlink()

    def record(row: dict[str, Any]) -> None:
        if d.main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def checkpoint(step: int, final: bool) -> None:
        """Evaluate (on every rank: it is collective), then rank 0 writes an eyas-format drafter
        with the metrics in its contract; intermediate ones also get the resumable train state."""
        val = evaluate(drafter, batches, samples, val_idx, cfg, d) if val_idx else None
        if val is not None:
            record({"kind": "val", "step": step, **val.model_dump()})
        if not d.main:
            return
        c = contract.model_copy(update={"metrics": (val or ValidationMetrics()).model_copy(update={"step": step})})
        if final:
            save_drafter(drafter, c, out)
            atomic_write_text(out / "train_config.json", cfg.model_dump_json(indent=2))
            return
        final_dir = out / "checkpoints" / f"step-{step:07d}"
        tmp = final_dir.with_name(final_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash mid-write
        tmp.parent.mkdir(parents=True, exist_ok=True)
        save_drafter(drafter, c, tmp)
        save_train_state(tmp, step, opt, sched, {"total_steps": total_steps})
        (tmp / "train_config.json").write_text(cfg.model_dump_json(indent=2))
        commit_dir(tmp, final_dir)

    bar = tqdm(range(start, total_steps), initial=start, total=total_steps, disable=not d.main, desc="train",
               dynamic_ncols=True)
    window = Tally(cfg.ttt_steps)
    t0, tokens = time.perf_counter(), 0
    for step in bar:
        batch: Batch = batches.make([samples[i] for i in step_samples(train_idx, step, cfg, d)])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            r = ttt_forward(drafter, batch.input_ids, batch.features, batch.labels, batch.loss_mask,
                            cfg.ttt_steps, cfg.ttt_decay)
        opt.zero_grad(set_to_none=True)
        r.loss.backward()
        if d.world > 1:  # data parallel: average gradients over ranks
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= d.world
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        window.add(r)
        tokens += batch.num_tokens * d.world
        done = step + 1
        if done % cfg.log_every == 0 or done == total_steps:
            s = window.summary()
            tok_s = tokens / (time.perf_counter() - t0)
            record({"kind": "train", "step": done, "loss": r.loss.item(), "lr": sched.get_last_lr()[0],
                    "grad_norm": float(grad_norm), "tokens_per_s": round(tok_s, 1), **s.model_dump()})
            bar.set_postfix(loss=f"{r.loss.item():.3f}", acc0=f"{s.accuracy_per_position[0]:.3f}",
                            tok_s=f"{tok_s:.0f}")
            window = Tally(cfg.ttt_steps)
        if done < total_steps and done % cfg.save_every == 0:
            checkpoint(done, final=False)
        elif done < total_steps and done % cfg.eval_every == 0 and val_idx:
            record({"kind": "val", "step": done, **evaluate(drafter, batches, samples, val_idx, cfg, d).model_dump()})
        if stop_after is not None and done - start >= stop_after:
            return TrainResult(out, drafter, done)
    checkpoint(total_steps, final=True)
    if d.main:
        plot_metrics(metrics_path, out / "training.png")
        log(f"wrote {out} (metrics {metrics_path}, plot {out / 'training.png'})")
    return TrainResult(out, drafter, total_steps)
