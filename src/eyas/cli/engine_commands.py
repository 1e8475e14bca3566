"""`eyas generate` and `eyas bench`: serving a drafter with the eyas engine."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from eyas.cli.common import (ATTENTION_HELP, DRAFT_DTYPE_HELP, DRAFT_HELP, MATVEC_HELP, TARGET_HELP, TARGET_IMPL_HELP,
                             console, err, fail)
from eyas.cli.common import print_json as _print_json
from eyas.cli.common import run as _run

from eyas.interop.embedded import resolve_draft

if TYPE_CHECKING:
    from eyas.targets import LoadedTarget

TREE_HELP = ("DEPTH,TOPK,TOTAL (EAGLE-2 dynamic tree, e.g. 6,4,24), DEPTH for a chain, or 'auto': time the "
             "target's verification and the drafter's rounds on this hardware, calibrate the drafter's acceptance "
             "on text the target decodes at the temperature served (prompts shipped with eyas, from training sets), "
             "and use the tree with the best predicted speedup")
TREE_SAMPLED_HELP = ("the tree of sampled requests (temperature > 0), as --tree (auto: tuned at the temperature "
                     "served); default: the same as --tree")
SAMPLED_DRAFTS_HELP = ("how a sampled request drafts: top-k (the greedy tree, verified by EAGLE's rule for top-k "
                       "drafts; the default) | gumbel (children drawn without replacement, recursive rejection "
                       "sampling)")
CALIBRATION_HELP = "--tree auto: round positions its calibration measures at each temperature"
CALIBRATION_PROMPTS_HELP = ("--tree auto: the prompts its calibration decodes, a prompt file or a named set "
                            "(default: the 50 shipped with eyas, from five training sets); prompts like the ones you "
                            "serve predict best")
HELD_OUT = "held-out"
BENCH_CALIBRATION_HELP = (CALIBRATION_PROMPTS_HELP + f"; '{HELD_OUT}': the prompts of the benchmarked sets that this "
                          "run does not time (those after --limit), taken in turn from each set")


@dataclass
class Calibration:
    """What ``--tree auto`` calibrates on: ``positions`` per temperature, from ``prompts`` (a named set
    or a prompt file; None: the prompts shipped with eyas; ``held-out``: ``conversations``, given by
    ``eyas bench``: its sets' prompts it does not time)."""

    positions: int
    prompts: Optional[str] = None
    conversations: Optional[list[Any]] = None

    def check(self, held_out: bool = False) -> "Calibration":
        """Fails (naming --calibration-prompts) before anything loads when the prompts cannot be read;
        ``held_out``: whether ``held-out`` is allowed (eyas bench)."""
        if self.prompts is None or (held_out and self.prompts == HELD_OUT):
            return self
        from eyas.bench import NAMED_SETS, load_prompts

        if self.prompts not in NAMED_SETS and not Path(self.prompts).is_file():
            fail(f"--calibration-prompts: expected a prompt file, one of {', '.join(NAMED_SETS)}"
                 f"{f' or {HELD_OUT}' if held_out else ''}, found {self.prompts!r}: no such file")
        if not _run(load_prompts, self.prompts):
            fail(f"--calibration-prompts {self.prompts}: expected at least one prompt, found none")
        return self

    def hold_out(self, sets: list[str], limit: Optional[int]) -> "Calibration":
        """``held-out``: the prompts of ``sets`` past the first ``limit`` of each, taken in turn from each
        set (the timed prompts are the first ``limit``); fails when there are none."""
        if self.prompts != HELD_OUT:
            return self
        from eyas.bench import load_prompts

        rest = [_run(load_prompts, name)[limit:] for name in sets] if limit else []
        self.conversations = [c for row in _zip_longest(rest) for c in row]
        if not self.conversations:
            fail(f"--calibration-prompts {HELD_OUT}: expected prompts past --limit in the benchmarked sets, found none "
                 f"(--limit {limit})")
        return self

    def token_ids(self, tokenizer: Any) -> list[list[int]]:
        from eyas.data.render import render_prompt
        from eyas.tune import calibration_prompts

        if self.conversations is not None:
            return [render_prompt(c, tokenizer).tolist() for c in self.conversations]
        if self.prompts is None:
            return calibration_prompts(tokenizer)
        from eyas.bench import load_prompts

        return [render_prompt(c, tokenizer).tolist() for c in load_prompts(self.prompts)]

    @property
    def label(self) -> str:
        if self.prompts == HELD_OUT:
            return f"{HELD_OUT}: the benchmarked sets' prompts past --limit"
        return self.prompts or "eyas' calibration prompts (training sets)"


def _zip_longest(rows: list[list[Any]]) -> list[list[Any]]:
    """[[a1, a2], [b1]] -> [[a1, b1], [a2]]: one from each row in turn."""
    return [[r[i] for r in rows if i < len(r)] for i in range(max(map(len, rows), default=0))]


def parse_tree(option: str, text: str) -> Any:
    """``auto`` (the string) or a TreeSpec; anything else fails naming the option, what it expects
    and what it found."""
    from eyas.engine import TreeSpec
    from eyas.errors import EyasError

    if is_auto(text):
        return "auto"
    try:
        return TreeSpec.parse(text)
    except EyasError as e:
        detail = "" if "expected DEPTH,TOPK,TOTAL" in str(e) else f" ({e})"
        fail(f"{option}: expected DEPTH,TOPK,TOTAL like '6,10,60', DEPTH for a chain, or auto; found {text!r}{detail}")


def parse_temperatures(temperature: float | None, temperatures: str | None) -> list[float]:
    """``--temperature`` or ``--temperatures 0,1`` (not both) -> the temperatures to run, in order,
    once each; default [0.0]."""
    if temperature is not None and temperatures is not None:
        fail(f"--temperature {temperature:g} and --temperatures {temperatures}: expected one of the two, found both")
    if temperatures is None:
        out = [0.0 if temperature is None else float(temperature)]
    else:
        try:
            out = [float(x) for x in temperatures.split(",") if x.strip()]
        except ValueError:
            out = []
        if not out:
            fail(f"--temperatures: expected comma-separated numbers such as 0,1, found {temperatures!r}")
    bad = [t for t in out if not t >= 0]
    if bad:
        name = "--temperatures" if temperatures is not None else "--temperature"
        fail(f"{name}: expected temperatures >= 0, found {', '.join(f'{t:g}' for t in bad)}")
    return list(dict.fromkeys(out))


def check_sampled_drafts(value: str) -> str:
    from eyas.engine.sampling import SAMPLED_DRAFTS

    if value not in SAMPLED_DRAFTS:
        fail(f"--sampled-drafts: expected one of {', '.join(SAMPLED_DRAFTS)}, found {value!r}")
    return value


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


def auto_trees(tgt: Any, drafter: Any, loaded: Any, contract: Any, temperatures: list[float], calibration: Calibration,
               out: Any, progress: bool, sampled_drafts: str = "top-k") -> Any:
    """`--tree auto` at ``temperatures``: :func:`eyas.tune.tune_trees` (the hardware measured once, the
    calibration prompts decoded at each temperature until ``calibration.positions`` positions, a
    choice per temperature), then each temperature's candidates and reason printed on ``out``;
    returns the TreePlanChoice."""
    from eyas.bench.report import auto_tree_table
    from eyas.tune import tune_trees

    t0 = time.perf_counter()
    temps = ", ".join(f"{t:g}" for t in temperatures)
    out.print(f"[dim]--tree auto: timing target verification and drafting on this hardware; calibrating at "
              f"temperature {temps} on up to {calibration.positions} positions of {calibration.label}...[/]")
    plan = _run(tune_trees, tgt, drafter, calibration.token_ids(loaded.tokenizer), contract,
                temperatures=temperatures, eos_token_ids=list(loaded.eos_ids), positions=calibration.positions,
                progress=progress, sampled_drafts=sampled_drafts)
    for choice in plan.choices:
        out.print(auto_tree_table(choice))
        out.print(f"temperature {choice.temperature:g}: {choice.reason}", highlight=False)
    out.print(f"[dim]--tree auto took {time.perf_counter() - t0:.1f}s[/]")
    return plan


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
    tree_sampled: Optional[str] = typer.Option(None, help=TREE_SAMPLED_HELP),
    sampled_drafts: str = typer.Option("top-k", help=SAMPLED_DRAFTS_HELP),
    calibration_positions: int = typer.Option(2000, min=1, help=CALIBRATION_HELP),
    calibration_prompts: Optional[str] = typer.Option(None, help=CALIBRATION_PROMPTS_HELP),
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
    from eyas.engine import SamplingParams, speculative_generate

    sampling = _run(SamplingParams, temperature, top_p, top_k)  # checked before anything loads
    greedy_tree = parse_tree("--tree", tree)
    sampled_tree = parse_tree("--tree-sampled", tree_sampled) if tree_sampled is not None else greedy_tree
    check_sampled_drafts(sampled_drafts)
    calibration = Calibration(calibration_positions, calibration_prompts).check()
    draft = str(_run(resolve_draft, draft, target))
    loaded, drafter, tgt, contract = load_for_serving(target, Path(draft), device, force, target_impl, draft_dtype,
                                                        matvec, attention)
    tokenizer = loaded.tokenizer
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = render_prompt(messages, tokenizer).to(tgt.device)[None]
    choice = None
    spec_tree = greedy_tree if sampling.greedy else sampled_tree  # the tree of this request's kind
    if spec_tree == "auto":  # tuned at this request's temperature
        plan = auto_trees(tgt, drafter, loaded, contract, [temperature], calibration,
                          err if json_out else console, progress=not json_out, sampled_drafts=sampled_drafts)
        choice = plan.choices[0]
        spec_tree = choice.spec
    stream = (lambda t: None) if json_out else (lambda t: console.print(tokenizer.decode([t]), end="", highlight=False))
    t0 = time.perf_counter()
    r = speculative_generate(tgt, drafter, ids, tree=spec_tree,
                             sampling=sampling, max_new_tokens=max_new_tokens,
                             eos_token_ids=loaded.eos_ids, sampled_drafts=sampled_drafts,
                             generator=torch.Generator(device=tgt.device).manual_seed(seed), on_token=stream)
    wall = time.perf_counter() - t0
    stats = r.stats.to_dict()
    text = tokenizer.decode(r.tokens, skip_special_tokens=True)
    if json_out:
        report = {"text": text, "tokens": r.tokens, "wall_s": round(wall, 3), "target_impl": tgt.implementation,
                  "tree": [spec_tree.depth, spec_tree.top_k, spec_tree.total_tokens], "temperature": temperature,
                  "sampled_drafts": sampled_drafts, "stats": stats}
        if choice is not None:
            report["tree_auto"] = choice.to_dict()
        _print_json(report)
        return
    console.print()
    console.print(
        f"[dim]{stats['new_tokens']} tokens in {stats['rounds']} rounds: tau {stats['tau']:.2f}, "
        f"{stats['tokens_per_s']:.1f} tok/s; acceptance per position "
        f"{[round(a, 2) for a in stats['acceptance_at_depth']]}; draft {stats['time_draft']:.2f}s, "
        f"verify {stats['time_verify']:.2f}s, bookkeeping {stats['time_bookkeeping']:.2f}s; "
        f"stop: {stats['stop_reason']}; tree {spec_tree.label}; target: {tgt.implementation}[/]"
    )


def bench_cmd(
    target: str = typer.Option(..., help=TARGET_HELP),
    draft: Optional[str] = typer.Option(None, help=DRAFT_HELP),
    prompts: list[str] = typer.Option(..., help="mt_bench|humaneval|gsm8k|alpaca|sum|qa or a prompt file; repeatable"),
    limit: Optional[int] = typer.Option(None, help="prompts per set"),
    max_new_tokens: int = typer.Option(256),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy (default); not with --temperatures"),
    temperatures: Optional[str] = typer.Option(None, help="run and report each temperature on its own, e.g. 0,1"),
    tree: list[str] = typer.Option(["5"], help=TREE_HELP + "; repeatable: every tree runs on the same prompts at "
                                   "every temperature (the first is the one reported as the bench's tree, the "
                                   "others are compared with it, e.g. --tree auto --tree 4,8,15 --tree 6,10,60)"),
    tree_sampled: Optional[str] = typer.Option(None, help=TREE_SAMPLED_HELP + " (replaces the first --tree above 0)"),
    sampled_drafts: str = typer.Option("top-k", help=SAMPLED_DRAFTS_HELP),
    calibration_positions: int = typer.Option(2000, min=1, help=CALIBRATION_HELP),
    calibration_prompts: Optional[str] = typer.Option(None, help=BENCH_CALIBRATION_HELP),
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
    hf_baseline: str = typer.Option("auto", help="the HF baseline: auto (a static cache and torch.compile on a GPU, "
                                                 "eager on the CPU) | compiled | eager"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Speculative decoding with one or more trees vs eyas plain decoding vs HF `generate`, on the same
    prompts, in one process, each temperature on its own."""
    from eyas.bench.hf import HF_BASELINES

    temps = parse_temperatures(temperature, temperatures)
    first = parse_tree("--tree", tree[0])
    sampled_first = parse_tree("--tree-sampled", tree_sampled) if tree_sampled is not None else first
    others = [(t.strip().lower() if is_auto(t) else t, parse_tree("--tree", t)) for t in tree[1:]]
    check_sampled_drafts(sampled_drafts)
    calibration = Calibration(calibration_positions, calibration_prompts).check(held_out=True)
    if hf_baseline not in HF_BASELINES:
        fail(f"--hf-baseline: expected one of {', '.join(HF_BASELINES)}, found {hf_baseline!r}")

    def asked(t: float) -> list[tuple[str, Any]]:
        """The trees of temperature t: (as asked, TreeSpec or 'auto'), the primary first."""
        primary = first if t == 0 else sampled_first
        text = tree[0] if t == 0 or tree_sampled is None else tree_sampled
        return [("auto" if primary == "auto" else text, primary)] + others

    auto_temps = [t for t in temps if any(spec == "auto" for _, spec in asked(t))]
    _bench(target, draft, prompts, limit, max_new_tokens, temps, asked, auto_temps, sampled_drafts,
           calibration, seed, device, target_impl, matvec, attention, draft_dtype, png, out, force,
           hf_baseline if hf else None, json_out)


def _bench(target: str, draft: Optional[str], prompts: list[str], limit: Optional[int], max_new_tokens: int,
           temps: list[float], asked: Any, auto_temps: list[float], sampled_drafts: str, calibration: Calibration,
           seed: int, device: str, target_impl: str, matvec: str, attention: str, draft_dtype: str,
           png: Optional[Path], out: Optional[Path], force: bool, hf_mode: Optional[str], json_out: bool) -> None:
    """`eyas bench` once its options are checked: load, tune (--tree auto), run each temperature
    (eyas.bench.sweep), report."""
    import json

    from eyas.bench import load_prompts, plot_accept_lengths
    from eyas.bench.hf import hf_baseline
    from eyas.bench.report import acceptance_lines, bench_table, prediction_line, trees_table
    from eyas.bench.sweep import bench_temperature, tree_options
    from eyas.data.render import render_prompt

    draft = str(_run(resolve_draft, draft, target))
    sets = [(name, _run(load_prompts, name, limit)) for name in prompts]  # checked before anything loads
    if auto_temps:
        calibration.hold_out(prompts, limit)
    loaded, drafter, tgt, contract = load_for_serving(target, Path(draft), device, force, target_impl, draft_dtype,
                                                        matvec, attention)
    tokenizer = loaded.tokenizer
    err.print(f"[dim]target implementation: {tgt.implementation}; drafter in {str(drafter.fc.weight.dtype)[6:]}[/]")
    hf_gen = None
    if hf_mode is not None:
        rendered = [render_prompt(c, tokenizer) for _, convs in sets for c in convs]
        longest = max((len(r) for r in rendered), default=1)
        with err.status("[dim]HF baseline: compiling and warming generate (static cache) ...[/]"):
            hf_gen = hf_baseline(loaded.model, loaded.eos_ids, tokenizer.pad_token_id, max_new_tokens, mode=hf_mode,
                                 max_cache_len=longest + max_new_tokens + 8,
                                 warm_ids=rendered[0].to(tgt.device)[None] if rendered else None)
        err.print(f"[dim]HF baseline: {hf_gen.label}{'; ' + hf_gen.note if hf_gen.note else ''}[/]")
    plan = None
    if auto_temps:
        plan = auto_trees(tgt, drafter, loaded, contract, auto_temps, calibration,
                          err if json_out else console, progress=not json_out, sampled_drafts=sampled_drafts)
    runs = []
    for t in temps:
        choice = plan.for_temperature(t) if plan is not None and t in auto_temps else None
        options = tree_options([(a, choice.spec if spec == "auto" else spec) for a, spec in asked(t)])
        runs.append(bench_temperature(t, options, [(Path(n).stem, c) for n, c in sets], loaded, tgt, drafter,
                                      max_new_tokens, seed=seed, progress=not json_out, hf=hf_gen,
                                      sampled_drafts=sampled_drafts, choice=choice))
    sections = [r.to_dict() for r in runs]
    png = png or (out.with_suffix(".png") if out else Path("bench.png"))
    many = len(sections) > 1
    plot_accept_lengths([{**s, "set": f"{s['set']} @ T={sec['temperature']:g}" if many else s["set"]}
                         for sec in sections for s in sec["sets"]], png)
    head = sections[0]
    report = {"target": target, "draft": str(draft), "max_new_tokens": max_new_tokens, "device": str(tgt.device),
              "target_impl": tgt.implementation, "sampled_drafts": sampled_drafts,
              "hf_baseline": hf_gen.label if hf_gen is not None else None,
              "hf": hf_gen.to_dict() if hf_gen is not None else None,
              "temperatures": sections,
              # the first temperature's figures under the keys a one-temperature bench always had
              "temperature": head["temperature"], "tree": head["tree"], "sets": head["sets"], "png": str(png)}
    if "tree_auto" in head:
        report["tree_auto"] = head["tree_auto"]
    if plan is not None:
        report["tree_plan"] = plan.plan.to_dict()
        report["calibration"] = {"prompts": calibration.label, "positions": calibration.positions}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
    if json_out:
        _print_json(report)
        return
    if hf_gen is not None:
        console.print(f"hf = Hugging Face {hf_gen.label}", highlight=False)
    for sec in sections:
        console.print(bench_table(sec["sets"], f"temperature {sec['temperature']:g}, tree {sec['tree_label']}"))
        for line in acceptance_lines(sec["sets"]):
            console.print(line, highlight=False)
        if len(sec["trees"]) > 1:
            console.print(trees_table(sec))
        if prediction_line(sec):
            console.print(prediction_line(sec), highlight=False)
    err.print(f"accept-length histogram: {png}")


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_cmd)
    app.command("bench")(bench_cmd)
