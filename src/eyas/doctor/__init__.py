"""``eyas doctor``: find and name every train/serve mismatch of a drafter, and say how to fix it.

    from eyas.doctor import run_doctor
    report = run_doctor("smollm2", "runs/drafter", data="shards/", engine="vllm")
    report.healthy, report.cause, report.fix, report.to_dict()
    report.stages.replay.result.accuracy     # each stage's typed result

Stages (each its own module): static, replay, live, fingerprint, search, verdict; each a function
of the :class:`~eyas.doctor.context.DoctorContext` returning its typed stage. See
:mod:`eyas.doctor.run` for the order and :mod:`eyas.doctor.common` for the thresholds.

``eyas trace`` (:mod:`eyas.doctor.trace`) records the engine's three junctions per round and holds
them against the same training fingerprint:

    from eyas.doctor import Tracer, run_trace
    report = run_trace("smollm2", "runs/drafter", "Why is the sky blue?", "trace.jsonl", engine="vllm")
"""

from eyas.doctor.report import DoctorReport, plot_png, render
from eyas.doctor.run import run_doctor, static_check
from eyas.doctor.trace import TraceError, TraceReport, Tracer, TraceSummary, render_trace, run_trace

__all__ = ["DoctorReport", "TraceError", "static_check", "TraceReport", "TraceSummary", "Tracer", "plot_png", "render",
           "render_trace", "run_doctor", "run_trace"]
