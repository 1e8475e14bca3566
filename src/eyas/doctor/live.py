"""Stage 3, live: the target captured the way the chosen engine captures it, on the same token
sequences as the replay, and the drafter built with the norm flags that engine reads.

The engine's protocol comes from :func:`eyas.interop.read_as` (the boundaries it reads
from the directory as it stands, in its slot order; its norm flags); the values come from eyas'
one capture path. Live falls short when its position-0 accuracy is below the replay's by more than
max(3 points, 10 %) (:func:`eyas.doctor.common.short_by`): both run on the same tokens, so a healthy serving path matches to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eyas.doctor.common import FAIL, INFO, OK, Stage, fmt_acc, replay_tolerance, short_by
from eyas.doctor.evaluate import Accuracy

if TYPE_CHECKING:
    from eyas.doctor.context import DoctorContext


@dataclass
class LiveResult:
    boundaries: list[int]  # what the engine captures, in its slot order
    flags: dict[str, bool]  # the norm flags it builds the drafter with
    engine: str  # the engine's label
    accuracy: Accuracy

    def to_dict(self) -> dict[str, Any]:
        return {"boundaries": self.boundaries, "flags": self.flags, "engine": self.engine, **self.accuracy.to_dict()}


def live_stage(ctx: DoctorContext) -> Stage[LiveResult]:
    """The drafter as the engine builds it, fed what the engine captures, on the replay's tokens;
    held against the replay (else the accuracy recorded at training)."""
    reading = ctx.served
    ctx.say(f"live, as {reading.label} serves it")
    st: Stage[LiveResult] = Stage("live")
    if not reading.loadable or reading.boundaries is None:
        return st.skip(f"{reading.label} cannot serve this directory: {reading.why_not}")
    cap = ctx.live_capture()
    bs = reading.boundaries
    fc = ctx.dd.tensors.get("fc.weight")
    fc_in = int(fc.shape[1]) if fc is not None and fc.dim() == 2 else None
    if fc_in is not None and fc_in != len(bs) * cap.hidden_size:
        return st.skip(f"{reading.label} captures {len(bs)} boundaries x {cap.hidden_size} = "
                       f"{len(bs) * cap.hidden_size} features; the drafter's fc takes {fc_in}")
    build_notes = ctx.drafter_cache.with_notes(reading.flags)[1]
    measured = ctx.live_accuracy(bs, reading.flags, ctx.steps)  # measured once when replay ran the same protocol
    st.result = LiveResult(bs, reading.flags, reading.label, measured)
    acc = measured.accuracy_per_position
    for note in build_notes:
        st.add(INFO, "build", f"{reading.label} drafter: {note}")
    replay = ctx.stages.replay.result
    if replay is not None:
        ref = replay.accuracy.accuracy_per_position
        if short_by(acc[0], ref[0]):
            st.add(FAIL, "live_short", f"served as {reading.label} serves it, the drafter reaches {acc[0]:.3f} at "
                   f"position 0 against {ref[0]:.3f} in replay on the same tokens (simulated accept length "
                   f"{measured.simulated_accept_length:.2f} vs {replay.accuracy.simulated_accept_length:.2f})",
                   field="accuracy_per_position[0]", expected=ref[0], found=acc[0])
        else:
            st.add(OK, "live", f"position-0 accuracy {acc[0]:.3f} vs {ref[0]:.3f} in replay on the same tokens")
        return st.settle(f"live {fmt_acc(acc)} vs replay {fmt_acc(ref)}")
    training = ctx.metrics.accuracy_per_position if ctx.metrics is not None else None
    if training:
        tol = replay_tolerance(training[0], measured.tokens_counted)
        if acc[0] < training[0] - tol:
            st.add(FAIL, "live_short", f"served as {reading.label} serves it, the drafter reaches {acc[0]:.3f} at "
                   f"position 0 against {training[0]:.3f} recorded at training (tolerance {tol:.3f})",
                   field="accuracy_per_position[0]", expected=training[0], found=acc[0])
        return st.settle(f"live {fmt_acc(acc)} vs training {fmt_acc(training)}")
    st.add(INFO, "no_reference", "no replay and no recorded training accuracy to compare with")
    return st.settle(f"live {fmt_acc(acc)}")
