"""The eyas checkpoint: an SGLang-loadable drafter directory plus ``eyas.json``.

    config.json        LlamaForCausalLMEagle3 config (eyas.interop.servers.sglang writes it), SGLang
                       ids for the current rule, top-level ids = boundaries (vLLM), all flags explicit
    model.safetensors  the drafter's state_dict names; embed_tokens.weight only when asked for (the
                       engines take the target's embedding otherwise)
    eyas.json          {"format", "embeddings": "saved"|"from_target", "boundaries",
                        "num_target_blocks", "drafter_config", "contract"}, and
                        "boundaries_assumed" (why) when an import had to assume them

Exports (the SGLang / speculators layouts, each written by its engine's spec in
eyas.interop.servers) carry the same ``eyas.json`` so that the contract survives a trip through an
engine format; its ``format`` then names that layout.
``contract`` is null only for drafters imported without a target.

Reading goes through :func:`read_checkpoint` for every supported layout: the layout of
``config.json`` decides the tensor names and config fields; ``eyas.json`` (when present) is the
record of what the drafter was trained on and wins over anything inferred from ``config.json``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
from pydantic import ValidationError
from torch import Tensor, nn

from eyas.convention.boundaries import BoundaryError, validate_boundaries
from eyas.targets.loaded import LoadedTarget
from eyas.targets.structure import find_embedding
from eyas.contract.contract import (
    CaptureContract,
    Contract,
    Mismatch,
    compare,
    enforce,
    tokenisation_of,
)
from eyas.drafter.build import drafter_flags
from eyas.drafter.config import NORM_FLAGS, DrafterConfig
from eyas.drafter.model import Eagle3Drafter
from eyas.interop import servers, sglang, speculators
from eyas.io import atomic_write_json
from eyas.interop.common import (
    CONFIG_JSON,
    EYAS_JSON,
    WEIGHTS,
    CheckpointError,
    atomic_save_sharded,
    check_tensors,
    pickle_only_error,
    prepare_out_dir,
    read_json,
    read_tensors,
    tensors_dtype,
)

EMBEDDING = "embed_tokens.weight"
LAYOUTS = {"sglang": sglang, "speculators": speculators}


# ---------------------------------------------------------------------------------------------
# Metadata: config.json + eyas.json, no tensors (what the engines' view needs)
# ---------------------------------------------------------------------------------------------


@dataclass
class Meta:
    path: Path
    config: dict[str, Any]  # config.json as written
    layout: str  # how config.json is laid out: "sglang" | "speculators"
    format: str  # what wrote the directory: eyas.json "format", else the layout
    eyas: dict[str, Any] | None  # eyas.json as written
    drafter_config: DrafterConfig | None  # from eyas.json
    contract: Contract | None  # from eyas.json
    num_target_blocks: int | None
    boundaries: list[int] | None  # None only when they depend on an unknown block count
    boundaries_source: str  # where the boundaries came from (or why they are unknown)
    # Why the boundaries are only assumed (third-party ids the conventions read differently, none
    # named; or eyas.json's record of an import that assumed them); None: the directory says
    boundaries_assumed: str | None = None
    # Each convention's reading of third-party ids where they differ (convention -> boundaries or
    # why it cannot read them); empty otherwise
    id_readings: dict[str, list[int] | str] = field(default_factory=dict)
    ids_convention: str | None = None  # the convention third-party ids were read by, where several apply
    # Norm flags config.json states that are not known to be the trained ones (a converter's own
    # choice, speculators.converter_flags; or eyas.json's record of an import of such a directory):
    # flag -> why; empty when the directory says
    flags_assumed: dict[str, str] = field(default_factory=dict)


def _directory(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file() and p.name in (CONFIG_JSON, EYAS_JSON, WEIGHTS):
        p = p.parent
    if not p.is_dir():
        raise CheckpointError(f"{p}: expected a drafter directory, found {'a file' if p.exists() else 'nothing'}")
    return p


def _read_eyas_json(d: Path) -> tuple[dict[str, Any] | None, DrafterConfig | None, Contract | None]:
    f = d / EYAS_JSON
    if not f.exists():
        return None, None, None
    e = read_json(f)
    try:
        cfg = DrafterConfig.model_validate(e["drafter_config"])
    except KeyError:
        raise CheckpointError(f"{f}: drafter_config: expected the drafter's config, found no such key") from None
    except ValidationError as err:
        raise CheckpointError(f"{f}: drafter_config: invalid ({err})") from None
    try:
        contract = Contract.model_validate(e["contract"]) if e.get("contract") is not None else None
    except ValidationError as err:
        raise CheckpointError(f"{f}: contract: invalid ({err})") from None
    return e, cfg, contract


def read_meta(
    path: str | Path, num_target_blocks: int | None = None, default_num_blocks: int | None = None,
    ids_convention: str | None = None,
) -> Meta:
    """Read ``config.json`` and ``eyas.json``.

    ``num_target_blocks`` is asserted by the caller (a disagreement with the directory is an
    error); ``default_num_blocks`` is only used when the directory does not say.
    ``ids_convention`` (specforge | sglang | sglang-legacy) is what the user says the nested SGLang
    ids of a directory eyas did not write mean; without it, ids the conventions read differently
    give boundaries marked assumed (``Meta.boundaries_assumed``). Directories eyas wrote record
    their boundaries and ignore it.
    """
    conventions = servers.get("sglang").ids_conventions
    if ids_convention is not None and ids_convention not in conventions:
        raise CheckpointError(f"ids_convention: expected one of {list(conventions)}, found {ids_convention!r}")
    if num_target_blocks is not None and num_target_blocks < 1:
        raise CheckpointError(
            f"num_target_blocks: expected the target's number of decoder blocks (1 or more), found {num_target_blocks}"
        )
    d = _directory(path)
    cfile = d / CONFIG_JSON
    if not cfile.exists():
        raise CheckpointError(pickle_only_error(d) or f"{cfile}: file not found (every drafter directory has one)")
    config = read_json(cfile)
    if speculators.is_speculators_config(config):
        speculators.check_config(config, str(cfile))
        layout = "speculators"
    elif sglang.is_sglang_config(config):
        layout = "sglang"
    else:
        raise CheckpointError(
            f"{cfile}: architectures: expected [{sglang.ARCHITECTURE!r}] (eyas, SGLang, SpecForge, EAGLE-3) "
            f"or [{speculators.ARCHITECTURE!r}] (speculators, vLLM), found {config.get('architectures')!r}"
        )
    eyas, drafter_config, contract = _read_eyas_json(d)
    efile = d / EYAS_JSON

    # --- the target's block count: the directory's own record first ---
    recorded: list[tuple[int, str]] = []
    if eyas is not None and eyas.get("num_target_blocks") is not None:
        recorded.append((int(eyas["num_target_blocks"]), f"{efile} num_target_blocks"))
    if contract is not None:
        recorded.append((contract.target.num_blocks, f"{efile} contract.target.num_blocks"))
    if config.get("eyas_num_target_blocks") is not None:
        recorded.append((int(config["eyas_num_target_blocks"]), f"{cfile} eyas_num_target_blocks"))
    if layout == "speculators" and (n := speculators.verifier_num_blocks(config)) is not None:
        recorded.append((n, "the verifier's local config.json"))
    L: int | None = recorded[0][0] if recorded else None
    for value, where in recorded[1:]:
        if value != L:
            raise CheckpointError(
                f"{where}: expected {L} target blocks (as {recorded[0][1]} says), found {value}"
            )
    if num_target_blocks is not None:
        if L is not None and num_target_blocks != L:
            raise CheckpointError(
                f"num_target_blocks: expected {L} (from {recorded[0][1]}), found {num_target_blocks} (passed in)"
            )
        L = num_target_blocks
    # Only a recorded or asserted count may reject the boundaries here; a default one (the target
    # being checked) is the other side of the contract check, which reports instead.
    known_L = L
    if L is None:
        L = default_num_blocks

    # --- the boundaries it was trained on: eyas.json, then eyas_boundaries, then the layout's convention ---
    assumed: str | None = None
    readings: dict[str, list[int] | str] = {}
    convention: str | None = None
    if eyas is not None and (eyas.get("boundaries") is not None or contract is not None):
        bs = [int(b) for b in (eyas.get("boundaries") or contract.capture.boundaries)]  # type: ignore[union-attr]
        if contract is not None and contract.capture.boundaries != bs:
            raise CheckpointError(
                f"{efile}: contract.capture.boundaries: expected {bs} (the file's boundaries), "
                f"found {contract.capture.boundaries}"
            )
        source = f"{efile}"
        if eyas.get("boundaries_assumed"):  # an import that had to assume them says so for good
            assumed = str(eyas["boundaries_assumed"])
    elif config.get("eyas_boundaries") is not None:
        bs, source = [int(b) for b in config["eyas_boundaries"]], f"{cfile} eyas_boundaries"
    else:
        tb = servers.for_layout(layout).trained_boundaries(config, L, str(cfile), ids_convention)
        bs, source, assumed, readings, convention = tb.boundaries, tb.source, tb.assumed, tb.readings, tb.convention
    if bs is not None and known_L is not None:
        try:
            validate_boundaries(bs, known_L)
        except BoundaryError as e:
            raise CheckpointError(f"{source}: {e}") from None

    fmt = str(eyas.get("format", "eyas")) if eyas is not None else layout
    if eyas is not None:  # an import of a directory whose flags were assumed says so for good
        flags_assumed = {str(k): str(v) for k, v in (eyas.get("flags_assumed") or {}).items()}
    else:
        flags_assumed = speculators.converter_flags(config, str(cfile)) if layout == "speculators" else {}
    return Meta(d, config, layout, fmt, eyas, drafter_config, contract, L, bs, source, assumed, readings, convention,
                flags_assumed)


PASS_BLOCKS = "pass the target or its number of decoder blocks (CLI: --target T or --num-target-blocks N)"


def unknown_blocks_error(meta: Meta) -> CheckpointError:
    """The error for a directory that does not say how many decoder blocks its target has (and
    none was passed): where eyas looked, why it found nothing, and what to pass. Never 0."""
    cfile, efile = meta.path / CONFIG_JSON, meta.path / EYAS_JSON
    looked = [f"{efile} num_target_blocks", f"{cfile} eyas_num_target_blocks"]
    why = ""
    if meta.layout == "speculators":
        looked.append("the config.json of speculators_config.verifier.name_or_path")
        name = ((meta.config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        why = (f" (verifier.name_or_path {name!r} is not a local model directory, and eyas never downloads "
               f"a model to count its blocks)")
    return CheckpointError(
        f"{cfile}: the target's number of decoder blocks: expected it in {', '.join(looked)}, "
        f"found none{why}; {PASS_BLOCKS}"
    )


# ---------------------------------------------------------------------------------------------
# The full checkpoint: metadata + tensors, every consistency check
# ---------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    meta: Meta
    config: DrafterConfig
    tensors: dict[str, Tensor]  # eyas state_dict names, as stored (dtype kept)
    boundaries: list[int]

    @property
    def contract(self) -> Contract | None:
        return self.meta.contract

    @property
    def num_target_blocks(self) -> int | None:
        return self.meta.num_target_blocks


def config_json_fields(meta: Meta) -> dict[str, Any]:
    """DrafterConfig fields (all but num_slots; draft_vocab_size may be None) from config.json alone:
    the layout's Llama fields, and the norm flags as the engine native to the layout reads them
    (absent flags at its defaults: vLLM's speculators loader reads norm_before_residual as true)."""
    cfile = str(meta.path / CONFIG_JSON)
    fields = LAYOUTS[meta.layout].config_fields(meta.config, cfile)
    fields.update(servers.for_layout(meta.layout).flags_as_read(meta.config, meta.layout, cfile))
    return fields


def _config_from_files(meta: Meta, tensors: dict[str, Tensor], where: str) -> DrafterConfig:
    cfile = meta.path / CONFIG_JSON
    fields = config_json_fields(meta)
    fc = tensors.get("fc.weight")
    if fc is None or fc.dim() != 2:
        raise CheckpointError(f"{where}: fc.weight: expected a 2-D tensor, found {None if fc is None else tuple(fc.shape)}")
    th = fields["target_hidden_size"]
    if fc.shape[1] % th:
        raise CheckpointError(
            f"{where}: fc.weight: expected in_features = num_slots x target_hidden_size ({th}, from "
            f"{cfile}), found {fc.shape[1]}"
        )
    if fields["draft_vocab_size"] is None:  # absent: the lm_head is the truth
        head = tensors.get("lm_head.weight")
        fields["draft_vocab_size"] = head.shape[0] if head is not None else fields["vocab_size"]
    try:
        return DrafterConfig(**fields, num_slots=fc.shape[1] // th)
    except ValidationError as e:
        raise CheckpointError(f"{cfile}: not a valid drafter config ({e})") from None


def _contract_vs_config(c: Contract, cfg: DrafterConfig) -> list[str]:
    """Where a contract does not describe the drafter config it is stored with."""
    problems = []
    if c.target.hidden_size != cfg.target_hidden_size:
        problems.append(
            f"drafter.target_hidden_size: expected {c.target.hidden_size} (contract.target.hidden_size), "
            f"found {cfg.target_hidden_size}"
        )
    if c.target.vocab_size != cfg.vocab_size:
        problems.append(
            f"drafter vocab_size: expected {c.target.vocab_size} (contract.target.vocab_size), found {cfg.vocab_size}"
        )
    if c.drafter is not None:
        for name, value in drafter_flags(cfg).model_dump().items():
            if name != "vocab_map" and getattr(c.drafter, name) != value:
                problems.append(
                    f"contract.drafter.{name}: expected {value} (the drafter's config), found {getattr(c.drafter, name)}"
                )
    return problems


def _check_consistency(meta: Meta, cfg: DrafterConfig, bs: list[int]) -> None:
    """The directory's own records must agree with each other and with the weights."""
    problems: list[str] = []
    if len(bs) != cfg.num_slots:
        problems.append(
            f"drafter.num_slots: expected {len(bs)} (one per boundary {bs}, from {meta.boundaries_source}), "
            f"found {cfg.num_slots} (fc takes {cfg.fc_in_features} = {cfg.num_slots} x target_hidden_size "
            f"{cfg.target_hidden_size})"
        )
    if meta.drafter_config is not None:
        # config.json is what the engines read: its flags must say what the drafter was trained with.
        for flag in NORM_FLAGS:
            if flag in meta.config and bool(meta.config[flag]) != getattr(cfg, flag):
                problems.append(
                    f"{CONFIG_JSON} {flag}: expected {getattr(cfg, flag)} (eyas.json drafter_config), "
                    f"found {meta.config[flag]}"
                )
    if meta.contract is not None:
        problems += _contract_vs_config(meta.contract, cfg)
    if problems:
        raise CheckpointError(f"{meta.path}: inconsistent checkpoint:\n  - " + "\n  - ".join(problems))


def _check_vocab_map(tensors: dict[str, Tensor], cfg: DrafterConfig, where: str) -> None:
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        return
    if d2t.dtype.is_floating_point or t2d is None:
        raise CheckpointError(f"{where}: d2t: expected an integer tensor with t2d beside it, found {d2t.dtype}")
    target_ids = d2t.long() + torch.arange(d2t.shape[0])
    bad = (target_ids < 0) | (target_ids >= cfg.vocab_size)
    if bad.any():
        raise CheckpointError(
            f"{where}: d2t: expected draft id + d2t in 0..{cfg.vocab_size - 1}, found {int(bad.sum())} ids outside"
        )
    if int(t2d.bool().sum()) != cfg.draft_vocab_size or not bool(t2d.bool()[target_ids].all()):
        raise CheckpointError(
            f"{where}: t2d: expected exactly the {cfg.draft_vocab_size} target ids that d2t maps to, "
            f"found {int(t2d.bool().sum())} set, not matching d2t"
        )


def read_checkpoint(
    path: str | Path, num_target_blocks: int | None = None, default_num_blocks: int | None = None,
    ids_convention: str | None = None,
) -> Checkpoint:
    meta = read_meta(path, num_target_blocks, default_num_blocks, ids_convention)
    if (pickle_only := pickle_only_error(meta.path)) is not None:  # say this before anything else
        raise CheckpointError(pickle_only)
    if meta.boundaries is None:
        raise CheckpointError(f"{meta.boundaries_source}: {PASS_BLOCKS}")
    raw, where = read_tensors(meta.path)
    layout = LAYOUTS[meta.layout]
    tensors = layout.tensors_from_file(raw)
    cfg = meta.drafter_config or _config_from_files(meta, tensors, where)
    _check_consistency(meta, cfg, meta.boundaries)

    with torch.device("meta"):  # names and shapes only: allocates nothing
        expected = {k: v.shape for k, v in Eagle3Drafter(cfg).state_dict().items()}
    optional = [EMBEDDING]
    if cfg.draft_vocab_size == cfg.vocab_size:
        optional += ["d2t", "t2d"]  # a full-vocabulary drafter needs no map (identity)
    check_tensors(tensors, expected, optional, where, layout.to_file_name)
    _check_vocab_map(tensors, cfg, where)
    return Checkpoint(meta, cfg, tensors, list(meta.boundaries))


class BuiltDrafter(NamedTuple):
    drafter: Eagle3Drafter
    notes: list[str]  # what of the weights did not fit the configuration, for people


def build_drafter(
    cfg: DrafterConfig, tensors: dict[str, Tensor], target_embedding: Tensor | None = None
) -> BuiltDrafter:
    """An fp32 drafter of architecture ``cfg`` holding ``tensors``, as an engine loads it.

    Tensors the config has no module for, or of another shape, are left out; a module without a
    tensor keeps its initialisation (norm weights = 1); each is noted. The embedding is the saved
    one, else ``target_embedding`` when its shape fits, else NaN: a random one would make a drafter
    that was never given its target's embedding produce plausible garbage, or leak into another
    model through ``state_dict()``. For a checkpoint that passed :func:`read_checkpoint`'s checks
    the only possible note is a target embedding that does not fit.
    """
    drafter = Eagle3Drafter(cfg)
    state = drafter.state_dict()
    notes: list[str] = []
    with torch.no_grad():
        for name, t in tensors.items():
            if name not in state:
                notes.append(f"{name} in the weights is not used by this configuration")
            elif tuple(state[name].shape) != tuple(t.shape):
                notes.append(f"{name}: the configuration needs shape {tuple(state[name].shape)}, the weights have {tuple(t.shape)}")
            else:
                state[name].copy_(t)
        absent = [k for k in state if k not in tensors and k not in (EMBEDDING, "d2t", "t2d")]
        if absent:
            notes.append(f"{', '.join(absent)} not in the weights: left at initialisation (norm weights = 1)")
        if EMBEDDING not in tensors:
            own = drafter.embed_tokens.weight
            if target_embedding is not None and tuple(target_embedding.shape) == tuple(own.shape):
                own.copy_(target_embedding.detach().to(own))
            else:
                own.fill_(float("nan"))
                if target_embedding is not None:
                    notes.append(f"embed_tokens: expected the target's embedding of shape {tuple(own.shape)}, "
                                 f"found {tuple(target_embedding.shape)}; left NaN")
    return BuiltDrafter(drafter, notes)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _blocks_or_bound(bs: Sequence[int], num_blocks: int | None) -> int:
    # When the target's block count is unknown (an import without it), the smallest target the
    # boundaries fit serves for the id conversion, whose only use of the count is range checks.
    return num_blocks if num_blocks is not None else max(bs)


@dataclass(frozen=True)
class WrittenCheckpoint:
    path: Path
    ids_written: dict[str, list[int]]  # config.json key -> the layer ids written under it
    sglang_rule: str | None  # the SGLang id rule the nested ids follow (None: no SGLang ids written)
    notes: tuple[str, ...] = ()  # what the engine's config could not say as the engine needs it


def write_checkpoint(
    out_dir: str | Path,
    cfg: DrafterConfig,
    tensors: dict[str, Tensor],
    boundaries: Sequence[int],
    num_target_blocks: int | None,
    contract: Contract | None,
    layout: str = "eyas",
    sglang_rule: str | None = None,
    speculative_tokens: int = 3,
    verifier: str | None = None,
    boundaries_assumed: str | None = None,
    max_file_bytes: int | None = None,
    flags_assumed: dict[str, str] | None = None,
) -> WrittenCheckpoint:
    """Write a drafter directory in ``layout`` ("eyas", "sglang" or "speculators"), ``eyas.json``
    included (weights in shards of at most ``max_file_bytes`` when given and needed); ``sglang_rule``
    (default: the current one) is the SGLang id rule nested ids are
    written for; ``verifier`` the target model a speculators config names (default: from the
    contract, see :meth:`~eyas.interop.servers.vllm.VLLMServer.write_config`);
    ``boundaries_assumed`` (why) is recorded in ``eyas.json`` when the boundaries are an assumption
    (an import of ambiguous ids), so that every later reading still says so; ``flags_assumed``
    (flag -> why) likewise for norm flags a converter chose (:attr:`Meta.flags_assumed`)."""
    if layout != "eyas" and layout not in LAYOUTS:
        raise CheckpointError(f"layout: expected 'eyas', 'sglang' or 'speculators', found {layout!r}")
    # config.json comes from the engine the layout is for (eyas writes SGLang's, eyas.json beside it)
    spec = servers.get("eyas") if layout == "eyas" else servers.for_layout(layout)
    bs = [int(b) for b in boundaries]
    L = num_target_blocks
    problems: list[str] = []
    if len(bs) != cfg.num_slots:
        problems.append(f"drafter.num_slots: expected {len(bs)} (one per boundary {bs}), found {cfg.num_slots}")
    if contract is not None:
        if contract.capture.boundaries != bs:
            problems.append(f"contract.capture.boundaries: expected {bs}, found {contract.capture.boundaries}")
        if L is not None and contract.target.num_blocks != L:
            problems.append(f"contract.target.num_blocks: expected {L}, found {contract.target.num_blocks}")
        problems += _contract_vs_config(contract, cfg)
    if problems:
        raise CheckpointError(f"{out_dir}: refusing to write an inconsistent checkpoint:\n  - " + "\n  - ".join(problems))
    try:
        validate_boundaries(bs, _blocks_or_bound(bs, L), cfg.num_slots)
    except BoundaryError as e:
        raise CheckpointError(f"{out_dir}: {e}") from None

    written = spec.write_config(cfg, bs, _blocks_or_bound(bs, L), rule=sglang_rule, dtype=tensors_dtype(tensors),
                                contract=contract, speculative_tokens=speculative_tokens, verifier=verifier)
    config = written.config
    if L is None:
        config["eyas_num_target_blocks"] = None
    file_tensors = LAYOUTS["sglang" if layout == "eyas" else layout].tensors_to_file(tensors)

    eyas_json: dict[str, Any] = {
        "format": layout,
        "embeddings": "saved" if EMBEDDING in tensors else "from_target",
        "boundaries": bs,
        "num_target_blocks": L,
        "drafter_config": cfg.model_dump(mode="json"),
        "contract": contract.model_dump(mode="json") if contract is not None else None,
    }
    if written.rule is not None:
        eyas_json["sglang_rule"] = written.rule
    if boundaries_assumed:
        eyas_json["boundaries_assumed"] = boundaries_assumed
    if flags_assumed:
        eyas_json["flags_assumed"] = dict(flags_assumed)
    out = prepare_out_dir(out_dir)
    # Each file is replaced atomically; the three together are not (an interrupted overwrite can
    # mix generations, which the checks on load against eyas.json report).
    atomic_save_sharded(out, file_tensors, max_file_bytes)
    atomic_write_json(out / CONFIG_JSON, config)
    atomic_write_json(out / EYAS_JSON, eyas_json)
    return WrittenCheckpoint(out, written.ids_written, written.rule, written.notes)


# ---------------------------------------------------------------------------------------------
# Checking against a live target
# ---------------------------------------------------------------------------------------------


def against_target(ckpt: Checkpoint, target: LoadedTarget, tokenizer: Any | None = None) -> list[Mismatch]:
    """Every way the drafter does not fit ``target`` (and ``tokenizer``), as contract mismatches."""
    found = target.identity  # hashed once per loaded target
    cfg, bs = ckpt.config, ckpt.boundaries
    out: list[Mismatch] = []
    if ckpt.contract is not None:
        live = Contract(
            target=found,
            capture=ckpt.contract.capture,  # a target has no boundaries of its own; range is checked below
            tokenisation=tokenisation_of(tokenizer) if tokenizer is not None else None,
        )
        out += compare(ckpt.contract, live)
    else:  # imported without a target: check what the files say
        if ckpt.num_target_blocks is not None and ckpt.num_target_blocks != found.num_blocks:
            out.append(Mismatch("target.num_blocks", ckpt.num_target_blocks, found.num_blocks))
        if cfg.vocab_size != found.vocab_size:
            out.append(Mismatch("target.vocab_size", cfg.vocab_size, found.vocab_size))
    if max(bs) > found.num_blocks:
        out.append(Mismatch("capture.boundaries", bs, f"boundaries of a {found.num_blocks}-block target (0..{found.num_blocks})"))
    if cfg.target_hidden_size != found.hidden_size:
        out.append(Mismatch("drafter.target_hidden_size", cfg.target_hidden_size, found.hidden_size))
    return out


def new_contract(ckpt: Checkpoint, target: LoadedTarget) -> Contract:
    """A contract for a drafter that came without one, from the target it is now paired with."""
    d2t = ckpt.tensors.get("d2t")
    identity = d2t is None or not bool(d2t.any())
    return Contract(
        target=target.identity,
        capture=CaptureContract(boundaries=ckpt.boundaries),
        drafter=drafter_flags(ckpt.config, "identity_prefix" if identity else "trained"),
    )


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def save_drafter(
    drafter: Eagle3Drafter, contract: Contract, out_dir: str | Path, include_embeddings: bool = False,
    max_file_bytes: int | None = None,
) -> Path:
    """Write ``drafter`` and its ``contract`` as an eyas directory (SGLang-loadable) and return it;
    with ``max_file_bytes``, weights larger than that go into shards with an index."""
    tensors = {
        k: v for k, v in drafter.state_dict().items() if include_embeddings or k != EMBEDDING
    }
    write_checkpoint(
        out_dir, drafter.config, tensors, contract.capture.boundaries, contract.target.num_blocks, contract,
        max_file_bytes=max_file_bytes,
    )
    return Path(out_dir)


def load_drafter(
    path: str | Path, target: LoadedTarget | nn.Module | None = None, tokenizer: Any | None = None,
    force: bool = False,
) -> tuple[Eagle3Drafter, Contract | None]:
    """Load a drafter from an eyas, SGLang/SpecForge or speculators directory.

    With ``target`` (an HF model) the contract is checked against it (and ``tokenizer``): any
    mismatch raises :class:`~eyas.contract.ContractError` naming field, expected and found, unless
    ``force`` (then it warns), and the target's embedding is copied in when the checkpoint does not
    carry one. Without ``target`` such a drafter's embedding is NaN (unknown), never random.
    The drafter is float32 whatever the stored dtype. Returns the drafter and its contract (built
    from the target for a directory without one; None when there is neither).
    """
    loaded = LoadedTarget.of(target) if target is not None else None
    ckpt = read_checkpoint(path, default_num_blocks=loaded.num_blocks if loaded is not None else None)
    contract = ckpt.contract
    if loaded is not None:
        mismatches = against_target(ckpt, loaded, tokenizer)
        enforce(mismatches, f"drafter {ckpt.meta.path} against target {type(loaded.model).__name__}", force)
    # Without a target an unsaved embedding is NaN (unknown); with one, the target's when it fits.
    drafter, notes = build_drafter(ckpt.config, ckpt.tensors,
                                   find_embedding(loaded.model).weight if loaded is not None else None)
    for note in notes:  # checked tensors: only a target embedding of another shape
        warnings.warn(note, stacklevel=2)
    if loaded is not None and contract is None:
        contract = new_contract(ckpt, loaded)
    return drafter, contract


def read_contract(path: str | Path) -> Contract | None:
    """The contract in a directory's ``eyas.json`` (None when there is no eyas.json or it has none)."""
    return _read_eyas_json(_directory(path))[2]
