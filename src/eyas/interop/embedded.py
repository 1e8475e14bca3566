"""The drafters that ship inside eyas, and what ``--draft`` means when it names none.

``--draft default`` (or no ``--draft`` at all) resolves to the drafter shipped for the target:
today one, for the embedded default target ``smollm2`` (SmolLM2-135M-Instruct), trained with
``benchmarks/train_smollm2_drafter.py`` (its README, next to the weights, has the commands and
figures). Its files are bf16 safetensors of at most 16 MiB each, without the embedding table
(the drafter reads the target's own), with the contract and metrics in ``eyas.json``.
"""

from __future__ import annotations

from pathlib import Path

from eyas.interop.common import EYAS_JSON, CheckpointError

DEFAULT = "default"
EMBEDDED_DIR = Path(__file__).parent / "embedded"
# --target value -> the folder under EMBEDDED_DIR holding its drafter
EMBEDDED_DRAFTERS: dict[str, str] = {"smollm2": "smollm2-135m-instruct"}


def embedded_drafter(target: str, option: str = "--draft") -> Path:
    """The shipped drafter's directory for ``target`` (an embedded target's name); ``option``: the
    flag that asked for it (``--draft``, ``eyas train --init-from``), which an error names."""
    name = EMBEDDED_DRAFTERS.get(target)
    if name is None:
        raise CheckpointError(
            f"{option} {DEFAULT}: eyas ships a drafter only for --target "
            f"{', '.join(sorted(EMBEDDED_DRAFTERS))}, found --target {target!r}; pass {option} DIR "
            f"(a drafter trained with `eyas train`, or an SGLang / speculators directory)")
    path = EMBEDDED_DIR / name
    if not (path / EYAS_JSON).exists():
        raise CheckpointError(f"{path}: expected the shipped drafter ({EYAS_JSON} and weights), found no {EYAS_JSON}; "
                              f"the package was installed without its data files: reinstall eyas")
    return path


def resolve_draft(draft: str | Path | None, target: str, option: str = "--draft") -> Path:
    """``--draft`` (or ``option``) as a directory: None or ``default`` -> the drafter shipped for ``target``."""
    if draft is None or str(draft) == DEFAULT:
        return embedded_drafter(target, option)
    return Path(draft)
