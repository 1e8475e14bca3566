"""`eyas regenerate` and `eyas capture`: the data half of the pipeline.

    eyas regenerate --target smollm2 --prompts prompts.jsonl --out answers.jsonl
    eyas capture    --target smollm2 --data answers.jsonl --out shards/

Both resume where a crashed run stopped (rerun the same command). `main.py` adds them with
``register(app)``; they are plain functions so that this module does not import main (no cycle).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.table import Table

from eyas.cli.common import TARGET_DEVICES_HELP, TARGET_HELP, IdsConventionChoice, console, err
from eyas.cli.common import fail as _fail
from eyas.cli.common import print_json as _print_json
from eyas.cli.common import run as _run

if TYPE_CHECKING:
    from eyas.targets import LoadedTarget

SYSTEM_HELP = "'template_default' (the conversation's own, else the template's), 'none', or the prompt text"


def _load(target: str, device: str, target_dtype: str, target_devices: str | None = None) -> LoadedTarget:
    """The LoadedTarget for ``--target``, ``--device``, ``--target-dtype`` and ``--target-devices``
    (rules in eyas.targets.placement and eyas.targets.split: under torchrun each process takes its
    own GPU; a split target replaces --device)."""
    from eyas.targets import load_target

    return _run(load_target, target, dtype=target_dtype, device=device, target_devices=target_devices)


def _read(path: Path) -> Any:
    from eyas.data.conversation_files import read_conversations

    if not path.exists():
        _fail(f"{path}: no such file")
    result = _run(read_conversations, path, on_error="skip")
    if result.problems:
        err.print(f"[yellow]{result.summary()}[/]", highlight=False)
        err.print(f"[yellow]  first: {result.problems[0]}[/]", highlight=False)
    if not result.conversations:
        _fail(f"{path}: no usable conversations ({result.summary()})")
    return result


def _floats(option: str, text: str) -> list[float]:
    """``0,0.8`` -> [0.0, 0.8]; anything else fails naming the option, expected and found."""
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        _fail(f"{option}: expected comma-separated numbers such as 0,0.8, found {text!r}")
        raise  # unreachable: fail exits


def _table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for k, v in rows:
        table.add_row(k, str(v))
    return table


# ---------------------------------------------------------------------------------------------


def regenerate_cmd(
    target: str = typer.Option(..., help=TARGET_HELP),
    prompts: Path = typer.Option(..., help="prompts or conversations (ShareGPT, OpenAI messages, MT-bench turns, ...)"),
    out: Path = typer.Option(..., help="JSONL to write (appended to, and resumed, if it exists)"),
    limit: Optional[int] = typer.Option(None, help="only the first N conversations"),
    max_new_tokens: int = typer.Option(1024, help="per answer"),
    batch_size: Optional[int] = typer.Option(
        None, help="conversations generated together (also the resume unit) [default: 4 x --rows with the fast "
                   "engine, which streams them through its rows; 64 with hf]"),
    temperature: Optional[float] = typer.Option(None, help="one answer per prompt: 0 = greedy (default), > 0 sampled"),
    temperatures: Optional[str] = typer.Option(
        None, help="one answer per prompt and temperature, e.g. 0,0.8 (ids <id>@t0.8); not with --temperature"),
    top_p: float = typer.Option(1.0, help="nucleus sampling (only with a temperature > 0)"),
    seed: int = typer.Option(0, help="sampling seed (per batch and temperature: a resumed run samples the same)"),
    system_prompt: str = typer.Option("template_default", help=SYSTEM_HELP),
    max_turns: Optional[int] = typer.Option(None, help="answer at most this many user turns per conversation"),
    max_prompt_tokens: Optional[int] = typer.Option(None, help="end a conversation before a longer prompt"),
    loops: str = typer.Option("cut", help="an answer with a repetition loop: cut (after its first copy; the "
                                          "conversation ends there) | drop (the conversation) | keep"),
    sort_by_length: bool = typer.Option(True, help="batch conversations of similar prompt length (less padding)"),
    cache: str = typer.Option("auto", help="--engine hf's KV cache: static (compiled decode step on CUDA) | "
                                           "dynamic | auto (static on CUDA)"),
    engine: str = typer.Option("auto", help="what generates: fast (eyas' batched Llama-family forward: continuous "
                                            "batching over --rows, compiled and CUDA-graphed on a GPU) | hf "
                                            "(Hugging Face generate) | auto (fast for a Llama-family target on "
                                            "CUDA, else hf)"),
    rows: Optional[int] = typer.Option(None, help="--engine fast: rows decoded together; a chunk of --batch-size "
                                                  "conversations streams through them [default: 256, or --batch-size "
                                                  "when smaller; an explicit --rows above --batch-size is refused: rows "
                                                  "would stay empty]"),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N"),
    target_devices: Optional[str] = typer.Option(None, help=TARGET_DEVICES_HELP),
    target_dtype: str = typer.Option("auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float32"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress",
                                            help="progress bars on stderr [default: on, off with --json]"),
) -> None:
    """Answer prompts with the target itself (the drafter trains on the target's own answers)."""
    from eyas.data.regenerate import RegenerateOptions, regenerate

    t0 = time.perf_counter()
    sampling: dict[str, Any] = {}
    if temperature is not None:
        sampling["temperature"] = temperature
    if temperatures is not None:
        sampling["temperatures"] = _floats("--temperatures", temperatures)
    rows = _rows(rows, batch_size, engine)
    show_progress = not json_out if progress is None else progress  # bars go to stderr, JSON to stdout
    options = _run(RegenerateOptions, out_path=out, max_new_tokens=max_new_tokens, batch_size=batch_size or 64,
                   **sampling, top_p=top_p, seed=seed, limit=limit, system_prompt=system_prompt,
                   max_prompt_tokens=max_prompt_tokens, max_turns=max_turns, loops=loops,
                   sort_by_length=sort_by_length, cache=cache, progress=show_progress)
    read = _read(prompts)
    loaded = _load(target, device, target_dtype, target_devices)
    model, tokenizer, src = loaded.model, loaded.tokenizer, loaded.name
    generator = _generator(model, engine, rows, progress=show_progress)
    if generator is not None:  # the fast engine: --rows rows, fed --batch-size conversations at a time
        if batch_size is not None and batch_size < rows:
            _fail(_rows_vs_batch(rows, batch_size))
        options = options.model_copy(update={"batch_size": batch_size or 4 * rows})
    s = _run(regenerate, model, tokenizer, read.conversations, options, source=str(src), generator=generator)
    report = {"command": "regenerate", "target": str(src), "prompts": str(prompts), **s.to_dict(),
              "rows": getattr(generator, "rows", None), "batch_size": options.batch_size, "read": read.counts,
              "total_wall_s": round(time.perf_counter() - t0, 3)}
    if json_out:
        _print_json(report)
        if s.interrupted:
            raise typer.Exit(130)
        return
    temps = ", ".join(f"{t:g}" for t in s.temperatures)
    console.print(_table(f"regenerated answers -> {s.out_path}", [
        ("target", src),
        ("conversations", f"{s.conversations} x temperatures [{temps}] = {s.total} ({s.written} written, "
                          f"{s.skipped} already there, {s.failed} failed, {s.duplicates} duplicate ids)"),
        ("finish", f"answers: {s.finish['eos']} eos, {s.finish['length']} length, {s.finish['loop']} loop"),
        ("loops", f"{s.loops_cut} answers cut, {s.loops_dropped} conversations dropped (--loops {options.loops})"),
        ("tokens", f"{s.new_tokens} new, {s.prompt_tokens} prompt"),
        ("engine", f"{s.engine} ({s.cache}" + (f", {generator.rows} rows)" if generator is not None else " cache)")),
        ("speed", f"{s.tokens_per_s:.1f} new tokens/s over {s.wall_s:.1f} s; {s.generate_s:.1f} s generating: "
                  f"{s.generate_calls} calls, {s.decode_steps} decoding steps"),
        *([("failed", s.skipped_path)] if s.skipped_path else []),
        *([("interrupted", "stopped early: rerun the same command to resume")] if s.interrupted else []),
    ]))
    if s.interrupted:
        raise typer.Exit(130)


DEFAULT_ROWS = 256


def _rows(rows: int | None, batch_size: int | None, engine: str) -> int:
    """--rows as given (refused below 1, or above an explicit --batch-size with --engine fast), else
    the default, no more than --batch-size."""
    if rows is None:
        return min(DEFAULT_ROWS, batch_size) if batch_size else DEFAULT_ROWS
    if rows < 1:
        _fail(f"--rows: expected >= 1, found {rows}")
    if engine == "fast" and batch_size is not None and batch_size < rows:
        _fail(_rows_vs_batch(rows, batch_size))
    return rows


def _rows_vs_batch(rows: int, batch_size: int) -> str:
    return (f"--rows {rows} with --batch-size {batch_size}: the fast engine decodes at most --batch-size "
            f"conversations at once, so {rows - batch_size} rows would stay empty; pass --batch-size {4 * rows} "
            f"(4 x --rows, the default) or --rows {batch_size}")


def _generator(model: Any, engine: str, rows: int, progress: bool) -> Any:
    """The generator for ``--engine`` (eyas.engine.batched.choose_engine): a BatchedLlama for fast,
    None for hf (regenerate's default, Hugging Face generate); an unsupported model under ``fast``
    fails naming the reason."""
    from eyas.engine.batch_engines import choose_engine
    from eyas.engine.batched import BatchedLlama

    if _run(choose_engine, model, engine) == "hf":
        return None
    return _run(BatchedLlama, model, rows=rows, progress=progress)


def capture_cmd(
    target: str = typer.Option(..., help=TARGET_HELP),
    data: Path = typer.Option(..., help="conversations with assistant turns (e.g. from `eyas regenerate`)"),
    out: Path = typer.Option(..., help="shard directory (resumed if it holds an unfinished capture)"),
    boundaries: Optional[str] = typer.Option(None, help="e.g. 2,15,27 (default [2, L//2, L-3])"),
    max_length: int = typer.Option(2048, help="tokens per conversation (truncated)"),
    batch_size: int = typer.Option(8, help="conversations per forward pass"),
    dtype: str = typer.Option("bfloat16", help="stored dtype: bfloat16 | float16 | float32"),
    shard_size: int = typer.Option(256, help="conversations per shard"),
    shard_tokens: Optional[int] = typer.Option(None, help="also cap a shard at this many tokens"),
    system_prompt: str = typer.Option("template_default", help=SYSTEM_HELP),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N (torchrun: cuda:LOCAL_RANK)"),
    target_devices: Optional[str] = typer.Option(None, help=TARGET_DEVICES_HELP),
    target_dtype: str = typer.Option("auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float32"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Capture the target's hidden states for training conversations into safetensors shards.

    Under torchrun every rank captures its share (conversations rank::world_size) and the last one
    to finish writes manifest.json."""
    from eyas.convention import CaptureSpec, parse_boundaries
    from eyas.data.shards import CaptureOptions, capture_shards

    t0 = time.perf_counter()
    bs = _run(parse_boundaries, boundaries) if boundaries else None
    options = _run(CaptureOptions, out_dir=out, boundaries=bs, max_length=max_length, batch_size=batch_size,
                   dtype=dtype, shard_size=shard_size, shard_tokens=shard_tokens, system_prompt=system_prompt,
                   source_data=str(data), progress=not json_out)
    read = _read(data)
    loaded = _load(target, device, target_dtype, target_devices)
    model, tokenizer, src = loaded.model, loaded.tokenizer, loaded.name
    spec = _run(CaptureSpec.create, loaded.num_blocks, bs)
    s = _run(capture_shards, model, tokenizer, read.conversations, options, source=str(src))
    report = {"command": "capture", "target": str(src), "data": str(data), "boundaries": list(spec.boundaries),
              **s.to_dict(), "read": read.counts, "total_wall_s": round(time.perf_counter() - t0, 3)}
    if json_out:
        _print_json(report)
        return
    console.print(_table(f"captured hidden states -> {s.out_dir}", [
        ("target", src), ("boundaries", f"{list(spec.boundaries)} + {spec.num_blocks} (last_hidden), {dtype}"),
        ("rank", f"{s.rank} of {s.world_size}"),
        ("samples", f"{s.samples} of {s.conversations} conversations ({s.no_loss_tokens} without assistant "
                    f"tokens, {s.render_problems} template problems, {s.truncated} truncated)"),
        ("tokens", f"{s.tokens} ({s.loss_tokens} assistant)"),
        ("shards", f"{s.shards} ({s.shards_written} written now, {s.shards_resumed} from an earlier run)"),
        ("speed", f"{s.tokens_per_s:.0f} tokens/s over {s.wall_s:.1f} s"),
        ("manifest", s.manifest or "not yet: waiting for the other ranks"),
    ]))
    if s.problems:
        err.print(f"[yellow]first template problem: {s.problems[0]}[/]", highlight=False)


def _import_boundaries(dump_format: str, boundaries: str | None, layer_ids: str | None, ids_convention: Any,
                       num_blocks: int) -> list[int]:
    """The dump's captured layers in eyas' convention, from ``--boundaries`` or from ``--layer-ids``
    (SpecForge: read by ``--ids-convention``, required where the conventions read the ids
    differently; speculators: launch_vllm.py's ids, vLLM's id k = boundary k)."""
    from eyas.convention import parse_boundaries
    from eyas.interop.servers.sglang import ids_readings

    speculators = dump_format == "speculators"
    if (boundaries is None) == (layer_ids is None):
        default = f"2,{num_blocks // 2},{num_blocks - 3}"
        tool = (f"launch_vllm.py --target-layer-ids; its default 2 L//2 L-3 is boundaries {default}" if speculators
                else f"prepare_hidden_states.py --aux-hidden-states-layers; its default 1,L//2-1,L-4 is boundaries "
                     f"{default}")
        _fail("the dump does not record which layers it holds: pass exactly one of --boundaries (eyas: boundary b "
              f"= the input of block b, 0..L) or --layer-ids (as given to {tool} for this target's "
              f"L={num_blocks}); found "
              + ("both" if boundaries is not None else "neither"))
    if speculators:
        if ids_convention is not None:
            _fail(f"--ids-convention {ids_convention.value}: applies to --format specforge only; speculators' ids "
                  "(launch_vllm.py --target-layer-ids) are vLLM's, id k = boundary k, the eyas number")
        return list(_run(parse_boundaries, boundaries if boundaries is not None else layer_ids))
    if boundaries is not None:
        return list(_run(parse_boundaries, boundaries))
    ids = list(_run(parse_boundaries, layer_ids))
    readings = ids_readings(ids, num_blocks)
    if ids_convention is not None:
        got = readings[ids_convention.value]
        if isinstance(got, str):
            _fail(f"--layer-ids {layer_ids} read by --ids-convention {ids_convention.value}: {got}")
        return list(got)  # type: ignore[arg-type]
    valid = {k: v for k, v in readings.items() if not isinstance(v, str)}
    if len({tuple(v) for v in valid.values()}) == 1:  # every convention reads them alike
        return list(next(iter(valid.values())))
    _fail(f"--layer-ids {layer_ids}: the conventions read them differently ("
          + "; ".join(f"{k}: {v}" for k, v in readings.items())
          + "); name the one the dump was made with: --ids-convention specforge (output of block k = boundary "
            "k+1) | sglang | sglang-legacy, or give --boundaries")
    raise AssertionError  # unreachable: fail exits


def import_hidden_states_cmd(
    dump: Path = typer.Option(..., help="the dump directory: SpecForge prepare_hidden_states.py --output-path "
                                        "(rows_*/data_<idx>.ckpt) | speculators generate-offline-data --output "
                                        "(hs_<row>.safetensors)"),
    out: Path = typer.Option(..., help="shard directory to write (new, or an unfinished run of the same import: "
                                       "it resumes)"),
    target: str = typer.Option(..., help=TARGET_HELP + "; its identity goes into the contract (loaded on the CPU)"),
    dump_format: str = typer.Option("specforge", "--format", help="the dump's format: specforge | speculators"),
    boundaries: Optional[str] = typer.Option(None, help="the dump's layers in eyas' convention, ascending, e.g. 2,16,29"),
    layer_ids: Optional[str] = typer.Option(
        None, help="or the ids given to the dumping tool, e.g. 1,15,28 (SpecForge --aux-hidden-states-layers) | "
                   "2,15,27 (launch_vllm.py --target-layer-ids; a last id L, the layer it appends, may be given)"),
    ids_convention: Optional[IdsConventionChoice] = typer.Option(
        None, help="specforge format, with --layer-ids: how the tool read them: specforge (output of block k = "
                   "boundary k+1) | sglang (SGLang since PR #25454: +1 only when the first id is 1) | sglang-legacy "
                   "(+1); required when these readings differ"),
    preprocessed_data: Optional[Path] = typer.Option(
        None, help="speculators format: the preprocessed dataset (speculators prepare-data --output) that holds the "
                   "loss masks; default: the dump's parent directory"),
    dtype: str = typer.Option("bfloat16", help="stored dtype: bfloat16 | float16 | float32"),
    shard_size: int = typer.Option(256, help="samples per shard"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Convert hidden states dumped by another engine (SpecForge's offline capture through SGLang,
    speculators' through vLLM) into eyas shards with the contract filled in; `eyas train --data OUT`
    trains on them."""
    from eyas.data.dumps import FORMATS, SPECFORGE, import_dump

    if dump_format not in FORMATS:
        _fail(f"--format: expected {' | '.join(FORMATS)}, found {dump_format!r}")
    if dump_format == SPECFORGE and preprocessed_data is not None:
        _fail("--preprocessed-data: applies to --format speculators only (SpecForge's files hold their loss masks)")
    loaded = _load(target, "cpu", "float32")
    bs = _import_boundaries(dump_format, boundaries, layer_ids, ids_convention, loaded.num_blocks)
    s = _run(import_dump, dump_format, dump, out, loaded.model, bs, source=loaded.name, dtype=dtype,
             shard_size=shard_size, **({} if dump_format == SPECFORGE else {"preprocessed_data": preprocessed_data}))
    if json_out:
        _print_json({"command": "import-hidden-states", "target": loaded.name, **s.to_dict()})
        return
    last = ("the final norm's output" if dump_format == SPECFORGE
            else f"boundary {loaded.num_blocks} (last_hidden, pre-norm)")
    console.print(_table(f"imported hidden states -> {s.out_dir}", [
        ("from", f"{dump} ({s.format})"), ("target", loaded.name),
        ("boundaries", f"{s.boundaries} (eyas convention) + {last}, {dtype}"),
        ("samples", f"{s.samples} ({s.tokens} tokens, {s.loss_tokens} assistant)"
                    + (f"; {s.missing} rows of the preprocessed data have no file" if s.missing else "")),
        ("shards", f"{s.shards} ({s.shards_resumed} from an earlier run)" if s.shards_resumed else s.shards),
        ("manifest", s.manifest),
    ]))


def prompts_cmd(
    target: str = typer.Option(..., help=TARGET_HELP),
    out: Path = typer.Option(..., help="JSONL of user prompts to write (appended to, and resumed, if it exists)"),
    count: int = typer.Option(1000, min=1, help="prompts the file should hold"),
    temperatures: str = typer.Option("0.8,1.0,1.2", help="sampling temperatures, taken in turn batch by batch"),
    top_p: float = typer.Option(1.0),
    max_new_tokens: int = typer.Option(256, min=8, help="per prompt; a longer one (no end of turn) is dropped"),
    batch_size: Optional[int] = typer.Option(None, help="prompts asked for together [default: 4 x --rows with the "
                                                        "fast engine, 64 with hf]"),
    seed: int = typer.Option(0),
    system_prompt: str = typer.Option("template_default", help=SYSTEM_HELP),
    near_threshold: float = typer.Option(0.7, min=0.0, max=1.0, help="estimated Jaccard similarity (word 3-grams) "
                                                                     "above which a prompt is a near duplicate"),
    documents: Optional[Path] = typer.Option(None, help="JSON lines of long documents ({id, text}; `eyas "
                                                        "open-prompts --documents-out` writes them): the target "
                                                        "writes requests about each, in turn"),
    engine: str = typer.Option("auto", help="fast | hf | auto, as eyas regenerate"),
    rows: Optional[int] = typer.Option(None, help="--engine fast: rows decoded together [default: 256, or "
                                                  "--batch-size when smaller]"),
    cache: str = typer.Option("auto", help="--engine hf's KV cache, as eyas regenerate"),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N"),
    target_dtype: str = typer.Option("auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float32"),
    max_document_tokens: int = typer.Option(2048, min=1, help="--documents: each cut to its first this many "
                                                                "tokens (the prompt holds what the target read)"),
    request_openers: bool = typer.Option(True, help="--documents: start each request with an opener the target "
                                                    "completes ('Summarize', 'According to the text,', ...); "
                                                    "without one it mostly goes on writing the document"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Let the target write user prompts itself (Magpie): continuations of its chat template's user
    header, filtered (no end of turn, short, not text, template tokens, loops) and deduplicated
    (exact and near)."""
    from tqdm.auto import tqdm

    from eyas.data.prompts import (REQUEST_OPENERS, NearDuplicates, PromptFilter, cut_documents, make_prompts,
                                   read_documents)
    from eyas.data.regenerate import HFGenerator

    temps = _floats("--temperatures", temperatures)
    if not temps or any(t <= 0 for t in temps):
        _fail(f"--temperatures: expected numbers > 0 (a greedy draw gives one prompt), found {temperatures!r}")
    docs = _run(read_documents, documents) if documents is not None else ()
    rows = _rows(rows, batch_size, engine)
    loaded = _load(target, device, target_dtype, None)
    model, tokenizer = loaded.model, loaded.tokenizer
    docs = cut_documents(docs, tokenizer, max_document_tokens) if docs else ()
    generator = _generator(model, engine, rows, progress=False)
    if generator is not None and batch_size is not None and batch_size < rows:
        _fail(_rows_vs_batch(rows, batch_size))
    size = batch_size or (4 * rows if generator is not None else 64)
    if generator is None:
        generator = HFGenerator(model, tokenizer, cache, size)
    specials = [t for t in tokenizer.all_special_tokens if t]
    bar = None if json_out else tqdm(total=count, desc="prompts", unit="prompt", dynamic_ncols=True)

    def progress(written: int, asked: int) -> None:
        if bar is not None:
            bar.n = written
            bar.set_postfix(asked=asked, refresh=False)
            bar.refresh()

    try:
        result = _run(make_prompts, generator, tokenizer, out, count, temps, top_p=top_p, max_new_tokens=max_new_tokens,
                      batch_size=size, seed=seed, eos_ids=loaded.eos_ids, system_prompt=system_prompt,
                      source=str(loaded.name), filter_=PromptFilter(specials, near=NearDuplicates(near_threshold)),
                      documents=docs, openers=REQUEST_OPENERS if request_openers else (), on_batch=progress)
    finally:
        if bar is not None:
            bar.close()
    report = {"command": "prompts", "target": str(loaded.name), **result.to_dict(), "engine": generator.name,
              "batch_size": size}
    if json_out:
        _print_json(report)
    else:
        console.print(_table(f"prompts -> {result.out_path}", [
            ("written", f"{result.written} this run, {result.existing} already there"),
            ("per temperature", ", ".join(f"{t}: {n}" for t, n in result.per_temperature.items())),
            ("asked", f"{result.generated} continuations, {report['kept_share']:.0%} kept" if result.generated
             else "none"),
            ("rejected", ", ".join(f"{k} {v}" for k, v in result.rejected.items() if v) or "none"),
            *([("interrupted", "stopped early: rerun the same command to resume")] if result.interrupted else []),
        ]))
    if result.interrupted:
        raise typer.Exit(130)


def register(app: typer.Typer) -> None:
    """Add `prompts`, `regenerate`, `capture` and `import-hidden-states` to the eyas app."""
    app.command("prompts")(prompts_cmd)
    app.command("regenerate")(regenerate_cmd)
    app.command("capture")(capture_cmd)
    app.command("import-hidden-states")(import_hidden_states_cmd)
