"""``--init-from``: a training run that starts from an existing drafter (fine-tuning on more data).

The run takes the drafter's own draft vocabulary size, capture boundaries and variant flags
(:func:`adopt_init_from`) unless the user set them: a user who fine-tunes the shipped SmolLM2
drafter (``--init-from default``, draft vocabulary 12288) should not have to know and repeat its
sizes; one who sets a value that differs gets the field named (:func:`init_weights`). The weights,
d2t and t2d are then loaded into the fresh drafter; its contract is checked against the target.
"""

from __future__ import annotations

from eyas.convention.boundaries import CaptureSpec
from eyas.data.shard_format import is_shard_dir
from eyas.drafter.config import NORM_FLAGS
from eyas.drafter.model import Eagle3Drafter
from eyas.targets import LoadedTarget
from eyas.training.config import TrainConfig

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


def init_weights(drafter: Eagle3Drafter, path: str, target: LoadedTarget, spec: CaptureSpec, force: bool) -> None:
    """Load the drafter at ``path`` (``--init-from``) into the fresh ``drafter``: weights and draft
    vocabulary. Its contract is checked against the target (ContractError unless ``force``); its
    boundaries and its config (sizes, draft vocabulary, variant flags) must equal this run's, else a
    CheckpointError names the field, this run's value and the one found."""
    from eyas.interop import CheckpointError, load_drafter

    where = f"--init-from {path}"
    # With a target, the contract comes back whole (built from the checkpoint when it has none)
    init, contract = load_drafter(path, target=target, tokenizer=target.tokenizer, force=force)
    found = list(contract.capture.boundaries)
    if found != list(spec.boundaries):
        raise CheckpointError(f"{where}: capture.boundaries: expected this run's {list(spec.boundaries)}, "
                              f"found {found} (pass --boundaries to match)")
    ours, theirs = drafter.config.model_dump(), init.config.model_dump()
    for field, value in ours.items():
        if theirs.get(field) != value:
            hint = " (pass --draft-vocab to match)" if field == "draft_vocab_size" else ""
            raise CheckpointError(f"{where}: drafter config {field}: expected this run's {value!r}, "
                                  f"found {theirs.get(field)!r}{hint}")
    drafter.load_state_dict(init.state_dict())  # d2t and t2d included: its draft vocabulary
