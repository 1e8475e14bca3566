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
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Literal, Sequence

import torch
from pydantic import PositiveInt
from torch import Tensor
from torch.utils.data import Dataset

from eyas.io import atomic_write_bytes, atomic_write_json, read_json_object
from eyas.convention.boundaries import CaptureSpec
from eyas.capture.hooks import BoundaryCapture
from eyas.capture.stats import FingerprintAccumulator
from eyas.contract import (
    CaptureContract,
    Contract,
    compare,
    enforce,
    target_identity,
    tokenisation_of,
)
from eyas.data.conversations import Conversation, conversation_id
from eyas.data.render import TEMPLATE_DEFAULT, TemplateAlignmentError, render, system_prompt_mode
from eyas.data.runs import RunOptions, Throughput, changed_params, eval_mode
from eyas.errors import EyasError
from eyas.targets.loaded import LoadedTarget
from eyas.targets.structure import find_decoder_blocks

FORMAT = "eyas-hidden-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def is_shard_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a finished capture (a directory with its manifest), not a conversations file."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).exists()


DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_SHARD_BYTES = 1 << 30  # hidden states per shard when shard_tokens is not given
_MAX_PROBLEMS_KEPT = 20


class ShardError(EyasError, ValueError):
    """A shard set that cannot be written, resumed or read; the message names the file."""


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:02d}-{index:05d}.safetensors"


def progress_name(rank: int) -> str:
    return f"progress-r{rank:02d}.json"


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


class _PlanParameter:
    """Marks an option as a plan parameter (``Annotated[..., PLAN]``): it decides which tokens land
    in which shard or which values are stored, so a rerun resumes only when it is unchanged."""

    def __repr__(self) -> str:
        return "PLAN"


PLAN = _PlanParameter()


class CaptureOptions(RunOptions):
    """Every option of one rank's capture (``eyas capture``, :func:`capture_shards`), flat and typed.

    The fields marked ``PLAN`` are the plan parameters (:data:`PLAN_PARAMS`): resolved (no ``None``
    left), they are recorded in each rank's progress file and in the manifest, and a rerun resumes
    only when every one of them is unchanged. ``batch_size`` is not one: it moves values only at
    the level of float rounding, and every shard records its own. Invalid values raise
    :class:`ShardError` naming the field, expected and found.
    """

    error: ClassVar[type[EyasError]] = ShardError

    out_dir: Path  # the shard directory: created if missing, resumed if it holds an unfinished capture
    # --- what is stored, and how it is cut into shards (all plan parameters) ---
    boundaries: Annotated[list[int] | None, PLAN] = None  # slot order (eyas boundaries); None: [2, L//2, L-3]
    dtype: Annotated[Literal["bfloat16", "float16", "float32"], PLAN] = "bfloat16"  # of slots and last_hidden
    max_length: Annotated[PositiveInt, PLAN] = 2048  # tokens per rendered conversation (truncated)
    shard_size: Annotated[PositiveInt, PLAN] = 256  # at most this many samples per shard
    shard_tokens: Annotated[PositiveInt | None, PLAN] = None  # and tokens per shard; None: ~1 GiB of hidden states
    system_prompt: Annotated[str, PLAN] = TEMPLATE_DEFAULT  # as in eyas.data.render.render; recorded as its mode
    # --- who captures which conversations; what the fingerprint measures ---
    rank: int | None = None  # this process takes conversations rank::world_size; None: $RANK, else 0
    world_size: Annotated[int | None, PLAN] = None  # processes sharing the input; None: $WORLD_SIZE, else 1
    channels: Annotated[list[int] | None, PLAN] = None  # fingerprint channel indices; None: 8 evenly spaced
    # --- how it runs (free to change on a rerun) ---
    batch_size: PositiveInt = 8  # samples per forward pass
    source_data: str | None = None  # the conversations file, recorded in the manifest
    progress: bool = True  # show progress bars
    finalize: bool = True  # write the manifest once every rank is complete

    def plan_params(self) -> dict[str, Any]:
        """The plan parameters as the progress file and the manifest record them (of resolved options):
        JSON values in field order, the system prompt as its mode (a custom prompt's text reaches the
        rendered tokens, so the plan digest sees a change of it)."""
        params = self.model_dump(mode="json", include=set(PLAN_PARAMS))
        params["system_prompt"] = system_prompt_mode(self.system_prompt)
        return params


# What a rerun must share with the run it resumes, in field order.
PLAN_PARAMS: tuple[str, ...] = tuple(name for name, f in CaptureOptions.model_fields.items() if PLAN in f.metadata)


# ---------------------------------------------------------------------------------------------
# Atomic file writes
# ---------------------------------------------------------------------------------------------


def _atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_json(path, obj, indent=1)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    obj = read_json_object(path, ShardError, what)
    if str(obj.get("format", "")).split("+")[0] != FORMAT:
        raise ShardError(f"{path}: not an eyas {what} (format {obj.get('format')!r}, expected {FORMAT!r})")
    return obj


# ---------------------------------------------------------------------------------------------
# Planning: render this rank's conversations, cut them into shards
# ---------------------------------------------------------------------------------------------


@dataclass
class _Sample:
    id: str
    input_ids: Tensor  # [T] long
    loss_mask: Tensor  # [T] long

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class _RenderCounts:
    """What rendering this rank's conversations left out, and why (field order = the progress
    file's ``counts`` order)."""

    conversations: int = 0  # assigned to this rank
    no_loss_tokens: int = 0  # no assistant token after truncation: left out (no loss)
    truncated: int = 0  # cut at max_length (kept)
    render_problems: int = 0  # the template does not line up: left out
    problems: list[str] = field(default_factory=list)  # the first _MAX_PROBLEMS_KEPT, "<id>: <message>"

    def counts(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "problems"}


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
    world = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
    if world < 1 or not 0 <= rank < world:
        raise ShardError(f"rank {rank} / world_size {world}: expected 0 <= rank < world_size")
    return rank, world


def _render_samples(conversations: Sequence[Conversation], rank: int, world: int, tokenizer: Any,
                    max_length: int, system_prompt: str, progress: bool) -> tuple[list[_Sample], _RenderCounts]:
    """This rank's conversations (positions rank::world) rendered; conversations without any
    assistant token after truncation are left out (they carry no loss), and so are those whose
    template does not line up (reported)."""
    from tqdm.auto import tqdm

    samples: list[_Sample] = []
    stats = _RenderCounts()
    positions = range(rank, len(conversations), world)
    for i in tqdm(positions, desc=f"render r{rank}", unit="conv", disable=not progress, dynamic_ncols=True):
        conv = conversations[i]
        cid = conversation_id(conv, i)  # position in the whole input: the same id on every rank count
        stats.conversations += 1
        try:
            r = render(conv, tokenizer, max_length=max_length, system_prompt=system_prompt)
        except TemplateAlignmentError as e:
            stats.render_problems += 1
            if len(stats.problems) < _MAX_PROBLEMS_KEPT:
                stats.problems.append(f"{cid}: {e}")
            continue
        stats.truncated += int(r.truncated)
        if r.num_assistant_tokens == 0:
            stats.no_loss_tokens += 1
            continue
        samples.append(_Sample(cid, r.input_ids.long(), r.loss_mask.long()))
    return samples, stats


def plan_shards(lengths: Sequence[int], shard_size: int, shard_tokens: int | None = None) -> list[list[int]]:
    """Cut samples (in order) into shards of at most ``shard_size`` samples and, if given, at most
    ``shard_tokens`` tokens (a longer single sample gets a shard of its own)."""
    if shard_size < 1:
        raise ShardError(f"shard_size: expected >= 1, found {shard_size}")
    plan: list[list[int]] = []
    cur: list[int] = []
    cur_tokens = 0
    for j, n in enumerate(lengths):
        if cur and (len(cur) >= shard_size or (shard_tokens is not None and cur_tokens + n > shard_tokens)):
            plan.append(cur)
            cur, cur_tokens = [], 0
        cur.append(j)
        cur_tokens += n
    if cur:
        plan.append(cur)
    return plan


def _plan_digest(samples: Sequence[_Sample], plan: list[list[int]]) -> str:
    """sha256 over what the shards will contain: every sample's id and tokens, and the plan."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.id.encode() + b"\0")
        h.update(s.input_ids.to(torch.int32).numpy().tobytes())
        h.update(s.loss_mask.to(torch.uint8).numpy().tobytes())
    h.update(json.dumps(plan).encode())
    return h.hexdigest()


def _base_contract(model: Any, tokenizer: Any, spec: CaptureSpec, dtype: str, system_prompt: str,
                   source: str | None) -> Contract:
    """The target, capture and tokenisation of the manifest's contract (its fingerprint is merged in
    when every rank is done)."""
    return Contract(target=target_identity(model, source),
                    capture=CaptureContract(boundaries=list(spec.boundaries), dtype=dtype),
                    tokenisation=tokenisation_of(tokenizer, system_prompt_mode(system_prompt)))


@dataclass
class _CapturePlan:
    """One rank's capture, fixed before the first forward pass.

    Invariant: a function of the options, the target and the conversations only, so a rerun
    computes the same plan; ``digest`` says whether it did."""

    options: CaptureOptions  # resolved: boundaries, shard_tokens, rank, world_size, channels are set
    spec: CaptureSpec
    contract: Contract  # target, capture and tokenisation; the fingerprint is merged into the manifest
    samples: list[_Sample]  # this rank's, in input order
    rendered: _RenderCounts
    shards: list[list[int]]  # positions in ``samples``, per shard (plan_shards)
    digest: str  # _plan_digest(samples, shards)
    total_conversations: int  # in the whole input, every rank's

    @property
    def out(self) -> Path:
        return self.options.out_dir

    @property
    def rank(self) -> int:
        return int(self.options.rank)  # type: ignore[arg-type]  # resolved by _plan_capture

    @property
    def world(self) -> int:
        return int(self.options.world_size)  # type: ignore[arg-type]

    @property
    def hidden_size(self) -> int:
        return self.contract.target.hidden_size

    def members(self, k: int) -> list[_Sample]:
        """Shard k's samples in stored order: longest first (stable), so batches are runs of
        similar lengths (less padding)."""
        return sorted((self.samples[j] for j in self.shards[k]), key=lambda x: -x.length)


def _plan_capture(model: Any, tokenizer: Any, conversations: Sequence[Conversation], options: CaptureOptions,
                  source: str | None) -> _CapturePlan:
    """Step 1, plan: resolve every default of ``options`` (boundaries from the target's depth, rank
    and world from torchrun's environment, shard_tokens from about 1 GiB of hidden states, the
    fingerprint channels), render this rank's conversations and cut them into shards."""
    rank, world = _rank_world(options.rank, options.world_size)
    spec = CaptureSpec.create(len(find_decoder_blocks(model)), options.boundaries)
    base = _base_contract(model, tokenizer, spec, options.dtype, options.system_prompt, source)
    hidden = base.target.hidden_size
    shard_tokens = options.shard_tokens
    if shard_tokens is None:
        per_token = (spec.num_slots + 1) * hidden * DTYPES[options.dtype].itemsize  # slots + last_hidden
        shard_tokens = max(options.max_length, DEFAULT_SHARD_BYTES // per_token)
    resolved = options.model_copy(update={
        "boundaries": list(spec.boundaries), "shard_tokens": shard_tokens, "rank": rank, "world_size": world,
        "channels": FingerprintAccumulator(spec.boundaries, hidden, options.channels).channels,
    })
    samples, rendered = _render_samples(conversations, rank, world, tokenizer, options.max_length,
                                        options.system_prompt, options.progress)
    shards = plan_shards([s.length for s in samples], options.shard_size, shard_tokens)
    return _CapturePlan(options=resolved, spec=spec, contract=base, samples=samples, rendered=rendered,
                        shards=shards, digest=_plan_digest(samples, shards),
                        total_conversations=len(conversations))


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
def _capture_shard(model: Any, spec: CaptureSpec, samples: Sequence[_Sample], batch_size: int,
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


def _shard_metadata(plan: _CapturePlan, k: int, ids: list[str]) -> dict[str, str]:
    """The safetensors metadata of shard k: one key holding JSON. (safetensors writes a metadata
    map in hash order, which would make the bytes of identical shards differ from run to run.)"""
    return {"eyas": json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "rank": plan.rank, "index": k,
                                "boundaries": list(plan.spec.boundaries), "dtype": plan.options.dtype, "ids": ids})}


def _shard_entry(plan: _CapturePlan, k: int, members: Sequence[_Sample], tensors: dict[str, Tensor],
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
    def of(cls, plan: _CapturePlan) -> "CaptureSummary":
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

    def __init__(self, plan: _CapturePlan, summary: CaptureSummary, entries: list[dict[str, Any]]) -> None:
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
        _atomic_write_json(self.path, {
            "format": FORMAT + "+progress", "version": FORMAT_VERSION, "rank": plan.rank, "world_size": plan.world,
            "params": plan.options.plan_params(), "plan_sha256": plan.digest, "num_shards": len(plan.shards),
            "counts": plan.rendered.counts()
            | {"samples": summary.samples, "tokens": summary.tokens, "loss_tokens": summary.loss_tokens,
               "total_conversations": plan.total_conversations},
            "problems": plan.rendered.problems, "source_data": plan.options.source_data,
            "contract": plan.contract.model_dump(mode="json"),
            "shards": self.entries, "complete": len(self.entries) == len(plan.shards),
        })


def _resume(plan: _CapturePlan) -> list[dict[str, Any]]:
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
    prog = _read_json(path, "progress file")
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


def _capture_planned(model: Any, pad_id: int, plan: _CapturePlan, progress: _RankProgress,
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
    plan = _plan_capture(model, tokenizer, conversations, options, source)
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


def finalize_manifest(out_dir: str | os.PathLike) -> Path:
    """Merge every rank's progress file into ``manifest.json``: contract (with the fingerprint of
    all shards), counts, shard list, and rank 0's ``manifest_extra`` (what an import adds, so the
    manifest is written once). Errors name the rank file that is missing or incomplete."""
    out = Path(out_dir)
    first = _read_json(out / progress_name(0), "progress file (rank 0)")
    world = int(first["world_size"])
    progs = [first] + [_read_json(out / progress_name(r), f"progress file (rank {r})") for r in range(1, world)]
    for r, p in enumerate(progs):
        path = out / progress_name(r)
        if not p.get("complete"):
            raise ShardError(f"{path}: rank {r} has {len(p['shards'])} of {p['num_shards']} shards; "
                             f"rerun its capture (it resumes) before finalising")
        if p["params"] != first["params"] or p["world_size"] != world:
            raise ShardError(f"{path}: rank {r} ran with other parameters than rank 0: {p['params']} vs {first['params']}")
        mism = compare(Contract.model_validate(first["contract"]), Contract.model_validate(p["contract"]))
        if mism:
            raise ShardError(f"{path}: rank {r} captured another target than rank 0: " + "; ".join(map(str, mism)))
    shards = [e for p in progs for e in p["shards"]]  # rank order, then index order
    contract = Contract.model_validate(first["contract"])
    if shards:
        acc = FingerprintAccumulator.merged([FingerprintAccumulator.from_state(e["fingerprint"]) for e in shards])
        contract = contract.model_copy(update={"fingerprint": acc.result()})
    counts = {k: sum(int(p["counts"].get(k, 0)) for p in progs)
              for k in ("conversations", "samples", "tokens", "loss_tokens", "no_loss_tokens", "truncated",
                        "render_problems")}
    counts["shards"] = len(shards)
    params = first["params"]
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "contract": contract.model_dump(mode="json"),
        "counts": counts,
        "layout": {
            "num_slots": len(params["boundaries"]), "hidden_size": contract.target.hidden_size,
            "dtype": params["dtype"],
            "tensors": {"input_ids": "int32 [N]", "loss_mask": "uint8 [N]", "offsets": "int64 [S+1]",
                        "slots": "dtype [N, num_slots, H]", "last_hidden": "dtype [N, H] (boundary L, pre-norm)"},
        },
        "params": params,
        "world_size": world,
        "source_data": first.get("source_data"),
        "problems": [x for p in progs for x in p.get("problems", [])][:_MAX_PROBLEMS_KEPT],
        "shards": [{k: e[k] for k in ("file", "rank", "index", "samples", "tokens", "loss_tokens", "bytes",
                                      "sha256", "ids")} for e in shards],
    }
    _merge(manifest, first.get("manifest_extra") or {})  # e.g. an import's layout flags and source
    path = out / MANIFEST
    _atomic_write_json(path, manifest)
    return path


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    """``extra``'s keys into ``into``, merging nested dicts key by key (layout.tensors stays whole)."""
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


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
        self.manifest = _read_json(mpath, "manifest")
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
