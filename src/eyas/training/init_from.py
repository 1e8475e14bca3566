"""``--init-from``: a training run that starts from an existing drafter (fine-tuning on more data).

The run takes the drafter's own draft vocabulary size, capture boundaries and variant flags
(:func:`adopt_init_from`) unless the user set them: a user who fine-tunes the shipped SmolLM2
drafter (``--init-from default``, draft vocabulary 12288) should not have to know and repeat its
sizes; one who sets a value that differs gets the field named (:func:`init_weights`). The weights,
d2t and t2d are then loaded into the fresh drafter; its contract is checked against the target.

Widening (``--draft-vocab`` larger than the drafter's). A drafter proposes only tokens of its draft
vocabulary, so a target token outside it is a miss for every draft: on the shipped SmolLM2 drafter
(12,288 ids) 13% of the target's greedy summary tokens are outside (names copied from the document,
``benchmarks/draft_vocab_coverage.py``). A run that sets a larger ``--draft-vocab`` keeps the
drafter's ids and adds the most frequent training targets outside them (:func:`widened_ids`); the
kept ids keep their lm_head rows, and each added id gets a row fitted from the target's own head
(:func:`fit_head_rows`), so the widened drafter starts where the old one was instead of from noise.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from eyas.convention.boundaries import CaptureSpec
from eyas.data.shard_format import is_shard_dir
from eyas.drafter.config import NORM_FLAGS
from eyas.drafter.model import Eagle3Drafter
from eyas.targets import LoadedTarget
from eyas.training.config import TrainConfig
from eyas.training.vocab import DraftVocab, vocab_of

ADOPTED = ("draft_vocab_size", "boundaries", *NORM_FLAGS)  # what a run takes from --init-from unless set


def adopt_init_from(cfg: TrainConfig) -> tuple[TrainConfig, dict[str, object]]:
    """``cfg`` with the ``--init-from`` drafter's draft vocabulary size, boundaries and norm flags
    in the fields the user did not set (pydantic's ``model_fields_set``); also returns what was
    taken. Without ``init_from``, ``cfg`` as it is."""
    if cfg.init_from is None:
        return cfg, {}
    from eyas.interop import CheckpointError
    from eyas.interop.eyas_format import read_meta

    meta = read_meta(cfg.init_from)
    trained = meta.drafter_config
    if trained is None:
        raise CheckpointError(f"--init-from {cfg.init_from}: no drafter config (eyas.json drafter_config or "
                              f"config.json) to take the draft vocabulary and flags from")
    found: dict[str, object] = {"draft_vocab_size": trained.draft_vocab_size,
                                **{flag: getattr(trained, flag) for flag in NORM_FLAGS}}
    if meta.boundaries is not None and not is_shard_dir(cfg.data):  # shards fix their own boundaries
        found["boundaries"] = list(meta.boundaries)
    taken = {k: v for k, v in found.items() if k not in cfg.model_fields_set and getattr(cfg, k) != v}
    return cfg.model_copy(update=taken), taken


def init_weights(drafter: Eagle3Drafter, path: str, target: LoadedTarget, spec: CaptureSpec, force: bool,
                 counts: Tensor) -> DraftVocab:
    """Load the drafter at ``path`` (``--init-from``) into the fresh ``drafter``: weights and draft
    vocabulary, widened when this run's draft vocabulary is larger (module docstring); -> the draft
    vocabulary with its coverage of ``counts`` (the training targets' histogram). Its contract is
    checked against the target (ContractError unless ``force``); its boundaries and its config
    (sizes, variant flags; a draft vocabulary no larger than this run's) must equal this run's, else
    a CheckpointError names the field, this run's value and the one found."""
    from eyas.interop import CheckpointError, load_drafter

    where = f"--init-from {path}"
    # With a target, the contract comes back whole (built from the checkpoint when it has none)
    init, contract = load_drafter(path, target=target, tokenizer=target.tokenizer, force=force)
    found = list(contract.capture.boundaries)
    if found != list(spec.boundaries):
        raise CheckpointError(f"{where}: capture.boundaries: expected this run's {list(spec.boundaries)}, "
                              f"found {found} (pass --boundaries to match)")
    ours, theirs = drafter.config.model_dump(), init.config.model_dump()
    widen = ours["draft_vocab_size"] > theirs["draft_vocab_size"]
    for field, value in ours.items():
        if theirs.get(field) != value and not (field == "draft_vocab_size" and widen):
            hint = " (pass --draft-vocab to match, or a larger one to widen it)" if field == "draft_vocab_size" else ""
            raise CheckpointError(f"{where}: drafter config {field}: expected this run's {value!r}, "
                                  f"found {theirs.get(field)!r}{hint}")
    if not widen:
        drafter.load_state_dict(init.state_dict())  # d2t and t2d included: its draft vocabulary
        return vocab_of(drafter.draft_to_target(torch.arange(ours["draft_vocab_size"])), counts)
    old_ids = init.draft_to_target(torch.arange(theirs["draft_vocab_size"]))
    ids = widened_ids(old_ids, counts, ours["draft_vocab_size"])
    vocabulary_keys = {"lm_head.weight", "d2t", "t2d"}  # sized by the draft vocabulary: set below
    state = {k: v for k, v in init.state_dict().items() if k not in vocabulary_keys}
    loaded = drafter.load_state_dict(state, strict=False)
    assert set(loaded.missing_keys) == vocabulary_keys and not loaded.unexpected_keys, loaded
    drafter.set_vocab_map(ids)
    target_head = target.model.get_output_embeddings().weight.detach().float().cpu()  # [V, H_t]
    with torch.no_grad():
        drafter.lm_head.weight.copy_(fit_head_rows(init.lm_head.weight.detach().float(), old_ids, ids, target_head))
    return dataclasses.replace(vocab_of(ids, counts), widened_from=int(theirs["draft_vocab_size"]))


def widened_ids(old_ids: Tensor, counts: Tensor, size: int) -> Tensor:
    """``size`` target ids, ascending: every id of ``old_ids``, then the most frequent ids of
    ``counts`` outside them (ties and never-seen ids by ascending id, as ``build_draft_vocab``)."""
    if size > counts.numel():
        raise ValueError(f"draft_vocab_size: expected at most the target's vocabulary {counts.numel()}, found {size}")
    rest = counts.clone().to(torch.float64)
    rest[old_ids] = float("-inf")  # already in: never added twice
    added = torch.sort(-rest, stable=True).indices[:size - old_ids.numel()]
    return torch.sort(torch.cat([old_ids.cpu(), added])).values


def fit_head_rows(old_head: Tensor, old_ids: Tensor, ids: Tensor, target_head: Tensor) -> Tensor:
    """lm_head rows [len(ids), H] for the draft vocabulary ``ids``: an id the drafter had keeps its
    row of ``old_head`` [len(old_ids), H]; a new id gets its target head row mapped by the linear map
    A [H_t, H] that best fits the drafter's rows from the target's over the ids it had (least
    squares: target_head[old_ids] @ A ~ old_head). On the shipped SmolLM2 drafter A fitted on 80% of
    its 12,288 rows predicts the other 20% with a mean cosine similarity of 0.81."""
    A = torch.linalg.lstsq(target_head[old_ids], old_head).solution  # [H_t, H]
    rows = target_head[ids] @ A
    where = {int(t): i for i, t in enumerate(old_ids.tolist())}
    keep = [(j, where[int(t)]) for j, t in enumerate(ids.tolist()) if int(t) in where]
    rows[[j for j, _ in keep]] = old_head[[i for _, i in keep]]
    return rows
