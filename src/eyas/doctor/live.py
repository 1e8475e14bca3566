"""Stage 3, live: the target captured the way the chosen engine captures it, on the same token
sequences as the replay, and the drafter built with the norm flags that engine reads.

The engine's protocol comes from :func:`eyas.interop.read_as` (the boundaries it reads
from the directory as it stands, in its slot order; its norm flags); the values come from eyas'
one capture path. Live falls short when its position-0 accuracy is below the replay's by more than
max(3 points, 5 %): both run on the same tokens, so a healthy serving path matches to rounding.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from eyas.doctor.capture import LiveCapture
from eyas.doctor.common import FAIL, INFO, OK, Stage, fmt_acc, replay_tolerance, short_by
from eyas.doctor.evaluate import accuracy
from eyas.doctor.samples import SampleSet
from eyas.interop.servers import EngineReading


def live_stage(reading: EngineReading, samples: SampleSet, cap: LiveCapture, labels: list[Tensor], drafter: Any,
               build_notes: list[str], fc_in: int | None, replay: dict | None, training: dict | None,
               steps: int) -> tuple[Stage, dict | None]:
    st = Stage("live")
    if not reading.loadable or reading.boundaries is None:
        return st.skip(f"{reading.label} cannot serve this directory: {reading.why_not}"), None
    bs = reading.boundaries
    if fc_in is not None and fc_in != len(bs) * cap.hidden_size:
        return st.skip(f"{reading.label} captures {len(bs)} boundaries x {cap.hidden_size} = "
                       f"{len(bs) * cap.hidden_size} features; the drafter's fc takes {fc_in}"), None
    summary = accuracy(drafter, samples.samples, lambda i: cap.features(i, bs), labels, steps)
    acc = summary["accuracy_per_position"]
    st.data.update({"boundaries": bs, "flags": reading.flags, "engine": reading.label, **summary})
    for note in build_notes:
        st.add(INFO, "build", f"{reading.label} drafter: {note}")
    if replay is not None:
        ref = replay["accuracy_per_position"]
        if short_by(acc[0], ref[0]):
            st.add(FAIL, "live_short", f"served as {reading.label} serves it, the drafter reaches {acc[0]:.3f} at "
                   f"position 0 against {ref[0]:.3f} in replay on the same tokens (simulated accept length "
                   f"{summary['simulated_accept_length']:.2f} vs {replay['simulated_accept_length']:.2f})",
                   field="accuracy_per_position[0]", expected=ref[0], found=acc[0])
        else:
            st.add(OK, "live", f"position-0 accuracy {acc[0]:.3f} vs {ref[0]:.3f} in replay on the same tokens")
        return st.settle(f"live {fmt_acc(acc)} vs replay {fmt_acc(ref)}"), summary
    ref = (training or {}).get("accuracy_per_position")
    if ref:
        tol = replay_tolerance(ref[0], summary["tokens_counted"])
        if acc[0] < ref[0] - tol:
            st.add(FAIL, "live_short", f"served as {reading.label} serves it, the drafter reaches {acc[0]:.3f} at "
                   f"position 0 against {ref[0]:.3f} recorded at training (tolerance {tol:.3f})",
                   field="accuracy_per_position[0]", expected=ref[0], found=acc[0])
        return st.settle(f"live {fmt_acc(acc)} vs training {fmt_acc(ref)}"), summary
    st.add(INFO, "no_reference", "no replay and no recorded training accuracy to compare with")
    return st.settle(f"live {fmt_acc(acc)}"), summary
