"""`eyas doctor`: replay, live capture as an engine would do it, fingerprint, search, verdict;
`eyas trace`: the engine's three junctions per round, held against the training fingerprint.

    eyas doctor --target smollm2 --draft runs/drafter --data shards/ --engine vllm --png doctor.png
    eyas trace  --target smollm2 --draft runs/drafter --prompt "Why is the sky blue?" --out trace.jsonl
    eyas trace  ... --target-impl fast   # trace the fast Llama target (CUDA graphs on a GPU)

Exit code 0 only when the drafter is healthy / the trace matches the fingerprint (1 when it does
not, 2 for unusable input). `main.py` adds both with ``register(app)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from eyas.cli.common import (
    IDS_CONVENTION_HELP, SGLANG_RULE_DEFAULT, SGLANG_RULE_HELP, TARGET_DEVICES_HELP, TARGET_HELP, TARGET_IMPL_HELP, EngineChoice,
    IdsConventionChoice, SGLangRuleChoice, console, err,
)
from eyas.cli.common import fail as _fail
from eyas.cli.common import print_json as _print_json
from eyas.cli.common import run as _run
from eyas.interop.embedded import resolve_draft


def doctor_cmd(
    target: str = typer.Option(..., help=TARGET_HELP),
    draft: Optional[str] = typer.Option(None, help="the drafter directory as it is served (eyas, SGLang or speculators "
                                             "format); 'default' or none with --target smollm2: the one shipped with eyas"),
    data: Optional[str] = typer.Option(
        None, help="the training shards (replay on the stored hidden states) or a conversations file; "
                   "default: the data in the drafter's train_config.json, else built-in prompts"),
    engine: EngineChoice = typer.Option(EngineChoice("eyas"), help="read and capture the way this engine does"),
    sglang_rule: SGLangRuleChoice = typer.Option(SGLANG_RULE_DEFAULT, help="with --engine sglang: " + SGLANG_RULE_HELP),
    samples: int = typer.Option(32, min=1, help="samples to evaluate on"),
    max_length: int = typer.Option(512, min=8, help="tokens per sample at most"),
    png: Optional[Path] = typer.Option(None, help="write a PNG of replay vs live accuracy per position"),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    target_devices: Optional[str] = typer.Option(None, help=TARGET_DEVICES_HELP),
    ids_convention: Optional[IdsConventionChoice] = typer.Option(None, help=IDS_CONVENTION_HELP),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Check that a drafter sees, as ENGINE serves it, the hidden states it was trained on; name the fix."""
    from eyas.doctor import render, run_doctor

    draft = _run(resolve_draft, draft, target)
    if not draft.exists():
        _fail(f"--draft {draft}: no such directory")
    log = (lambda m: err.print(f"[dim]doctor: {m}[/]", highlight=False))
    report = _run(run_doctor, target, str(draft), data=data, engine=engine.value, sglang_rule=sglang_rule.value,
                  samples=samples, max_length=max_length, png=png, device=device, log=log,
                  target_devices=target_devices,
                  ids_convention=ids_convention.value if ids_convention else None)
    if json_out:
        _print_json(report.to_dict())
    else:
        render(report, console)
    raise typer.Exit(report.exit_code)


def trace_cmd(
    target: str = typer.Option(..., help=TARGET_HELP),
    draft: Optional[str] = typer.Option(None, help="the drafter directory as it is served (eyas, SGLang or speculators "
                                             "format); 'default' or none with --target smollm2: the one shipped with eyas"),
    prompt: str = typer.Option(..., help="the user message to answer with the trace on"),
    out: Path = typer.Option(..., help="the JSONL file of junction records (a header line, the records, the summary)"),
    max_new_tokens: int = typer.Option(64, min=1),
    tree: str = typer.Option("5", help="DEPTH,TOPK,TOTAL (EAGLE-2 dynamic tree, e.g. 6,4,24) or DEPTH for a chain"),
    system: Optional[str] = typer.Option(None, help="a system message (default: the template's own)"),
    engine: EngineChoice = typer.Option(
        EngineChoice("eyas"), help="serve the boundaries and norm flags this engine reads from the directory"),
    sglang_rule: SGLangRuleChoice = typer.Option(SGLANG_RULE_DEFAULT, help="with --engine sglang: " + SGLANG_RULE_HELP),
    device: str = typer.Option("auto", help="cpu | cuda | auto"),
    target_impl: str = typer.Option("auto", help=TARGET_IMPL_HELP),
    ids_convention: Optional[IdsConventionChoice] = typer.Option(None, help=IDS_CONVENTION_HELP),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Trace the engine's junctions (each captured boundary, the concatenation, the fc input) per round
    to JSONL, and hold them against the drafter's training fingerprint."""
    from eyas.doctor.trace import render_trace, run_trace
    from eyas.engine import TreeSpec

    draft = _run(resolve_draft, draft, target)
    if not draft.exists():
        _fail(f"--draft {draft}: no such directory")
    spec_tree = _run(TreeSpec.parse, tree)
    log = (lambda m: err.print(f"[dim]trace: {m}[/]", highlight=False))
    # A TraceError (the engine cannot serve the directory, or the drafter does not fit the target) is
    # an EyasError: _run prints it and exits 2.
    report = _run(run_trace, target, str(draft), prompt, out, system=system, max_new_tokens=max_new_tokens,
                  tree=spec_tree, engine=engine.value, sglang_rule=sglang_rule.value, device=device,
                  target_impl=target_impl, log=log, ids_convention=ids_convention.value if ids_convention else None)
    if json_out:
        _print_json(report.to_dict())
    else:
        render_trace(report, console)
    raise typer.Exit(report.exit_code)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_cmd)
    app.command("trace")(trace_cmd)
