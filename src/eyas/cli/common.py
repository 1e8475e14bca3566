"""What every `eyas` subcommand shares: consoles, JSON output, and turning eyas' own errors into a
clean one-line message with exit code 2 instead of a traceback."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import typer
from rich.console import Console

from eyas.errors import EyasError

console = Console()
err = Console(stderr=True)

TARGET_HELP = "'smollm2' (the embedded default), a local model directory, a .gguf file or a HF id"


def fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (EyasError, FileNotFoundError) as e:  # bad input: the message names file, field, expected, found
        fail(str(e))
