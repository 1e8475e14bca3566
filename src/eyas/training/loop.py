"""`eyas train`: the training loop, top to bottom.

    set up (distributed, device, target) -> samples (online or shards) -> held-out split
    -> draft vocabulary -> drafter + contract -> AdamW + warm-up/cosine -> resume if possible
    -> for each step: batch (fixed size or length-bucketed) -> TTT loss -> backward -> all-reduce
       -> clip -> step (log, evaluate + keep the best + patience, checkpoint every N)
    -> final evaluation -> the best eyas-format drafter + plot

A step reads nothing back from the device; only log, evaluation and checkpoint steps do.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from eyas.convention.boundaries import CaptureSpec
from eyas.io import atomic_write_text
from eyas.targets import LoadedTarget, PlacementError, load_target, parse_target_devices, resolve_device
from eyas.capture.stats import FingerprintAccumulator
from eyas.contract.contract import SlotFingerprint, ValidationMetrics
from eyas.data.shard_format import is_shard_dir
from eyas.drafter.build import drafter_flags, new_drafter
from eyas.drafter.config import NORM_FLAGS
from eyas.drafter.model import Eagle3Drafter
from eyas.training.batches import Batch, OfflineBatches, OnlineBatches
from eyas.training.config import TrainConfig, split_indices
from eyas.training.distributed import init_distributed
from eyas.training.evaluation import NO_LOOPS, Best, evaluate, keep_outside_loops, plot_metrics
from eyas.training.init_from import adopt_init_from, init_weights
from eyas.training.order import make_order, sample_lengths
from eyas.training.state import SHARD_BYTES, checkpoint_dirs, commit_dir, load_train_state, save_train_state
from eyas.drafter.ttt import Tally, ttt_forward
from eyas.training.timing import PhaseTimer, Window
from eyas.training.vocab import build_draft_vocab, count_targets

METRICS_FILE = "metrics.jsonl"


# ---------------------------------------------------------------------------------------------
# Set-up helpers
# ---------------------------------------------------------------------------------------------


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up to lr, then cosine down to lr * min_lr_ratio at the last step."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


# Steps of this run before its pace is trusted for fitting the schedule to --time-budget-s (the first
# steps compile and warm up); it is refitted at every log line after that.
FIT_AFTER_STEPS = 20


def fit_schedule(planned: int, start: int, done: int, elapsed_s: float, budget_s: float) -> int:
    """The schedule's total steps that end it at ``budget_s`` seconds of this run, from its pace so
    far: ``done - start`` steps in ``elapsed_s`` (evaluations and checkpoints included, as they will
    recur). Never more than ``planned`` (the steps or epochs asked for), never fewer than ``done + 1``.

    Refitted as the run goes: a shorter total moves the cosine on (the learning rate steps down a
    little), a longer one (a pace that improved after the warm-up) moves it back, so the decay ends
    at the budget rather than being cut off at a high learning rate."""
    pace = elapsed_s / max(1, done - start)  # seconds per step
    fits = done + int(max(0.0, budget_s - elapsed_s) / pace)
    return max(done + 1, min(planned, fits))


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_samples(cfg: TrainConfig, target: LoadedTarget, force: bool) -> tuple[Any, CaptureSpec, bool, str]:
    """(indexable samples, capture spec, offline?, system prompt mode)."""
    L, tokenizer = target.num_blocks, target.tokenizer
    if is_shard_dir(cfg.data):
        from eyas.data.shard_dataset import ShardDataset

        ds = ShardDataset(cfg.data, features=True)
        ds.check_target(target, tokenizer, force=force)  # same fingerprint, blocks, template, ...
        if cfg.boundaries is not None and list(cfg.boundaries) != list(ds.contract.capture.boundaries):
            raise ValueError(
                f"--boundaries {cfg.boundaries}: the shards in {cfg.data} hold boundaries "
                f"{ds.contract.capture.boundaries}; recapture or drop --boundaries")
        mode = ds.contract.tokenisation.system_prompt if ds.contract.tokenisation else cfg.system_prompt
        return ds, CaptureSpec(tuple(ds.contract.capture.boundaries), L), True, mode
    from eyas.data.conversation_files import read_conversations
    from eyas.data.render import system_prompt_mode
    from eyas.data.render_pool import render_many

    result = read_conversations(cfg.data, on_error="skip")
    rendered = render_many(result.conversations, tokenizer, max_length=cfg.max_length, system_prompt=cfg.system_prompt)
    misaligned = sum(r is None for r in rendered)
    # prompt-only conversations carry no loss
    samples = [{"input_ids": r.input_ids, "loss_mask": r.loss_mask} for r in rendered if r is not None and r.num_assistant_tokens > 0]
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
# The loop
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    out: Path  # the eyas-format drafter directory
    drafter: Eagle3Drafter  # this rank's weights (identical on every rank): the best ones when tracked
    steps_done: int
    best_step: int | None = None  # the step of the drafter written to ``out`` (None: no evaluation)
    stopped_early: bool = False  # patience ran out


BEST_DIR = "best"


def _copy_dir(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` by hard links where possible (checkpoints of out/best cost no space;
    files are never modified in place, only replaced)."""

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)


def train(cfg: TrainConfig, force: bool = False, stop_after: int | None = None,
          log: Callable[[str], None] = print,
          validate: Callable[[Eagle3Drafter, Any], dict[str, float]] | None = None) -> TrainResult:
    """Train a drafter per ``cfg`` into ``cfg.out`` (an eyas-format drafter at the end).

    ``stop_after`` ends the process-local run early after that many steps (as a crash would),
    leaving the checkpoints for a resume; tests use it.

    Evaluations (every ``eval_every`` and ``save_every`` steps, and at the end) measure the
    held-out metrics, with and without repetition loops, and call ``validate(drafter, model)`` (rank 0
    only; its figures are broadcast, recorded in metrics.jsonl and the contract). The best
    evaluation -- by validate's "tau" when it returns one, else by the simulated accept length --
    is kept in ``out/best`` (eyas format); with ``cfg.patience`` the run stops once that many
    evaluations in a row did not improve on it. ``model`` is the frozen target training holds (a
    probe serves a copy of the drafter on it; its capture hooks exist only inside each forward).
    The drafter written to ``out`` is the best one
    (its contract's metrics.step says which step; ``last_step`` the last one trained).

    A training step reads nothing back from the device (counts stay on it; throughput is
    measured with events read at log steps): only log, evaluation and checkpoint steps sync.

    ``cfg.time_budget_s`` counts from this call (loading the target, reading and tokenizing the
    data included); the loop's schedule is refitted to what is left of it (:func:`fit_schedule`),
    and the last evaluation and the save come after it.
    """
    from eyas.interop import load_drafter, save_drafter

    t_entry = time.perf_counter()
    cfg, taken = adopt_init_from(cfg)  # --init-from: its draft vocabulary, boundaries and flags unless set

    split = parse_target_devices(cfg.target_devices)  # --target-devices: the drafter on its first device
    if split is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise PlacementError(f"--target-devices {cfg.target_devices}: expected one process (a split target "
                             f"is not supported under torchrun), found WORLD_SIZE={os.environ['WORLD_SIZE']}")
    if split is None:
        device = resolve_device(cfg.device)  # under torchrun: cuda:LOCAL_RANK
    else:  # the target's first device (auto: cuda:0, where accelerate puts the embedding)
        device = split.first or resolve_device("cuda:0" if torch.cuda.is_available() else "cpu")
    d = init_distributed(device.type)
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    out = Path(cfg.out)
    if d.main:
        log(f"eyas train config: {cfg.model_dump_json()}")
        if taken:
            log(f"--init-from {cfg.init_from}: took its " + ", ".join(f"{k}={v}" for k, v in taken.items())
                + " (set them to override)")
        out.mkdir(parents=True, exist_ok=True)

    # Target and data. The target stays frozen; with bf16 the target runs in bf16 on GPU.
    target = load_target(cfg.target, dtype=torch.bfloat16 if use_bf16 else torch.float32, device=device,
                         target_devices=split)
    model, tokenizer = target.model, target.tokenizer
    for p in model.parameters():
        p.requires_grad_(False)
    samples, spec, offline, sys_mode = load_samples(cfg, target, force)
    train_idx, val_idx = split_indices(len(samples), cfg)
    order = make_order(train_idx, sample_lengths(samples, train_idx) if cfg.tokens_per_batch else None,
                       cfg.batch_size, cfg.tokens_per_batch, cfg.seed)
    # Loop bodies of the held-out samples, found once (host work, never inside a step).
    outside_loops = {i: keep_outside_loops(samples[i]) for i in val_idx}

    # Draft vocabulary from the training split only (never the held-out samples), over the config's
    # vocabulary (DrafterConfig.for_target sizes t2d by it); --init-from keeps its drafter's.
    counts = count_targets(token_pairs(samples, train_idx), target.text_config.vocab_size)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    drafter, contract = new_drafter(target, tokenizer, spec.boundaries, cfg.draft_vocab_size, source=target.name,
                                    capture_dtype="bfloat16" if use_bf16 else "float32", seed=cfg.seed,
                                    **{flag: getattr(cfg, flag) for flag in NORM_FLAGS})
    ckpts = checkpoint_dirs(out)  # a resume (below) loads the newest instead of --init-from
    if cfg.init_from is not None and not ckpts:
        vocab = init_weights(drafter, cfg.init_from, target, spec, force, counts)
    else:
        vocab = build_draft_vocab(counts, cfg.draft_vocab_size)
        drafter.set_vocab_map(vocab.ids)
    if d.main:
        source = ""  # where the weights came from (a resume says so below)
        if cfg.init_from is not None and not ckpts:
            source = f"; weights from {cfg.init_from}, its draft vocabulary"
            if vocab.widened_from is not None:
                source += f" of {vocab.widened_from} widened by the most frequent training targets"
        log(f"{len(train_idx)} training / {len(val_idx)} held-out samples ({'offline shards' if offline else 'online'}); "
            f"draft vocab {cfg.draft_vocab_size} covers {vocab.coverage:.2%} of {vocab.num_targets} training "
            f"targets{source}")
    contract = contract.model_copy(update={"drafter": drafter_flags(drafter.config, "trained")})
    if contract.tokenisation is not None:
        contract.tokenisation.system_prompt = sys_mode  # type: ignore[assignment]
    drafter.to(device).train()
    draft_ids = drafter.draft_to_target(torch.arange(cfg.draft_vocab_size, device=device))
    batches = (OfflineBatches(model, draft_ids, device, samples.last_hidden_normed) if offline
               else OnlineBatches(model, spec, draft_ids, device, torch.bfloat16 if use_bf16 else None))
    # The training fingerprint that doctor and trace hold live captures against.
    if offline:
        contract.fingerprint = samples.contract.fingerprint
    elif d.main:
        contract.fingerprint = online_fingerprint(batches, samples, train_idx[:64], spec, target.hidden_size)

    planned = cfg.steps if cfg.steps is not None else order.steps_for(cfg.epochs, d.world)  # type: ignore[arg-type]
    total_steps = planned  # fitted to cfg.time_budget_s as the run goes (fit_schedule)
    params = [p for p in drafter.parameters() if p.requires_grad]
    # fused on CUDA: one kernel for the whole update, its step counters on the device (no host reads)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total_steps))

    # Resume from the newest complete checkpoint: weights, optimizer, scheduler, RNG, data position,
    # the best evaluation so far (and out/best as it was at that checkpoint).
    start = 0
    best = Best()
    if ckpts:
        latest = ckpts[-1]
        loaded, _ = load_drafter(latest, target=target)  # the embedding comes from the target
        drafter.load_state_dict(loaded.state_dict())
        meta = load_train_state(latest, opt, sched)
        start = meta["step"]
        if meta.get("best"):
            best = Best(**meta["best"])
        if d.main:
            shutil.rmtree(out / (BEST_DIR + ".tmp"), ignore_errors=True)
            if (latest / BEST_DIR).is_dir():  # out/best may hold a later step of the crashed run
                _copy_dir(latest / BEST_DIR, out / (BEST_DIR + ".tmp"))
                commit_dir(out / (BEST_DIR + ".tmp"), out / BEST_DIR)
            elif (out / BEST_DIR).exists():
                shutil.rmtree(out / BEST_DIR)
            log(f"resumed from {latest} at step {start}")

    metrics_path = out / METRICS_FILE
    if d.main and start == 0 and metrics_path.exists():
        metrics_path.unlink()
    elif d.main and metrics_path.exists():  # rows the crashed run wrote after the checkpoint come again
        kept = [x for x in metrics_path.read_text().splitlines() if x.strip() and json.loads(x).get("step", 0) <= start]
        atomic_write_text(metrics_path, "".join(x + "\n" for x in kept))

    def record(row: dict[str, Any]) -> None:
        if d.main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def contract_with(row: dict[str, Any] | None, step: int, **extra: Any) -> Any:
        figures = {k: v for k, v in (row or {}).items() if k not in ("kind", "step")}
        return contract.model_copy(update={"metrics": ValidationMetrics(step=step, **figures, **extra)})

    def evaluation(step: int) -> dict[str, Any]:
        """Evaluate (collective: every rank), record, track the best (rank 0 writes out/best)."""
        row: dict[str, Any] = {"kind": "val", "step": step}
        if val_idx:
            row.update(evaluate(drafter, batches, samples, val_idx, cfg, d, outside_loops).model_dump())
        if validate is not None:
            figures: list[Any] = [None]
            if d.main:
                drafter.eval()
                figures[0] = {k: float(v) for k, v in validate(drafter, model).items()}
                drafter.train()
            if d.world > 1:
                dist.broadcast_object_list(figures, src=0)
            row.update(figures[0])
        record(row)
        improved = best.update(step, row)
        if d.main and "simulated_accept_length" in row:
            nl = row.get("simulated_accept_length" + NO_LOOPS)
            log(f"step {step}: held-out simulated accept length {row['simulated_accept_length']:.3f}"
                + (f" ({nl:.3f} outside loops)" if nl is not None else "")
                + (f", tau {row['tau']:.3f}" if row.get("tau") is not None else "")
                + (" (best)" if improved else f" (best {best.score:.3f} at step {best.step})"))
        if improved and d.main:
            tmp = out / (BEST_DIR + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            save_drafter(drafter, contract_with(row, step), tmp, max_file_bytes=SHARD_BYTES)
            commit_dir(tmp, out / BEST_DIR)
        return row

    def save_checkpoint(step: int, row: dict[str, Any] | None) -> None:
        """Rank 0 writes an eyas-format drafter with the metrics in its contract, the resumable
        train state (sharded) and a hard-linked copy of out/best, under a temporary name."""
        if not d.main:
            return
        final_dir = out / "checkpoints" / f"step-{step:07d}"
        tmp = final_dir.with_name(final_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash mid-write
        tmp.parent.mkdir(parents=True, exist_ok=True)
        save_drafter(drafter, contract_with(row, step), tmp, max_file_bytes=SHARD_BYTES)
        save_train_state(tmp, step, opt, sched, {"total_steps": total_steps, "best": asdict(best)})
        (tmp / "train_config.json").write_text(cfg.model_dump_json(indent=2))
        if (out / BEST_DIR).is_dir():
            _copy_dir(out / BEST_DIR, tmp / BEST_DIR)
        commit_dir(tmp, final_dir)

    bar = tqdm(range(start, total_steps), initial=start, total=total_steps, disable=not d.main, desc="train",
               dynamic_ncols=True)
    window = Tally(cfg.ttt_steps)
    timer = PhaseTimer(device)
    # Plan the first epoch now; a later epoch is planned at its first step, on the host from CPU
    # tensors (a seeded randperm: no device involved).
    order.step(start, d.rank, d.world)
    done, stopped_early, last_eval = start, False, None
    t_loop = time.perf_counter()
    for step in bar:
        t_start = timer.mark()
        rows = order.step(step, d.rank, d.world)
        batch: Batch = batches.make([samples[i] for i in rows], order.pad_multiple)
        t_mid = timer.mark()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            r = ttt_forward(drafter, batch.input_ids, batch.features, batch.labels, batch.loss_mask,
                            cfg.ttt_steps, cfg.ttt_decay)
        opt.zero_grad(set_to_none=True)
        r.loss.backward()
        if d.world > 1:  # data parallel: average gradients over ranks, one all-reduce for all of them
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= d.world
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        window.add(r)
        timer.step(t_start, t_mid, timer.mark(), batch.num_tokens, batch.padded_tokens)
        done = step + 1
        if done % cfg.log_every == 0 or done == total_steps:
            w = timer.read()
            s = window.summary()
            figures = w.row()
            if d.world > 1:  # real tokens of every rank (batches differ in size with buckets)
                t = torch.tensor([w.tokens, w.padded_tokens], dtype=torch.float64, device=device)
                dist.all_reduce(t)
                tokens_all, padded_all = t.tolist()
                figures = Window(w.wall_s, w.target_s, w.drafter_s, int(tokens_all), int(padded_all)).row()
            loss = r.loss.item()
            record({"kind": "train", "step": done, "loss": loss, "lr": sched.get_last_lr()[0],
                    "grad_norm": float(grad_norm), **figures, **s.model_dump()})
            bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{s.accuracy_per_position[0]:.3f}",
                            tok_s=f"{figures['tokens_per_s']:.0f}", tgt=f"{figures['target_share']:.0%}",
                            dft=f"{figures['drafter_share']:.0%}")
            window = Tally(cfg.ttt_steps)
            if cfg.time_budget_s is not None and done - start >= FIT_AFTER_STEPS and done < total_steps:
                fitted = fit_schedule(planned, start, done, time.perf_counter() - t_loop,
                                      cfg.time_budget_s - (t_loop - t_entry))  # what setup left of the budget
                if d.world > 1:  # every rank runs rank 0's schedule
                    t = torch.tensor([fitted], dtype=torch.long, device=device)
                    dist.broadcast(t, src=0)
                    fitted = int(t.item())
                if fitted != total_steps:
                    if abs(fitted - total_steps) > 0.05 * total_steps:  # say so when it moves by more than 5%
                        if d.main:
                            log(f"step {done}: the schedule now ends at step {fitted} of {planned} planned, to "
                                f"fit --time-budget-s {cfg.time_budget_s:g}")
                        record({"kind": "schedule", "step": done, "total_steps": fitted, "planned_steps": planned})
                    total_steps = fitted
                    sched.lr_lambdas = [lr_lambda(cfg, total_steps)]  # type: ignore[attr-defined]
                    bar.total = total_steps
        evaluates = val_idx or validate is not None
        t_other = time.perf_counter()
        if done < total_steps and evaluates and (done % cfg.eval_every == 0 or done % cfg.save_every == 0):
            last_eval = evaluation(done)
            if cfg.patience is not None and best.evals_since >= cfg.patience:
                stopped_early = True
                if d.main:
                    log(f"step {done}: no improvement for {best.evals_since} evaluations (patience "
                        f"{cfg.patience}); stopping, best at step {best.step}")
                bar.close()
                break
        if done < total_steps and done % cfg.save_every == 0:
            save_checkpoint(done, last_eval if last_eval is not None and last_eval["step"] == done else None)
        timer.exclude(time.perf_counter() - t_other)
        if stop_after is not None and done - start >= stop_after:
            return TrainResult(out, drafter, done, best.step)
        if total_steps < planned and done >= total_steps:  # the schedule fitted to --time-budget-s ends here
            bar.close()
            break

    # The end: a last evaluation (unless the early stop just made one), then the best drafter to out.
    if (val_idx or validate is not None) and not (last_eval is not None and last_eval["step"] == done):
        last_eval = evaluation(done)
    if best.step is not None and best.step != done:
        if d.world > 1:
            dist.barrier()  # rank 0 wrote out/best
        loaded, _ = load_drafter(out / BEST_DIR, target=target)
        drafter.load_state_dict(loaded.state_dict())
    if d.main:
        extra = {"last_step": done, "selected_by": best.key} if best.step is not None else {}
        final_row = best.row if best.step is not None else last_eval
        save_drafter(drafter, contract_with(final_row, best.step if best.step is not None else done, **extra), out,
                     max_file_bytes=SHARD_BYTES)
        atomic_write_text(out / "train_config.json", cfg.model_dump_json(indent=2))
        plot_metrics(metrics_path, out / "training.png")
        if best.step is not None:
            log(f"the drafter in {out} is the best evaluation: step {best.step} of {done} "
                f"({best.key} {best.score:.3f}); out/{BEST_DIR} holds the same")
        log(f"wrote {out} (metrics {metrics_path}, plot {out / 'training.png'})")
    return TrainResult(out, drafter, done, best.step, stopped_early)
