"""The contract stored with every hidden-state dataset and every drafter (``eyas.json``).

It says which target produced the features, how they were captured and tokenised, and how the
drafter consumes them. Whenever a dataset or drafter meets a target, :func:`compare` lists every
disagreement as (field, expected, found) and :class:`ContractError` prints them all at once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, model_serializer

from eyas import __version__
# The target's identity lives with the targets (floor 2); the contract stores it and re-exports it.
from eyas.targets.identity import (  # noqa: F401 (target_identity, weights_fingerprint, changed_count: re-exported)
    TargetIdentity,
    changed_count,
    changed_parts,
    describe_changes,
    modified_copy,
    target_identity,
    weights_fingerprint,
)
from eyas.errors import EyasError

SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CaptureContract(_Model):
    boundaries: list[int]  # eyas convention (eyas.convention.boundaries)
    dtype: str = "bfloat16"
    values: Literal["pre_norm_residual"] = "pre_norm_residual"


class Tokenisation(_Model):
    chat_template_sha256: str | None
    bos_token: str | None
    eos_token: str | None
    # Whether training conversations carried the template's default system prompt.
    system_prompt: Literal["template_default", "custom", "none"] = "template_default"


class DrafterFlags(_Model):
    norm_before_residual: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    target_hidden_size: int
    num_slots: int
    draft_vocab_size: int
    vocab_map: Literal["identity_prefix", "trained"] = "identity_prefix"  # how d2t/t2d were made


class SlotFingerprint(_Model):
    boundary: int
    rms_mean: float  # mean over tokens of the per-token RMS
    rms_std: float
    channels: list[int]  # a few channel indices...
    channel_means: list[float]  # ...and their means over tokens
    num_tokens: int


class ValidationMetrics(BaseModel):
    """The held-out metrics of a training run, as :class:`eyas.drafter.ttt.Tally` sums them, and the
    step they were measured at (``contract.metrics`` in ``eyas.json``).

    Per draft position k (the k-th TTT step): ``loss_per_position[k]`` the mean soft cross-entropy,
    ``accuracy_per_position[k]`` P(drafter argmax == target argmax), ``conditional_accuracy_per_position[k]``
    the same among positions whose steps 0..k-1 were all right; ``simulated_accept_length`` =
    1 + sum_k prod_{i<=k} cond_acc_i; ``tokens_counted``: the positions counted at step 0.

    Every field is optional: a run without a validation split records only its ``step``, and a
    reader with the accuracy alone (the doctor) leaves the loss out. Absent fields are left out of
    the JSON, so eyas.json reads as it did when metrics were a plain dict; keys other writers added
    are kept (extra="allow").
    """

    model_config = ConfigDict(extra="allow")

    step: int | None = None
    loss_per_position: list[float] | None = None
    accuracy_per_position: list[float] | None = None
    conditional_accuracy_per_position: list[float] | None = None
    simulated_accept_length: float | None = None
    tokens_counted: int | None = None

    @model_serializer(mode="wrap")
    def _without_absent(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}

    @property
    def recorded(self) -> bool:
        """Whether anything was recorded (an old eyas.json may carry ``"metrics": {}``)."""
        return bool(self.model_dump())


class Contract(_Model):
    schema_version: int = SCHEMA_VERSION
    eyas_version: str = __version__
    target: TargetIdentity
    capture: CaptureContract
    tokenisation: Tokenisation | None = None
    drafter: DrafterFlags | None = None  # absent in a dataset manifest
    fingerprint: list[SlotFingerprint] | None = None  # from the training data
    metrics: ValidationMetrics | None = None  # validation metrics of the training run

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Contract":
        return cls.model_validate_json(text)


# ---------------------------------------------------------------------------------------------
# Building the parts from a live target
# ---------------------------------------------------------------------------------------------


def tokenisation_of(tokenizer: Any, system_prompt: str = "template_default") -> Tokenisation:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return Tokenisation(
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest()[:16] if template else None,
        bos_token=getattr(tokenizer, "bos_token", None),
        eos_token=getattr(tokenizer, "eos_token", None),
        system_prompt=system_prompt,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    field: str  # dotted path, e.g. "target.hidden_size"
    expected: Any  # what the dataset / drafter was made with
    found: Any  # what the target / serving side has

    def __str__(self) -> str:
        return f"{self.field}: expected {self.expected!r}, found {self.found!r}"


# The fields checked when a drafter or dataset meets a target, in report order.
CHECKED_FIELDS: tuple[str, ...] = (
    "target.architecture",
    "target.num_blocks",
    "target.hidden_size",
    "target.vocab_size",
    "target.fingerprint",
    "target.weights",  # per-part sampled hashes, when both sides recorded them: names what changed
    "capture.boundaries",
    "capture.values",
    "tokenisation.chat_template_sha256",
    "tokenisation.bos_token",
    "tokenisation.eos_token",
    "tokenisation.system_prompt",
    "drafter.num_slots",
    "drafter.target_hidden_size",
    "drafter.norm_before_residual",
    "drafter.norm_before_fc",
    "drafter.fc_norm",
    "drafter.norm_output",
    "drafter.draft_vocab_size",
)

_ABSENT = object()


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if obj is None:
            return _ABSENT
        obj = getattr(obj, part, _ABSENT)
        if obj is _ABSENT:
            return _ABSENT
    return obj


def compare(expected: Contract, found: Contract, fields: Iterable[str] = CHECKED_FIELDS) -> list[Mismatch]:
    """Every field where ``found`` disagrees with ``expected``. A section missing on either side
    (e.g. no tokenisation recorded for a bare target, no ``target.weights`` in an older eyas.json)
    is unknown, not a mismatch. ``target.weights`` is compared part by part: its mismatch names
    the parts that differ (``found`` e.g. "blocks 20 to 22 differ"). A target that is the recorded
    one with some parts changed (:func:`~eyas.targets.identity.modified_copy`: at most half of the
    parts differ) gets that mismatch alone, even when the embedding or final norm changed and so
    the fingerprint; another model (more parts differ, or no per-part record) gets the fingerprint's."""
    out = []
    modified = modified_copy(expected.target, found.target)
    for f in fields:
        if f == "target.weights":  # behind an equal fingerprint, or a modified copy: else the fingerprint says it
            parts = changed_parts(expected.target, found.target)
            if parts and (expected.target.fingerprint == found.target.fingerprint or modified):
                out.append(Mismatch(f, "the same sampled weights", describe_changes(parts)))
            continue
        if f == "target.fingerprint" and modified:  # the embedding or final norm changed: target.weights names it
            continue
        e, v = _get(expected, f), _get(found, f)
        if e is _ABSENT or v is _ABSENT or e is None or v is None:
            continue
        if e != v:
            out.append(Mismatch(f, e, v))
    return out


class ContractError(EyasError, ValueError):
    """A dataset or drafter met a target (or engine config) it was not made for."""

    def __init__(self, mismatches: list[Mismatch], context: str) -> None:
        self.mismatches, self.context = mismatches, context
        lines = [f"{context}: {len(mismatches)} contract mismatch(es)"]
        lines += [f"  - {m}" for m in mismatches]
        lines.append("  (pass --force to load anyway; it skips exactly the checks listed above)")
        super().__init__("\n".join(lines))


# Mismatches that are reported but never refuse a load, each with why. The end-of-sequence token
# decides where generation stops, not which hidden states the drafter sees (the chat template renders
# the end-of-turn token itself and is checked by its sha256), and tokenizer readers disagree on it
# across versions: transformers 5.17 reads SmolLM2's GGUF eos as '<|im_start|>', 5.24 as '<|im_end|>'.
# Changed weights of the recorded target (a merged LoRA, a fine-tune with frozen embeddings, a retouched
# embedding or final norm; at most half of its parts) may or may not move the hidden states the
# drafter reads: measured acceptance decides (eyas doctor).
ADVISORY_NOTES: dict[str, str] = {
    "tokenisation.eos_token": "generation stops at another token than in training; the drafter's inputs are unaffected",
    "target.weights": "some of the target's weights differ from those recorded (at most half of its parts); "
                      "`eyas doctor` measures whether the drafter's acceptance holds",
}
ADVISORY_FIELDS: frozenset[str] = frozenset(ADVISORY_NOTES)


def enforce(mismatches: list[Mismatch], context: str, force: bool = False) -> list[Mismatch]:
    """Raise :class:`ContractError` on any mismatch, unless ``force``: then warn and return them.
    Mismatches of :data:`ADVISORY_FIELDS` only warn."""
    import warnings

    advisory = [m for m in mismatches if m.field in ADVISORY_FIELDS]
    binding = [m for m in mismatches if m.field not in ADVISORY_FIELDS]
    if advisory:
        warnings.warn(f"{context}: " + "; ".join(f"{m} ({ADVISORY_NOTES[m.field]})" for m in advisory),
                      stacklevel=2)
    if binding and not force:
        raise ContractError(binding, context)
    if binding:
        warnings.warn(
            f"{context}: --force skips {len(binding)} contract check(s): "
            + "; ".join(str(m) for m in binding),
            stacklevel=2,
        )
    return mismatches
