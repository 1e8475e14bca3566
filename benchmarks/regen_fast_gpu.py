"""Regeneration speed on a GPU: eyas' batched engine (``--engine fast``, eyas.engine.batched) against
Hugging Face ``generate`` (``--engine hf``: left-padded batches, static cache, compiled with CUDA
graphs), on the same rendered prompts, greedy (issue 11: at least 25k new tokens/s).

    PYTHONPATH=src:/tmp/deps python benchmarks/regen_fast_gpu.py --target /tmp/smol.gguf \\
        --prompts benchmarks/data/regen_1024.jsonl --limit 1024 --max-new-tokens 256 --rows 256,512 \\
        --out regen_fast.json

What runs, in this order (each stage's result goes into the JSON as soon as it is done, and a stage
that fails records its error and lets the others run):

1. load the target (``eyas.targets.load_target``: a GGUF file or an HF directory, bf16 on the GPU) and
   render the first user turn of each of the first ``--limit`` conversations (as ``eyas regenerate``
   does: template default system prompt), sorted by length like regenerate's chunks; prompts longer
   than ``--max-prompt-tokens`` are left out.
2. fast: for each ``--rows`` R, a :class:`~eyas.engine.batched.BatchedLlama` with R rows; its key
   buckets compiled and captured up front (``warmup_s``, not timed below), then every prompt in one
   call (continuous batching: a prompt enters a row as soon as one frees up), timed with the wall
   clock around the call (it ends with a host read, so the GPU work is inside). Reported: new
   tokens/s, decode steps, row occupancy, prefills, syncs, peak GPU memory; with
   ``--chunk N``, also the prompts in calls of N (as regenerate calls it with ``--batch-size N``).
3. hf: ``eyas.data.regenerate.HFGenerator`` (static cache, compiled) on batches of ``--hf-batch``
   prompts (the first ``--hf-limit``); its first batch is run once untimed (compilation), then all
   batches are timed.
4. agreement, greedy: per prompt both engines answered, token-identical or not (bf16: the two
   forwards round differently, so near-ties may part), and the mean share of the shorter answer
   before the first difference.
5. ``--end-to-end``: the whole ``eyas regenerate`` (rendering, loop search, writing) through the fast
   engine with ``--batch-size --chunk`` (default: all prompts), its summary.

Prints the JSON (and writes ``--out``). ``--tiny`` runs a random 4-block Llama with a byte tokenizer
on the CPU or GPU (a smoke test of this script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch


def _stage(report: dict[str, Any], name: str, fn: Callable[[], Any], out: Path | None) -> Any:
    """Run one stage: its result (or its error) under report[name], the report written after it."""
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001 - a failed stage is reported, the others still run
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    if isinstance(report[name], dict):
        report[name]["stage_s"] = round(time.perf_counter() - t0, 2)
    if out is not None:
        out.write_text(json.dumps(report, indent=2, default=str))
    return report[name]


def _load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    if args.tiny:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.support.chat import chat_target, chat_tokenizer

        tok = chat_tokenizer()
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return chat_target(tok, num_blocks=4).to(dev), tok, "tiny"
    from eyas.targets import load_target

    loaded = load_target(args.target, dtype=args.dtype, device=args.device)
    return loaded.model.eval(), loaded.tokenizer, str(loaded.name)


def _conversations(args: argparse.Namespace) -> list[Any]:
    """The first ``--limit`` conversations of ``--prompts`` (``--tiny``: made up, one with two turns)."""
    from eyas.data.conversations import Conversation
    from eyas.data.conversation_files import read_conversations

    if args.tiny:
        return [Conversation([{"role": "user", "content": "why " * (i % 13) + f"question {i}?"}]
                             + ([{"role": "user", "content": "and then?"}] if i % 5 == 0 else []), id=f"q{i}")
                for i in range(args.limit or 64)]
    return list(read_conversations(args.prompts, on_error="skip").conversations)[:args.limit]


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    from eyas.data.render import render_prompt

    out = []
    for c in _conversations(args):
        users = [m for m in c.messages if m["role"] == "user"]
        if not users:
            continue
        system = [m for m in c.messages if m["role"] == "system"][:1]
        ids = render_prompt(system + users[:1], tokenizer).tolist()
        if len(ids) <= args.max_prompt_tokens:
            out.append(ids)
    return sorted(out, key=len)


def _memory(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _fast(model: Any, prompts: list[list[int]], eos: list[int], args: argparse.Namespace, rows: int,
          answers: dict[str, list]) -> dict[str, Any]:
    from eyas.engine.batched import BatchedLlama

    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = BatchedLlama(model, rows=rows, sync_every=args.sync_every)
    longest = max(map(len, prompts))
    warmup_s = engine.warmup(longest, args.max_new_tokens)
    res = engine.run(prompts, args.max_new_tokens, eos)
    answers[f"fast{rows}"] = res.answers
    out = {"rows": rows, "implementation": engine.implementation, "capacity": engine.capacity,
           "key_buckets": engine.buckets(), "warmup_s": round(warmup_s, 2), **res.to_dict(),
           "peak_gib": _memory(device)}
    if args.chunk:
        t0 = time.perf_counter()
        new = steps = 0
        for i in range(0, len(prompts), args.chunk):
            r = engine.run(prompts[i:i + args.chunk], args.max_new_tokens, eos)
            new, steps = new + r.new_tokens, steps + r.decode_steps
        wall = time.perf_counter() - t0
        out["chunked"] = {"chunk": args.chunk, "new_tokens": new, "decode_steps": steps, "wall_s": round(wall, 3),
                          "tokens_per_s": round(new / wall, 2)}
    return out


def _hf(model: Any, tokenizer: Any, prompts: list[list[int]], eos: list[int], args: argparse.Namespace,
        answers: dict[str, list]) -> dict[str, Any]:
    from eyas.data.generation import BatchParams
    from eyas.data.regenerate import HFGenerator

    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prompts = prompts[:args.hf_limit]
    gen = HFGenerator(model, tokenizer, "static" if device.type == "cuda" else "dynamic", args.hf_batch)
    gen.reserve(max(map(len, prompts)), args.max_new_tokens)
    params = BatchParams(args.max_new_tokens, tuple(eos))
    batches = [prompts[i:i + args.hf_batch] for i in range(0, len(prompts), args.hf_batch)]
    t0 = time.perf_counter()
    gen.generate(batches[0], params)  # compilation (CUDA graphs of the decode step)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out, steps = [], 0
    for b in batches:
        out += gen.generate(b, params)
        steps += gen.last_decode_steps
    wall = time.perf_counter() - t0
    answers["hf"] = out
    new = sum(len(a) + (f == "eos") for a, f in out)
    return {"implementation": gen.implementation, "batch": args.hf_batch, "prompts": len(prompts),
            "warmup_s": round(warmup_s, 2), "new_tokens": new, "decode_steps": steps, "wall_s": round(wall, 3),
            "tokens_per_s": round(new / wall, 2), "peak_gib": _memory(device)}


def _agreement(a: list, b: list) -> dict[str, Any]:
    n = min(len(a), len(b))
    same = prefix = 0.0
    for (x, fx), (y, fy) in zip(a[:n], b[:n]):
        same += (x, fx) == (y, fy)
        k = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix += k / max(1, min(len(x), len(y)))
    return {"prompts": n, "identical": round(same / max(n, 1), 4), "mean_shared_prefix": round(prefix / max(n, 1), 4)}


def _end_to_end(model: Any, tokenizer: Any, name: str, args: argparse.Namespace, rows: int) -> dict[str, Any]:
    from eyas.data.regenerate import RegenerateOptions, regenerate
    from eyas.engine.batched import BatchedLlama

    convs = _conversations(args)
    batch = args.chunk or len(convs)
    with tempfile.TemporaryDirectory() as d:
        options = RegenerateOptions(out_path=Path(d) / "answers.jsonl", max_new_tokens=args.max_new_tokens,
                                    batch_size=batch, max_prompt_tokens=args.max_prompt_tokens,
                                    max_turns=args.max_turns, progress=False)
        engine = BatchedLlama(model, rows=min(rows, batch), sync_every=args.sync_every)
        s = regenerate(model, tokenizer, convs, options, source=name, generator=engine)
    return {"rows": engine.rows, "batch_size": batch, **s.to_dict()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="a GGUF file or an HF model directory")
    p.add_argument("--prompts", help="conversations JSONL (what eyas regenerate reads)")
    p.add_argument("--limit", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--max-turns", type=int, default=2, help="--end-to-end: user turns answered per conversation")
    p.add_argument("--rows", default="256,512", help="comma-separated rows of the fast engine")
    p.add_argument("--sync-every", type=int, default=16)
    p.add_argument("--chunk", type=int, default=0, help="also time the fast engine on calls of this many prompts")
    p.add_argument("--hf-batch", type=int, default=512)
    p.add_argument("--hf-limit", type=int, default=512, help="prompts HF generate answers (it is slow)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--end-to-end", action="store_true", help="also run eyas regenerate through the fast engine")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tiny", action="store_true", help="a random tiny target (smoke test)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not args.tiny and (args.target is None or args.prompts is None):
        p.error("--target and --prompts are required (or --tiny)")

    from eyas.targets.structure import eos_token_ids

    report: dict[str, Any] = {"argv": vars(args) | {"out": str(args.out)}, "torch": torch.__version__,
                              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    t0 = time.perf_counter()
    model, tokenizer, name = _load(args)
    prompts = _prompts(args, tokenizer)
    eos = eos_token_ids(model, tokenizer)
    report["target"] = {"name": name, "dtype": str(next(model.parameters()).dtype),
                        "load_s": round(time.perf_counter() - t0, 2), "prompts": len(prompts),
                        "prompt_tokens": sum(map(len, prompts)),
                        "longest_prompt": max(map(len, prompts)), "eos": eos}
    answers: dict[str, list] = {}
    rows_list = [int(r) for r in str(args.rows).split(",") if r]
    with torch.no_grad():
        for rows in rows_list:
            _stage(report, f"fast_{rows}", lambda rows=rows: _fast(model, prompts, eos, args, rows, answers),
                   args.out)
        if not args.skip_hf:
            _stage(report, "hf", lambda: _hf(model, tokenizer, prompts, eos, args, answers), args.out)
        fast_keys = [k for k in answers if k.startswith("fast")]
        if "hf" in answers and fast_keys:
            report["agreement_fast_hf"] = _agreement(answers[fast_keys[0]], answers["hf"])
            rates = {k: report.get(f"fast_{k[4:]}", {}).get("tokens_per_s") for k in fast_keys}
            hf_rate = report["hf"].get("tokens_per_s")
            report["speedup_over_hf"] = {k: round(v / hf_rate, 2) for k, v in rates.items() if v and hf_rate}
        if len(fast_keys) > 1:
            report["agreement_fast_rows"] = _agreement(answers[fast_keys[0]], answers[fast_keys[-1]])
        if args.end_to_end:
            _stage(report, "end_to_end", lambda: _end_to_end(model, tokenizer, name, args, rows_list[-1]), args.out)
    report["total_s"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(report, indent=2, default=str)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
