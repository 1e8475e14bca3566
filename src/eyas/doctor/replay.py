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

from typing import Any, Callable

from torch import Tensor

from eyas.doctor.capture import LiveCapture
from eyas.doctor.common import FAIL, INFO, OK, Stage, fmt_acc, replay_tolerance
from eyas.doctor.evaluate import accuracy
from eyas.doctor.samples import SampleSet
from eyas.interop.directory import DrafterDir


def replay_features(trained: list[int], samples: SampleSet, cap: LiveCapture, live_labels: list[Tensor],
                    stored_labels: list[Tensor] | None) -> tuple[Callable[[int], Tensor], list[Tensor], str]:
    """(features of sample i, labels, description) for the replay of a drafter trained on ``trained``."""
    mc = samples.manifest_contract
    if (samples.source == "shards" and samples.stored_boundaries == trained and stored_labels is not None
            and mc is not None and mc.target.hidden_size == cap.hidden_size):
        return (lambda i: samples.samples[i].features), stored_labels, \
            f"stored training features (shards, boundaries {trained})"
    bs = trained
    return (lambda i: cap.features(i, bs)), live_labels, \
        f"the live target's trained boundaries {bs}, captured through eyas' capture path"


def replay_stage(dd: DrafterDir, samples: SampleSet, drafter: Any, features: Callable[[int], Tensor],
                 labels: list[Tensor], how: str, steps: int) -> tuple[Stage, dict]:
    st = Stage("replay")
    summary = accuracy(drafter, samples.samples, features, labels, steps)
    metrics = (dd.contract.metrics if dd.contract is not None else None) or {}
    trained = metrics.get("accuracy_per_position")
    st.data.update({"features": how, "samples": len(samples.samples), "selection": samples.selection, **summary,
                    "training": {k: metrics.get(k) for k in ("accuracy_per_position", "conditional_accuracy_per_position",
                                                             "simulated_accept_length", "tokens_counted", "step")}
                    if metrics else None})
    acc = summary["accuracy_per_position"]
    if not trained:
        st.add(INFO, "no_metrics", "no accuracy was recorded at training (contract.metrics): replay is the reference")
        return st.settle(f"replay accuracy {fmt_acc(acc)} (nothing recorded at training to compare)"), summary
    p, n = trained[0], summary["tokens_counted"]
    tol = replay_tolerance(p, min(n, metrics.get("tokens_counted") or n))
    if acc[0] < p - tol and samples.source == "generated":
        st.add(INFO, "replay_other_text", f"position-0 accuracy {acc[0]:.3f} on the built-in prompts vs {p:.3f} recorded "
               f"at training on the training data (other text, so not a failure; --data with the training data compares them)")
    elif acc[0] < p - tol:
        st.add(FAIL, "replay_short",
               f"on its own training samples the drafter reaches {acc[0]:.3f} at position 0, below the {p:.3f} "
               f"recorded at training (tolerance {tol:.3f} for {n} tokens): the drafter, its weights or the target's "
               f"labels are not what training had", field="accuracy_per_position[0]", expected=p, found=acc[0])
    else:
        st.add(OK, "replay", f"position-0 accuracy {acc[0]:.3f} vs {p:.3f} recorded at training "
               f"(tolerance {tol:.3f}; {'the same held-out samples' if samples.held_out else samples.selection})")
    return st.settle(f"replay {fmt_acc(acc)} vs training {fmt_acc(trained)}"), summary
