"""Step 1 of a capture (:func:`eyas.data.shards.capture_shards`), plan: the options of one rank's
capture (:class:`CaptureOptions`, the plan parameters a resume must share), rendering this rank's
conversations and cutting them into shards (:func:`plan_shards`), fixed in a :class:`CapturePlan`
before the first forward pass.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Sequence

import torch
from pydantic import PositiveInt
from torch import Tensor

from eyas.convention.boundaries import CaptureSpec
from eyas.capture.stats import FingerprintAccumulator
from eyas.contract import CaptureContract, Contract, target_identity, tokenisation_of
from eyas.data.conversations import Conversation, conversation_id
from eyas.data.render import TEMPLATE_DEFAULT, TemplateAlignmentError, render, system_prompt_mode
from eyas.data.runs import RunOptions
from eyas.data.shard_format import DTYPES, MAX_PROBLEMS_KEPT, ShardError
from eyas.errors import EyasError
from eyas.targets.structure import find_decoder_blocks

DEFAULT_SHARD_BYTES = 1 << 30  # hidden states per shard when shard_tokens is not given


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
# Planning: render this rank's conversations, cut them into shards
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardSample:
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
    problems: list[str] = field(default_factory=list)  # the first MAX_PROBLEMS_KEPT, "<id>: <message>"

    def counts(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "problems"}


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
    world = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
    if world < 1 or not 0 <= rank < world:
        raise ShardError(f"rank {rank} / world_size {world}: expected 0 <= rank < world_size")
    return rank, world


def _render_samples(conversations: Sequence[Conversation], rank: int, world: int, tokenizer: Any,
                    max_length: int, system_prompt: str, progress: bool) -> tuple[list[ShardSample], _RenderCounts]:
    """This rank's conversations (positions rank::world) rendered; conversations without any
    assistant token after truncation are left out (they carry no loss), and so are those whose
    template does not line up (reported)."""
    from tqdm.auto import tqdm

    samples: list[ShardSample] = []
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
            if len(stats.problems) < MAX_PROBLEMS_KEPT:
                stats.problems.append(f"{cid}: {e}")
            continue
        stats.truncated += int(r.truncated)
        if r.num_assistant_tokens == 0:
            stats.no_loss_tokens += 1
            continue
        samples.append(ShardSample(cid, r.input_ids.long(), r.loss_mask.long()))
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


def _plan_digest(samples: Sequence[ShardSample], plan: list[list[int]]) -> str:
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
class CapturePlan:
    """One rank's capture, fixed before the first forward pass.

    Invariant: a function of the options, the target and the conversations only, so a rerun
    computes the same plan; ``digest`` says whether it did."""

    options: CaptureOptions  # resolved: boundaries, shard_tokens, rank, world_size, channels are set
    spec: CaptureSpec
    contract: Contract  # target, capture and tokenisation; the fingerprint is merged into the manifest
    samples: list[ShardSample]  # this rank's, in input order
    rendered: _RenderCounts
    shards: list[list[int]]  # positions in ``samples``, per shard (plan_shards)
    digest: str  # _plan_digest(samples, shards)
    total_conversations: int  # in the whole input, every rank's

    @property
    def out(self) -> Path:
        return self.options.out_dir

    @property
    def rank(self) -> int:
        return int(self.options.rank)  # type: ignore[arg-type]  # resolved by plan_capture

    @property
    def world(self) -> int:
        return int(self.options.world_size)  # type: ignore[arg-type]

    @property
    def hidden_size(self) -> int:
        return self.contract.target.hidden_size

    def members(self, k: int) -> list[ShardSample]:
        """Shard k's samples in stored order: longest first (stable), so batches are runs of
        similar lengths (less padding)."""
        return sorted((self.samples[j] for j in self.shards[k]), key=lambda x: -x.length)


def plan_capture(model: Any, tokenizer: Any, conversations: Sequence[Conversation], options: CaptureOptions,
                  source: str | None) -> CapturePlan:
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
    return CapturePlan(options=resolved, spec=spec, contract=base, samples=samples, rendered=rendered,
                        shards=shards, digest=_plan_digest(samples, shards),
                        total_conversations=len(conversations))
