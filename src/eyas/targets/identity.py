"""A target's identity: what a dataset or drafter records about the model it was made for, so that
meeting another model (another architecture, depth, width, vocabulary, or another checkpoint of the
same shape) is caught. The contract (:mod:`eyas.contract`) stores it under ``target``.

Two hashes of the weights are kept:

- ``fingerprint`` (:func:`weights_fingerprint`): sampled embedding rows and the final norm. Every
  eyas.json has it; a mismatch means another checkpoint.
- ``weights`` (:func:`weights_sample`, optional: eyas.json files written before it lack it): one hash
  per part of the model (the embedding, each decoder block, the final norm, the lm_head, anything
  else), each over a strided sample of every tensor in the part. It names what changed when the
  embedding did not, e.g. a merged LoRA or a fine-tune that froze the embeddings:
  :func:`changed_parts` and :func:`describe_changes` say "blocks 20 to 22 differ".

A changed ``fingerprint`` alone does not make another model: a fine-tune that touched the embedding
or the final norm changes it too. :func:`modified_copy` tells the two apart with the per-part
record: the same model, modified, when the shapes agree and at most ``MAX_CHANGED_FRACTION`` of
its parts (embedding, each block, final norm, lm_head, the rest) differ; another model when more
do, or when either side has no per-part record (then the fingerprint is all there is).
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from eyas.targets.structure import find_decoder_blocks, find_embedding, find_final_norm, text_config

# Names and version of the sampling in :func:`weights_sample`; samples taken another way are not compared.
SAMPLE_METHOD = "strided-bf16-v1"
SAMPLE_VALUES = 256  # values read per tensor


class WeightsSample(BaseModel):
    """Per-part hashes of a strided sample of every parameter (16 hex digits each)."""

    model_config = ConfigDict(extra="forbid")

    method: str = SAMPLE_METHOD
    embedding: str
    blocks: list[str]  # one per decoder block, in order
    final_norm: str
    lm_head: str | None = None  # None when the model has no separate output embedding
    other: str | None = None  # parameters outside the parts above (None when there are none)


class TargetIdentity(BaseModel):
    model_config = ConfigDict(extra="forbid")

    architecture: str
    model_type: str
    num_blocks: int
    hidden_size: int
    vocab_size: int
    # sha256 over bf16-rounded sampled embedding rows + the final norm weight: catches another
    # checkpoint of the same shape, and is equal for fp32 and bf16 loads of the same weights.
    fingerprint: str
    source: str | None = None  # where it was loaded from; informational, never compared
    # Per-part hashes of every tensor (names changed blocks); absent in eyas.json files written before it.
    weights: WeightsSample | None = None


def weights_fingerprint(model: nn.Module, max_rows: int = 1024) -> str:
    """16 hex digits of sha256 over up to ``max_rows`` evenly spaced embedding rows and the final
    norm's weight, each rounded to bf16 first (so an fp32 and a bf16 load of the same checkpoint
    agree, and the hash costs O(max_rows * H), not O(V * H))."""
    emb = find_embedding(model).weight.detach()
    rows = torch.linspace(0, emb.shape[0] - 1, min(max_rows, emb.shape[0])).round().long()
    h = hashlib.sha256()
    for t in (emb[rows.to(emb.device)], find_final_norm(model).weight.detach()):
        h.update(t.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _strided(t: torch.Tensor, n: int) -> torch.Tensor:
    """Up to ``n`` evenly spaced values of ``t`` (flat order), rounded to bf16 and read as int16
    bits: the same indices and the same bits for an fp32 and a bf16 load of the same weights.
    Indexes without flattening, so a non-contiguous tensor is not copied."""
    numel = t.numel()
    if numel == 0:
        return torch.zeros(0, dtype=torch.int16)
    flat = torch.linspace(0, numel - 1, min(n, numel), dtype=torch.float64).round().long()
    idx = torch.unravel_index(flat, t.shape) if t.dim() > 1 else (flat,)
    vals = t[tuple(i.to(t.device) for i in idx)] if t.dim() > 0 else t.reshape(1)
    return vals.to(torch.bfloat16).view(torch.int16)


def _part_hash(params: Iterable[tuple[str, torch.Tensor]], n: int) -> str:
    """16 hex digits of sha256 over each tensor's name, shape and strided sample, in name order.
    The samples leave the device in one transfer; a tensor on the meta device (not loaded)
    contributes its name and shape only."""
    items = sorted(((name, t.detach()) for name, t in params), key=lambda nt: nt[0])
    samples = [_strided(t, n) for _, t in items if not t.is_meta]
    if samples:
        dev = samples[0].device
        host = iter(torch.cat([s.to(dev) for s in samples]).cpu().split([s.numel() for s in samples]))
    h = hashlib.sha256()
    for name, t in items:
        h.update(f"{name}:{tuple(t.shape)};".encode())
        if not t.is_meta:
            h.update(next(host).numpy().tobytes())
    return h.hexdigest()[:16]


def weights_sample(model: nn.Module, values_per_tensor: int = SAMPLE_VALUES) -> WeightsSample:
    """Hash ``values_per_tensor`` evenly spaced values of every parameter, one hash per part: the
    embedding, each decoder block, the final norm, the lm_head (when it is its own module) and the
    rest. Reads O(tensors x values_per_tensor) values and moves them off the device once per part,
    so it costs milliseconds even for a large target; deterministic, and equal for fp32 and bf16
    loads of the same checkpoint (values rounded to bf16)."""
    n = values_per_tensor
    emb_mod, norm_mod = find_embedding(model), find_final_norm(model)
    head_mod = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    blocks = find_decoder_blocks(model)
    seen: set[int] = set()

    def part(mod: nn.Module) -> str:
        params = list(mod.named_parameters(remove_duplicate=False))
        seen.update(id(p) for _, p in params)
        return _part_hash(params, n)

    embedding = part(emb_mod)
    block_hashes = [part(b) for b in blocks]
    final_norm = part(norm_mod)
    lm_head = part(head_mod) if isinstance(head_mod, nn.Module) and head_mod is not emb_mod else None
    rest = [(name, p) for name, p in model.named_parameters() if id(p) not in seen]
    return WeightsSample(embedding=embedding, blocks=block_hashes, final_norm=final_norm, lm_head=lm_head,
                         other=_part_hash(rest, n) if rest else None)


def target_identity(model: nn.Module, source: str | None = None) -> TargetIdentity:
    """The identity of a loaded HF causal LM. ``vocab_size`` is the embedding's rows (what the
    drafter's ``embed_tokens`` and ``t2d`` must match), not the config's."""
    cfg = text_config(model)
    archs = getattr(model.config, "architectures", None) or [type(model).__name__]
    return TargetIdentity(
        architecture=archs[0],
        model_type=cfg.model_type,
        num_blocks=len(find_decoder_blocks(model)),
        hidden_size=cfg.hidden_size,
        vocab_size=find_embedding(model).weight.shape[0],
        fingerprint=weights_fingerprint(model),
        source=source,
        weights=weights_sample(model),
    )


def _ranges(indices: list[int]) -> list[str]:
    """Contiguous runs named: [2] -> "block 2", [20, 21, 22] -> "blocks 20 to 22", [3, 4] -> "blocks 3 and 4"."""
    out: list[str] = []
    start = prev = None
    for i in [*indices, None]:
        if start is not None and (i is None or i != prev + 1):
            out.append(f"block {start}" if start == prev else
                       f"blocks {start} and {prev}" if prev == start + 1 else f"blocks {start} to {prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return out


def changed_parts(expected: TargetIdentity, found: TargetIdentity) -> list[str] | None:
    """The parts whose sampled weights differ, named and ordered as in the model ("the embedding",
    "blocks 20 to 22", "the final norm", "the lm_head", "other weights"); empty when every part
    agrees. None when it cannot be told: either side has no per-part record (an eyas.json written
    before it), they were sampled another way, or the block counts differ."""
    a, b = expected.weights, found.weights
    if a is None or b is None or a.method != b.method or len(a.blocks) != len(b.blocks):
        return None
    out = ["the embedding"] if a.embedding != b.embedding else []
    out += _ranges([i for i, (x, y) in enumerate(zip(a.blocks, b.blocks)) if x != y])
    out += ["the final norm"] if a.final_norm != b.final_norm else []
    out += ["the lm_head"] if a.lm_head != b.lm_head else []
    out += ["other weights"] if a.other != b.other else []
    return out


# At most this fraction of the parts may differ for a target to count as the recorded one, modified
# (a merged LoRA, a fine-tune of some blocks, a retouched embedding or final norm); beyond it (another
# seed, a full fine-tune, another model of the same shape) it is another checkpoint.
MAX_CHANGED_FRACTION = 0.5


def changed_count(expected: TargetIdentity, found: TargetIdentity) -> tuple[int, int] | None:
    """(parts whose sampled weights differ, parts in all), each block one part; None when the
    per-part records cannot be compared (see :func:`changed_parts`)."""
    a, b = expected.weights, found.weights
    if a is None or b is None or a.method != b.method or len(a.blocks) != len(b.blocks):
        return None
    pairs = [(a.embedding, b.embedding), *zip(a.blocks, b.blocks), (a.final_norm, b.final_norm),
             (a.lm_head, b.lm_head), (a.other, b.other)]
    pairs = [(x, y) for x, y in pairs if x is not None or y is not None]
    return sum(x != y for x, y in pairs), len(pairs)


def modified_copy(expected: TargetIdentity, found: TargetIdentity) -> bool:
    """Whether ``found`` is the recorded target with some of its weights changed (the module
    docstring): same architecture and shape, comparable per-part records, and at most
    ``MAX_CHANGED_FRACTION`` of the parts differ (none differing counts too)."""
    shape = ("architecture", "num_blocks", "hidden_size", "vocab_size")
    if any(getattr(expected, f) != getattr(found, f) for f in shape):
        return False
    counts = changed_count(expected, found)
    return counts is not None and counts[0] <= MAX_CHANGED_FRACTION * counts[1]


def describe_changes(parts: list[str]) -> str:
    """``changed_parts`` as a clause: "block 2 differs", "the embedding and blocks 20 to 22 differ"."""
    if not parts:
        return "every part agrees"
    joined = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    one = len(parts) == 1 and not parts[0].startswith(("blocks ", "other "))
    return f"{joined} {'differs' if one else 'differ'}"
