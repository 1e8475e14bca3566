"""What every `eyas` subcommand shares: consoles, JSON output, the engine choices (from the engine
registry), and turning eyas' own errors into a clean one-line message with exit code 2 instead of a
traceback."""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Any, Callable

import typer
from pydantic import ValidationError
from rich.console import Console

from eyas.errors import EyasError
from eyas.interop import servers  # the registry only: no torch

console = Console()
err = Console(stderr=True)

DRAFT_HELP = ("an eyas drafter directory; 'default' (or no --draft) with --target smollm2: the drafter shipped "
              "with eyas")
TARGET_HELP = "'smollm2' (the embedded default), a local model directory, a .gguf file or a HF id"
TARGET_DEVICES_HELP = ("split the target over several devices, replacing --device: cuda:0,cuda:1 (blocks in "
                       "contiguous runs; embedding on the first, final norm and lm_head on the last) | auto "
                       "(accelerate's device_map='auto') | a .json device map {module: device}")
DRAFT_DTYPE_HELP = ("the drafter's dtype: auto (bfloat16 on a CPU with native bf16, which halves the drafter's "
                    "cost; else the target's) | float32 | bfloat16 | float16. Lossless either way: the target "
                    "verifies in its own dtype")
TARGET_IMPL_HELP = ("auto (the fast Llama-family target where it applies: with CUDA graphs on a GPU, eager on "
                    "a CPU; else the Hugging Face one) | fast | hf")  # eyas generate / bench / trace --target-impl
MATVEC_HELP = ("the fast target's products on a GPU: auto (on a GPU with triton installed: triton-verify for a model "
               "of hidden size up to 1024 with split-kv attention, triton for larger ones; else gemm) | "
               "gemm (cuBLAS) | reduce | reduce-tuned (inductor's reductions, one-token steps) | triton (eyas's "
               "kernels with the norms, SiLU and residual adds in them, for the one-token steps of plain decoding: "
               "with --attention split-kv, 1.19x the bandwidth floor on an 8B-shaped Llama on an H200, against "
               "1.44x with gemm) | triton-verify (those kernels for tree verification and the drafter too: faster "
               "than cuBLAS on SmolLM2, slower on an 8B)")
ATTENTION_HELP = ("the fast target's attention: auto (= split-kv where --matvec auto picks the Triton kernels and "
                  "the head dimension is a power of two, else eager) | "
                  "eager | sdpa | split-kv (Triton kernels on the one-token steps of a GPU; with --matvec "
                  "triton-verify, on verification too)")


def _choice(name: str, values: list[str]) -> type[Enum]:
    return Enum(name, [(v, v) for v in values], type=str)  # type: ignore[return-value]


# Every choice comes from eyas.interop.servers: registering an engine (or an SGLang rule) adds it here.
EngineChoice = _choice("EngineChoice", servers.names())  # eyas doctor / trace --engine
ExportChoice = _choice("ExportChoice", [s.name for s in servers.SERVERS.values() if s.export_names])  # export --to
_SGLANG_RULES = list(servers.get("sglang").rules)
SGLangRuleChoice = _choice("SGLangRuleChoice", _SGLANG_RULES)
SGLANG_RULE_DEFAULT = SGLangRuleChoice(_SGLANG_RULES[0])
SGLANG_RULE_HELP = (f"the SGLang version's layer-id rule: {' | '.join(_SGLANG_RULES)} "
                    f"({_SGLANG_RULES[0]}, the current one, by default; legacy adds 1 to every id)")

_CONVENTIONS = list(servers.get("sglang").ids_conventions)
IdsConventionChoice = _choice("IdsConventionChoice", _CONVENTIONS)
IDS_CONVENTION_HELP = (f"what the nested SGLang ids of a directory eyas did not write mean: {' | '.join(_CONVENTIONS)} "
                       f"(specforge: output of block k = boundary k+1; sglang: as SGLang since PR #25454 reads "
                       f"them; sglang-legacy: +1 to every id). Without it, ids these read differently give "
                       f"boundaries marked ASSUMED")


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
    except ValidationError as e:  # a typed config's own checks (their messages name field, expected, found)
        fail("; ".join(str(x["msg"]).removeprefix("Value error, ") for x in e.errors()))
