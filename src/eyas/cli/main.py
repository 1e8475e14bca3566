"""The `eyas` command. Each subcommand is a thin layer over a library call; every command that
reports something prints a human table, or the same facts as JSON with ``--json``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.table import Table

from eyas.cli.common import (
    IDS_CONVENTION_HELP, SGLANG_RULE_DEFAULT, SGLANG_RULE_HELP, TARGET_DEVICES_HELP, TARGET_HELP, ExportChoice,
    IdsConventionChoice, SGLangRuleChoice, console, err, fail,
)
from eyas.cli.common import print_json as _print_json
from eyas.cli.common import run as _run
from eyas.cli.data_commands import register as register_data_commands
from eyas.cli.doctor_command import register as register_doctor_command
from eyas.cli.engine_commands import register as register_engine_commands
from eyas.cli.open_prompts_command import register as register_open_prompts_command
from eyas.cli.serve_commands import register as register_serve_commands

app = typer.Typer(
    name="eyas",
    help="EAGLE-3 drafters that see at serving time exactly the hidden states they were trained on.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


# ---------------------------------------------------------------------------------------------


def engine_table(view: Any) -> Table:
    """``view``: an :class:`eyas.interop.EngineView`."""
    trained = view.boundaries
    table = Table(title=f"boundaries each engine captures (target has {view.num_target_blocks} blocks)")
    table.add_column("engine")
    table.add_column("captures")
    table.add_column("vs trained " + str(trained) + (" (ASSUMED)" if getattr(view, "boundaries_assumed", None) else ""))
    for engine, got in view.engines.items():
        if got == trained:
            status = "[green]same[/]"
        elif got is None:
            status = "[yellow]unknown[/]"
        else:
            diff = [f"slot {i}: {t} -> {g}" for i, (t, g) in enumerate(zip(trained, got)) if t != g]
            if len(got) != len(trained):
                diff.append(f"{len(trained)} slots -> {len(got)}")
            status = "[bold red]DIFFERS[/] " + ", ".join(diff)
        table.add_row(engine, str(got), status)
    return table


def assumed_lines(view: Any, asked: Any) -> list[str]:
    """What ``info`` and ``import`` say about third-party ids: each convention's reading where they
    differ, and that the trained boundaries are assumed (or read by the named convention, ``asked``);
    and each norm flag a converter chose rather than read (``flags_assumed``), with the fix."""
    from eyas.interop.servers.sglang import readings_text

    lines = []
    if view.id_readings:
        lines.append(f"the nested SGLang ids read by each convention: {readings_text(view.id_readings)}")
    if view.boundaries_assumed:
        lines.append(f"[bold yellow]trained boundaries {view.boundaries} are ASSUMED[/]: {view.boundaries_assumed}")
    elif asked is not None and view.ids_convention == asked.value:
        lines.append(f"trained boundaries {view.boundaries}: the nested ids read by the {asked.value} convention "
                     f"(--ids-convention)")
    elif asked is not None:
        lines.append(f"[yellow]--ids-convention {asked.value} not used: {view.boundaries_source} says the "
                     f"boundaries[/]")
    for flag, why in getattr(view, "flags_assumed", {}).items():
        lines.append(f"[bold yellow]{flag} is ASSUMED[/]: {why}")
    return lines


@app.command()
def new(
    target: str = typer.Option(..., help=TARGET_HELP),
    out: Path = typer.Option(..., help="directory to write the drafter to"),
    boundaries: Optional[str] = typer.Option(None, help="e.g. 2,15,27 (default [2, L//2, L-3])"),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", help="draft vocabulary size"),
    seed: int = typer.Option(0),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """An untrained drafter for TARGET, with its contract (eyas format, SGLang-loadable)."""
    from eyas.convention import parse_boundaries
    from eyas.drafter.build import new_drafter
    from eyas.interop import save_drafter, view_engines
    from eyas.targets import load_target

    bs = _run(parse_boundaries, boundaries) if boundaries else None
    loaded = _run(load_target, target)
    drafter, contract = _run(new_drafter, loaded.model, loaded.tokenizer, bs, draft_vocab, source=loaded.name, seed=seed)
    path = save_drafter(drafter, contract, out)
    view = view_engines(path)
    if json_out:
        _print_json({"path": str(path), **view.to_dict(), "contract": contract.model_dump()})
        return
    console.print(f"wrote untrained drafter to [bold]{path}[/] for {loaded.name}")
    console.print(engine_table(view))


@app.command()
def info(
    path: Path = typer.Argument(..., help="a drafter directory (eyas, SGLang/SpecForge/EAGLE or speculators); "
                                          "'default': the one shipped for --target smollm2"),
    target: Optional[str] = typer.Option(
        None, help=TARGET_HELP + "; its number of decoder blocks, when the directory does not say"),
    num_target_blocks: Optional[int] = typer.Option(
        None, min=1, help="the target's number of decoder blocks, when the directory does not say (or --target)"),
    ids_convention: Optional[IdsConventionChoice] = typer.Option(None, help=IDS_CONVENTION_HELP),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """The drafter's contract, and which physical boundaries each engine will capture for it."""
    from eyas.interop import resolve_draft, view_engines

    path = _run(resolve_draft, path, target or "smollm2") if str(path) == "default" else path
    if target:
        from eyas.targets import load_target

        blocks = _run(load_target, target).num_blocks
        if num_target_blocks is not None and num_target_blocks != blocks:
            fail(f"--num-target-blocks: expected {blocks} (the decoder blocks of --target {target}), "
                 f"found {num_target_blocks}")
        num_target_blocks = blocks
    view = _run(view_engines, path, num_target_blocks, require_blocks=True,
                ids_convention=ids_convention.value if ids_convention else None)
    contract = view.contract  # read with the rest of the directory's metadata, once
    if json_out:
        _print_json({**view.to_dict(), "contract": contract.model_dump() if contract else None})
        return
    if contract is None:
        console.print(f"[yellow]{path}: no contract (not an eyas drafter, or imported without --target); "
                      f"`eyas import --target T` records one[/]")
    else:
        t, c = contract.target, contract.capture
        console.print(f"[bold]{path}[/]")
        console.print(
            f"  target   {t.architecture} ({t.model_type}), {t.num_blocks} blocks, hidden {t.hidden_size}, "
            f"vocab {t.vocab_size}, fingerprint {t.fingerprint}" + (f", from {t.source}" if t.source else "")
        )
        console.print(f"  capture  boundaries {c.boundaries} ({c.values}, {c.dtype})")
        if contract.tokenisation:
            tk = contract.tokenisation
            console.print(
                f"  tokens   chat template {tk.chat_template_sha256}, bos {tk.bos_token!r}, eos {tk.eos_token!r}, "
                f"system prompt {tk.system_prompt}"
            )
        if contract.drafter:
            console.print("  drafter  " + ", ".join(f"{k}={v}" for k, v in contract.drafter.model_dump().items()))
        if contract.metrics is not None and contract.metrics.recorded:
            console.print(f"  metrics  {json.dumps(contract.metrics.model_dump())}")
    for line in assumed_lines(view, ids_convention):
        console.print(line, highlight=False)
    console.print(engine_table(view))


@app.command("export")
def export_cmd(
    path: Path = typer.Argument(..., help="an eyas drafter directory; 'default': the one shipped for smollm2"),
    to: ExportChoice = typer.Option(..., "--to", help="target engine format"),
    out: Path = typer.Option(..., help="directory to write"),
    sglang_rule: SGLangRuleChoice = typer.Option(SGLANG_RULE_DEFAULT, help=SGLANG_RULE_HELP),
    verifier: Optional[str] = typer.Option(
        None, help="--to vllm: the target as speculators and vLLM resolve it (speculators_config.verifier."
                   "name_or_path): a hub id like org/name or a local model directory; default: the "
                   "recorded target when it was loaded from one"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Write the drafter in SGLang or speculators/vLLM format, with layer ids in that engine's convention."""
    import warnings

    from eyas.interop import export_drafter, resolve_draft

    path = _run(resolve_draft, path, "smollm2") if str(path) == "default" else path
    with warnings.catch_warnings(record=True) as caught:  # each said once, as a warning line
        warnings.simplefilter("always")
        report = _run(export_drafter, path, to.value, out, sglang_rule=sglang_rule.value, verifier=verifier)
    for message in dict.fromkeys(str(w.message) for w in caught):
        err.print(f"[yellow]warning:[/] {message}", highlight=False)
    if json_out:
        _print_json(report.to_dict())
        return
    console.print(f"wrote {to.value} format to [bold]{out}[/]")
    for k, v in report.to_dict().items():
        if k != "view":
            console.print(f"  {k}: {v}")
    console.print(engine_table(report.view))


@app.command("import")
def import_cmd(
    path: Path = typer.Argument(..., help="an SGLang/SpecForge/EAGLE or speculators drafter directory"),
    out: Path = typer.Option(..., help="eyas directory to write"),
    target: Optional[str] = typer.Option(None, help=TARGET_HELP + "; records the target in the contract"),
    num_target_blocks: Optional[int] = typer.Option(
        None, min=1, help="the target's number of decoder blocks, when the directory does not say (or --target)"),
    ids_convention: Optional[IdsConventionChoice] = typer.Option(None, help=IDS_CONVENTION_HELP),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Convert a drafter from another format to the eyas format (boundaries in the eyas convention)."""
    from eyas.interop import import_drafter, view_engines

    loaded = None
    if target:
        from eyas.targets import load_target

        loaded = _run(load_target, target)
    conv = ids_convention.value if ids_convention else None
    dest = _run(import_drafter, path, out, num_target_blocks=num_target_blocks, target=loaded, ids_convention=conv)
    source = _run(view_engines, path, num_target_blocks or (loaded.num_blocks if loaded else None),
                  ids_convention=conv)  # how the source's ids were read
    view = _run(view_engines, dest)
    if json_out:
        _print_json({"path": str(dest), **view.to_dict(), "ids_convention": source.ids_convention,
                     "id_readings": dict(source.id_readings)})
        return
    assumed = " ASSUMED" if view.boundaries_assumed else ""
    console.print(f"imported {path} -> [bold]{dest}[/] (trained boundaries {view.boundaries}{assumed})")
    for line in assumed_lines(source, ids_convention):
        console.print(line, highlight=False)
    console.print(engine_table(view))


def _engine_tau(cfg: Any, prompts: str, limit: int, max_new_tokens: int, tree: str) -> Callable[[Any, Any], dict[str, float]]:
    """The training loop's ``validate`` hook: :class:`eyas.bench.validate.TauProbe` (the engine's
    greedy tau, pooled over the rounds of the first ``limit`` prompts of ``prompts``) on a copy of
    the drafter in training, served on the target model training already holds (no second copy).
    Prompts are read and the tree parsed now, so a typo fails before training starts; the probe is
    built at the first evaluation, with the capture boundaries training uses."""
    from eyas.bench import load_prompts
    from eyas.bench.validate import TauProbe
    from eyas.engine import TreeSpec

    convs = _run(load_prompts, prompts, limit)
    spec_tree = _run(TreeSpec.parse, tree)
    probe: list[TauProbe] = []  # built on first use

    def validate(drafter: Any, model: Any) -> dict[str, float]:
        from eyas.convention import CaptureSpec
        from eyas.data.shard_dataset import ShardDataset
        from eyas.data.shard_format import is_shard_dir
        from eyas.targets import load_tokenizer
        from eyas.targets.structure import eos_token_ids, num_blocks

        if not probe:
            tokenizer = load_tokenizer(cfg.target)
            boundaries = (ShardDataset(cfg.data).contract.capture.boundaries if is_shard_dir(cfg.data)
                          else cfg.boundaries)
            spec = CaptureSpec.create(num_blocks(model), boundaries)
            probe.append(TauProbe.from_conversations(model, tokenizer, spec, convs, eos_token_ids(model, tokenizer),
                                                     tree=spec_tree, max_new_tokens=max_new_tokens))
        return {**probe[0](drafter), "validate_prompts": float(len(convs))}

    return validate


@app.command()
def train(
    target: str = typer.Option(..., help=TARGET_HELP),
    data: str = typer.Option(..., help="a shard directory from `eyas capture` (offline) or a conversations JSONL (online)"),
    out: Path = typer.Option(..., help="checkpoint directory (an eyas-format drafter at the end)"),
    steps: Optional[int] = typer.Option(None, help="optimizer steps (or --epochs)"),
    epochs: Optional[float] = typer.Option(None, help="passes over the training split (or --steps)"),
    time_budget_s: Optional[float] = typer.Option(
        None, help="finish within about this many seconds (loading and tokenizing included; the last evaluation "
                   "and the save come after): the learning-rate schedule is shortened to end there, from the pace "
                   "measured as it trains, rather than cut off at a high learning rate"),
    boundaries: Optional[str] = typer.Option(None, help="online only: e.g. 2,15,27 (default [2, L//2, L-3])"),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", help="draft vocabulary size (default 8192, or "
                                                                             "--init-from's; larger than --init-from's "
                                                                             "widens it: its ids and rows kept)"),
    batch_size: int = typer.Option(4, help="sequences per rank per step (without --tokens-per-batch)"),
    tokens_per_batch: Optional[int] = typer.Option(
        None, help="length-bucketed batches: rows * padded length <= this many tokens per rank per step "
                   "(padded to a multiple of 64); replaces --batch-size"),
    max_length: int = typer.Option(1024),
    lr: float = typer.Option(1e-3),
    ttt_steps: int = typer.Option(7),
    save_every: int = typer.Option(200),
    eval_every: int = typer.Option(100),
    log_every: int = typer.Option(10),
    patience: Optional[int] = typer.Option(
        None, help="stop when the held-out figure (tau with --validate-prompts, else the simulated accept length) "
                   "has not improved for this many evaluations; OUT/best keeps the best, OUT ends with it"),
    validate_prompts: Optional[str] = typer.Option(
        None, help="at every evaluation, measure the engine's tau (greedy) on these prompts (a prompt set name or "
                   "file, as `eyas bench --prompts`; keep them apart from evaluation prompts); picks the best"),
    validate_limit: int = typer.Option(8, help="--validate-prompts: how many prompts"),
    validate_tokens: int = typer.Option(128, help="--validate-prompts: new tokens per prompt"),
    validate_tree: str = typer.Option("5", help="--validate-prompts: the tree (" + "as --tree of `eyas generate`)"),
    seed: int = typer.Option(0),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    target_devices: Optional[str] = typer.Option(None, help="online training: " + TARGET_DEVICES_HELP
                                                 + "; the drafter trains on the first"),
    # The variant flags default to off, or to --init-from's drafter's: None = not given.
    norm_before_residual: Optional[bool] = typer.Option(
        None, "--norm-before-residual/--no-norm-before-residual",
        help="drafter variant: residual = hidden_norm(h) instead of h [default: off, or --init-from's]"),
    norm_before_fc: Optional[bool] = typer.Option(
        None, "--norm-before-fc/--no-norm-before-fc",
        help="drafter variant: one RMSNorm over the concatenated slots before fc [default: off, or --init-from's]"),
    fc_norm: Optional[bool] = typer.Option(
        None, "--fc-norm/--no-fc-norm",
        help="drafter variant: one RMSNorm per slot before the concatenation [default: off, or --init-from's]"),
    norm_output: Optional[bool] = typer.Option(
        None, "--norm-output/--no-norm-output",
        help="drafter variant: feed back the post-norm hidden state [default: off, or --init-from's]"),
    init_from: Optional[str] = typer.Option(
        None, help="start from this eyas drafter's weights and draft vocabulary ('default': the one shipped for "
                   "--target smollm2), not a fresh one: fine-tuning on more data; the run takes its boundaries, "
                   "draft vocabulary size and variant flags unless you set them"),
    force: bool = typer.Option(False, help="train even when the shards' contract does not match the target"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Train an EAGLE-3 drafter with training-time test; resumes from the newest checkpoint in OUT."""
    from eyas.convention import parse_boundaries
    from eyas.interop import read_contract, resolve_draft
    from eyas.training.config import TrainConfig
    from eyas.training.loop import train as run_training

    # Options left unset stay out of the config's fields_set: --init-from fills them from its drafter.
    given = {k: v for k, v in dict(boundaries=_run(parse_boundaries, boundaries) if boundaries else None,
                                   draft_vocab_size=draft_vocab, norm_before_residual=norm_before_residual,
                                   norm_before_fc=norm_before_fc, fc_norm=fc_norm, norm_output=norm_output).items()
             if v is not None}
    cfg = _run(
        TrainConfig, target=target, data=data, out=str(out), steps=steps, epochs=epochs, time_budget_s=time_budget_s,
        batch_size=batch_size, tokens_per_batch=tokens_per_batch, max_length=max_length, lr=lr, ttt_steps=ttt_steps,
        save_every=save_every, eval_every=eval_every, log_every=log_every, patience=patience, seed=seed, device=device,
        target_devices=target_devices,
        init_from=str(_run(resolve_draft, init_from, target, "--init-from")) if init_from is not None else None, **given,
    )
    log = (lambda m: err.print(m, highlight=False)) if json_out else (lambda m: console.print(m, highlight=False))
    t0 = time.perf_counter()
    validate = (_engine_tau(cfg, validate_prompts, validate_limit, validate_tokens, validate_tree)
                if validate_prompts else None)
    path = _run(run_training, cfg, force=force, log=log, validate=validate).out
    metrics = read_contract(path).metrics
    if json_out:
        _print_json({"path": str(path), "wall_s": round(time.perf_counter() - t0, 1),
                     "metrics": metrics.model_dump() if metrics is not None else None})
        return
    if metrics is not None and metrics.recorded:
        console.print(f"held-out accuracy per position: {metrics.accuracy_per_position}")
        console.print(f"conditional accuracy:           {metrics.conditional_accuracy_per_position}")
        console.print(f"simulated accept length:        {metrics.simulated_accept_length}")


register_data_commands(app)  # eyas regenerate, eyas capture
register_open_prompts_command(app)  # eyas open-prompts
register_engine_commands(app)  # eyas generate, eyas bench
register_doctor_command(app)  # eyas doctor
register_serve_commands(app)  # eyas serve, eyas watch


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
