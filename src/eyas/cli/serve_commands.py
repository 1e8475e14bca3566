"""`eyas serve` (an OpenAI-compatible server that refuses a mismatched pair) and `eyas watch` (the
acceptance of a running SGLang / vLLM / eyas server against the drafter's training prediction).

    eyas serve --target smollm2 [--draft default] [--host 127.0.0.1] [--port 8000] [--tree 5] [--force]
               [--max-rows 64] [--speculation auto|on|off] [--batch-speculation off|auto|on] [--in-process]
    eyas watch --metrics http://127.0.0.1:8000/metrics --draft runs/d-vllm [--every 30] [--json]

Exit codes: serve 1 when the start-up checks refuse the pair, 2 for unusable input; watch 0 when
the (last) verdict is not "broken", 1 when it is, 2 for unusable input.
"""

from __future__ import annotations

import logging
import signal
from typing import Optional

import typer

from eyas.cli.common import ATTENTION_HELP, DRAFT_HELP, MATVEC_HELP, TARGET_HELP, TARGET_IMPL_HELP, console, err
from eyas.cli.common import print_json as _print_json
from eyas.cli.common import run as _run


def serve_cmd(
    target: str = typer.Option(..., help=TARGET_HELP),
    draft: Optional[str] = typer.Option(None, help=DRAFT_HELP),
    host: str = typer.Option("127.0.0.1", help="the address to listen on"),
    port: int = typer.Option(8000, min=0, max=65535),
    tree: str = typer.Option("5", help="DEPTH,TOPK,TOTAL (EAGLE-2 dynamic tree, e.g. 6,4,24), DEPTH for a chain, or "
                                        "'auto' (timed on this hardware, calibrated at temperatures 0 and 1, as eyas bench)"),
    tree_sampled: Optional[str] = typer.Option(None, help="the tree of requests at a temperature above 0 (DEPTH,TOPK,"
                                                          "TOTAL or DEPTH; default: --tree's)"),
    force: bool = typer.Option(False, help="start even when the start-up checks fail (/health and /metrics say so)"),
    device: str = typer.Option("auto"),
    target_impl: str = typer.Option("auto", help=TARGET_IMPL_HELP),
    matvec: str = typer.Option("auto", help=MATVEC_HELP),
    attention: str = typer.Option("auto", help=ATTENTION_HELP),
    served_model_name: Optional[str] = typer.Option(None, help="the model id clients send (default: --target)"),
    max_tokens: int = typer.Option(256, min=1, help="new tokens when a request does not say (capped by the context)"),
    max_body_bytes: int = typer.Option(1 << 20, min=1024, help="larger request bodies get 413"),
    max_queue: int = typer.Option(256, min=1, help="requests waiting beyond this get 503 with Retry-After"),
    max_rows: Optional[int] = typer.Option(None, min=1, help="requests decoding at once in the running batch (default: 64 "
                                                             "on a GPU, 8 on a CPU; 1: one at a time, in arrival order)"),
    speculation: str = typer.Option("auto", help="a request alone (nothing else running or waiting): auto (speculative "
                                                 "where measured faster than a plain row, per greedy and sampled "
                                                 "requests), on (always speculative), off (never)"),
    batch_speculation: Optional[str] = typer.Option(None, help="several rows decoding: off (plain steps; measured "
                                                              "faster on the H100), auto (the depth of a batch's "
                                                              "speculative rounds measured per batch size), on "
                                                              "(default: on with --speculation on, else off)"),
    lone_sessions: int = typer.Option(1, min=1, help="requests that may decode speculatively alone side by side, each on "
                                                     "a twin of the target with a CUDA stream of its own (more in "
                                                     "flight: they all share the running batch)"),
    watch_window: int = typer.Option(512, min=1, help="the watchdog's sliding window, in speculative rounds"),
    watch_min_rounds: int = typer.Option(64, min=1, help="rounds in the window before the watchdog judges"),
    graceful_timeout: float = typer.Option(60.0, help="seconds in-flight requests get to finish at shutdown"),
    engine_process: bool = typer.Option(True, "--engine-process/--in-process",
                                        help="decode in a process of its own (default), so that the engine's steps "
                                             "never wait for the HTTP side's interpreter lock; --in-process: one process"),
) -> None:
    """Serve TARGET with its drafter through the OpenAI API (chat and completions, streaming or not)."""
    import threading

    from eyas.cli.common import fail
    from eyas.serve.load_args import LoadArgs
    from eyas.serve.policy import batch_mode

    try:  # before the port opens or a process starts
        batch_mode(speculation, batch_speculation)
    except ValueError as e:
        fail(f"--{str(e).replace('_', '-')}")
    args = LoadArgs(target, draft, tree=tree, tree_sampled=tree_sampled, force=force, device=device,
                    target_impl=target_impl, matvec=matvec, attention=attention, model_name=served_model_name)
    engine = None
    if engine_process:  # started first: its imports and loading overlap this process's imports
        from eyas.serve.engine_process import EngineOptions, EngineProcess

        engine = EngineProcess(args, EngineOptions(max_rows, speculation, batch_speculation, lone_sessions),
                               max_queue=max_queue)
    from eyas.serve import RefusedError, ServeOptions, ServeState, make_loading_server, serve_forever
    from eyas.serve.server import engine_state

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    options = ServeOptions(max_body_bytes=max_body_bytes, max_queue=max_queue, default_max_tokens=max_tokens,
                           watch_window=watch_window, watch_min_rounds=watch_min_rounds, max_rows=max_rows,
                           speculation=speculation, batch_speculation=batch_speculation, lone_sessions=lone_sessions)
    # The port opens first and answers "loading" (503, /health says which step) until the pair is
    # loaded, checked and warmed; a refused pair closes it again.
    server, loading = make_loading_server(host, port, graceful_timeout=graceful_timeout)
    failure: list[BaseException] = []

    def log(m: str) -> None:
        loading.step = m
        err.print(f"[dim]serve: {m}[/]", highlight=False)

    def load() -> None:
        try:
            state = engine_state(engine, options, log) if engine is not None else ServeState(args.load(log), options)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread once the port is closed
            failure.append(e)
            server.should_exit = True
            return
        served = state.served
        pf = served.preflight
        if pf.forced:
            err.print(f"[bold yellow]--force: serving despite {len(pf.failures)} failed check(s)[/] "
                      "(reported in /health and eyas_preflight_forced in /metrics):", highlight=False)
            for p in pf.failures:
                err.print(f"  {p}", highlight=False, markup=False)
        for p in pf.warnings:
            err.print(f"[yellow]warning:[/] {p.message}", highlight=False)
        server.ready(state)
        t, up = served.tree, served.startup
        err.print(f"eyas serve: {served.model_name} on http://{host}:{port}/v1 (tree {t.greedy.label}, sampled "
                  f"{t.sampled.label}, target {served.implementation}, drafter {served.draft_path}, "
                  f"{state.worker.max_rows} rows, {lone_sessions} lone session(s), speculation {speculation}, batches "
                  f"{batch_mode(speculation, batch_speculation)}, "
                  f"{'an engine process' if engine_process else 'in process'}); ready in {up.total_s:.1f} s "
                  f"({'warm' if up.warm_cache else 'cold'} compile cache {up.compile_cache})", highlight=False)

    threading.Thread(target=load, name="eyas-load", daemon=True).start()
    # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: with the
    # default one the process would die of it (exit -15) after an orderly drain. A drain is the
    # orderly end of a server, so it exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    serve_forever(server)
    if failure:
        e = failure[0]
        if isinstance(e, RefusedError):
            err.print(str(e), highlight=False, markup=False)
            raise typer.Exit(1) from None

        def reraise() -> None:
            raise e
        _run(reraise)  # eyas' own errors: their message, exit code 2
        raise e


def watch_cmd(
    metrics: str = typer.Option(..., help="the engine's metrics: an http(s) URL, a file:// URL or a file"),
    draft: Optional[str] = typer.Option(None, help="the drafter directory the engine serves (its eyas.json holds the "
                                                   "training prediction); 'default': the one shipped for smollm2"),
    target: Optional[str] = typer.Option(None, help="the target, for the doctor command printed (default: eyas.json's)"),
    engine: Optional[str] = typer.Option(None, help="vllm | sglang | eyas (default: whichever metrics are there)"),
    depth: Optional[int] = typer.Option(None, min=1, help="drafts per round served (SGLang: --speculative-num-steps); "
                                                          "default: vLLM's positions, else every trained one"),
    every: Optional[float] = typer.Option(None, min=0.1, help="check every N seconds (default: once)"),
    count: Optional[int] = typer.Option(None, min=1, help="with --every: stop after this many checks"),
    min_rounds: int = typer.Option(64, min=1, help="rounds needed for a verdict"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Compare a running SGLang or vLLM server's speculative acceptance with the drafter's training prediction."""
    from eyas.watch import Watcher

    w = _run(Watcher, metrics, draft, target=target, engine=engine, depth=depth, min_rounds=min_rounds)
    from eyas.cli.common import fail
    from eyas.errors import EyasError

    last = None
    checks = w.checks(every, count)
    while True:
        try:
            check = next(checks)
        except StopIteration:
            break
        except EyasError as e:  # a scrape that failed mid-watch
            fail(str(e))
        last = check
        v = check.verdict
        if json_out:
            _print_json(check.to_dict())
        else:
            style = {"ok": "green", "low": "yellow", "broken": "bold red"}.get(v.status, "dim")
            console.print(f"[{style}]{v.status.upper()}[/] {check.engine} ({check.window}): {v.message}",
                          highlight=False, soft_wrap=True)  # one line per check: grep- and log-friendly
            if v.alert:
                console.print(f"run: {v.doctor_command}", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(1 if last is not None and last.verdict.alert else 0)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_cmd)
    app.command("watch")(watch_cmd)
