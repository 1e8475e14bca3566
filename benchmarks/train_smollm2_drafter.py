"""Train the best SmolLM2-135M-Instruct drafter that a few minutes of one GPU allow, with eyas' own CLI.

Two steps, on two machines:

    # 1. here (CPU, seconds): mix first-turn training prompts from shared/data into the git-ignored
    #    benchmarks/data/train_prompts.jsonl, which the GPU run must be given (carry "benchmarks/data")
    python benchmarks/train_smollm2_drafter.py prepare --shared ../shared/data

    # 2. on the GPU (at most --budget-s seconds, 480 by default, everything included)
    PYTHONPATH=src:/tmp/deps python benchmarks/train_smollm2_drafter.py run --target /tmp/smol.gguf

``run`` does, printing progress and the time of each phase:

1. calibrate (~15 s): loads the target in this process and times, on synthetic inputs of the sizes
   the run will use, Hugging Face ``generate`` at the regeneration batch size (a step and the
   prefill) and one online training step (target forward with capture + TTT forward/backward +
   AdamW: the library calls `eyas train` makes). ``--no-calibrate`` uses ``--est-*`` instead.
2. ``eyas regenerate``: the target answers the first N prompts of the (shuffled) mix, greedy,
   ``--max-new-tokens`` 256, batches of 256 (eager HF generate is launch-bound: a large batch costs
   about what one sequence does). EAGLE-3 drafters learn the target's own outputs. N is planned
   from the measured rates so that the rest of the budget trains ``--epochs`` (4) passes over the
   answers. Stopped past its estimate (whole chunks written so far stay); a rerun resumes the file.
3. ``eyas train`` online (the target in the same process, features captured on the fly): TTT 7
   steps, the project's default lr 1e-3, a frequency-based draft vocabulary of ``--draft-vocab``
   12288 (lm_head under 16 MiB in bf16), batch 16, as many steps as the measured step rate allows
   in the rest of the budget, checkpoints every ~1/6 of the run. Stopped at the deadline if the
   estimate was wrong: then the newest checkpoint (a complete eyas drafter with its held-out
   metrics) is the result.
4. ``WORK/drafter``: the drafter's top-level files (config.json, eyas.json, weights, metrics),
   loadable by `eyas generate`, `eyas bench` and ``benchmarks/spec_gpu.py``; ``WORK/drafter_bf16``:
   the same in bf16 as shards of at most 15 MiB with an index (what serving on a GPU runs anyway);
   ``WORK/summary.json``: the plan, the measured rates, the drafter's metrics. With ``$OUT`` set
   (the device tool's output folder, which returns at most 8 files of 16 MiB), ``$OUT/drafter``
   (the bf16 copy, 5 files) and ``$OUT/train_summary.json`` are written there, so that a later call
   on a fresh machine can carry the drafter back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO / "benchmarks" / "data" / "train_prompts.jsonl"
DEFAULT_WORK = REPO / "benchmarks" / "out" / "smollm2"

# (folder/file under shared/data, how many prompts at most, licence). The caps balance the mix
# against the six EAGLE evaluation sets (chat, code, math, instructions, summaries, questions);
# the evaluation prompts themselves are never trained on.
SOURCES: list[tuple[str, int, str]] = [
    ("sharegpt_prompts/ShareGPT_V3_filtered_500.json", 500, "Apache-2.0 repo; ShareGPT terms unclear"),
    ("sharegpt_prompts/ShareGPT_V3_filtered_1000.json", 1000, "Apache-2.0 repo; ShareGPT terms unclear"),
    ("sharegpt_prompts/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json", 2978,
     "Apache-2.0 repo; ShareGPT terms unclear"),
    ("gpteacher/codegen_prompts.jsonl", 4535, "MIT"),
    ("gpteacher/roleplay_prompts.jsonl", 1923, "MIT"),
    ("gsm8k/train.jsonl", 3000, "MIT"),  # capped: 7,473 math word problems would outweigh the chat sets
    ("self_instruct/seed_tasks.jsonl", 175, "Apache-2.0"),
    ("self_instruct/user_oriented_instructions.jsonl", 252, "Apache-2.0"),
    ("arena_hard/v0.1_question.jsonl", 500, "Apache-2.0"),
]

# Every source holds first turns only. MT-bench (and chat in general) asks a second question about
# the first answer, so a share of the prompts gets one of these generic follow-ups as a second user
# turn; `eyas regenerate --max-turns 2` answers it after the target's own first answer.
FOLLOW_UPS: list[str] = [
    "Can you explain that in more detail?",
    "Please summarise your answer in three bullet points.",
    "Rewrite your answer so that a ten-year-old could understand it.",
    "Give a concrete example.",
    "What are the limitations or possible mistakes in your answer?",
    "Now make it shorter and more formal.",
    "Can you continue?",
    "Turn your answer into a short table.",
]


def log(msg: str) -> None:
    print(f"[train_smollm2 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# prepare: the prompt mix (CPU, here)
# ---------------------------------------------------------------------------------------------


def prepare(shared: Path, out: Path, seed: int, no_sharegpt: bool, max_chars: int,
            follow_up_share: float = 0.3) -> dict[str, Any]:
    """First user turn of every source record (system message kept when it leads), de-duplicated by
    text, at most ``cap`` per source, shuffled (any prefix is a mix), as OpenAI-style JSONL; a
    ``follow_up_share`` of them (seeded) get a second user turn from FOLLOW_UPS."""
    sys.path.insert(0, str(REPO / "src"))
    from eyas.data.conversations import read_conversations

    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    counts: dict[str, dict[str, Any]] = {}
    for rel, cap, licence in SOURCES:
        if no_sharegpt and rel.startswith("sharegpt"):
            continue
        path = shared / rel
        if not path.exists():
            log(f"prepare: {path} missing, skipped")
            continue
        convs = read_conversations(path, on_error="skip").conversations
        picked = []
        for i, c in enumerate(convs):
            users = [m for m in c.messages if m["role"] == "user"]
            if not users:
                continue
            text = users[0]["content"].strip()
            if not text or len(text) > max_chars or text in seen:
                continue
            seen.add(text)
            head = [m for m in c.messages[:1] if m["role"] == "system"]
            picked.append({"id": f"{Path(rel).parent.name}/{Path(rel).stem}:{c.id or i}", "messages": head + [{"role": "user", "content": text}]})
        rng.shuffle(picked)
        picked = picked[:cap]
        rows += picked
        counts[rel] = {"records": len(convs), "kept": len(picked), "licence": licence}
    rng.shuffle(rows)
    follow_ups = 0
    for r in rows:
        if rng.random() < follow_up_share:
            r["messages"].append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
            follow_ups += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out)
    info = {"prompts": len(rows), "with_follow_up": follow_ups, "bytes": out.stat().st_size, "seed": seed, "max_chars": max_chars,
            "shared": str(shared), "sources": counts}
    out.with_name(out.stem + ".sources.json").write_text(json.dumps(info, indent=2))
    log(f"prepare: wrote {len(rows)} prompts ({info['bytes'] / 2**20:.2f} MiB) to {out}")
    for rel, c in counts.items():
        log(f"  {rel}: {c['kept']} of {c['records']} ({c['licence']})")
    return info


# ---------------------------------------------------------------------------------------------
# run: calibrate -> regenerate -> train -> copy (GPU)
# ---------------------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    parts = [str(REPO / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TQDM_MININTERVAL", "5")  # progress bars every 5 s, not every 0.1 s (the log stays short)
    return env


def run_cli(args: list[str], deadline: float, name: str) -> tuple[int | None, float]:
    """``python -m eyas.cli.main ARGS`` with its output streamed; killed (its own process group:
    SIGINT, then SIGTERM, then SIGKILL) at ``deadline``. -> (exit code or None when killed, seconds)."""
    cmd = [sys.executable, "-m", "eyas.cli.main", *args]
    log(f"{name}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=child_env(), cwd=str(REPO), start_new_session=True)
    killed = False
    while proc.poll() is None:
        if time.time() > deadline and not killed:
            log(f"{name}: deadline reached, stopping it (pid {proc.pid}); what it wrote so far is kept")
            killed = True
            for sig, wait in ((signal.SIGINT, 10), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        time.sleep(0.5)
    dt = time.perf_counter() - t0
    log(f"{name}: {'killed' if killed else f'exit {proc.returncode}'} after {dt:.1f} s")
    return (None if killed else proc.returncode), dt


def token_lengths(tokenizer: Any, prompts: Path, n: int = 256) -> list[int]:
    """Rendered lengths (chat template, generation prompt) of the first ``n`` prompts."""
    from eyas.data.conversations import read_conversations
    from eyas.data.render import render_prompt

    convs = read_conversations(prompts, on_error="skip").conversations[:n]
    return sorted(len(render_prompt(c, tokenizer)) for c in convs)


def percentile(xs: list[int], q: float) -> int:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def calibrate(a: argparse.Namespace) -> dict[str, Any]:
    """Seconds per HF generate step at the regeneration batch, seconds per prefill of that batch,
    and seconds per online training step at the training batch, on synthetic inputs of the run's
    sizes (the prompts' 90th-percentile rendered length)."""
    import torch
    from transformers import GenerationConfig

    from eyas.convention import CaptureSpec
    from eyas.drafter.build import new_drafter
    from eyas.drafter.ttt import Tally, ttt_forward
    from eyas.targets import load_target
    from eyas.training.batches import OnlineBatches

    t0 = time.perf_counter()
    loaded = load_target(a.target, dtype="auto", device=a.device)
    load_s = time.perf_counter() - t0
    model, tok, dev = loaded.model, loaded.tokenizer, loaded.device
    lengths = token_lengths(tok, a.prompts)
    p90 = min(percentile(lengths, 0.9), a.max_prompt_tokens)
    out: dict[str, Any] = {"target_load_s": round(load_s, 2), "prompt_tokens_p50": percentile(lengths, 0.5),
                           "prompt_tokens_p90": percentile(lengths, 0.9)}
    log(f"calibrate: target loaded in {load_s:.1f} s on {dev} ({loaded.dtype}); rendered prompt length "
        f"p50 {out['prompt_tokens_p50']}, p90 {out['prompt_tokens_p90']} tokens")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    g = torch.Generator().manual_seed(0)
    vocab = loaded.vocab_size
    eos = list(loaded.eos_ids)

    # --- regeneration: generate(n) at the batch size, for two n; step = slope, prefill = intercept
    B, P = a.regen_batch, max(p90, 16)
    ids = torch.randint(100, vocab - 100, (B, P), generator=g).to(dev)

    def gen(n: int) -> float:
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=eos[0],
                               eos_token_id=eos, repetition_penalty=1.0, num_beams=1)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        sync()
        return time.perf_counter() - t

    gen(2)  # warm-up
    n1, n2 = 4, 4 + a.calib_gen_steps
    t1, t2 = gen(n1), gen(n2)
    step = max((t2 - t1) / (n2 - n1), 1e-4)
    out.update(regen_step_s=round(step, 5), regen_prefill_s=round(max(t1 - n1 * step, 0.0), 4),
               regen_batch=B, regen_prompt_tokens=P)
    log(f"calibrate: generate at batch {B} x {P} prompt tokens: {step * 1e3:.1f} ms a step "
        f"({B / step:.0f} tok/s if every row runs), prefill {out['regen_prefill_s'] * 1e3:.0f} ms")

    # --- training: the loop's step (eyas.training.loop.train) on a synthetic batch
    # a batch is padded to its longest sample: about the 95th percentile of 16 prompts, plus the answer
    T = min(a.max_length, min(percentile(lengths, 0.95), a.max_prompt_tokens) + a.max_new_tokens)
    spec = CaptureSpec.create(loaded.num_blocks, None)
    use_bf16 = dev.type == "cuda"
    drafter, _ = new_drafter(loaded, tok, spec.boundaries, a.draft_vocab, capture_dtype="bfloat16", seed=0)
    drafter.to(dev).train()
    draft_ids = drafter.draft_to_target(torch.arange(a.draft_vocab, device=dev))
    batches = OnlineBatches(model, spec, draft_ids, dev, torch.bfloat16 if use_bf16 else None)
    samples = []
    for _ in range(a.train_batch):
        x = torch.randint(100, vocab - 100, (T,), generator=g)
        m = torch.zeros(T, dtype=torch.long)
        m[min(p90, T - 1):] = 1
        samples.append({"input_ids": x, "loss_mask": m})
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95))
    tally = Tally(a.ttt_steps)

    def train_step() -> None:
        batch = batches.make(samples)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
            r = ttt_forward(drafter, batch.input_ids, batch.features, batch.labels, batch.loss_mask, a.ttt_steps, 0.8)
        opt.zero_grad(set_to_none=True)
        r.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        tally.add(r)

    for _ in range(2):
        train_step()
    sync()
    t = time.perf_counter()
    for _ in range(a.calib_train_steps):
        train_step()
    sync()
    tstep = (time.perf_counter() - t) / a.calib_train_steps
    out.update(train_step_s=round(tstep, 5), train_batch=a.train_batch, train_tokens=T)
    if dev.type == "cuda":
        out["train_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    log(f"calibrate: training step at batch {a.train_batch} x {T} tokens: {tstep * 1e3:.0f} ms "
        f"({1 / tstep:.1f} steps/s); calibration took {time.perf_counter() - t0:.1f} s")
    del model, loaded, drafter, batches, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def copy_drafter(src: Path, dest: Path) -> None:
    """The drafter's top-level files (weights, config.json, eyas.json, metrics, plot); not the
    checkpoints nor the resumable optimizer state."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)


def transport_copy(src: Path, dest: Path, max_mib: float = 15.0) -> list[str]:
    """A bf16 copy of the drafter in ``src`` whose every file is under ``max_mib`` (the device tool
    returns at most 8 files of 16 MiB from $OUT): config.json, eyas.json, and the weights as
    safetensors shards with a ``model.safetensors.index.json`` (eyas reads the index). Serving runs
    the drafter in the target's dtype, bf16 on a GPU, so the copy serves exactly what the original
    does there. Returns the files written."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    limit = int(max_mib * 2**20) - 65536  # room for the header
    too_big = [k for k, v in tensors.items() if v.numel() * v.element_size() > limit]
    if too_big:
        raise ValueError(f"tensors {too_big} exceed {max_mib} MiB even in bf16: use a smaller --draft-vocab")
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for k in sorted(tensors, key=lambda k: -tensors[k].numel() * tensors[k].element_size()):
        b = tensors[k].numel() * tensors[k].element_size()
        if size + b > limit and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += b
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(dest / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))
    for f in ("config.json", "eyas.json"):
        shutil.copy2(src / f, dest / f)
    return ["config.json", "eyas.json", "model.safetensors.index.json", *names]


def final_drafter(train_dir: Path) -> tuple[Path | None, str]:
    """The finished drafter (``train_dir`` itself), else the newest complete checkpoint."""
    if (train_dir / "eyas.json").exists() and any(train_dir.glob("*.safetensors")):
        return train_dir, "final"
    ckpts = sorted((p for p in (train_dir / "checkpoints").glob("step-*") if (p / "eyas.json").exists()
                    and not p.name.endswith(".tmp")), key=lambda p: int(p.name.split("-")[1])) \
        if (train_dir / "checkpoints").is_dir() else []
    return (ckpts[-1], f"checkpoint {ckpts[-1].name}") if ckpts else (None, "none")


def run(a: argparse.Namespace) -> int:
    t_start = time.time()
    deadline = t_start + a.budget_s
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    prompts = Path(a.prompts).resolve()
    if not prompts.exists():
        log(f"error: {prompts} does not exist: build it with `prepare` and carry benchmarks/data")
        return 2
    n_prompts = count_lines(prompts)
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv,
                               "target": a.target, "prompts": str(prompts), "prompts_available": n_prompts,
                               "budget_s": a.budget_s}
    log(f"{n_prompts} prompts in {prompts}; budget {a.budget_s:.0f} s; work dir {work}")

    # 1. calibrate
    if a.no_calibrate:
        cal = {"regen_step_s": a.est_regen_step_s, "regen_prefill_s": 0.5, "train_step_s": 1 / a.est_train_steps_per_s,
               "source": "--est-* (not measured)"}
    else:
        sys.path.insert(0, str(REPO / "src"))
        cal = calibrate(a)
    summary["calibration"] = cal

    # 2. regenerate. N conversations cost N / regen_rate to write and E * N / train_rate to train on for
    #    E epochs: N is chosen so that both fit with E = --epochs (more data beats more epochs; when the
    #    prompts run out, the rest of the time goes to training), capped at --regen-share-max.
    chunk_s = cal["regen_prefill_s"] + a.max_new_tokens * cal["regen_step_s"] * a.regen_slack
    regen_rate = a.regen_batch / chunk_s  # conversations per second
    train_rate = a.train_batch / (cal["train_step_s"] / a.train_safety)  # samples per second
    left = deadline - time.time()
    work_s = left - 2 * a.cli_overhead_s - a.final_overhead_s
    n_fit = work_s / (1 / regen_rate + a.epochs / train_rate)
    n_cap = max(a.regen_share_max * left - a.cli_overhead_s, chunk_s) * regen_rate
    chunks = max(1, math.ceil(min(n_fit, n_cap) / a.regen_batch))
    limit = a.limit or min(n_prompts, chunks * a.regen_batch)
    regen_est = math.ceil(limit / a.regen_batch) * chunk_s
    answers = work / "answers.jsonl"
    log(f"plan: regenerate {limit} of {n_prompts} prompts ({math.ceil(limit / a.regen_batch)} chunks of "
        f"{a.regen_batch}, ~{chunk_s:.1f} s each, ~{regen_est + a.cli_overhead_s:.0f} s), then train in the remaining "
        f"~{work_s - regen_est:.0f} s (~{(work_s - regen_est) * train_rate / max(limit, 1):.1f} epochs)")
    summary["regenerate"] = {"limit": limit, "chunk_estimate_s": round(chunk_s, 2),
                             "estimated_s": round(regen_est + a.cli_overhead_s, 1)}
    if a.dry_run:
        log("dry run: stopping before regenerate")
        print(json.dumps(summary, indent=2))
        return 0
    # killed past its estimate plus slack (whole chunks written so far stay), never into --min-train-s
    regen_deadline = min(time.time() + max(1.3 * regen_est + a.cli_overhead_s + 20, a.regen_share_max * left),
                         deadline - a.min_train_s)
    regen_args = ["regenerate", "--target", a.target, "--prompts", str(prompts), "--out", str(answers),
                  "--limit", str(limit), "--max-new-tokens", str(a.max_new_tokens), "--batch-size", str(a.regen_batch),
                  "--temperature", str(a.temperature), "--max-prompt-tokens", str(a.max_prompt_tokens),
                  "--device", a.device]
    code, regen_wall = run_cli(regen_args, regen_deadline, "regenerate")
    n_answers = count_lines(answers)
    summary["regenerate"].update(exit=code, wall_s=round(regen_wall, 1), conversations=n_answers)
    log(f"regenerate: {n_answers} conversations in {answers}")
    if n_answers < 8:
        log("error: too few regenerated conversations to train on")
        (work / "summary.json").write_text(json.dumps(summary, indent=2))
        return 1

    # 3. train online for as many steps as the rest of the budget allows
    train_dir = work / "train"
    if train_dir.exists() and not a.resume:
        shutil.rmtree(train_dir)  # a stale run would be resumed with another schedule
    left = deadline - time.time()
    train_s = left - a.cli_overhead_s - a.final_overhead_s
    steps = a.steps or max(a.min_steps, int(train_s / cal["train_step_s"] * a.train_safety))
    save_every = max(25, steps // 6)
    eval_every = max(25, steps // 12)
    summary["train"] = {"steps": steps, "estimated_s": round(steps * cal["train_step_s"], 1), "save_every": save_every}
    log(f"plan: train {steps} steps at batch {a.train_batch} (~{steps * cal['train_step_s']:.0f} s of steps, "
        f"{steps * a.train_batch / max(n_answers, 1):.1f} epochs), checkpoint every {save_every}")
    train_args = ["train", "--target", a.target, "--data", str(answers), "--out", str(train_dir),
                  "--steps", str(steps), "--batch-size", str(a.train_batch), "--max-length", str(a.max_length),
                  "--draft-vocab", str(a.draft_vocab), "--lr", str(a.lr), "--ttt-steps", str(a.ttt_steps),
                  "--save-every", str(save_every), "--eval-every", str(eval_every), "--seed", str(a.seed),
                  "--device", a.device]
    code, train_wall = run_cli(train_args, deadline, "train")
    summary["train"].update(exit=code, wall_s=round(train_wall, 1))
    metrics_rows = []
    if (train_dir / "metrics.jsonl").exists():
        metrics_rows = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trained = [r for r in metrics_rows if r.get("kind") == "train"]
    if trained:
        summary["train"]["steps_done"] = trained[-1]["step"]
        summary["train"]["tokens_per_s"] = trained[-1].get("tokens_per_s")

    # 4. the drafter
    src, which = final_drafter(train_dir)
    summary["drafter_from"] = which
    if src is None:
        log("error: training left no drafter (neither a final one nor a checkpoint)")
        (work / "summary.json").write_text(json.dumps(summary, indent=2))
        return 1
    dest = work / "drafter"
    copy_drafter(src, dest)
    for f in ("metrics.jsonl", "training.png", "train_config.json"):
        if (train_dir / f).exists() and not (dest / f).exists():
            shutil.copy2(train_dir / f, dest / f)
    meta = json.loads((dest / "eyas.json").read_text())
    summary["metrics"] = (meta.get("contract") or {}).get("metrics")
    summary["drafter"] = str(dest)
    summary["total_wall_s"] = round(time.time() - t_start, 1)
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    m = summary["metrics"] or {}
    log(f"drafter ({which}) -> {dest}")
    log(f"held-out simulated accept length {m.get('simulated_accept_length')}, accuracy per position "
        f"{m.get('accuracy_per_position')}")
    log(f"total {summary['total_wall_s']:.0f} s (budget {a.budget_s:.0f} s)")
    # A bf16, sharded copy small enough to come back through the device tool's $OUT (at most 8
    # files of 16 MiB): the machine goes cold 30 s after a call, so the benchmark's call may have to
    # carry the drafter back.
    small = work / "drafter_bf16"
    try:
        files = transport_copy(dest, small)
        summary["drafter_bf16"] = {"path": str(small), "files": files}
        log(f"bf16 copy in {len(files)} files of at most 15 MiB -> {small}")
    except Exception as e:  # noqa: BLE001 - the full drafter is still there
        log(f"no bf16 copy: {e!r}")
        files = []
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    out_env = os.environ.get("OUT")
    if out_env and a.copy_to_out:
        out_dir = Path(out_env)
        if files:
            shutil.copytree(small, out_dir / "drafter", dirs_exist_ok=True)
        shutil.copy2(work / "summary.json", out_dir / "train_summary.json")
        log(f"copied {'the bf16 drafter and ' if files else ''}the summary to {out_dir}")
    print(json.dumps({k: summary[k] for k in ("drafter", "drafter_from", "total_wall_s", "metrics")}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="mix first-turn training prompts into benchmarks/data/ (here, CPU)")
    p.add_argument("--shared", default=str(REPO.parent / "shared" / "data"), help="the shared/data folder")
    p.add_argument("--out", default=str(DEFAULT_PROMPTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sharegpt", action="store_true", help="leave out ShareGPT (unclear terms)")
    p.add_argument("--max-chars", type=int, default=6000, help="drop longer prompts")
    p.add_argument("--follow-up-share", type=float, default=0.3, help="share of prompts given a second, generic turn")

    r = sub.add_parser("run", help="calibrate, regenerate, train (GPU)")
    r.add_argument("--target", required=True, help="the SmolLM2 GGUF (or any eyas --target)")
    r.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    r.add_argument("--work", default=str(DEFAULT_WORK), help="answers, training run, drafter, summary")
    r.add_argument("--device", default="cuda")
    r.add_argument("--budget-s", type=float, default=480.0, help="the whole pipeline, calibration included")
    r.add_argument("--epochs", type=float, default=4.0,
                   help="plan as many conversations as can be regenerated AND trained on this many times")
    r.add_argument("--regen-share-max", type=float, default=0.6, help="regenerate plans at most this share of the time")
    r.add_argument("--min-train-s", type=float, default=120.0, help="regenerate never eats into this")
    r.add_argument("--limit", type=int, default=None, help="prompts to regenerate (default: what fits)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--max-prompt-tokens", type=int, default=768)
    r.add_argument("--regen-batch", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0, help="regeneration: 0 = greedy")
    r.add_argument("--steps", type=int, default=None, help="training steps (default: what fits)")
    r.add_argument("--min-steps", type=int, default=100)
    r.add_argument("--train-batch", type=int, default=16)
    r.add_argument("--max-length", type=int, default=1024)
    r.add_argument("--draft-vocab", type=int, default=12288,
                   help="12288 keeps lm_head under 16 MiB in bf16 (the device tool's file limit)")
    r.add_argument("--lr", type=float, default=1e-3, help="eyas train's default")
    r.add_argument("--ttt-steps", type=int, default=7)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--resume", action="store_true", help="keep WORK/train and let eyas train resume it")
    r.add_argument("--no-calibrate", action="store_true", help="use the --est-* figures instead of measuring")
    r.add_argument("--est-regen-step-s", type=float, default=0.04)
    r.add_argument("--est-train-steps-per-s", type=float, default=5.0)
    r.add_argument("--calib-gen-steps", type=int, default=24)
    r.add_argument("--calib-train-steps", type=int, default=8)
    r.add_argument("--regen-slack", type=float, default=1.15, help="safety factor on the regeneration estimate")
    r.add_argument("--train-safety", type=float, default=0.85, help="share of the estimated steps to plan")
    r.add_argument("--cli-overhead-s", type=float, default=25.0, help="start-up of one eyas command")
    r.add_argument("--final-overhead-s", type=float, default=15.0, help="training's last evaluation and save")
    r.add_argument("--no-copy-to-out", dest="copy_to_out", action="store_false")
    r.add_argument("--dry-run", action="store_true", help="calibrate and plan, run nothing")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(Path(a.shared), Path(a.out), a.seed, a.no_sharegpt, a.max_chars, a.follow_up_share)
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
