"""What every checkpoint format shares: file names, atomic writes, safetensors-only reading, and
the mapping between :class:`DrafterConfig` and the Llama fields of an engine's ``config.json``.

Nothing here knows about layer ids; that is each format module's job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Iterable

from pydantic import ValidationError

from eyas.io import atomic_write, atomic_write_text, read_json_object
from eyas.drafter.config import DrafterConfig
from eyas.errors import EyasError

if TYPE_CHECKING:  # torch and safetensors load when tensors are read or written: the engine specs
    import torch  # (and the CLI's choices built from them) import this module without them
    from torch import Tensor

CONFIG_JSON = "config.json"
EYAS_JSON = "eyas.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


class CheckpointError(EyasError, ValueError):
    """A drafter directory that cannot be read or written: missing, corrupt or inconsistent files.

    The message always names the file, and where it applies the field or tensor, the expected
    value and the value found.
    """


# ---------------------------------------------------------------------------------------------
# Writing: every file goes to a temporary name in its final directory, then os.replace, so a
# reader (or an engine started meanwhile) never sees half a file.
# ---------------------------------------------------------------------------------------------


def save_file(tensors: dict[str, Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """safetensors' writer, imported on first use (it imports torch)."""
    from safetensors.torch import save_file as write

    write(tensors, path, metadata=metadata)


def atomic_save_tensors(path: Path, tensors: dict[str, Tensor]) -> None:
    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(flat, tmp, metadata={"format": "pt"}))


SHARD_PATTERN = "model-{i:05d}-of-{n:05d}.safetensors"
SPLIT_KEY = "eyas_split_by_rows"  # index metadata: tensor name -> the names of its row blocks, in order


def _own_shard(name: str) -> bool:
    """A shard name :func:`atomic_save_sharded` writes (model-00001-of-00003.safetensors)."""
    parts = name.removesuffix(".safetensors").split("-")
    return (name.endswith(".safetensors") and len(parts) == 4 and parts[0] == "model" and parts[2] == "of"
            and parts[1].isdigit() and parts[3].isdigit())


def atomic_save_sharded(out: Path, tensors: dict[str, Tensor], max_file_bytes: int | None) -> list[str]:
    """Write ``tensors`` into ``out`` as ``model.safetensors``, or, when they exceed
    ``max_file_bytes`` (minus room for headers), as shards of at most that size plus
    ``model.safetensors.index.json`` (the Hugging Face layout every engine reads). Each file is
    written atomically; the index last, so a reader never follows it to a missing shard. The
    other layout's files left by an earlier save in ``out`` are removed afterwards. -> the files."""
    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    size = {k: v.numel() * v.element_size() for k, v in flat.items()}
    limit = None if max_file_bytes is None else max_file_bytes - 65536  # room for the JSON header
    if limit is None or sum(size.values()) <= limit:
        atomic_save_tensors(out / WEIGHTS, flat)
        for p in out.iterdir():
            if _own_shard(p.name) or p.name == WEIGHTS_INDEX:
                p.unlink()
        return [WEIGHTS]
    # A tensor larger than a file (a float32 lm_head over a large draft vocabulary) is cut into
    # blocks of rows, stored as NAME.rows0, NAME.rows1, ... and listed under the index's metadata;
    # read_tensors joins them back (torch.cat over dim 0, bit for bit). Only eyas reads such a
    # directory: engines get bf16 exports, where no tensor of a drafter this size needs cutting.
    split: dict[str, list[str]] = {}
    for k in sorted(k for k, b in size.items() if b > limit):
        t = flat.pop(k)
        row_bytes = max(1, t[0].numel() * t.element_size()) if t.dim() else size[k]
        rows = max(1, limit // row_bytes)
        if t.dim() == 0 or row_bytes > limit:
            raise CheckpointError(f"{out}: tensor {k!r} has rows of {row_bytes} bytes, more than the "
                                  f"{max_file_bytes} bytes a file may hold; expected it to split by rows")
        split[k] = []
        for j, a in enumerate(range(0, t.shape[0], rows)):
            name = f"{k}.rows{j}"
            flat[name] = t[a : a + rows].clone()
            size[name] = flat[name].numel() * flat[name].element_size()
            split[k].append(name)
        del size[k]
    shards: list[dict[str, Tensor]] = [{}]
    used = 0
    for k in sorted(flat, key=lambda k: (-size[k], k)):  # largest first: fewer, fuller files
        if used + size[k] > limit and shards[-1]:
            shards.append({})
            used = 0
        shards[-1][k] = flat[k]
        used += size[k]
    names = [SHARD_PATTERN.format(i=i + 1, n=len(shards)) for i in range(len(shards))]
    for name, shard in zip(names, shards):
        atomic_write(out / name, lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"}))
    metadata: dict[str, Any] = {"total_size": sum(size.values())}
    if split:
        metadata[SPLIT_KEY] = split
    index = {"metadata": metadata, "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
    atomic_write_text(out / WEIGHTS_INDEX, json.dumps(index, indent=2))
    for p in out.iterdir():
        if p.name == WEIGHTS or (_own_shard(p.name) and p.name not in names):
            p.unlink()
    return [*names, WEIGHTS_INDEX]


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir``; refuse one that holds weight files other than the ones we overwrite
    (``model.safetensors``, or the shards and index of an earlier eyas save in the same directory).

    Engines load every ``*.safetensors`` of a directory (vLLM) or follow an index file: a stale
    shard next to our ``model.safetensors`` would be loaded too, silently.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: expected a directory to write the drafter to, found a file")
    out.mkdir(parents=True, exist_ok=True)
    ours = (out / EYAS_JSON).exists()  # an earlier eyas save: its shards are replaced, not stale
    stale = sorted(
        p.name
        for p in out.iterdir()
        if p.name != WEIGHTS and not (ours and (p.name == WEIGHTS_INDEX or _own_shard(p.name)))
        and (p.suffix in (".safetensors", ".bin", ".pt", ".pth") or p.name.endswith(".index.json"))
    )
    if stale:
        raise CheckpointError(
            f"{out}: expected no weight files besides {WEIGHTS} (an engine would load them too), "
            f"found {stale}; write to an empty directory or remove them"
        )
    return out


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, CheckpointError)


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({e}); the file is corrupt or truncated "
            f"(an interrupted copy or download?)"
        ) from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e


def pickle_only_error(directory: Path) -> str | None:
    """The message for a directory whose weights exist only as pickles, else None."""
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if not pickles or any(directory.glob("*.safetensors")):
        return None
    return (
        f"{directory}: expected {WEIGHTS}, found only {pickles} (pickle). eyas reads safetensors "
        f"only and never unpickles a checkpoint (a pickle can run code). Convert it once, in an "
        f"environment you trust: python -c \"import torch; from safetensors.torch import save_file; "
        f"save_file(torch.load('{pickles[0]}', weights_only=True), '{WEIGHTS}')\""
    )


def read_tensors(directory: Path) -> tuple[dict[str, Tensor], str]:
    """All tensors of a directory and a label naming the file(s) they came from.

    Safetensors only: a pickled ``pytorch_model.bin`` can run arbitrary code when loaded, so it is
    never opened here.
    """
    single, index = directory / WEIGHTS, directory / WEIGHTS_INDEX
    if single.exists():
        return _load_safetensors(single), str(single)
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: expected a non-empty 'weight_map' object, found {weight_map!r}")
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = directory / shard
            if not shard_path.exists():
                raise CheckpointError(f"{index}: names shard {shard}, which is missing from {directory}")
            tensors.update(_load_safetensors(shard_path))
        metadata = read_json(index).get("metadata") or {}
        for name, parts in (metadata.get(SPLIT_KEY) or {}).items():
            missing = [p for p in parts if p not in tensors]
            if missing:
                raise CheckpointError(f"{index}: tensor {name!r} is split into {parts}; blocks {missing} are missing")
            import torch

            tensors[name] = torch.cat([tensors.pop(p) for p in parts], dim=0)
        return tensors, str(index)
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    if len(others) == 1:
        return _load_safetensors(directory / others[0]), str(directory / others[0])
    pickle_only = pickle_only_error(directory)
    if pickle_only:
        raise CheckpointError(pickle_only)
    raise CheckpointError(
        f"{directory}: expected {WEIGHTS} (or {WEIGHTS_INDEX} with shards), found "
        f"{others or 'no weight file'}"
    )


def check_tensors(
    tensors: dict[str, Tensor],
    expected: dict[str, torch.Size],
    optional: Iterable[str],
    where: str,
    file_name: Callable[[str], str] = lambda n: n,
) -> None:
    """Fail naming every missing, unexpected or mis-shaped tensor, by its name in the file."""
    show = file_name
    optional = set(optional)
    missing = sorted(show(n) for n in expected if n not in tensors and n not in optional)
    extra = sorted(show(n) for n in tensors if n not in expected)
    shapes = [
        f"{show(n)}: expected shape {tuple(expected[n])}, found {tuple(t.shape)}"
        for n, t in sorted(tensors.items())
        if n in expected and tuple(t.shape) != tuple(expected[n])
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    problems += shapes
    if problems:
        raise CheckpointError(
            f"{where}: the tensors do not match the drafter described by the config:\n  - "
            + "\n  - ".join(problems)
        )


# ---------------------------------------------------------------------------------------------
# DrafterConfig <-> the Llama fields of config.json (SGLang config / speculators transformer_layer_config)
# ---------------------------------------------------------------------------------------------


def llama_fields(cfg: DrafterConfig, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The Llama decoder-layer fields an engine needs to build the midlayer."""
    out: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "vocab_size": cfg.vocab_size,  # the target's vocabulary (embedding, t2d)
        "tie_word_embeddings": False,
    }
    if dtype is not None:
        out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def drafter_fields(llama: dict[str, Any], where: str) -> dict[str, Any]:
    """DrafterConfig fields (without the target-side ones: target_hidden_size, num_slots,
    draft_vocab_size, norm flags) from the Llama fields of a config.json."""
    missing = [k for k in _REQUIRED if llama.get(k) is None]
    if missing:
        raise CheckpointError(f"{where}: expected the Llama fields {list(_REQUIRED)}, missing {missing}")
    model_type = llama.get("model_type", "llama")
    if model_type != "llama":
        raise CheckpointError(
            f"{where}: model_type: expected 'llama' (eyas drafters have a Llama midlayer), found {model_type!r}"
        )
    layers = llama.get("num_hidden_layers", 1)
    if layers != 1:
        raise CheckpointError(
            f"{where}: num_hidden_layers: expected 1 (one EAGLE-3 midlayer), found {layers}"
        )
    if llama.get("tie_word_embeddings"):
        raise CheckpointError(
            f"{where}: tie_word_embeddings: expected false (eyas drafters have their own lm_head over "
            f"the draft vocabulary), found true"
        )
    # Reuse DrafterConfig.for_target for the rope_theta / rope_scaling / rope_parameters logic.
    ns = SimpleNamespace(**{k: v for k, v in llama.items() if v is not None})
    try:
        derived = DrafterConfig.for_target(ns, num_slots=1).model_dump()
    except ValidationError as e:
        raise CheckpointError(f"{where}: not a valid drafter config ({e})") from None
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_theta", "rope_scaling", "vocab_size")
    out = {k: derived[k] for k in keep}
    out["attention_bias"] = bool(llama.get("attention_bias", False))
    out["mlp_bias"] = bool(llama.get("mlp_bias", False))
    return out


def tensors_dtype(tensors: dict[str, Tensor]) -> torch.dtype | None:
    """The floating dtype of the weights (what ``torch_dtype`` in config.json should say)."""
    for name in ("fc.weight", "lm_head.weight"):
        if name in tensors:
            return tensors[name].dtype
    return None


def default_boundaries_or_none(num_blocks: int | None, where: str, missing: str) -> tuple[list[int] | None, str]:
    """A config without layer ids: engines fall back to the EAGLE-3 default [2, L//2, L-3], which
    needs the target's block count L (None, with the reason, when it is unknown)."""
    from eyas.convention.boundaries import default_boundaries

    if num_blocks is None:
        return None, (f"{where} has no {missing}, so the drafter uses the EAGLE-3 default boundaries "
                      f"[2, L//2, L-3], which depend on the target's number of decoder blocks L")
    return default_boundaries(num_blocks), f"the EAGLE-3 default for {num_blocks} blocks (no ids)"


def default_assumed(where: str, missing: str) -> str:
    """Why boundaries taken from the EAGLE-3 default are an assumption: the engines capture the
    default when a config has no ids, but nothing in the directory says the drafter was trained on it
    (a converter that drops the ids writes exactly such a directory)."""
    return (f"{where} records no {missing}: the engines capture the EAGLE-3 default, and nothing in the directory "
            f"says the drafter was trained on it")
