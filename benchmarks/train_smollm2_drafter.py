"""Train the best SmolLM2-135M-Instruct drafter that a few minutes of one GPU allow, with eyas' own CLI.

Two steps, on two machines:

    # 1. here (CPU, seconds): mix training prompts from shared/data into the git-ignored
    #    benchmarks/data/ (train_prompts.jsonl, and val_prompts.jsonl held out for the tau probe),
    #    which the GPU run must be given (carry "benchmarks/data")
    python benchmarks/train_smollm2_drafter.py prepare --shared ../shared/data

    # 2. on the GPU (at most --budget-s seconds, everything included)
    PYTHONPATH=src:/tmp/deps python benchmarks/train_smollm2_drafter.py run --target /tmp/smol.gguf \
        [--before-src /tmp/old/src]

``run`` does, printing progress and the time of each phase:

0. with ``--before-src`` (a src/ tree of an older commit): that code's `eyas regenerate` and
   `eyas train` on a small slice, so that before and after are measured in one run on one machine.
1. ``eyas regenerate``: the target answers every prompt of the mix (its first turn, then the
   follow-up turn where there is one), greedy plus any ``--temperatures``, ``--max-new-tokens``
   256, on a static cache (a compiled decoding step on a GPU), repetition loops cut. EAGLE-3
   drafters learn the target's own outputs. Killed at ``--regen-budget-s``: whole chunks stay.
2. ``eyas train`` online (the target in the same process, features captured on the fly), its
   schedule fitted to the time left (``--time-budget-s``: the cosine ends on its floor rather than
   being cut off): batches of about ``--tokens-per-batch`` tokens of similar length, TTT 7 steps, a
   frequency-based draft vocabulary of ``--draft-vocab`` 12288 (lm_head under 16 MiB in bf16).
   Every ``--eval-every`` steps: held-out metrics (with and without loop tokens) and the engine's
   tau on the held-out validation prompts; the best checkpoint by tau is kept, and training stops
   after ``--patience`` evaluations without improvement, or at the budget.
3. ``WORK/drafter``: the best drafter (config.json, eyas.json, weights, metrics, plot);
   ``WORK/drafter_bf16``: the same in bf16 as shards of at most 15 MiB with an index (what serving
   on a GPU runs anyway); ``WORK/summary.json``: the throughputs, the evaluations, the metrics. With
   ``$OUT`` set (the device tool's output folder, which returns at most 8 files of 16 MiB),
   ``$OUT/drafter`` (the bf16 copy) and ``$OUT/train_summary.json`` are written there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # drafter_mix.py beside it, however it is loaded
from drafter_mix import MixPart, compact_documents, expand_documents, grow, log, mix, prepare  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO / "benchmarks" / "data" / "train_prompts.jsonl"
DEFAULT_WORK = REPO / "benchmarks" / "out" / "smollm2"

# ---------------------------------------------------------------------------------------------
# run: [before] -> regenerate -> train -> copy (GPU)
# ---------------------------------------------------------------------------------------------


def child_env(src: Path) -> dict[str, str]:
    """The environment of an eyas command run from the source tree ``src``."""
    env = dict(os.environ)
    parts = [str(src)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO / "src")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TQDM_MININTERVAL", "10")  # progress bars every 10 s, not every 0.1 s (the log stays short)
    return env


def run_cli(args: list[str], deadline: float, name: str, src: Path = REPO / "src") -> tuple[int | None, float, str]:
    """``python -m eyas.cli.main ARGS`` (from the source tree ``src``) with its output streamed and
    kept; killed (its own process group: SIGINT, then SIGTERM, then SIGKILL) at ``deadline``.
    -> (exit code or None when killed, seconds, stdout)."""
    cmd = [sys.executable, "-m", "eyas.cli.main", *args]
    log(f"{name}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    out_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"eyas-{name}-{os.getpid()}.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen(cmd, env=child_env(src), cwd=str(REPO), start_new_session=True, stdout=out)
        killed = False
        while proc.poll() is None:
            if time.time() > deadline and not killed:
                log(f"{name}: deadline reached, stopping it (pid {proc.pid}); what it wrote so far is kept")
                killed = True
                # A short grace: both tools append whole batches or units and flush them, so a
                # kill loses only the one in progress, and on the H100 (2026-12-07) neither exited
                # within 60 s of SIGINT, which cost a run two minutes of its budget.
                for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
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
    text = out_path.read_text(errors="replace")
    print(text[-4000:], flush=True)
    log(f"{name}: {'killed' if killed else f'exit {proc.returncode}'} after {dt:.1f} s")
    return (None if killed else proc.returncode), dt, text


def last_json(text: str) -> dict[str, Any] | None:
    """The last top-level JSON object printed by a ``--json`` command."""
    i = text.rfind("\n{")
    for start in ([i + 1] if i >= 0 else []) + [0]:
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            continue
    return None


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def answers_written(path: Path) -> dict[str, Any]:
    """What a regenerated answers file holds, read from its records' provenance: conversations,
    answered turns, new tokens as kept (after loop cuts) and finish reasons. It survives a run
    that was killed before it could print its summary (eyas' own resumable reader cuts a torn last
    line, as a resumed run would)."""
    from eyas.data.regenerate import read_resumable_jsonl

    out: dict[str, Any] = {"conversations": 0, "turns": 0, "kept_new_tokens": 0,
                           "finish": {"eos": 0, "length": 0, "loop": 0}}
    for rec in read_resumable_jsonl(path):
        prov = rec.get("provenance") or {}
        out["conversations"] += 1
        out["turns"] += len(prov.get("new_tokens") or [])
        out["kept_new_tokens"] += sum(prov.get("new_tokens") or [])
        for reason in prov.get("finish_reasons") or []:
            out["finish"][reason] = out["finish"].get(reason, 0) + 1
    return out


def metrics_rows(train_dir: Path) -> list[dict[str, Any]]:
    path = train_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


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
    safetensors shards with an index, written by eyas' own sharding (the layout eyas and the engines
    read). Serving runs the drafter in the target's dtype, bf16 on a GPU, so the copy serves exactly
    what the original does there. Returns the files written."""
    import torch

    from eyas.interop.common import atomic_save_sharded, read_tensors

    tensors, _ = read_tensors(src)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in tensors.items()}
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    kept = atomic_save_sharded(dest, tensors, int(max_mib * 2**20))
    for f in ("config.json", "eyas.json", "metrics.jsonl", "training.png", "train_config.json"):
        if (src / f).exists():
            shutil.copy2(src / f, dest / f)
            kept.append(f)
    return kept


def final_drafter(train_dir: Path) -> tuple[Path | None, str]:
    """The finished drafter (``train_dir`` itself: the best checkpoint, which `eyas train` writes
    there at the end), else its best-so-far copy ``best/``, else the newest complete checkpoint."""
    def complete(p: Path) -> bool:
        return (p / "eyas.json").exists() and any(p.glob("*.safetensors"))

    if complete(train_dir):
        return train_dir, "final"
    if complete(train_dir / "best"):
        return train_dir / "best", "best so far"
    ckpts = sorted((p for p in (train_dir / "checkpoints").glob("step-*") if complete(p)
                    and not p.name.endswith(".tmp")), key=lambda p: int(p.name.split("-")[1])) \
        if (train_dir / "checkpoints").is_dir() else []
    return (ckpts[-1], f"checkpoint {ckpts[-1].name}") if ckpts else (None, "none")


def before(a: argparse.Namespace, work: Path, prompts: Path, deadline: float) -> dict[str, Any]:
    """Throughput of the code before this change (``--before-src``, a src/ tree of the old commit),
    on the same machine in the same run: its `eyas regenerate` (HF generate on a dynamic cache) on
    the first ``--before-prompts`` prompts, then its `eyas train` for ``--before-steps`` steps on them."""
    src = Path(a.before_src).resolve()
    d = work / "before"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    res: dict[str, Any] = {"src": str(src)}
    code, wall, text = run_cli(
        ["regenerate", "--target", a.target, "--prompts", str(prompts), "--out", str(d / "answers.jsonl"),
         "--limit", str(a.before_prompts), "--max-new-tokens", str(a.max_new_tokens),
         "--batch-size", str(min(256, a.before_prompts)),
         "--max-prompt-tokens", str(a.max_prompt_tokens), "--device", a.device, "--json"],
        min(deadline, time.time() + 0.6 * a.before_budget_s), "before-regenerate", src)
    rep = last_json(text) or {}
    res["regenerate"] = {"exit": code, "wall_s": round(wall, 1), "new_tokens": rep.get("new_tokens"),
                         "tokens_per_s": rep.get("tokens_per_s"), "conversations": count_lines(d / "answers.jsonl")}
    if count_lines(d / "answers.jsonl") >= min(32, a.before_prompts):  # enough to time a few steps on
        code, wall, _ = run_cli(
            ["train", "--target", a.target, "--data", str(d / "answers.jsonl"), "--out", str(d / "train"),
             "--steps", str(a.before_steps), "--batch-size", "16", "--max-length", str(a.max_length),
             "--draft-vocab", str(a.draft_vocab), "--save-every", "100000", "--eval-every", "100000",
             "--device", a.device], min(deadline, time.time() + a.before_budget_s / 2), "before-train", src)
        rows = [r for r in metrics_rows(d / "train") if r.get("kind") == "train"]
        res["train"] = {"exit": code, "wall_s": round(wall, 1), "steps": rows[-1]["step"] if rows else 0,
                        "tokens_per_s": rows[-1].get("tokens_per_s") if rows else None}
    log(f"before: {json.dumps(res)}")
    return res


def run(a: argparse.Namespace) -> int:
    t_start = time.time()
    deadline = t_start + a.budget_s
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    prompts = Path(a.prompts).resolve()
    if not prompts.exists() and not (a.magpie or a.open_prompts or a.doc_prompts):
        log(f"error: {prompts} does not exist: build it with `prepare` and carry benchmarks/data")
        return 2
    n_prompts = count_lines(prompts)
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv,
                               "target": a.target, "prompts": str(prompts), "prompts_available": n_prompts,
                               "budget_s": a.budget_s}
    log(f"{n_prompts} prompts in {prompts}; budget {a.budget_s:.0f} s; work dir {work}")

    def save_summary() -> None:
        (work / "summary.json").write_text(json.dumps(summary, indent=2))
        if os.environ.get("OUT") and a.copy_to_out:
            shutil.copy2(work / "summary.json", Path(os.environ["OUT"]) / "train_summary.json")

    if a.before_src:
        summary["before"] = before(a, work, prompts, deadline)
        save_summary()

    # 0. more prompts (issue 34): the target writes Magpie turns and requests about long documents,
    #    then every part is interleaved by weight into WORK/mix.jsonl, which regenerate answers.
    if a.magpie or a.open_prompts or a.doc_prompts:
        grown = Path(a.grown).resolve() if a.grown else None  # an earlier stage's prompts: eyas prompts resumes them
        if grown and (grown / "magpie.jsonl.gz").exists() and not (work / "magpie.jsonl").exists():
            with gzip.open(grown / "magpie.jsonl.gz", "rb") as f, (work / "magpie.jsonl").open("wb") as g:
                shutil.copyfileobj(f, g)
        if grown and (grown / "doc_requests.jsonl.gz").exists() and not (work / "doc_prompts.jsonl").exists():
            if not a.documents:
                log(f"error: {grown}/doc_requests.jsonl.gz needs --documents (the documents its requests are about)")
                return 2
            expand_documents(grown / "doc_requests.jsonl.gz", Path(a.documents), work / "doc_prompts.jsonl")
        if a.magpie or a.doc_prompts:
            docs = Path(a.documents).resolve() if a.documents else None
            summary["grow"] = grow(a.target, work, time.time() + a.grow_budget_s, run_cli, a.magpie, docs,
                                   a.doc_prompts, a.regen_rows, a.device, last_json, a.prompt_max_new_tokens,
                                   a.doc_temperatures, a.doc_max_new_tokens)
            save_summary()
        parts = [MixPart("shared", prompts, a.shared_weight, follow_ups=False),  # prepare gave it its follow-ups
                 MixPart("magpie", work / "magpie.jsonl", a.magpie_weight, follow_ups=True),
                 MixPart("open", Path(a.open_prompts).resolve() if a.open_prompts else work / "none.jsonl",
                         a.open_weight, follow_ups=True),
                 MixPart("documents", work / "doc_prompts.jsonl", a.doc_weight)]
        from eyas.targets.loading import load_tokenizer

        tok = load_tokenizer(a.target)
        summary["mix"] = mix(parts, work / "mix.jsonl", a.seed, a.follow_up_share,
                             lambda texts: [len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]],
                             a.mix_sample)
        prompts = work / "mix.jsonl"
        save_summary()
        if a.stop_after == "mix" or "grow" in summary:  # what grew travels, gzipped, to the next session
            if (work / "magpie.jsonl").exists():
                with (work / "magpie.jsonl").open("rb") as f, gzip.open(work / "magpie.jsonl.gz", "wb", 6) as g:
                    shutil.copyfileobj(f, g)
            if (work / "doc_prompts.jsonl").exists():  # the requests alone: the documents travel once
                compact_documents(work / "doc_prompts.jsonl", work / "doc_requests.jsonl.gz")
        if a.stop_after == "mix":
            log(f"stopped after the mix: {json.dumps(summary['mix'])}")
            return 0

    # 1. regenerate: the target's own answers (greedy, plus any sampled temperatures), first turn and
    #    follow-up, loops cut. Killed at its deadline: whole chunks written so far stay (resumable).
    answers = work / "answers.jsonl"
    regen_deadline = min(time.time() + a.regen_budget_s, deadline - a.min_train_s)
    regen_args = ["regenerate", "--target", a.target, "--prompts", str(prompts), "--out", str(answers),
                  "--max-new-tokens", str(a.max_new_tokens), "--batch-size", str(a.regen_batch), "--rows", str(a.regen_rows),
                  "--temperatures", a.temperatures, "--max-prompt-tokens", str(a.max_prompt_tokens),
                  "--max-turns", "2", "--loops", a.loops, "--cache", a.cache, "--device", a.device,
                  "--seed", str(a.regen_seed), "--json", "--progress"]  # bars in the log, JSON on stdout
    if a.limit:
        regen_args += ["--limit", str(a.limit)]
    code, regen_wall, text = run_cli(regen_args, regen_deadline, "regenerate")
    rep = last_json(text) or {}
    n_answers = count_lines(answers)
    # From the file too: a run killed at its deadline may print no summary (the H200 run of
    # 2026-12-01 did not within SIGINT's grace), but its records say what it wrote. The rate over
    # the whole wall time (model load and compilation included) is a lower bound of the run's own.
    written = answers_written(answers)
    written["kept_new_tokens_per_wall_s"] = round(written["kept_new_tokens"] / max(regen_wall, 1e-9), 1)
    summary["regenerate"] = {"exit": code, "wall_s": round(regen_wall, 1), "conversations": n_answers,
                             **{k: rep.get(k) for k in ("new_tokens", "tokens_per_s", "finish", "loops_cut",
                                                         "loops_dropped", "wall_s")},
                             "from_file": written}
    log(f"regenerate: {n_answers} conversations in {answers}")
    save_summary()
    if n_answers < 8:
        log("error: too few regenerated conversations to train on")
        return 1

    # 2. train online until the held-out figure stops improving or the budget ends; the best
    #    checkpoint (by the engine's tau on the validation prompts) is the result.
    train_dir = work / "train"
    if train_dir.exists() and not a.resume:
        shutil.rmtree(train_dir)  # a stale run would be resumed with another schedule
    train_args = ["train", "--target", a.target, "--data", str(answers), "--out", str(train_dir),
                  "--epochs", str(a.epochs), "--tokens-per-batch", str(a.tokens_per_batch),
                  "--batch-size", str(a.train_batch), "--max-length", str(a.max_length),
                  "--draft-vocab", str(a.draft_vocab), "--lr", str(a.lr), "--ttt-steps", str(a.ttt_steps),
                  "--eval-every", str(a.eval_every), "--save-every", str(a.eval_every), "--patience", str(a.patience),
                  "--seed", str(a.seed), "--device", a.device]
    if a.init_from:
        train_args += ["--init-from", a.init_from]
    # eyas train fits its learning-rate schedule to the time left (the cosine ends on its floor), and
    # its last evaluation and save come after that: --end-room-s before the hard stop below.
    train_budget = deadline - a.final_overhead_s - a.end_room_s - time.time()
    if train_budget > 0:
        train_args += ["--time-budget-s", f"{train_budget:.0f}"]
    if a.val_prompts and Path(a.val_prompts).exists():
        train_args += ["--validate-prompts", str(a.val_prompts), "--validate-limit", str(a.val_limit),
                       "--validate-tokens", str(a.val_max_new_tokens), "--validate-tree", a.val_tree]
    code, train_wall, _ = run_cli(train_args, deadline - a.final_overhead_s, "train")
    rows = metrics_rows(train_dir)
    trained = [r for r in rows if r.get("kind") == "train"]
    summary["train"] = {"exit": code, "wall_s": round(train_wall, 1),
                        "steps_done": trained[-1]["step"] if trained else 0,
                        "tokens_per_s": trained[-1].get("tokens_per_s") if trained else None,
                        "target_share": trained[-1].get("target_share") if trained else None,
                        "evaluations": [{k: r.get(k) for k in ("step", "simulated_accept_length",
                                                               "simulated_accept_length_no_loops", "tau")}
                                        for r in rows if r.get("kind") == "val"]}

    # 3. the drafter, and a bf16 copy small enough for the device tool's $OUT
    src, which = final_drafter(train_dir)
    summary["drafter_from"] = which
    if src is None:
        log("error: training left no drafter (neither a final one nor a checkpoint)")
        save_summary()
        return 1
    dest = work / "drafter"
    copy_drafter(src, dest)
    for f in ("metrics.jsonl", "training.png", "train_config.json"):
        if (train_dir / f).exists():
            shutil.copy2(train_dir / f, dest / f)
    meta = json.loads((dest / "eyas.json").read_text())
    summary["metrics"] = (meta.get("contract") or {}).get("metrics")
    summary["drafter"] = str(dest)
    summary["total_wall_s"] = round(time.time() - t_start, 1)
    small = work / "drafter_bf16"
    try:
        files = transport_copy(dest, small)
        summary["drafter_bf16"] = {"path": str(small), "files": files}
    except Exception as e:  # noqa: BLE001 - the full drafter is still there
        log(f"no bf16 copy: {e!r}")
        files = []
    save_summary()
    if os.environ.get("OUT") and a.copy_to_out and files:
        shutil.copytree(small, Path(os.environ["OUT"]) / "drafter", dirs_exist_ok=True)
        log(f"copied the bf16 drafter to {os.environ['OUT']}/drafter")
    m = summary["metrics"] or {}
    log(f"drafter ({which}) -> {dest}; held-out simulated accept length {m.get('simulated_accept_length')}")
    print(json.dumps({k: summary.get(k) for k in ("drafter", "drafter_from", "total_wall_s", "metrics")}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO / "src"))  # prepare and the bf16 copy use eyas in this process
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="mix first-turn training prompts into benchmarks/data/ (here, CPU)")
    p.add_argument("--shared", default=str(REPO.parent / "shared" / "data"), help="the shared/data folder")
    p.add_argument("--out", default=str(DEFAULT_PROMPTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sharegpt", action="store_true", help="leave out ShareGPT (unclear terms)")
    p.add_argument("--max-chars", type=int, default=6000, help="drop longer prompts")
    p.add_argument("--follow-up-share", type=float, default=0.3, help="share of prompts given a second, generic turn")
    p.add_argument("--val-prompts", type=int, default=24, help="prompts held out for the tau probe")

    r = sub.add_parser("run", help="[before] -> regenerate -> train (GPU)")
    r.add_argument("--target", required=True, help="the SmolLM2 GGUF (or any eyas --target)")
    r.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    r.add_argument("--val-prompts", default=str(DEFAULT_PROMPTS.with_name("val_prompts.jsonl")))
    r.add_argument("--work", default=str(DEFAULT_WORK), help="answers, training run, drafter, summary")
    r.add_argument("--device", default="cuda")
    r.add_argument("--budget-s", type=float, default=540.0, help="the whole pipeline")
    g = r.add_argument_group("more prompts (drafter_mix.py): grown on the GPU, then mixed by weight")
    g.add_argument("--magpie", type=int, default=0, help="Magpie prompts the target writes (eyas prompts)")
    g.add_argument("--documents", default=None, help="long documents (eyas open-prompts --documents-out)")
    g.add_argument("--doc-prompts", type=int, default=0, help="requests about the documents the target writes")
    g.add_argument("--open-prompts", default=None, help="eyas open-prompts' file, a part of the mix")
    g.add_argument("--prompt-max-new-tokens", type=int, default=256, help="eyas prompts --max-new-tokens")
    g.add_argument("--doc-temperatures", default="0.7,0.9", help="requests about documents: eyas prompts --temperatures")
    g.add_argument("--doc-max-new-tokens", type=int, default=96, help="requests about documents: at most this many "
                   "tokens (and --prompt-max-new-tokens)")
    g.add_argument("--grow-budget-s", type=float, default=240.0, help="eyas prompts' time, both files")
    g.add_argument("--mix-sample", type=int, default=2000,
                   help="prompts whose tokens are counted for the share over 1,000 (0: every prompt, exact)")
    g.add_argument("--shared-weight", type=float, default=1.0, help="--prompts' share of the mix")
    g.add_argument("--magpie-weight", type=float, default=1.5)
    g.add_argument("--open-weight", type=float, default=1.0)
    g.add_argument("--doc-weight", type=float, default=1.0)
    g.add_argument("--grown", default=None, help="a staged run's magpie.jsonl.gz and doc_requests.jsonl.gz: "
                   "the start of this run's files (eyas prompts adds what --magpie and --doc-prompts still ask)")
    g.add_argument("--stop-after", choices=["mix", "train"], default="train",
                   help="mix: stop once the prompts are grown and mixed (WORK/magpie.jsonl.gz, doc_requests.jsonl.gz)")
    g.add_argument("--follow-up-share", type=float, default=0.3, help="Magpie and open prompts given a second turn")
    r.add_argument("--before-src", default=None, help="src/ of the old commit: measure its throughput first")
    r.add_argument("--before-prompts", type=int, default=128, help="one batch: the old code cannot report a partial run")
    r.add_argument("--before-steps", type=int, default=40)
    r.add_argument("--before-budget-s", type=float, default=150.0)
    r.add_argument("--regen-budget-s", type=float, default=200.0)
    r.add_argument("--min-train-s", type=float, default=150.0, help="regenerate never eats into this")
    r.add_argument("--limit", type=int, default=None, help="prompts to regenerate (default: all)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--max-prompt-tokens", type=int, default=768)
    r.add_argument("--regen-batch", type=int, default=2048,
                   help="conversations per resumable chunk: several times --regen-rows keeps the rows refilled")
    r.add_argument("--regen-rows", type=int, default=512, help="rows the fast engine decodes together")
    r.add_argument("--regen-seed", type=int, default=0,
                   help="regenerate's seed: the order in which it visits its chunks of similar-length prompts "
                        "(and its sampling); a staged run's sessions each take another, so that each session "
                        "answers mostly prompts the earlier ones did not reach")
    r.add_argument("--temperatures", default="0", help="e.g. 0,0.8: one answer per temperature")
    r.add_argument("--loops", default="cut", choices=["cut", "drop", "keep"])
    r.add_argument("--cache", default="auto", choices=["auto", "static", "dynamic"])
    r.add_argument("--epochs", type=float, default=4.0)
    r.add_argument("--tokens-per-batch", type=int, default=16384)
    r.add_argument("--train-batch", type=int, default=16, help="rows per batch without --tokens-per-batch")
    r.add_argument("--max-length", type=int, default=1024)
    r.add_argument("--draft-vocab", type=int, default=12288,
                   help="12288 keeps lm_head under 16 MiB in bf16 (the device tool's file limit)")
    r.add_argument("--lr", type=float, default=1e-3, help="eyas train's default")
    r.add_argument("--ttt-steps", type=int, default=7)
    r.add_argument("--eval-every", type=int, default=150)
    r.add_argument("--patience", type=int, default=4)
    r.add_argument("--val-limit", type=int, default=12, help="validation prompts the tau probe answers")
    r.add_argument("--val-max-new-tokens", type=int, default=64)
    r.add_argument("--val-tree", default="6,10,60")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--init-from", default=None,
                   help="eyas train --init-from: start from this drafter (e.g. the shipped one) rather than afresh")
    r.add_argument("--resume", action="store_true", help="keep WORK/train and let eyas train resume it")
    r.add_argument("--final-overhead-s", type=float, default=30.0, help="the bf16 copy and the summary after training")
    r.add_argument("--end-room-s", type=float, default=60.0,
                   help="eyas train's last evaluation (its tau probe) and save, after its --time-budget-s")
    r.add_argument("--no-copy-to-out", dest="copy_to_out", action="store_false")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(Path(a.shared), Path(a.out), a.seed, a.no_sharegpt, a.max_chars, a.follow_up_share, a.val_prompts)
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
