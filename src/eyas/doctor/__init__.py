"""``eyas doctor``: find and name every train/serve mismatch of a drafter, and say how to fix it.

    from eyas.doctor import run_doctor
    report = run_doctor("smollm2", "runs/drafter", data="shards/", engine="vllm")
    report.healthy, report.cause, report.fix, report.to_dict()

Stages (each its own module): static, replay, live, fingerprint, search, verdict; see
:mod:`eyas.doctor.run` for the order and :mod:`eyas.doctor.common` for the thresholds.
"""

from eyas.doctor.engines import ENGINES, EngineReading, read_drafter_dir, read_engine
from eyas.doctor.report import DoctorReport, plot_png, render
from eyas.doctor.run import run_doctor

__all__ = ["ENGINES", "DoctorReport", "EngineReading", "plot_png", "read_drafter_dir", "read_engine", "render",
           "run_doctor"]
