"""Reading a shard directory: :class:`ShardDataset`, the samples of a finished capture (the layout
is in :mod:`eyas.data.shards`) for offline training, with its checks of the files and of the
contract against a live target.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

from eyas.contract import Contract, compare, enforce, tokenisation_of
from eyas.data.render import TEMPLATE_DEFAULT
from eyas.data.shard_format import MANIFEST, ShardError, read_shard_json
from eyas.targets.loaded import LoadedTarget


class ShardDataset(Dataset):
    """Samples of a shard directory. Item i ->

        id           str
        input_ids    LongTensor [T]
        loss_mask    LongTensor [T]           (not shifted; see eyas.data.render.shift_targets)
        slots        [T, num_slots, H]        stored dtype; or, with features=True,
        features     [T, num_slots * H]       slots concatenated in slot order (the drafter's fc input)
        last_hidden  [T, H]                   boundary L, pre-norm

    Opening checks every shard's presence, size and header (``verify="full"`` also its sha256).
    With ``target`` (and optionally ``tokenizer``) the manifest's contract is checked against it
    and a mismatch raises :class:`eyas.contract.ContractError` naming the fields (``force`` warns).
    """

    def __init__(self, root: str | os.PathLike, *, features: bool = False, target: Any = None,
                 tokenizer: Any = None, force: bool = False, verify: str = "header") -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ShardError(f"{self.root}: no such shard directory")
        mpath = self.root / MANIFEST
        if not mpath.exists():
            partial = sorted(p.name for p in self.root.glob("progress-r*.json"))
            hint = (f" (progress files {partial} exist: the capture is unfinished; rerun it, or call "
                    f"finalize_manifest once every rank is complete)") if partial else ""
            raise ShardError(f"{mpath}: missing manifest{hint}")
        self.manifest = read_shard_json(mpath, "manifest")
        try:
            self.contract = Contract.model_validate(self.manifest["contract"])
            self.shards: list[dict[str, Any]] = list(self.manifest["shards"])
            self.num_slots = int(self.manifest["layout"]["num_slots"])
            self.hidden_size = int(self.manifest["layout"]["hidden_size"])
            # Shards imported from a SpecForge dump (eyas.data.dumps) store the final norm's output.
            self.last_hidden_normed = bool(self.manifest["layout"].get("last_hidden_normed", False))
        except (KeyError, TypeError, ValueError) as e:
            raise ShardError(f"{mpath}: malformed manifest ({type(e).__name__}: {e})") from None
        self.features = features
        if verify not in ("none", "header", "full"):
            raise ValueError(f"verify: expected none|header|full, found {verify!r}")
        # Global index: sample i lives in shard _shard[i], rows _start[i]:_end[i].
        self._shard: list[int] = []
        self._start: list[int] = []
        self._end: list[int] = []
        self.ids: list[str] = []
        for k, entry in enumerate(self.shards):
            offsets = self._check_shard(entry, verify) if verify != "none" else None
            if offsets is None:
                offsets = self._read(k, "offsets")
            self._shard += [k] * entry["samples"]
            self._start += offsets[:-1].tolist()
            self._end += offsets[1:].tolist()
            self.ids += list(entry["ids"])
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()
        if target is not None:
            self.check_target(target, tokenizer, force=force)

    # -- checks -----------------------------------------------------------------------------------

    def _check_shard(self, entry: dict[str, Any], verify: str) -> Tensor:
        from safetensors import SafetensorError, safe_open

        path = self.root / entry["file"]
        if not path.exists():
            raise ShardError(f"{path}: shard listed in {self.root / MANIFEST} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ShardError(f"{path}: corrupt shard: {size} bytes, the manifest says {entry['bytes']} "
                             f"(truncated or overwritten); recapture it")
        if verify == "full":
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest != entry["sha256"]:
                raise ShardError(f"{path}: corrupt shard: sha256 {digest[:16]}..., the manifest says "
                                 f"{entry['sha256'][:16]}...; recapture it")
        n, s = entry["tokens"], entry["samples"]
        want = {"input_ids": [n], "loss_mask": [n], "offsets": [s + 1],
                "slots": [n, self.num_slots, self.hidden_size], "last_hidden": [n, self.hidden_size]}
        try:
            with safe_open(str(path), "pt") as f:
                shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
                bad = {k: (v, shapes.get(k)) for k, v in want.items() if shapes.get(k) != v}
                if bad:
                    raise ShardError(f"{path}: corrupt shard: tensor shapes {', '.join(f'{k} expected {a} found {b}' for k, (a, b) in bad.items())}")
                offsets = f.get_tensor("offsets")
        except SafetensorError as e:
            raise ShardError(f"{path}: corrupt shard: cannot read it as safetensors ({e})") from None
        if int(offsets[0]) != 0 or int(offsets[-1]) != n or bool((offsets[1:] < offsets[:-1]).any()):
            raise ShardError(f"{path}: corrupt shard: offsets do not cut {n} tokens into {s} samples")
        return offsets

    def check_target(self, target: LoadedTarget | Any, tokenizer: Any = None, force: bool = False) -> list:
        """Compare the manifest's contract with a live target (a LoadedTarget, whose cached identity
        is used, or an HF model) and tokenizer: raises ContractError naming every differing field
        (target.fingerprint, tokenisation.chat_template_sha256, ...)."""
        live = Contract(
            target=LoadedTarget.of(target).identity,
            capture=self.contract.capture,
            tokenisation=(tokenisation_of(tokenizer, self.contract.tokenisation.system_prompt
                                          if self.contract.tokenisation else TEMPLATE_DEFAULT)
                          if tokenizer is not None else None),
        )
        return enforce(compare(self.contract, live), f"shards {self.root} vs target", force=force)

    # -- reading ----------------------------------------------------------------------------------

    def _handle(self, k: int) -> Any:
        from safetensors import SafetensorError, safe_open

        if self._pid != os.getpid():  # a DataLoader worker forked after open: use its own handles
            self._handles, self._pid = {}, os.getpid()
        if k not in self._handles:
            path = self.root / self.shards[k]["file"]
            try:
                self._handles[k] = safe_open(str(path), "pt")
            except (SafetensorError, OSError) as e:
                raise ShardError(f"{path}: cannot open shard ({e})") from None
        return self._handles[k]

    def _read(self, k: int, key: str, a: int | None = None, b: int | None = None) -> Tensor:
        from safetensors import SafetensorError

        try:
            h = self._handle(k)
            return h.get_tensor(key) if a is None else h.get_slice(key)[a:b]
        except SafetensorError as e:
            raise ShardError(f"{self.root / self.shards[k]['file']}: cannot read {key!r} ({e})") from None

    def __len__(self) -> int:
        return len(self._shard)

    @property
    def lengths(self) -> list[int]:
        """Tokens per sample (for length-grouped batching)."""
        return [e - s for s, e in zip(self._start, self._end)]

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["counts"]["tokens"])

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        k, a, b = self._shard[i], self._start[i], self._end[i]
        item: dict[str, Any] = {
            "id": self.ids[i],
            "input_ids": self._read(k, "input_ids", a, b).long(),
            "loss_mask": self._read(k, "loss_mask", a, b).long(),
            "last_hidden": self._read(k, "last_hidden", a, b),
        }
        slots = self._read(k, "slots", a, b)  # [T, num_slots, H]
        if self.features:
            item["features"] = slots.reshape(slots.shape[0], -1)  # [T, num_slots * H], slot order
        else:
            item["slots"] = slots
        return item
