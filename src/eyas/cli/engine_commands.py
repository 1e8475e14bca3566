"""`eyas generate` and `eyas bench`: serving a drafter with the eyas engine."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from eyas.cli.common import (ATTENTION_HELP, DRAFT_DTYPE_HELP, DRAFT_HELP, MATVEC_HELP, TARGET_HELP, TARGET_IMPL_HELP,
                             console, err)
from eyas.cli.common import print_json as _print_json
from eyas.cli.common import run as _run

from eyas.interop.embedded import resolve_draft

if TYPE_CHECKING:
    from eyas.targets import LoadedTarget

TREE_HELP = ("DEPTH,TOPK,TOTAL (EAGLE-2 dynamic tree, e.g. 6,4,24), DEPTH for a chain, or 'auto': time the "
             "target's verification and the drafter on this hardware, measure the drafter's acceptance on a "
             "short greedy calibration, and use the tree with the best predicted speedup")


def load_for_serving(target: str, draft: Path, device: str, force: bool, target_impl: str = "auto",
                     draft_dtype: str = "auto", matvec: str = "auto",
                     attention: str = "auto") -> tuple[LoadedTarget, Any, Any, Any]:
    """(the loaded target, drafter, engine target, contract), the drafter checked against the target's
    contract. ``--device auto`` and the dtype follow eyas.targets.placement: bf16 on a GPU, float32 on
    the CPU (bf16 matmuls are slow there and greedy equality is exact in float32); ``target_impl``
    picks the engine's target (:func:`eyas.engine.build_target`); ``draft_dtype`` the drafter's
    (:func:`eyas.targets.placement.resolve_draft_dtype`: bf16 on a CPU with native bf16); ``matvec`` and
    ``attention`` the fast target's kernels."""
    from eyas.convention import CaptureSpec
    from eyas.engine import build_target
    from eyas.interop import load_drafter
    from eyas.targets import load_target
    from eyas.targets.placement import resolve_draft_dtype

    loaded = _run(load_target, target, dtype="auto", device=device)
    drafter, contract = _run(load_drafter, draft, target=loaded, tokenizer=loaded.tokenizer, force=force)
    drafter = drafter.to(loaded.device, dtype=_run(resolve_draft_dtype, draft_dtype, loaded.dtype, loaded.device)).eval()
    spec = CaptureSpec(tuple(contract.capture.boundaries), loaded.num_blocks)
    tgt = _run(build_target, loaded.model, spec, target_impl, matvec=matvec, attention=attention)
    if getattr(tgt, "cuda_graphs", False):  # compile and capture every bucket now, not mid-generation
        with err.status("[dim]fast target: compiling its steps and capturing CUDA graphs (once per bucket)...[/]"):
            seconds = tgt.warmup()
        err.print(f"[dim]fast target ready in {seconds:.1f} s ({tgt.implementation})[/]")
    return loaded, drafter, tgt, contract


def is_auto(tree: str) -> bool:
    return tree.strip().lower() == "auto"


def auto_tree(tgt: Any, drafter: Any, calibration: list[Any], contract: Any, eos: list[int], temperature: float,
              out: Any) -> Any:
    """`--tree auto`: :func:`eyas.tune.tune_tree` (measure, calibrate on ``calibration``, choose),
    then print the candidates and the reason on ``out``; returns the TreeChoice."""
    from eyas.bench.report import auto_tree_table
    from eyas.tune import tune_tree

    t0 = time.perf_counter()
    out.print("[dim]--tree auto: timing target verification and drafting on this hardware...[/]")
    choice = _run(tune_tree, tgt, drafter, calibration, contract, eos_token_ids=eos, temperature=temperature)
    out.print(auto_tree_table(choice))
    out.print(choice.reason, highlight=False)
    out.print(f"[dim]--tree auto took {time.perf_counter() - t0:.1f}s[/]")
    return choice


def generate_cmd(
    target: str = typer.Option(..., help=TARGET_HELP),
    draft: Optional[str] = typer.Option(None, help=DRAFT_HELP),
    prompt: str = typer.Option(..., help="the user message"),
    system: Optional[str] = typer.Option(None, help="a system message (default: the template's own)"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    max_new_tokens: int = typer.Option(256),
    tree: str = typer.Option("5", help=TREE_HELP),
    seed: int = typer.Option(0),
    device: str = typer.Option("auto"),
    target_impl: str = typer.Option("auto", help=TARGET_IMPL_HELP),
    matvec: str = typer.Option("auto", help=MATVEC_HELP),
    attention: str = typer.Option("auto", help=ATTENTION_HELP),
    draft_dtype: str = typer.Option("auto", help=DRAFT_DTYPE_HELP),
    force: bool = typer.Option(False, help="serve even when the contract does not match the target"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Generate a reply with speculative decoding; prints the text and per-request statistics."""
    import torch

    from eyas.data.render import render_prompt
    from eyas.engine import SamplingParams, TreeSpec, speculative_generate

    sampling = _run(SamplingParams, temperature, top_p, top_k)  # checked before anything loads
    draft = str(_run(resolve_draft, draft, target))
    loaded, drafter, tgt, contract = load_for_serving(target, Path(draft), device, force, target_impl, draft_dtype,
                                                        matvec, attention)
    tokenizer = loaded.tokenizer
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = render_prompt(messages, tokenizer).to(tgt.device)[None]
    choice = None
    if is_auto(tree):  # calibrated on the prompt itself
        choice = auto_tree(tgt, drafter, [ids[0]], contract, list(loaded.eos_ids), temperature,
                           err if json_out else console)
        spec_tree = choice.spec
    else:
        spec_tree = _run(TreeSpec.parse, tree)
    stream = (lambda t: None) if json_out else (lambda t: console.print(tokenizer.decode([t]), end="", highlight=False))
    t0 = time.perf_counter()
    r = speculative_generate(tgt, drafter, ids, tree=spec_tree,
                             sampling=sampling, max_new_tokens=max_new_tokens,
                             eos_token_ids=loaded.eos_ids,
                             generator=torch.Generator(device=tgt.device).manual_seed(seed), on_token=stream)
    wall = time.perf_counter() - t0
    stats = r.stats.to_dict()
    text = tokenizer.decode(r.tokens, skip_special_tokens=True)
    if json_out:
        report = {"text": text, "tokens": r.tokens, "wall_s": round(wall, 3), "target_impl": tgt.implementation,
                  "tree": [spec_tree.depth, spec_tree.top_k, spec_tree.total_tokens], "stats": stats}
        if choice is not None:
            report["tree_auto"] = choice.to_dict()
        _print_json(report)
        return
    console.print()
    console.print(
        f"[dim]{stats['new_tokens']} tokens in {stats['rounds']} rounds: tau {stats['tau']:.2f}, "
        f"{stats['tokens_per_s']:.1f} tok/s; acceptance per position "
        f"{[round(a, 2) for a in stats['acceptance_at_depth']]}; draft {stats['time_draft']:.2f}s, "
        f"verify {stats['time_verify']:.2f}s, bookkeeping {stats['time_bookkeeping']:.2f}s; stop: {stats['stop_reason']}; "
        f"target: {tgt.implementation}[/]"
    )


def bench_cmd(
    target: str = typer.Option(..., help=TARGET_HELP),
    draft: Optional[str] = typer.Option(None, help=DRAFT_HELP),
    prompts: list[str] = typer.Option(..., help="mt_bench|humaneval|gsm8k|alpaca|sum|qa or a prompt file; repeatable"),
    limit: Optional[int] = typer.Option(None, help="prompts per set"),
    max_new_tokens: int = typer.Option(256),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    tree: str = typer.Option("5", help=TREE_HELP),
    seed: int = typer.Option(0),
    device: str = typer.Option("auto"),
    target_impl: str = typer.Option("auto", help=TARGET_IMPL_HELP),
    matvec: str = typer.Option("auto", help=MATVEC_HELP),
    attention: str = typer.Option("auto", help=ATTENTION_HELP),
    draft_dtype: str = typer.Option("auto", help=DRAFT_DTYPE_HELP),
    png: Optional[Path] = typer.Option(None, help="accept-length histogram (default: next to --out or ./bench.png)"),
    out: Optional[Path] = typer.Option(None, help="also write the JSON report here"),
    force: bool = typer.Option(False),
    hf: bool = typer.Option(True, "--hf/--no-hf", help="also time Hugging Face `generate` (slow on a CPU)"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Speculative vs plain decoding vs HF `generate` on the same prompts, in one process."""
    import json

    from eyas.bench import bench_set, bench_table, load_prompts, plot_accept_lengths
    from eyas.bench.report import acceptance_lines
    from eyas.data.render import render_prompt
    from eyas.engine import SamplingParams, TreeSpec
    from eyas.tune import CALIBRATION_PROMPTS

    sampling = _run(SamplingParams, temperature)  # checked before anything loads
    draft = str(_run(resolve_draft, draft, target))
    loaded, drafter, tgt, contract = load_for_serving(target, Path(draft), device, force, target_impl, draft_dtype,
                                                        matvec, attention)
    tokenizer = loaded.tokenizer
    err.print(f"[dim]target implementation: {tgt.implementation}; drafter in {str(drafter.fc.weight.dtype)[6:]}[/]")
    sets = [(name, _run(load_prompts, name, limit)) for name in prompts]
    choice = None
    if is_auto(tree):  # calibrated on the first prompts of the first set
        calibration = [render_prompt(c, tokenizer).tolist() for c in sets[0][1][:CALIBRATION_PROMPTS]]
        choice = auto_tree(tgt, drafter, calibration, contract, list(loaded.eos_ids), temperature,
                           err if json_out else console)
        spec_tree = choice.spec
    else:
        spec_tree = _run(TreeSpec.parse, tree)
    summaries = []
    for name, convs in sets:
        result = bench_set(Path(name).stem, convs, loaded, tgt, drafter, spec_tree, sampling,
                           max_new_tokens, seed=seed, progress=not json_out, compare_hf=hf)
        summaries.append(result.summary())
    png = png or (out.with_suffix(".png") if out else Path("bench.png"))
    plot_accept_lengths(summaries, png)
    report = {"target": target, "draft": str(draft), "tree": [spec_tree.depth, spec_tree.top_k, spec_tree.total_tokens],
              "temperature": temperature, "max_new_tokens": max_new_tokens, "device": str(tgt.device),
              "target_impl": tgt.implementation,
              "sets": summaries, "png": str(png)}
    if choice is not None:
        report["tree_auto"] = choice.to_dict()
        rounds = sum(s["rounds"] for s in summaries)
        if rounds:  # the rounds this run paid, against the prediction
            measured_ms = sum((s["round_ms"] or 0.0) * s["rounds"] for s in summaries) / rounds
            report["tree_auto"]["measured_round_ms"] = round(measured_ms, 4)
            report["tree_auto"]["round_prediction_error"] = round(choice.round_s * 1e3 / measured_ms - 1, 4)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
    if json_out:
        _print_json(report)
        return
    console.print(bench_table(summaries))
    for line in acceptance_lines(summaries):
        console.print(line, highlight=False)
    err.print(f"accept-length histogram: {png}")


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_cmd)
    app.command("bench")(bench_cmd)
