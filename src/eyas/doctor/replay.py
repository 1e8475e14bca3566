"""Stage 2, replay: the drafter alone, built as it was trained, on its own training samples.

With shards whose slots are the trained boundaries, the features are the stored ones (exactly what
training read) and the labels come from the stored boundary L through the target's final norm and
lm_head (as offline training computes them). Otherwise (conversations, built-in prompts, shards of
other boundaries) the features are the live target's trained boundaries, captured through the one
capture path. The per-position accuracy is held against ``contract.metrics`` (the held-out
accuracy recorded at training): falling short means the drafter, its weights or the target's
labels are not what training had, before any engine is involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from torch import Tensor

from eyas.contract.contract import ValidationMetrics
from eyas.doctor.capture import LiveCapture, stored_labels
from eyas.doctor.common import FAIL, INFO, OK, Stage, fmt_acc, replay_tolerance
from eyas.doctor.evaluate import Accuracy, accuracy
from eyas.doctor.samples import SampleSet

if TYPE_CHECKING:
    from eyas.doctor.context import DoctorContext

# The recorded training metrics the report shows next to the replay (in this order, absent ones as null).
TRAINING_KEYS = ("accuracy_per_position", "conditional_accuracy_per_position", "simulated_accept_length",
                 "tokens_counted", "step")


@dataclass
class ReplayResult:
    features: str  # where the features came from (stored shards, or the live target's trained boundaries)
    samples: int
    selection: str  # which samples (the held-out split of the run, or an even spread)
    accuracy: Accuracy
    training: ValidationMetrics | None  # recorded at training (contract.metrics), when any was

    def to_dict(self) -> dict[str, Any]:
        training = None if self.training is None else {k: getattr(self.training, k) for k in TRAINING_KEYS}
        return {"features": self.features, "samples": self.samples, "selection": self.selection,
                **self.accuracy.to_dict(), "training": training}


def replays_stored(trained: list[int], samples: SampleSet, cap: LiveCapture, stored_labels: list[Tensor] | None) -> bool:
    """Whether the replay runs on the stored training features (shards of the trained boundaries,
    of the live target's width); else on the live capture of the trained boundaries."""
    mc = samples.manifest_contract
    return (samples.source == "shards" and samples.stored_boundaries == trained and stored_labels is not None
            and mc is not None and mc.target.hidden_size == cap.hidden_size)


def replay_features(trained: list[int], samples: SampleSet, cap: LiveCapture, live_labels: list[Tensor],
                    stored_labels: list[Tensor] | None) -> tuple[Callable[[int], Tensor], list[Tensor], str]:
    """(features of sample i, labels, description) for the replay of a drafter trained on ``trained``."""
    if replays_stored(trained, samples, cap, stored_labels):
        return (lambda i: samples.samples[i].features), stored_labels, \
            f"stored training features (shards, boundaries {trained})"
    bs = trained
    return (lambda i: cap.features(i, bs)), live_labels, \
        f"the live target's trained boundaries {bs}, captured through eyas' capture path"


def replay_stage(ctx: DoctorContext) -> Stage[ReplayResult]:
    """The drafter built with its trained flags, on the trained features of the samples, held
    against the accuracy recorded at training."""
    cap = ctx.live_capture()
    ctx.say("replay")
    sset = ctx.sample_set
    stored = stored_labels(ctx.model, sset.samples, sset.last_hidden_normed) if sset.source == "shards" else None
    features, labels, how = replay_features(ctx.trained, sset, cap, cap.argmax, stored)
    if replays_stored(ctx.trained, sset, cap, stored):
        measured = accuracy(ctx.drafter_cache.get(ctx.dd.trained_flags), sset.samples, features, labels, ctx.steps)
    else:  # the live capture: the measurement live and the search reuse for the same protocol
        measured = ctx.live_accuracy(ctx.trained, ctx.dd.trained_flags, ctx.steps)
    metrics = ctx.metrics
    st: Stage[ReplayResult] = Stage("replay", result=ReplayResult(how, len(sset.samples), sset.selection, measured, metrics))
    acc = measured.accuracy_per_position
    trained = metrics.accuracy_per_position if metrics is not None else None
    if not trained:
        st.add(INFO, "no_metrics", "no accuracy was recorded at training (contract.metrics): replay is the reference")
        return st.settle(f"replay accuracy {fmt_acc(acc)} (nothing recorded at training to compare)")
    assert metrics is not None
    p, n = trained[0], measured.tokens_counted
    tol = replay_tolerance(p, min(n, metrics.tokens_counted or n))
    if acc[0] < p - tol and sset.source == "generated":
        st.add(INFO, "replay_other_text", f"position-0 accuracy {acc[0]:.3f} on the built-in prompts vs {p:.3f} recorded "
               f"at training on the training data (other text, so not a failure; --data with the training data compares them)")
    elif acc[0] < p - tol and sset.other_data:
        st.add(INFO, "replay_other_data",
               f"position-0 accuracy {acc[0]:.3f} on {sset.path} vs {p:.3f} recorded at training on the data its "
               f"train_config.json names (other text, so not a failure: a drafter predicts text unlike its training "
               f"data less well; --data with the training data compares them, and live against replay on the same "
               f"tokens checks the capture)")
    elif acc[0] < p - tol:
        st.add(FAIL, "replay_short",
               f"on its own training samples the drafter reaches {acc[0]:.3f} at position 0, below the {p:.3f} "
               f"recorded at training (tolerance {tol:.3f} for {n} tokens): the drafter, its weights or the target's "
               f"labels are not what training had", field="accuracy_per_position[0]", expected=p, found=acc[0])
    else:
        st.add(OK, "replay", f"position-0 accuracy {acc[0]:.3f} vs {p:.3f} recorded at training "
               f"(tolerance {tol:.3f}; {'the same held-out samples' if sset.held_out else sset.selection})")
    return st.settle(f"replay {fmt_acc(acc)} vs training {fmt_acc(trained)}")
