"""Hidden-state shards: the target's captured boundaries for a set of conversations, on disk.

Written by :func:`capture_shards` (``eyas capture``), read by :class:`ShardDataset` (offline training).
Everything goes through :class:`eyas.capture.BoundaryCapture`, the one capture code path.

Directory layout::

    out_dir/
      manifest.json                      the contract, counts, the shard list (written last, atomically)
      progress-r00.json                  per-rank progress: finished shards, fingerprint sums, params
      shard-r00-00000.safetensors        rank 0, shard 0
      shard-r00-00001.safetensors
      shard-r01-00000.safetensors        rank 1 (torchrun), ...

One shard holds S samples of N tokens in total, concatenated (ragged), only real tokens (no padding):

    input_ids    int32  [N]                 token ids
    loss_mask    uint8  [N]                 1 = assistant token (eyas.data.render), not shifted
    offsets      int64  [S + 1]             sample i is rows offsets[i]:offsets[i+1]
    slots        dtype  [N, num_slots, H]   the captured boundaries, slot order = contract.capture.boundaries
    last_hidden  dtype  [N, H]              boundary L (last block output, BEFORE the final norm):
                                            final_norm + lm_head of the target give its logits at training time
                                            (shards imported from a SpecForge dump, eyas.data.dumps, hold the
                                            final norm's output instead: manifest layout.last_hidden_normed;
                                            a speculators/vLLM dump holds boundary L itself)

The safetensors metadata key ``eyas`` holds JSON repeating format, rank, index, boundaries, dtype
and the sample ids, so a shard describes itself without the manifest.

Determinism and resume. Rank r takes conversations ``r::world_size``. Its samples are cut into a
fixed plan of shards (at most ``shard_size`` samples and ``shard_tokens`` tokens, by default about
1 GiB of hidden states) before anything runs. Inside a shard the samples are sorted longest first
(similar lengths share a batch: less padding) and stored in that order, so each batch's real tokens
go to the host in one copy; the shard's ``ids`` list the stored order. A background thread
serialises, hashes and writes shard k while shard k+1 is captured (host memory: two shards plus
one serialised copy). After each shard is on disk the rank's progress file is rewritten
(atomically) with that shard's counts, size, sha256 and fingerprint sums. A rerun checks that the
parameters and the plan are unchanged, keeps every listed shard whose file is intact and continues
with the next planned shard: the result is byte-identical to an uninterrupted run (same batch
size). When every rank's progress is complete, the manifest is merged from the progress files (by
the last rank to finish, or rank 0 after a barrier under torch.distributed, or
:func:`finalize_manifest`).

The manifest's ``contract.fingerprint`` summarises the stored slot values of every sample but its
first token (the attention sink; see :mod:`eyas.capture.stats`).

Modules: this one captures and writes a rank's shards (:func:`capture_shards`: resume, capture,
background writes, progress, finalising); :mod:`eyas.data.shard_plan` holds :class:`CaptureOptions`
and the plan (step 1); :mod:`eyas.data.shard_format` the file names, constants, manifest and
progress JSON and :func:`finalize_manifest`; :mod:`eyas.data.shard_dataset` the reader,
:class:`ShardDataset`. Their public names are importable from here too.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from eyas.io import atomic_write_bytes
from eyas.convention.boundaries import CaptureSpec
from eyas.capture.hooks import BoundaryCapture
from eyas.capture.stats import FingerprintAccumulator
from eyas.contract import Contract, compare
from eyas.data.conversations import Conversation
from eyas.data.runs import Throughput, changed_params, eval_mode
from eyas.data.shard_dataset import ShardDataset
from eyas.data.shard_format import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ShardError,
    finalize_manifest,
    is_shard_dir,
    progress_name,
    read_shard_json,
    shard_name,
    write_shard_json,
)
from eyas.data.shard_plan import (
    DEFAULT_SHARD_BYTES,
    PLAN,
    PLAN_PARAMS,
    CaptureOptions,
    CapturePlan,
    ShardSample,
    plan_capture,
    plan_shards,
)

# The public names of the shard modules, importable from here as before the split.
__all__ = [
    "DEFAULT_SHARD_BYTES", "DTYPES", "FORMAT", "FORMAT_VERSION", "MANIFEST", "PLAN", "PLAN_PARAMS",
    "CaptureOptions", "CaptureSummary", "ShardDataset", "ShardError", "capture_shards", "finalize_manifest",
    "is_shard_dir", "plan_shards", "progress_name", "shard_name",
]


# ---------------------------------------------------------------------------------------------
# Capturing one shard
# ---------------------------------------------------------------------------------------------


def _forward(model: Any, ids: Tensor, attn: Tensor) -> None:
    """Run the target for its hooks. logits_to_keep=1 skips the [B, T, vocab] lm_head product
    where the model supports it: only the hidden states are wanted."""
    kw: dict[str, Any] = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1
    model(input_ids=ids, attention_mask=attn, **kw)


@torch.no_grad()
def _capture_shard(model: Any, spec: CaptureSpec, samples: Sequence[ShardSample], batch_size: int,
                   dtype: torch.dtype, pad_id: int, acc: FingerprintAccumulator,
                   on_batch: Callable[[int], None] | None = None) -> dict[str, Tensor]:
    """The tensors of one shard; ``samples`` are already in stored order (longest first), so the
    batches are consecutive runs of them. Batches are right-padded with an attention mask; only
    the real tokens of each row are kept. The fingerprint sees exactly the stored (dtype-cast) values."""
    device = next(model.parameters()).device
    hidden = acc.hidden_size
    lengths = [s.length for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    n = int(offsets[-1])
    out = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),  # [N]
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),  # [N]
        "offsets": offsets,  # [S + 1]
        "slots": torch.empty(n, spec.num_slots, hidden, dtype=dtype),  # [N, num_slots, H]
        "last_hidden": torch.empty(n, hidden, dtype=dtype),  # [N, H]
    }
    with BoundaryCapture(model, spec, include_last=True) as cap:
        for b0 in range(0, len(samples), batch_size):
            batch = samples[b0:b0 + batch_size]
            t_max = max(s.length for s in batch)
            ids = torch.full((len(batch), t_max), pad_id, dtype=torch.long)  # [B, T], right-padded
            attn = torch.zeros(len(batch), t_max, dtype=torch.long)
            for r, s in enumerate(batch):
                ids[r, :s.length] = s.input_ids
                attn[r, :s.length] = 1
            cap.clear()
            real = attn.to(device)
            _forward(model, ids.to(device), real)
            slots = torch.stack(cap.slots(), dim=2).to(dtype)  # [B, T, num_slots, H]
            acc.update_batch(slots, real)  # all real tokens but each row's first (the attention sink)
            # Boolean indexing keeps real tokens row after row = the batch's rows of the shard.
            keep = real.bool()
            a, b = int(offsets[b0]), int(offsets[b0 + len(batch)])
            out["slots"][a:b].copy_(slots[keep])  # [n_real, num_slots, H], one device->host copy
            out["last_hidden"][a:b].copy_(cap.last_hidden()[keep].to(dtype))  # [n_real, H]
            if on_batch is not None:
                on_batch(b - a)
    return out


def _write_shard(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Serialise, hash and write atomically -> (bytes, sha256). Runs in the writer thread; the hash
    runs in one more thread beside the write (hashlib and file writes both release the GIL)."""
    import threading

    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    h = hashlib.sha256()
    hasher = threading.Thread(target=h.update, args=(memoryview(data),), daemon=True)
    hasher.start()
    try:
        atomic_write_bytes(path, data)
    finally:
        hasher.join()
    return len(data), h.hexdigest()


def _shard_metadata(plan: CapturePlan, k: int, ids: list[str]) -> dict[str, str]:
    """The safetensors metadata of shard k: one key holding JSON. (safetensors writes a metadata
    map in hash order, which would make the bytes of identical shards differ from run to run.)"""
    return {"eyas": json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "rank": plan.rank, "index": k,
                                "boundaries": list(plan.spec.boundaries), "dtype": plan.options.dtype, "ids": ids})}


def _shard_entry(plan: CapturePlan, k: int, members: Sequence[ShardSample], tensors: dict[str, Tensor],
                 acc: FingerprintAccumulator) -> dict[str, Any]:
    """Shard k's record in the progress file (and, less batch_size and fingerprint, in the manifest);
    ``bytes`` and ``sha256`` are filled in once the file is written."""
    return {"file": shard_name(plan.rank, k), "rank": plan.rank, "index": k, "samples": len(members),
            "tokens": int(tensors["input_ids"].shape[0]), "loss_tokens": int(tensors["loss_mask"].sum()),
            "bytes": None, "sha256": None, "batch_size": plan.options.batch_size, "ids": [x.id for x in members],
            "fingerprint": acc.state()}


# ---------------------------------------------------------------------------------------------
# capture_shards
# ---------------------------------------------------------------------------------------------


@dataclass
class CaptureSummary(Throughput):
    out_dir: str
    rank: int
    world_size: int
    conversations: int = 0  # assigned to this rank
    samples: int = 0  # with at least one assistant token
    tokens: int = 0  # in this rank's samples
    loss_tokens: int = 0
    shards: int = 0  # planned for this rank
    shards_written: int = 0  # by this run
    shards_resumed: int = 0  # already complete from an earlier run
    tokens_captured: int = 0  # by this run
    no_loss_tokens: int = 0
    truncated: int = 0
    render_problems: int = 0
    problems: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    manifest: str | None = None  # set once the manifest (all ranks) is written

    @property
    def rated_tokens(self) -> int:
        return self.tokens_captured

    @classmethod
    def of(cls, plan: CapturePlan) -> "CaptureSummary":
        """The counts a plan fixes; the run adds what it wrote, resumed and how long it took."""
        r = plan.rendered
        return cls(out_dir=str(plan.out), rank=plan.rank, world_size=plan.world, conversations=r.conversations,
                   samples=len(plan.samples), tokens=sum(s.length for s in plan.samples),
                   loss_tokens=sum(int(s.loss_mask.sum()) for s in plan.samples), shards=len(plan.shards),
                   no_loss_tokens=r.no_loss_tokens, truncated=r.truncated, render_problems=r.render_problems,
                   problems=list(r.problems))


class _RankProgress:
    """This rank's ``progress-rNN.json``: the plan (parameters, digest, counts, contract) and the
    shards that are on disk.

    Invariant: it lists exactly the shards whose files are complete under their final names, in
    index order, and says ``complete`` once that is every planned shard; it is rewritten atomically,
    so a crash leaves the previous version."""

    def __init__(self, plan: CapturePlan, summary: CaptureSummary, entries: list[dict[str, Any]]) -> None:
        self.path = plan.out / progress_name(plan.rank)
        self.plan = plan
        self.summary = summary
        self.entries = entries

    def add(self, entry: dict[str, Any]) -> None:
        """Record one more shard that is on disk (the next index) and rewrite the file."""
        self.entries.append(entry)
        self.save()

    def save(self) -> None:
        plan, summary = self.plan, self.summary
        write_shard_json(self.path, {
            "format": FORMAT + "+progress", "version": FORMAT_VERSION, "rank": plan.rank, "world_size": plan.world,
            "params": plan.options.plan_params(), "plan_sha256": plan.digest, "num_shards": len(plan.shards),
            "counts": plan.rendered.counts()
            | {"samples": summary.samples, "tokens": summary.tokens, "loss_tokens": summary.loss_tokens,
               "total_conversations": plan.total_conversations},
            "problems": plan.rendered.problems, "source_data": plan.options.source_data,
            "contract": plan.contract.model_dump(mode="json"),
            "shards": self.entries, "complete": len(self.entries) == len(plan.shards),
        })


def _resume(plan: CapturePlan) -> list[dict[str, Any]]:
    """Step 2, resume: the finished shards of an earlier run that this run keeps.

    Invariant: resuming never duplicates nor reorders a shard. Kept are the earlier run's shards
    0..k-1, up to the first whose file is missing or has another size; that shard and every later
    one are captured again. An earlier run with other plan parameters, another target or other
    rendered samples is refused (ShardError naming each difference). Temporary files of a write
    that a crash interrupted are removed."""
    for tmp in plan.out.glob(f".shard-r{plan.rank:02d}-*.tmp"):  # left by a crash inside atomic_write
        tmp.unlink(missing_ok=True)
    path = plan.out / progress_name(plan.rank)
    if not path.exists():
        return []
    prog = read_shard_json(path, "progress file")
    diff = changed_params(prog["params"], plan.options.plan_params(), PLAN_PARAMS, "progress has")
    diff += [str(m) for m in compare(Contract.model_validate(prog["contract"]), plan.contract)]
    if prog.get("plan_sha256") != plan.digest:
        diff.append("the rendered samples or their shard plan changed (other data, tokenizer or max_length)")
    if diff:
        raise ShardError(f"{path}: cannot resume, the earlier run differs: " + "; ".join(diff)
                         + f". Use another output directory, or delete {plan.out} to start over")
    kept = []
    for k, entry in enumerate(prog["shards"]):
        f = plan.out / entry["file"]
        if entry["index"] != k or k >= len(plan.shards) or not f.exists() or f.stat().st_size != entry["bytes"]:
            break  # this shard and every later one are redone
        kept.append(entry)
    return kept


class _ShardWriter:
    """Writes shards in one background thread while the next shard is captured.

    Invariants: at most one shard is in flight (host memory: the shard being captured, the one
    being written and its serialised copy); a shard counts (progress file, summary, callback) only
    once its file is complete under its final name (written to a temporary name, then renamed), and
    shards count in index order. Leaving the block on an error still counts a shard whose write
    succeeded."""

    def __init__(self, progress: _RankProgress, summary: CaptureSummary,
                 on_shard_written: Callable[[int, dict[str, Any]], None] | None) -> None:
        self.progress, self.summary, self.on_shard_written = progress, summary, on_shard_written
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eyas-shard-writer")
        self._pending: tuple[Future, dict[str, Any]] | None = None

    def submit(self, path: Path, tensors: dict[str, Tensor], metadata: dict[str, str], entry: dict[str, Any]) -> None:
        self.settle()  # shard k-1 must be on disk (and in the progress file) before shard k is
        self._pending = (self._pool.submit(_write_shard, path, tensors, metadata), entry)

    def settle(self) -> None:
        """Wait for the shard being written, if any; then it counts."""
        if self._pending is None:
            return
        fut, entry = self._pending
        self._pending = None
        entry["bytes"], entry["sha256"] = fut.result()
        self.progress.add(entry)
        self.summary.shards_written += 1
        self.summary.tokens_captured += entry["tokens"]
        if self.on_shard_written is not None:
            self.on_shard_written(entry["index"], entry)

    def __enter__(self) -> "_ShardWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if exc_type is None:
                self.settle()
            elif self._pending is not None:  # keep a shard that was being written when something else failed
                try:
                    self.settle()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
        finally:
            self._pool.shutdown(wait=True)


def _capture_planned(model: Any, pad_id: int, plan: CapturePlan, progress: _RankProgress,
                     summary: CaptureSummary, on_shard_written: Callable[[int, dict[str, Any]], None] | None) -> None:
    """Step 3 and 4, capture and write: every planned shard after the resumed ones, in index order.

    Shard k is captured while shard k-1 is written (:class:`_ShardWriter`). The fingerprint sums of
    a shard see exactly its stored values and travel with its progress entry, so a resumed run
    merges the same sums as an uninterrupted one."""
    from tqdm.auto import tqdm

    opts = plan.options
    first = len(progress.entries)
    todo_tokens = sum(plan.samples[j].length for shard in plan.shards[first:] for j in shard)
    bar = tqdm(total=todo_tokens, desc=f"capture r{plan.rank}", unit="tok", unit_scale=True,
               disable=not opts.progress, dynamic_ncols=True)
    try:
        with eval_mode(model), _ShardWriter(progress, summary, on_shard_written) as writer:
            for k in range(first, len(plan.shards)):
                members = plan.members(k)
                acc = FingerprintAccumulator(plan.spec.boundaries, plan.hidden_size, opts.channels)
                tensors = _capture_shard(model, plan.spec, members, opts.batch_size, DTYPES[opts.dtype], pad_id,
                                         acc, bar.update)
                entry = _shard_entry(plan, k, members, tensors, acc)
                writer.submit(plan.out / entry["file"], tensors, _shard_metadata(plan, k, entry["ids"]), entry)
                del tensors  # the writer holds the only reference: freed once written
    finally:
        bar.close()


def capture_shards(
    model: Any,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    options: CaptureOptions,
    *,
    source: str | None = None,
    on_shard_written: Callable[[int, dict[str, Any]], None] | None = None,
) -> CaptureSummary:
    """Capture the boundaries ``options.boundaries`` (and boundary L) of ``model`` over
    ``conversations`` into this rank's shards: plan -> resume -> capture and write -> finalise.

    Args:
        conversations: the whole input (every rank passes the same list); rank r takes r::world_size.
        options: see :class:`CaptureOptions`.
        source: the target's name, recorded in the contract (``target.source``).
        on_shard_written: called as ``f(index, progress_entry)`` after each shard is on disk.

    Returns: a :class:`CaptureSummary` for this rank (``manifest`` set when the manifest was written).
    """
    t0 = time.perf_counter()
    plan = plan_capture(model, tokenizer, conversations, options, source)
    plan.out.mkdir(parents=True, exist_ok=True)
    summary = CaptureSummary.of(plan)
    entries = _resume(plan)
    summary.shards_resumed = len(entries)
    progress = _RankProgress(plan, summary, entries)
    progress.save()  # also records an empty rank (more ranks than conversations) as complete
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked anyway
    _capture_planned(model, pad_id, plan, progress, summary, on_shard_written)
    if options.finalize:
        summary.manifest = _finalize_when_complete(plan.out, plan.rank, plan.world)
    summary.wall_s = time.perf_counter() - t0
    return summary


def _finalize_when_complete(out: Path, rank: int, world: int) -> str | None:
    """Step 5, finalise: the manifest's path once every rank's progress is complete (written here by
    one rank: rank 0 after a barrier under torch.distributed, else whichever rank finds all complete);
    None while another rank still has shards to capture."""
    import torch.distributed as dist

    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank's progress is complete after this
        if rank == 0:
            return str(finalize_manifest(out))
        dist.barrier()  # the others return once the manifest exists
        return str(out / MANIFEST)
    # Without a process group: whichever rank finds all progress complete writes the manifest
    # (the content is deterministic, and the write atomic, so two ranks racing is harmless).
    if all(_rank_complete(out / progress_name(r)) for r in range(world)):
        return str(finalize_manifest(out))
    return None


def _rank_complete(path: Path) -> bool:
    try:
        return bool(json.loads(path.read_text()).get("complete"))
    except (OSError, json.JSONDecodeError):
        return False
