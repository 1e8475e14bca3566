"""A target split across several devices: ``--target-devices`` resolved and applied in one place.

    --target-devices cuda:0,cuda:1      the decoder blocks cut into contiguous, nearly equal runs, one
                                        per device in the order given; the embedding (and everything
                                        outside the blocks: rotary tables, ...) on the first device,
                                        the final norm and lm_head on the last (with the embedding
                                        when lm_head shares its weight: tied weights stay together)
    --target-devices map.json           an explicit device map: {"module.name": "cuda:1", ...}; every
                                        parameter must fall under one entry (checked, the error names
                                        the first block left unplaced)
    --target-devices auto               transformers/accelerate ``device_map="auto"`` at load time

The first two load the target on the CPU (host memory holds the weights once), then move each
module to its device and hook it so that its inputs follow it (:func:`place_model`). The model's
outputs, and those of its final norm and lm_head (which training also calls on stored boundary L),
come back to the device their input came from, so callers see a model that lives on its first
device. :class:`eyas.capture.BoundaryCapture` hooks the same blocks as on one device and moves
every captured boundary to the target's first device (the embedding's), so the captured values do
not depend on the split: a test splits a tiny random Llama over ``cpu,cpu`` (the same hooks and
moves, on one kind of device) and checks the captures bit for bit in float32 against the unsplit
model. The same check on two real GPUs is pending a machine with several GPUs.

Not supported with a split target: torchrun data parallelism (one process would need several
GPUs of its own) and the static KV cache of ``eyas regenerate`` (its ``auto`` cache is dynamic
there).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eyas.targets.placement import PlacementError
from eyas.targets.structure import find_decoder_blocks, find_embedding, find_final_norm

OPTION = "--target-devices"
AUTO = "auto"


@dataclass(frozen=True)
class TargetDevices:
    """``--target-devices`` parsed: ``auto``, or a device list, or an explicit device map."""

    text: str
    auto: bool = False
    devices: tuple[torch.device, ...] = ()  # explicit list, in order
    device_map: Mapping[str, torch.device] | None = None  # from a JSON file

    @property
    def first(self) -> torch.device | None:
        """The device of the embedding (None for ``auto``, known only once loaded)."""
        if self.devices:
            return self.devices[0]
        if self.device_map:
            return next(iter(self.device_map.values()))
        return None

    def plan(self, model: nn.Module) -> dict[str, torch.device]:
        """The device map this option gives ``model`` (not for ``auto``)."""
        if self.device_map is not None:
            check_device_map(model, self.device_map)
            return dict(self.device_map)
        return split_device_map(model, self.devices)


def _device(name: str, where: str) -> torch.device:
    """One device name -> a torch.device that exists on this machine; errors name the option."""
    text = name.strip().lower()
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise PlacementError(f"{OPTION}{where}: expected cpu or cuda:N, found {name!r}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise PlacementError(f"{OPTION}{where}: expected cpu or cuda:N, found {name!r}")
    if dev.index is None:
        raise PlacementError(f"{OPTION}{where}: expected an indexed GPU such as cuda:0, found {name!r}")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev.index >= available:
        raise PlacementError(f"{OPTION}{where}: {name!r} is not available: this machine has {available} CUDA "
                             f"device{'s' if available != 1 else ''}"
                             + (f" (cuda:0..cuda:{available - 1})" if available else ""))
    return dev


def parse_target_devices(text: str | None) -> TargetDevices | None:
    """``None``/empty -> None (the target on one device, ``--device``); ``auto``; a comma-separated
    device list (``cuda:0,cuda:1``); or a ``.json`` file holding ``{module name: device}``."""
    if text is None or not text.strip():
        return None
    t = text.strip()
    if t.lower() == AUTO:
        return TargetDevices(text=t, auto=True)
    if t.endswith(".json"):
        path = Path(t)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlacementError(f"{OPTION} {t}: no such file (expected a JSON device map)") from None
        except (OSError, json.JSONDecodeError) as e:
            raise PlacementError(f"{OPTION} {t}: expected a JSON object {{module name: device}}, found "
                                 f"unreadable JSON ({e})") from None
        if not isinstance(raw, dict) or not raw:
            raise PlacementError(f"{OPTION} {t}: expected a non-empty JSON object {{module name: device}}, "
                                 f"found {type(raw).__name__}")
        dmap = {str(k): _device(str(v), f" {t} entry {k!r}") for k, v in raw.items()}
        return TargetDevices(text=t, device_map=dmap)
    names = [x for x in t.split(",")]
    if any(not x.strip() for x in names):
        raise PlacementError(f"{OPTION}: expected auto, devices such as cuda:0,cuda:1 or a .json device map, "
                             f"found {text!r}")
    return TargetDevices(text=t, devices=tuple(_device(x, f" ({x.strip()!r})") for x in names))


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


def _tied(a: nn.Module, b: nn.Module) -> bool:
    wa, wb = getattr(a, "weight", None), getattr(b, "weight", None)
    return wa is not None and wa is wb


def split_device_map(model: nn.Module, devices: Sequence[torch.device]) -> dict[str, torch.device]:
    """``{"": first, <block i>: devices[i * D // L], <final norm>: last, <lm_head>: last}``: the
    whole model on the first device, then the blocks in D contiguous runs (sizes differ by at most
    one), the final norm and lm_head on the last (lm_head with the embedding when tied)."""
    if not devices:
        raise PlacementError(f"{OPTION}: expected at least one device, found none")
    blocks = find_decoder_blocks(model)
    if len(devices) > len(blocks):
        raise PlacementError(f"{OPTION}: {len(devices)} devices for a target of {len(blocks)} decoder blocks "
                             f"(expected at most one device per block)")
    names = _module_names(model)
    first, last = devices[0], devices[-1]
    dmap: dict[str, torch.device] = {"": first}
    for i, block in enumerate(blocks):
        dmap[names[id(block)]] = devices[i * len(devices) // len(blocks)]
    dmap[names[id(find_final_norm(model))]] = last
    head = model.get_output_embeddings()
    if head is not None:
        dmap[names[id(head)]] = first if _tied(head, find_embedding(model)) else last
    return dmap


def check_device_map(model: nn.Module, device_map: Mapping[str, Any]) -> None:
    """Every name must be a module of ``model`` and every parameter must fall under an entry;
    the error names the option, what is expected and what was found (the first block left
    unplaced, when one is)."""
    modules = dict(model.named_modules())
    unknown = [n for n in device_map if n not in modules]
    if unknown:
        raise PlacementError(f"{OPTION}: the device map names {unknown[:3]}, which are not modules of "
                             f"{type(model).__name__} (expected names such as {list(modules)[1:4]})")

    def placed(name: str) -> bool:
        return "" in device_map or any(name == k or name.startswith(k + ".") for k in device_map)

    names = _module_names(model)
    for i, block in enumerate(find_decoder_blocks(model)):
        for p, _ in block.named_parameters():
            if not placed(f"{names[id(block)]}.{p}"):
                raise PlacementError(f"{OPTION}: the device map leaves decoder block {i} ({names[id(block)]}) "
                                     f"unplaced (expected an entry for it or a module above it)")
    missing = [n for n, _ in model.named_parameters() if not placed(n)]
    if missing:
        raise PlacementError(f"{OPTION}: the device map leaves {len(missing)} parameters unplaced, first "
                             f"{missing[0]!r} (expected every parameter under an entry)")


def _move(obj: Any, device: torch.device) -> Any:
    """Tensors inside tuples, lists and dicts (ModelOutputs included) moved to ``device``; anything
    else (a KV cache, None, numbers) as it is."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_move(x, device) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(x, device) for x in obj)
    if isinstance(obj, dict):
        for k in list(obj.keys()):
            obj[k] = _move(obj[k], device)
        return obj
    return obj


def _first_device(args: tuple, kwargs: dict) -> torch.device | None:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.device
    return None


def _inputs_follow(device: torch.device):
    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _move(args, device), _move(kwargs, device)
    return hook


def _return_to_caller(module: nn.Module) -> list[Any]:
    """Hooks that send ``module``'s outputs back to the device of its first tensor input."""
    state: list[torch.device | None] = []

    def pre(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        state.append(_first_device(args, kwargs))

    def post(_mod: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> Any:
        dev = state.pop() if state else None
        return _move(out, dev) if dev is not None else out

    return [module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True),
            module.register_forward_hook(post, with_kwargs=True)]


def _owner(name: str, device_map: Mapping[str, torch.device]) -> torch.device:
    """The device of module ``name``: its own entry, else its nearest ancestor's, else (a module
    no entry covers: only buffers, check_device_map has placed every parameter) the first device."""
    while name not in device_map and name:
        name = name.rpartition(".")[0]
    return device_map[name] if name in device_map else next(iter(device_map.values()))


def place_model(model: nn.Module, device_map: Mapping[str, torch.device]) -> nn.Module:
    """Move each parameter and buffer straight to the device of its nearest entry in ``device_map``
    (never the whole model to one device first: a target split because it does not fit one GPU
    would not fit there either), hook every named module so that its inputs follow it, and make
    the model, its final norm and lm_head return their outputs on their caller's device. Returns
    ``model`` (placed in place); its ``hf_device_map`` records the map."""
    check_device_map(model, device_map)
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        dev = _owner(name, device_map)
        # this module's own parameters and buffers only; a tied weight stays one Parameter
        mod._apply(lambda t, dev=dev: t.to(dev), recurse=False)
    for name, dev in device_map.items():
        modules[name].register_forward_pre_hook(_inputs_follow(dev), with_kwargs=True)
    _return_to_caller(model)
    _return_to_caller(find_final_norm(model))
    head = model.get_output_embeddings()
    if head is not None:
        _return_to_caller(head)
    model.hf_device_map = {k: str(v) for k, v in device_map.items()}
    return model


def devices_of(model: nn.Module) -> list[torch.device]:
    """The distinct devices holding ``model``'s parameters, in order of first appearance."""
    seen: list[torch.device] = []
    for p in model.parameters():
        if p.device not in seen:
            seen.append(p.device)
    return seen
